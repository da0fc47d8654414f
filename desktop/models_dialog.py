"""The Models dialog: the bundled demo model and the models already on this machine (the Hugging Face cache,
LM Studio, Ollama, the folders a person added), as `python -m engine models` lists them, opened with a click;
the model in use is marked.

The scan runs on a thread of its own and rows appear as they are read, so the window never waits;
a model kvchat cannot open is listed greyed, with the reason.
"""

from __future__ import annotations

import threading
from pathlib import Path

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QBrush, QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from engine.hub import fits
from engine.weights.catalog import bundled_row, default_cache, is_bundled, scan

from .core.panel_words import fmt_size
from .hub_tab import HubTab
from .outside_text import plain, plain_tooltip

# What a person looks for first (is it loaded, does it fit) comes right after the name, in view at the default size.
COLUMNS = ("Name", "Status", "Memory", "Source", "Format", "Architecture", "Parameters", "Quantization", "Size",
           "KV / position")  # fmt: skip
RIGHT_ALIGNED = ("Parameters", "Size")


def kv_words(found) -> str:
    """A row's KV bytes per position, and a sliding-window cache's layers (they keep a ring, not the capacity)."""
    if found.kv_bytes_per_position is None:
        return ""
    text = fmt_size(found.kv_bytes_per_position)
    return f"{text} · {found.kv_layers_short}" if found.kv_layers_short else text


def fmt_params(n) -> str:
    if n is None:
        return "—"
    return f"{n / 1e9:,.1f} B" if n >= 1e9 else f"{n / 1e6:,.0f} M" if n >= 1e6 else f"{n:,}"


class _Scan(QObject):
    """Rows from engine.weights.catalog.scan on a plain thread, handed to the GUI thread by queued signals."""

    row = Signal(object)  # a FoundModel
    done = Signal(str)  # "" or the error that ended the scan

    def start(self, folders, env=None, home=None, cache=None) -> None:
        def run():
            try:
                for found in scan(folders, env=env, home=home, cache=cache):
                    self.row.emit(found)
                self.done.emit("")
            except Exception as e:  # a scan that breaks says why; the dialog stays usable
                self.done.emit(f"{type(e).__name__}: {e}")

        threading.Thread(target=run, name="kvchat-model-scan", daemon=True).start()


