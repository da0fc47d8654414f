"""The banner while another program's lock holds changes to the conversation database back: how many wait
(in memory, read as written; beside the database at close), a retry every second, and the way out, a copy
of the conversations with every change saved elsewhere."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QFileDialog, QHBoxLayout, QLabel, QWidget

from .core.store_file import StoreError
from .outside_text import plain
from .style import button

HELD_RETRY_MS = 1000  # how often changes a lock held back are tried again


class HeldBanner(QWidget):
    """`store()` is the window's store; `show_error(text)` and `say(text, ms)` are the window's banner and
    status bar."""

    def __init__(self, store: Callable, show_error: Callable[[str], None], say: Callable[[str, int], None]):
        super().__init__()
        self.store, self.show_error, self.say = store, show_error, say
        row = QHBoxLayout(self)
        self.label = plain(QLabel())
        self.label.setObjectName("heldBanner")
        self.label.setWordWrap(True)
        row.addWidget(self.label, 1)
        self.saveCopyButton = button("Save a copy elsewhere…", "saveCopyButton", lambda: self.save_copy(), row)
        self.saveCopyButton.setAccessibleName("Save a copy of the conversations, with the changes not yet saved")
        self.setVisible(False)
        self.timer = QTimer(self)
        self.timer.setInterval(HELD_RETRY_MS)
        self.timer.timeout.connect(self.retry)

    def held(self, n: int) -> None:
        """Another program holds the database: the changes wait in memory (the transcript shows them),
        retried every second, with the way out (a copy elsewhere) beside them."""
        self.label.setText(
            f"{n} change{'s' if n != 1 else ''} not saved yet: {self.store().held_because}. kvchat keeps "
            f"{'them' if n != 1 else 'it'} and tries again every second (on closing, beside the database, to "
            "be saved at the next start)."
        )
        self.setVisible(True)
        if not self.timer.isActive():
            self.timer.start()

    def retry(self) -> None:
        try:
            saved = self.store().flush()
        except StoreError as e:
            self.timer.stop()
            self.show_error(f"{e}; the changes are still held: save a copy elsewhere")
            return
        if saved:
            self.timer.stop()
            self.setVisible(False)
            self.say("The conversation database is free again: every change is saved.", 10000)
        else:
            self.held(len(self.store().held))

    def save_copy(self, path: str | None = None) -> None:
        """The conversations with every change, to a file of the person's choosing."""
        if path is None:
            default = str(self.store().path.with_name("kvchat-copy.db"))
            path, _ = QFileDialog.getSaveFileName(self, "Save a copy of the conversations", default, "SQLite (*.db)")
            if not path:
                return
        try:
            saved = self.store().save_copy(path)
        except StoreError as e:
            self.show_error(str(e))
            return
        self.say(f"Saved a copy with every change to {saved}", 15000)
