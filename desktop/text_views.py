"""Text widgets that size themselves to their text: a one-line label that elides, a wrapped label that keeps its
height per width, a read-only view as tall as its document, and the view a reply streams into, a few lines at a
time (desktop/README.md, "The seam", says why each is shaped so)."""

from __future__ import annotations

import math

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QPainter, QTextCursor
from PySide6.QtWidgets import QFrame, QLabel, QSizePolicy, QTextEdit

from engine.trace import now

from .core.markdown import Piece


class ElidedLabel(QLabel):
    """One line that ends in "…" where its room is too narrow for it (a long model name beside a reply's role),
    rather than being clipped mid-letter, and shows nothing where fewer than MIN_CHARS of it would be left; the
    whole text is its tooltip's business."""

    MIN_CHARS = 4

    def shown(self) -> str:
        """What is painted at the label's width now."""
        cut = self.fontMetrics().elidedText(self.text(), Qt.ElideRight, self.contentsRect().width())
        return "" if cut != self.text() and len(cut) - 1 < self.MIN_CHARS else cut

    def paintEvent(self, _):
        p = QPainter(self)
        p.setPen(self.palette().color(self.foregroundRole()))
        p.drawText(self.contentsRect(), Qt.AlignVCenter | Qt.AlignLeft, self.shown())


class WrapLabel(QLabel):
    """A word-wrapped QLabel that remembers its height per width until its text changes.

    QLabel lays its whole text out again on every heightForWidth call, and the transcript's layout asks
    every message whenever one grows: while a reply streams, each update would lay out every message
    above it again. Heights of unchanged text are answered from here.
    """

    def __init__(self):
        super().__init__()
        self._heights: dict[int, int] = {}
        self.setWordWrap(True)

    def setText(self, text: str) -> None:
        if text != self.text():
            self._heights.clear()
            super().setText(text)

    def setTextFormat(self, fmt) -> None:
        if fmt != self.textFormat():
            self._heights.clear()
            super().setTextFormat(fmt)

    def heightForWidth(self, w: int) -> int:
        h = self._heights.get(w)
        if h is None:
            h = self._heights[w] = super().heightForWidth(w)
        return h

    def minimumSizeHint(self) -> QSize:  # QLabel's lays the text out at width 0: a line per word
        fm = self.fontMetrics()
        return QSize(fm.averageCharWidth() * 12, fm.lineSpacing())

    def sizeHint(self) -> QSize:  # the height at the width it has (one cached layout), not at a guessed one
        w = self.width() if self.width() > 0 else self.fontMetrics().averageCharWidth() * 80
        return QSize(w, self.heightForWidth(w))


class FitTextEdit(QTextEdit):
    """A read-only text view as tall as its document: the transcript scrolls, not this view."""

    def __init__(self, wrap: bool = True):
        super().__init__()
        self.setReadOnly(True)
        self.setFrameShape(QFrame.NoFrame)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarAsNeeded if not wrap else Qt.ScrollBarAlwaysOff)
        if not wrap:
            self.setLineWrapMode(QTextEdit.NoWrap)
        self.setSizePolicy(QSizePolicy.Preferred, QSizePolicy.Fixed)
        self.setTextInteractionFlags(Qt.TextSelectableByMouse | Qt.TextSelectableByKeyboard)
        self.setFocusPolicy(Qt.ClickFocus)  # selectable, not a tab stop: the message is (its Copy copies it)
        self.document().setDocumentMargin(4)
        self.document().documentLayout().documentSizeChanged.connect(self._fit)

    grow_lines = 0  # > 0: grow by this many lines at a time (text still arriving), not to the exact height

    def set_growing(self, lines: int) -> None:
        """While text streams in, each change of height lays out, scrolls and repaints the whole
        transcript: growing a few lines at a time does that once every few lines."""
        self.grow_lines = lines
        self._fit()

    def _fit(self, *_) -> None:
        bar = self.horizontalScrollBar()
        extra = bar.sizeHint().height() if bar.isVisible() else 0
        h = math.ceil(self.document().size().height()) + extra
        if self.grow_lines:
            step = self.fontMetrics().lineSpacing() * self.grow_lines
            h = max(step, math.ceil(h / step) * step)
        else:
            h += 2
        if h != self.height():
            self.setFixedHeight(h)


GROW_LINES = 4  # lines a view of streaming text grows by at a time


class StreamView(FitTextEdit):
    """The text of a reply while it streams: new text is appended to the document, so Qt lays out and
    paints only the last paragraph, where a label lays out and paints the whole reply on every update
    (desktop/README.md, "The seam"). Its height follows the document a few lines at a time (set_growing),
    not exactly as a finished view does. It reports when its first real text is painted (`firstPainted`, on
    engine.trace.now): the moment token 1 is on screen."""

    firstPainted = Signal(float)

    def __init__(self):
        super().__init__()
        self.waiting_for_paint = False  # text is shown but not yet painted
        self.setTextInteractionFlags(Qt.TextSelectableByMouse)
        self.document().setDocumentMargin(0)
        self.shown = ""  # the text in the document
        self.piece: Piece | None = None  # the open paragraph of a reply it shows (ReplyBody)
        self.set_growing(GROW_LINES)

    def set_piece(self, piece: Piece) -> None:
        self.piece = piece
        self.show_text(piece.text)

    def show_text(self, text: str) -> None:
        if text.startswith(self.shown) and self.shown:
            cursor = QTextCursor(self.document())
            cursor.movePosition(QTextCursor.End)
            cursor.insertText(text[len(self.shown) :])
        else:
            self.setPlainText(text)
        if text and not self.shown.strip("…") and text != "…":
            self.waiting_for_paint = True
        self.shown = text

    def paintEvent(self, e) -> None:
        super().paintEvent(e)
        if self.waiting_for_paint:
            self.waiting_for_paint = False
            self.firstPainted.emit(now())
