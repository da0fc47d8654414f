"""The message box: Enter sends, Shift+Enter is a new line, Esc stops the reply."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QPlainTextEdit


class Composer(QPlainTextEdit):
    """Enter sends; Shift+Enter is a new line."""

    submitted = Signal()
    stopRequested = Signal()  # Esc while typing: the window's Esc shortcut does not reach past a text edit

    def keyPressEvent(self, e):
        if e.key() in (Qt.Key_Return, Qt.Key_Enter) and not (e.modifiers() & Qt.ShiftModifier):
            self.submitted.emit()
            return
        if e.key() == Qt.Key_Escape:
            self.stopRequested.emit()
            return
        super().keyPressEvent(e)
