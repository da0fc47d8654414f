"""The Models dialog's Hub tab: search the Hugging Face Hub, see a repository's files (quantization, size, whether
kvchat can open it, whether it fits the memory free now), and download one with `python -m engine pull` in a
process of its own: progress in bytes, speed and time left; Pause stops it (the next Download goes on from
there, in this run or a later one), Cancel stops it and forgets what came. Nothing is offered until the file is
whole and checked (engine/hub.py). Searching and listing run on a thread, so the dialog never waits."""

from __future__ import annotations

import json
import os
import re
import sys
import threading

from PySide6.QtCore import QObject, QProcess, Signal
from PySide6.QtWidgets import (
    QAbstractItemView,
    QCheckBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QProgressBar,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from engine.errors import one_line
from engine.hub import HubError, choose, discard_partial, fits, is_projector, offline, repo_facts, repo_files, search

from .core.panel_words import fmt_size
from .outside_text import plain
from .panel_parts import set_bar
from .style import button

ONLINE = "Models for text generation, most downloaded first."
OFFLINE = "Offline: the Hub is not asked. The models on this computer are listed in the other tab."
MAX_ROWS = 1000  # a repository's files shown; the rest are counted in the note
PROGRESS = re.compile(
    r"^(?P<what>.+): (?P<done>[\d,.]+) / (?P<total>[\d,.]+) MiB · (?P<rate>[\d,.]+) MiB/s · (?P<eta>.+)$"
)


class _Ask(QObject):
    """A Hub question on a plain thread; its answer (or the error, in words) back on the GUI thread."""

    answered = Signal(object, object)  # (what was asked, the answer or a HubError)

    def ask(self, key, fn, *args) -> None:
        def run():
            try:
                self.answered.emit(key, fn(*args))
            except HubError as e:
                self.answered.emit(key, e)
            except Exception as e:  # a broken answer is said, never a crash of the dialog
                self.answered.emit(key, HubError(one_line(f"{type(e).__name__}: {e}")))

        threading.Thread(target=run, name="kvchat-hub", daemon=True).start()


def _files_and_facts(repo: str):
    """A repository's files and what the Hub says of its model (the list's two questions, on one thread)."""
    commit, files = repo_files(repo)
    return files, repo_facts(repo, commit, files)


def _table(name: str, columns: tuple[str, ...]) -> QTableWidget:
    t = QTableWidget(0, len(columns))
    t.setObjectName(name)
    t.setHorizontalHeaderLabels(columns)
    t.setSelectionBehavior(QAbstractItemView.SelectRows)
    t.setSelectionMode(QAbstractItemView.SingleSelection)
    t.setEditTriggers(QAbstractItemView.NoEditTriggers)
    t.verticalHeader().setVisible(False)
    t.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeToContents)
    t.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
    return t


