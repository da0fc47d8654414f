"""Export and import as the window offers them: the conversation shown to a Markdown (the branch on screen)
or JSON (every branch) file, and a JSON export back as a new conversation (exchange.py is the Qt-free format)."""

from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtWidgets import QFileDialog

from .exchange import ExchangeError, from_json, read_json, to_json, to_markdown


def export_conversation(window, path: str | None = None) -> None:
    """The conversation shown, to a file: Markdown (.md, the branch shown) or JSON (every branch)."""
    cid = window.chat.current_cid
    if cid is None:
        window.show_error("There is no conversation to export yet.")
        return
    if path is None:
        name = "".join(c if c.isalnum() or c in " -_" else "_" for c in window.store.conversation(cid).title)
        path, _ = QFileDialog.getSaveFileName(
            window, "Export the conversation", f"{name.strip() or 'conversation'}.md",
            "Markdown, the branch shown (*.md);;JSON, every branch, importable (*.json)",
        )  # fmt: skip
        if not path:
            return
    try:
        if path.lower().endswith(".json"):
            text = json.dumps(to_json(window.store, cid), ensure_ascii=False, indent=2)
        else:
            text = to_markdown(window.store, cid)
        Path(path).write_text(text, encoding="utf-8")
    except OSError as e:
        window.show_error(f"The conversation could not be written to {path}: {e.strerror or e}.")
        return
    window.statusBar().showMessage(f"Exported to {path}.", 5000)


def import_conversation(window, path: str | None = None) -> None:
    """A conversation exported as JSON, back as a new conversation with the same branches."""
    if window.generating:
        return
    if path is None:
        path, _ = QFileDialog.getOpenFileName(window, "Import a conversation", "", "kvchat conversation (*.json)")
        if not path:
            return
    try:
        conv = window.chat.guard(from_json, window.store, read_json(path))
    except ExchangeError as e:
        window.show_error(f"The conversation could not be imported: {e}.")
        return
    if conv is not None:
        window.select_conversation(conv.id)
        window.statusBar().showMessage(f"Imported “{conv.title}”.", 5000)
