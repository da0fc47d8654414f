"""Images beside messages: the strip of a draft's attachments over the message box (each removable), the row of a
sent message's images in the transcript, and their thumbnails, decoded by Qt's reader under an allocation limit at
the size they are shown."""

from __future__ import annotations

from PySide6.QtCore import QBuffer, QByteArray, QIODevice, QSize, Qt, Signal
from PySide6.QtGui import QImage, QImageReader, QPixmap
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QToolButton, QWidget

from engine.images import Image, ImageError, image_file, read_image

from .outside_text import plain, plain_tooltip

THUMB = 56  # a thumbnail's side in the composer's strip and the transcript, in pixels
ALLOCATION_MB = 256  # what Qt's reader may allocate for one image (its own decompression-bomb guard)
IMAGE_FILTER = "Images (*.png *.jpg *.jpeg *.webp *.gif *.bmp)"
SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")


def thumbnail(data: bytes, side: int = THUMB) -> QPixmap:
    """The picture scaled to fit side × side, read at that size where the format allows (JPEG)."""
    QImageReader.setAllocationLimit(ALLOCATION_MB)
    buf = QBuffer()
    buf.setData(QByteArray(data))
    buf.open(QIODevice.ReadOnly)
    reader = QImageReader(buf)
    size = reader.size()
    if size.isValid() and size.width() > 0 and size.height() > 0:
        reader.setScaledSize(size.scaled(QSize(side, side), Qt.KeepAspectRatio))
    picture = reader.read()
    if picture.isNull():
        return QPixmap()
    return QPixmap.fromImage(picture.scaled(side, side, Qt.KeepAspectRatio, Qt.SmoothTransformation))


def pasted_image(picture: QImage) -> Image:
    """An image pasted from the clipboard, as PNG bytes read back under the engine's limits."""
    buf = QBuffer()
    buf.open(QIODevice.WriteOnly)
    picture.save(buf, "PNG")
    return read_image(bytes(buf.data()), "pasted image.png")


def image_files(paths) -> tuple[list[Image], list[str]]:
    """Image files read and checked (engine.images.image_file), and why each refused one was."""
    found, refused = [], []
    for p in paths:
        try:
            found.append(image_file(p))
        except ImageError as e:
            refused.append(str(e))
    return found, refused


def _image_paths(source) -> list[str]:
    """A paste's or a drop's local files named as images."""
    paths = [u.toLocalFile() for u in source.urls() if u.isLocalFile()] if source.hasUrls() else []
    return [p for p in paths if p.lower().endswith(SUFFIXES)]


def images_in(source) -> tuple[list[Image], list[str]]:
    """The images in a paste or a drop (its picture, or its local image files), and why each refused one was."""
    if not source.hasImage():
        return image_files(_image_paths(source))
    try:
        return [pasted_image(QImage(source.imageData()))], []
    except ImageError as e:
        return [], [str(e)]


def holds_images(source) -> bool:
    return source.hasImage() or bool(_image_paths(source))


class ImageChip(QFrame):
    """One image: its thumbnail, what it is in a tooltip, and (in the draft) a button that takes it away."""

    removed = Signal()

    def __init__(self, data: bytes, words: str, removable: bool):
        super().__init__()
        self.setObjectName("imageChip")
        lay = QHBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        lay.setSpacing(0)
        self.picture = QLabel()
        self.picture.setObjectName("imageThumb")
        pixmap = thumbnail(data)
        if pixmap.isNull():
            self.picture.setText("?")
        else:
            self.picture.setPixmap(pixmap)
        self.picture.setFixedSize(THUMB, THUMB)
        self.picture.setAlignment(Qt.AlignCenter)
        self.setToolTip(plain_tooltip(words))
        self.picture.setAccessibleName(f"Image: {words}")
        lay.addWidget(self.picture)
        if removable:
            self.removeButton = QToolButton()
            self.removeButton.setObjectName("removeImage")
            self.removeButton.setText("×")
            self.removeButton.setAccessibleName(f"Remove the image {words}")
            self.removeButton.setToolTip("Remove this image from the message")
            self.removeButton.clicked.connect(self.removed)
            lay.addWidget(self.removeButton, 0, Qt.AlignTop)


class AttachmentStrip(QWidget):
    """The draft's images over the message box: hidden while there are none."""

    changed = Signal()

    def __init__(self):
        super().__init__()
        self.setObjectName("attachments")
        self.images: list[Image] = []
        self.row = QHBoxLayout(self)
        self.row.setContentsMargins(0, 0, 0, 0)
        self.note = plain(QLabel())
        self.note.setObjectName("attachmentsNote")
        self.setVisible(False)

    def add(self, images: list[Image], most: int) -> int:
        """Add images (each once) up to `most` in all; returns how many did not fit."""
        fresh = [im for im in images if im not in self.images]
        room = max(0, most - len(self.images))
        self.images += fresh[:room]
        self._draw()
        return len(fresh) - min(len(fresh), room)

    def remove(self, index: int) -> None:
        del self.images[index]
        self._draw()

    def clear(self) -> None:
        self.images = []
        self._draw()

    def _draw(self) -> None:
        while self.row.count():
            w = self.row.takeAt(0).widget()
            if w is not None and w is not self.note:
                w.deleteLater()
        for i, im in enumerate(self.images):
            chip = ImageChip(im.data, im.describe(), removable=True)
            chip.removed.connect(lambda i=i: self.remove(i))
            self.row.addWidget(chip)
        n = len(self.images)
        what = "1 image: the model sees it" if n == 1 else f"{n} images: the model sees them"
        self.note.setText(f"{what} before your text")
        self.row.addWidget(self.note)
        self.row.addStretch(1)
        self.setVisible(bool(self.images))
        self.changed.emit()


class MessageImages(QWidget):
    """A sent message's images in the transcript (read from kvchat's image folder)."""

    def __init__(self, refs: list[dict], files):
        super().__init__()
        self.setObjectName("messageImages")
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 2, 0, 2)
        for ref in refs:
            words = f"{ref['name']} ({ref['width']}×{ref['height']} {ref['format']})"
            try:
                data = files.path(ref).read_bytes()
            except OSError:
                data, words = b"", f"{words}: missing from kvchat's image folder"
            row.addWidget(ImageChip(data, words, removable=False))
        row.addStretch(1)
