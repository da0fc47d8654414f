"""Export and import as the window offers them: the conversation shown to a Markdown (the branch on screen)
or JSON (every branch) file, and a JSON export back as a new conversation (exchange.py is the Qt-free format)."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path
from urllib.parse import quote

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import QFileDialog, QProgressDialog

from .core.exchange import ExchangeError, from_json, read_json, to_json, to_markdown
from .core.store_file import StoreError


def file_name(title: str) -> str:
    """A conversation's title as a file name: its words, without what file systems refuse or a title's "…"
    ("I am planning a trip to Chengdu for 3 nights. My…" → "I am planning a trip to Chengdu for 3 nights My")."""
    words = "".join(c if c.isalnum() or c in "-_'" else " " for c in title.removesuffix("…")).split()
    return " ".join(words)[:80].strip() or "conversation"


EXPORT_TYPES = {  # the save dialog's file types: the one chosen decides the format, and its extension is added
    "Markdown, the branch shown (*.md)": ".md",
    "JSON, every branch, importable (*.json)": ".json",
}


def with_extension(path: str, extension: str) -> str:
    """`path` ending in `extension` (added unless it ends so already, in any case)."""
    return path if path.lower().endswith(extension) else path + extension


def export_conversation(window, path: str | None = None) -> None:
    """The conversation shown, to a file: Markdown (.md, the branch shown) or JSON (every branch). Asked with
    the save dialog, the file type chosen there decides; given a `path`, its extension does."""
    cid = window.chat.current_cid
    if cid is None:
        window.show_error("There is no conversation to export yet.")
        return
    if path is None:
        dialog = QFileDialog(window, "Export the conversation")
        dialog.setObjectName("exportDialog")
        dialog.setAcceptMode(QFileDialog.AcceptSave)
        dialog.setNameFilters(list(EXPORT_TYPES))
        dialog.selectFile(f"{file_name(window.store.conversation(cid).title)}.md")
        dialog.filterSelected.connect(lambda f: _retype(dialog, EXPORT_TYPES.get(f, ".md")))
        if not dialog.exec() or not dialog.selectedFiles():
            return
        path = with_extension(dialog.selectedFiles()[0], EXPORT_TYPES.get(dialog.selectedNameFilter(), ".md"))
    try:
        if path.lower().endswith(".json"):
            text = json.dumps(to_json(window.store, cid), ensure_ascii=False, indent=2)
        else:
            text = to_markdown(window.store, cid, images_beside(window.store, Path(path)))
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        window.show_error(f"The conversation could not be written to {path}: {e.strerror or e}.")
        return
    window.statusBar().showMessage(f"Exported to {path}.", 5000)


def images_beside(store, document: Path):
    """A Markdown export's image links: each image copied into a folder beside the document (NAME-images/), the
    link its relative path; an image gone from kvchat's folder is named, not linked."""
    folder = document.with_name(document.stem + "-images")

    def link(ref: dict) -> str | None:
        source = store.images.path(ref)
        if not source.is_file():
            return None
        folder.mkdir(exist_ok=True)
        target = folder / source.name
        if not target.exists():
            shutil.copyfile(source, target)
        return f"{quote(folder.name)}/{source.name}"

    return link


def _retype(dialog: QFileDialog, extension: str) -> None:
    """The name typed so far given the extension of the file type just chosen (…/title.md → …/title.json)."""
    names = dialog.selectedFiles()
    if names:
        stem = Path(names[0])
        if stem.suffix.lower() in EXPORT_TYPES.values():
            dialog.selectFile(stem.with_suffix(extension).name)


class _Import(QObject):
    """One import on a thread of its own, with its own connection to the database: the window goes on
    drawing while a long conversation is read, checked and written; progress and the end come back as
    signals to the GUI thread."""

    progressed = Signal(int, int)  # messages written, of how many
    ended = Signal(object)  # the new Conversation, or an error message

    def __init__(self, store, path: str):
        super().__init__()
        self.store, self.path = store, path

    def run(self) -> None:
        try:
            conv = from_json(self.store, read_json(self.path), self.progressed.emit)
        except (ExchangeError, StoreError) as e:
            conv = str(e)
        except Exception as e:  # whatever else fails, the window hears of it (and the transaction rolled back)
            conv = f"{type(e).__name__}: {e}"
        finally:
            self.store.close()
        self.ended.emit(conv)


def import_conversation(window, path: str | None = None) -> None:
    """A conversation exported as JSON, back as a new conversation with the same branches: read and written
    off the GUI thread (all of it or nothing), a progress dialog while it lasts."""
    if window.generating or getattr(window, "importing", None) is not None:
        return
    if path is None:
        path, _ = QFileDialog.getOpenFileName(window, "Import a conversation", "", "kvchat conversation (*.json)")
        if not path:
            return
    store = window.store.for_thread()
    if store is None:  # a temporary or read-only database: here, as one call
        try:
            conv = window.chat.guard(from_json, window.store, read_json(path))
        except ExchangeError as e:
            conv = str(e)
        _imported(window, conv)
        return
    job = window.importing = _Import(store, path)
    dialog = QProgressDialog("Importing the conversation…", "", 0, 0, window)
    dialog.setObjectName("importProgress")
    dialog.setCancelButton(None)
    dialog.setMinimumDuration(300)
    job.progressed.connect(lambda done, total: (dialog.setMaximum(total), dialog.setValue(done)))

    def ended(conv) -> None:
        dialog.close()
        window.importing = None
        window.store.forget_branches()
        _imported(window, conv)

    job.ended.connect(ended, Qt.QueuedConnection)
    threading.Thread(target=job.run, name="kvchat-import", daemon=True).start()


def _imported(window, conv) -> None:
    if conv is None:
        return
    if isinstance(conv, str):
        window.show_error(f"The conversation could not be imported: {conv}.")
        return
    window.select_conversation(conv.id)
    window.statusBar().showMessage(f"Imported “{conv.title}”.", 5000)