class ModelsDialog(QDialog):
    """Pick a model: double-click a row or press Open. `chosen` is the path to load; `folders` the
    added folders (kept in the settings by the window)."""

    scanned = Signal()  # every source has been read (tests wait on it)

    def __init__(self, folders: list[str], current: str | None, parent=None, env=None, home=None, cache=None):
        super().__init__(parent)
        self.setWindowTitle("Models")
        self.resize(1120, 460)
        self.folders, self.current, self.chosen = list(folders), current, None
        self._env, self._home, self._cache = env, home, default_cache() if cache is None else cache
        self.rows: list = []
        outer = QVBoxLayout(self)
        self.tabs = QTabWidget()
        self.tabs.setObjectName("modelsTabs")
        local = QWidget()
        lay = QVBoxLayout(local)
        lay.setContentsMargins(0, 0, 0, 0)
        self.tabs.addTab(local, "On this computer")
        self.hub = HubTab()
        self.hub.downloaded.connect(self._downloaded)
        self.tabs.addTab(self.hub, "Hugging Face Hub")
        outer.addWidget(self.tabs, 1)
        self.note = plain(QLabel("Looking in the Hugging Face cache, LM Studio, Ollama and your folders…"))
        self.note.setObjectName("modelsNote")
        self.note.setWordWrap(True)
        lay.addWidget(self.note)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setObjectName("modelsTable")
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.verticalHeader().setVisible(False)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeToContents)
        header.setSectionResizeMode(0, QHeaderView.Interactive)
        self.table.setColumnWidth(0, 240)  # a long name is cut here and whole in its tooltip
        header.setSectionResizeMode(COLUMNS.index("Status"), QHeaderView.Interactive)
        self.table.setColumnWidth(COLUMNS.index("Status"), 150)  # "cannot open: …" is whole in the tooltip
        header.setSectionResizeMode(len(COLUMNS) - 1, QHeaderView.Stretch)
        self.table.itemDoubleClicked.connect(lambda item: self.open_row(item.row()))
        self.table.itemSelectionChanged.connect(self._selection_changed)
        lay.addWidget(self.table, 1)
        buttons = QHBoxLayout()
        self.addFolderButton = QPushButton("Add folder…")
        self.addFolderButton.setObjectName("addFolderButton")
        self.addFolderButton.clicked.connect(self.add_folder)
        self.fileButton = QPushButton("Open a file…")
        self.fileButton.setObjectName("openFileButton")
        self.fileButton.clicked.connect(self.open_file)
        self.rescanButton = QPushButton("Rescan")
        self.rescanButton.setObjectName("rescanButton")
        self.rescanButton.clicked.connect(self.rescan)
        self.openButton = QPushButton("Open")
        self.openButton.setObjectName("openModelButton")
        self.openButton.setDefault(True)
        self.openButton.setEnabled(False)
        self.openButton.clicked.connect(lambda: self.open_row(self.table.currentRow()))
        cancel = QPushButton("Cancel")
        cancel.clicked.connect(self.reject)
        for b in (self.addFolderButton, self.fileButton, self.rescanButton):
            buttons.addWidget(b)
        buttons.addStretch(1)
        buttons.addWidget(cancel)
        buttons.addWidget(self.openButton)
        outer.addLayout(buttons)
        self.finished.connect(lambda _: self.hub.stop())  # a download running is paused, to go on later
        local_buttons = (self.addFolderButton, self.fileButton, self.rescanButton, self.openButton)
        self.tabs.currentChanged.connect(lambda i: [b.setVisible(i == 0) for b in local_buttons])  # the Hub's own
        self.rescan()

    # --- scanning ----------------------------------------------------------------------------------
    def rescan(self) -> None:
        self.table.setRowCount(0)
        self.rows = []
        self.rescanButton.setEnabled(False)
        self._add_row(bundled_row())  # always there: the way back to the demo model
        self._scan = _Scan()
        self._scan.row.connect(self._add_row)
        self._scan.done.connect(self._scan_done)
        self._scan.start(self.folders, self._env, self._home, self._cache)

    def _add_row(self, found) -> None:
        self.rows.append(found)
        r = self.table.rowCount()
        self.table.insertRow(r)
        status = "ready" if found.openable else f"cannot open: {found.reason}"
        in_use = (
            is_bundled(self.current)
            if found.source == "bundled"
            else self.current and Path(found.path) == Path(self.current)
        )
        if in_use and found.openable:
            status = "in use"
        cells = {
            "Name": found.name,
            "Status": status,
            "Memory": fits((found.held_bytes or found.size_bytes) + (found.kv_allocated_bytes or 0))[1]
            if found.openable
            else "",
            "Source": found.source,
            "Format": found.format,
            "Architecture": (found.architecture or "?") + (" · images" if found.images else ""),
            "Parameters": fmt_params(found.parameters),
            "Quantization": found.quantization or "?",
            "Size": fmt_size(found.size_bytes),
            "KV / position": kv_words(found),
        }
        for c, column in enumerate(COLUMNS):
            text = cells[column]
            item = QTableWidgetItem(text)
            kv = f"\nKV cache: {found.kv_layers}" if found.kv_layers else ""
            held = f"\nWeights once loaded: {fmt_size(found.held_bytes)}" if found.held_bytes else ""
            seen = f"\nIt {found.images}" if found.images else ""
            item.setToolTip(plain_tooltip(f"{found.path}\n{status}{kv}{held}{seen}"))
            if not found.openable:
                item.setForeground(QBrush(QColor("#8a93a6")))
            if status == "in use":  # the model loaded now, in bold
                font = item.font()
                font.setBold(True)
                item.setFont(font)
            if column in RIGHT_ALIGNED:
                item.setTextAlignment(Qt.AlignRight | Qt.AlignVCenter)
            self.table.setItem(r, c, item)

    def _scan_done(self, error: str) -> None:
        self.rescanButton.setEnabled(True)
        found = [r for r in self.rows if r.source != "bundled"]
        n, ok = len(found), sum(r.openable for r in found)
        if error:
            self.note.setText(f"The scan stopped: {error}")
        elif not n:
            self.note.setText(
                "No models found in the Hugging Face cache, LM Studio or Ollama (the bundled demo model is always "
                "here). Add a folder, or open a GGUF file or a model folder directly."
            )
        else:
            found = f"{n} model{'s' if n != 1 else ''} found"
            can = "it can" if n == 1 and ok else "it cannot" if n == 1 else f"{ok} of them can"
            self.note.setText(f"{found}, {can} be opened. Double-click one to open it.")
        self.scanned.emit()

    # --- choosing ----------------------------------------------------------------------------------
    def _selection_changed(self) -> None:
        r = self.table.currentRow()
        self.openButton.setEnabled(0 <= r < len(self.rows) and self.rows[r].openable)

    def open_row(self, r: int) -> None:
        if 0 <= r < len(self.rows) and self.rows[r].openable:
            self.chosen = self.rows[r].path
            self.accept()

    def _downloaded(self, path: str) -> None:
        """A download from the Hub is whole and checked: it is the model to open."""
        self.chosen = path
        self.accept()

    def add_folder(self) -> None:
        d = QFileDialog.getExistingDirectory(self, "A folder that holds models")
        if d and d not in self.folders:
            self.folders.append(d)
            self.rescan()

    def open_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model file", "", "GGUF models (*.gguf);;All files (*)")
        if path:
            self.chosen = path
            self.accept()