class HubTab(QWidget):
    """Search, pick a file, download it; `downloaded` carries what `--model` takes once it is whole."""

    downloaded = Signal(str)
    searched = Signal()  # results (or the reason there are none) are shown: tests wait on it
    listed = Signal()

    def __init__(self):
        super().__init__()
        lay = QVBoxLayout(self)
        row = QHBoxLayout()
        self.query = QLineEdit()
        self.query.setObjectName("hubQuery")
        self.query.setPlaceholderText("Search the Hugging Face Hub, e.g. SmolLM2 GGUF")
        self.query.setAccessibleName("Search the Hugging Face Hub")
        self.query.returnPressed.connect(self.run_search)
        row.addWidget(self.query, 1)
        self.searchButton = button("Search", "hubSearchButton", lambda: self.run_search(), row)
        self.offline = QCheckBox("Offline")
        self.offline.setObjectName("hubOffline")
        self.offline.setToolTip(
            "Never ask the Hub (huggingface_hub's HF_HUB_OFFLINE, for this run and the downloads it starts)"
        )
        self.offline.setChecked(offline())
        self.offline.toggled.connect(self._set_offline)
        row.addWidget(self.offline)
        lay.addLayout(row)
        self.note = plain(QLabel(OFFLINE if offline() else ONLINE))
        self.note.setObjectName("hubNote")
        self.note.setWordWrap(True)
        lay.addWidget(self.note)
        self.repos = _table("hubRepos", ("Repository", "Formats", "Downloads", "Likes", "Access"))
        self.repos.itemSelectionChanged.connect(self._repo_picked)
        lay.addWidget(self.repos, 1)
        self.files = _table("hubFiles", ("File", "Quantization", "Size", "KV / position", "kvchat", "Memory"))
        self.files.itemSelectionChanged.connect(self._update)
        lay.addWidget(self.files, 1)
        bottom = QHBoxLayout()
        self.progress = QProgressBar()
        self.progress.setObjectName("hubProgress")
        self.progress.setToolTip("The download: MiB fetched of the files chosen, its rate and the time left")
        self.progress.setTextVisible(True)
        self.progress.setVisible(False)
        bottom.addWidget(self.progress, 1)
        self.downloadButton = button("Download", "hubDownloadButton", lambda: self.download(), bottom)
        self.pauseButton = button("Pause", "hubPauseButton", lambda: self.pause(), bottom)
        self.cancelButton = button("Cancel download", "hubCancelButton", lambda: self.cancel(), bottom)
        lay.addLayout(bottom)
        self._ask = _Ask()
        self._ask.answered.connect(self._answered)
        self.found: list = []
        self.listing: tuple[str, list] | None = None  # (repo, its files)
        self.proc: QProcess | None = None
        self.spec: str | None = None  # what is being (or was last) downloaded
        self._stopping = None  # "pause" | "cancel" while a stop is under way
        self._stderr = ""  # what the running download has said (its last "error:" line is shown)
        self._searching = False
        self._at: tuple[float, float] | None = None  # MiB done and in all, as the download last said
        self._update()

    # --- asking the Hub -------------------------------------------------------------------------------
    def _set_offline(self, on: bool) -> None:
        if on:
            os.environ["HF_HUB_OFFLINE"] = "1"
        else:
            os.environ.pop("HF_HUB_OFFLINE", None)
        self.note.setText(OFFLINE if on else ONLINE)
        self._update()

    def run_search(self) -> None:
        text = self.query.text().strip()
        if not text or offline():
            return
        self.note.setText(f"Searching the Hub for “{text}”…")
        self._searching = True
        self._update()
        self._ask.ask(("search", text), search, text)

    def _repo_picked(self) -> None:
        r = self.repos.currentRow()
        if 0 <= r < len(self.found):
            repo = self.found[r].repo
            self.files.setRowCount(0)
            self.note.setText(f"Listing the files of {repo}…")
            self._ask.ask(("files", repo), _files_and_facts, repo)

    def _answered(self, key, answer) -> None:
        kind, what = key
        if kind == "search":
            self._searching = False
            self._update()
        if isinstance(answer, HubError):
            said = one_line(str(answer))
            switch = " Tick Offline to stop asking." if said.startswith("cannot reach") else ""
            self.note.setText(f"{said}.{switch} The models on this computer are still listed in the other tab.")
            (self.searched if kind == "search" else self.listed).emit()
            return
        if kind == "search":
            self._show_repos(what, answer)
        else:
            self._show_files(what, *answer)

    def _show_repos(self, text: str, found: list) -> None:
        self.found = found
        self.repos.setRowCount(0)
        self.files.setRowCount(0)
        for m in found:
            r = self.repos.rowCount()
            self.repos.insertRow(r)
            cells = (m.repo, ", ".join(m.formats) or "?", f"{m.downloads:,}", f"{m.likes:,}",
                     "gated: needs a token" if m.gated else "open")  # fmt: skip
            for c, v in enumerate(cells):
                self.repos.setItem(r, c, QTableWidgetItem(v))
        n = len(found)
        self.note.setText(f"{n} model{'s' if n != 1 else ''} for “{text}”. Pick one for its files." if n else
                          f"No text-generation models match “{text}”.")  # fmt: skip
        self.searched.emit()

    def _show_files(self, repo: str, files: list, facts) -> None:
        shown = [f for f in files if f.kind in ("gguf", "safetensors") and not is_projector(f)]  # (comes with one)
        try:
            folder = choose(repo, files, None) if any(f.kind == "safetensors" for f in shown) else None
        except HubError:
            folder = None
        if folder:  # a safetensors model is one download: the folder
            size = sum(f.size for f in folder)
            shown = [f for f in shown if f.kind == "gguf"]
            rows = [("(the whole model: safetensors folder)", "as stored", size)]
        else:
            rows = []
        rows += [(f.path, f.quantization or "?", f.size) for f in shown if f.kind == "gguf"]
        left_out, rows = max(0, len(rows) - MAX_ROWS), rows[:MAX_ROWS]
        self.listing = (repo, rows)
        self.files.setRowCount(0)
        kv = facts.kv_bytes_per_position
        ok = f"no: {facts.reason}" if facts.reason else "yes" if facts.architecture else "not known before download"
        if facts.images and not facts.reason:
            ok += f" · {facts.images}"
        for path, quant, size in rows:
            r = self.files.rowCount()
            self.files.insertRow(r)
            need = size + (facts.kv_allocated_bytes or 0)  # the weights, and the default cache
            room = fits(need)[1]
            kv_text = fmt_size(kv) if kv else "after download"
            for c, v in enumerate((path, quant, fmt_size(size), kv_text, ok, room)):
                item = QTableWidgetItem(v)
                if c == 3 and not kv:
                    item.setToolTip(
                        "The Hub's summary of a GGUF file does not give its KV heads: known once it is here"
                    )
                elif c == 3 and facts.kv_layers:  # a sliding-window cache: most layers keep a ring
                    item.setText(f"{kv_text} · {facts.kv_layers_short}")
                    item.setToolTip(f"KV cache: {facts.kv_layers}")
                self.files.setItem(r, c, item)
        more = f" ({left_out:,} more not shown: name one as {repo}:FILE in `engine pull`)" if left_out else ""
        self.note.setText(f"{repo}: {len(rows):,} to download{more}. Pick one and press Download." if rows else
                          f"{repo} holds no GGUF file and no safetensors model kvchat can open.")  # fmt: skip
        self._update()
        self.listed.emit()

    # --- downloading ----------------------------------------------------------------------------------
    def chosen_spec(self) -> str | None:
        r = self.files.currentRow()
        if self.listing is None or not 0 <= r < len(self.listing[1]):
            return None
        repo, rows = self.listing
        path = rows[r][0]
        return repo if path.startswith("(") else f"{repo}:{path}"

    def download(self) -> None:
        spec = self.chosen_spec() if self.proc is None else None
        if spec is None:
            return
        resuming = spec == self.spec and self._at is not None and self.progress.isVisible()
        self.spec, self._stopping = spec, None
        self.proc = QProcess(self)
        self.proc.setProgram(sys.executable)
        self.proc.setArguments(["-m", "engine", "pull", spec, "--json"])
        self.proc.readyReadStandardError.connect(self._progress)
        self.proc.finished.connect(self._finished)
        if resuming:  # the bar stays where the pause left it until the download says more
            set_bar(self.progress, 1000, self.progress.value(), f"{spec}: resuming at {mib(*self._at)}…")
        else:
            self._at = None
            set_bar(self.progress, 1000, 0, f"{spec}: starting…")
        self.progress.setVisible(True)
        self.proc.start()
        self._update()

    def _progress(self) -> None:
        text = bytes(self.proc.readAllStandardError()).decode("utf-8", "replace")
        self._stderr += text
        for line in text.splitlines():
            m = PROGRESS.match(line.strip())
            if m:
                done, total = (float(m[k].replace(",", "")) for k in ("done", "total"))
                self._at = (done, total)
                words = f"{m['what']}: {mib(done, total)} · {m['rate']} MiB/s · {m['eta']}"
                set_bar(self.progress, 1000, int(1000 * done / total) if total else 0, words)

    def _finished(self, code: int, _status) -> None:
        out = bytes(self.proc.readAllStandardOutput()).decode("utf-8", "replace").strip()
        err = self._stderr
        self.proc, self._stderr = None, ""
        stopping, self._stopping = self._stopping, None
        if stopping == "pause":
            self.note.setText(f"Paused: {self.spec}. Download goes on from where it stopped, now or after a restart.")
            at = mib(*self._at) if self._at else "the start"
            set_bar(self.progress, 1000, self.progress.value(), f"{self.spec}: paused at {at}")
        elif stopping == "cancel":
            repo = self.spec.partition(":")[0]
            discard_partial(repo)
            self.progress.setVisible(False)
            self.note.setText(f"Cancelled: {self.spec}; what had come was discarded.")
            self._at = None
        elif code == 0 and out:
            path = json.loads(out.splitlines()[-1])["path"]
            set_bar(self.progress, 1000, 1000, f"{self.spec}: downloaded and checked")
            self.note.setText(f"Downloaded {self.spec} into the Hugging Face cache; opening it.")
            self.downloaded.emit(path)
        else:
            said = [ln for ln in err.splitlines() if ln.startswith("error:")]
            self.note.setText(said[-1].removeprefix("error: ") if said else f"the download stopped (exit {code})")
        self._update()
        if stopping == "pause" and (self.cancelButton.hasFocus() or self.pauseButton.hasFocus()):
            self.downloadButton.setFocus()  # on Resume, not on Cancel: a stray Enter goes on, never discards

    def pause(self) -> None:
        if self.proc is not None:
            self._stopping = "pause"
            self.proc.kill()

    def cancel(self) -> None:
        if self.proc is not None:
            self._stopping = "cancel"
            self.proc.kill()
        elif self.spec:
            discard_partial(self.spec.partition(":")[0])
            self.progress.setVisible(False)
            self.note.setText(f"Cancelled: {self.spec}; what had come was discarded.")
            self.spec = None
            self._update()

    def _update(self) -> None:
        running = self.proc is not None
        self.query.setEnabled(not offline())
        self.searchButton.setEnabled(not offline() and not self._searching)
        self.downloadButton.setEnabled(not running and self.chosen_spec() is not None)
        paused = not running and self.spec is not None and self.spec == self.chosen_spec()
        paused = paused and self.progress.isVisible() and self.progress.value() < 1000
        self.downloadButton.setText("Resume" if paused else "Download")
        self.pauseButton.setEnabled(running)
        self.cancelButton.setEnabled(running or bool(self.spec and self.progress.isVisible()))

    def stop(self) -> None:
        """The dialog closes: a running download is paused (it goes on at the next Download)."""
        if self.proc is not None:
            self._stopping = "pause"
            self.proc.kill()
            self.proc.waitForFinished(3000)


def mib(done: float, total: float) -> str:
    """A download's place, as its bar says it: "3.2 of 93.0 MiB"."""
    return f"{done:,.1f} of {total:,.1f} MiB"
