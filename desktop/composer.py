"""The message box: Enter sends, Shift+Enter is a new line, Esc stops the reply; an image pasted or dropped into
it is attached to the draft (desktop.attachments)."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QPlainTextEdit

from .attachments import holds_images, images_in


class Composer(QPlainTextEdit):
    """Enter sends; Shift+Enter is a new line; a pasted or dropped image (or image file) is attached, not typed."""

    submitted = Signal()
    stopRequested = Signal()  # Esc while typing: the window's Esc shortcut does not reach past a text edit
    imagesGiven = Signal(list)  # the engine.images.Image of a paste or a drop
    imagesRefused = Signal(list)  # why each image of a paste or drop that could not be read was refused

    def keyPressEvent(self, e):
        if e.key() in (Qt.Key_Return, Qt.Key_Enter) and not (e.modifiers() & Qt.ShiftModifier):
            self.submitted.emit()
            return
        if e.key() == Qt.Key_Escape:
            self.stopRequested.emit()
            return
        super().keyPressEvent(e)

    def canInsertFromMimeData(self, source) -> bool:
        return holds_images(source) or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source) -> None:
        """A paste or a drop: its images attached (none of their bytes typed as text), else its text as usual."""
        if not holds_images(source):
            super().insertFromMimeData(source)
            return
        found, refused = images_in(source)
        if found:
            self.imagesGiven.emit(found)
        if refused:
            self.imagesRefused.emit(refused)
