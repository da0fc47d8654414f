"""The window's side of a draft's images: attached by the Image… button, a paste or a drop (the composer's), capped
at a message's limit, shown over the message box and sent with the text."""

from __future__ import annotations

from PySide6.QtWidgets import QFileDialog

from .attachments import IMAGE_FILTER, image_files
from .core.image_files import MAX_IMAGES


class WindowImages:
    """MainWindow's draft images (a mixin over its `attachments` strip and `show_error`)."""

    @property
    def draft_images(self) -> tuple:
        return tuple(self.attachments.images)

    def attach_images(self, images: list) -> None:
        """Images for the draft, each once, up to MAX_IMAGES a message (those past it said, not attached)."""
        left = self.attachments.add(list(images), MAX_IMAGES)
        if left:
            self.show_error(f"Not attached: a message takes at most {MAX_IMAGES} images ({left} left out)")
        self.composer.setFocus()

    def choose_images(self) -> None:
        """The Image… button: image files chosen in a file dialog, each read and checked before it is attached."""
        paths, _ = QFileDialog.getOpenFileNames(self, "Attach images", "", IMAGE_FILTER)
        found, refused = image_files(paths)
        if found:
            self.attach_images(found)
        if refused:
            self.show_error("Not attached: " + "; ".join(refused))
