"""The conversations beside the transcript: a search field, the list (a search's match shown under its
conversation's title; a dot beside those where a reply streams now) and the buttons that make, rename, delete,
export and import conversations."""

from __future__ import annotations

import time
from collections import Counter, defaultdict

from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtGui import QColor, QIcon, QPainter, QPixmap
from PySide6.QtWidgets import QHBoxLayout, QLabel, QLineEdit, QListWidget, QListWidgetItem, QVBoxLayout, QWidget

from .outside_text import plain, plain_tooltip
from .style import button

FOUND_ROLE = Qt.UserRole + 1  # a conversation list item's search match: the message id
STREAMING = "a reply is streaming here"  # the dot's words (tooltip, and the item's accessible description)


def dot(colour: str = "#5ab0f0", size: int = 10) -> QIcon:
    """The mark of a conversation whose reply streams now."""
    pixmap = QPixmap(size, size)
    pixmap.fill(Qt.transparent)
    p = QPainter(pixmap)
    p.setRenderHint(QPainter.Antialiasing)
    p.setBrush(QColor(colour))
    p.setPen(Qt.NoPen)
    p.drawEllipse(1, 1, size - 2, size - 2)
    p.end()
    return QIcon(pixmap)


class Sidebar(QWidget):
    """The list shows what `fill` is given; picking an item (a click, the keyboard's Enter, or moving the
    current item) says which conversation, and which message when a search's match was picked."""

    picked = Signal(int, object)  # conversation id, the matched message's id or None
    searchChanged = Signal(str)

    def __init__(self, window):
        """`window`: whose slots the buttons call (new_conversation, rename_conversation, ...)."""
        super().__init__()
        ll = QVBoxLayout(self)
        self.search = QLineEdit()
        self.search.setObjectName("searchField")
        self.search.setPlaceholderText("Search conversations (Ctrl+F)")
        self.search.setAccessibleName("Search conversations by title and message text")
        self.search.textChanged.connect(self.searchChanged)
        self.search.installEventFilter(self)  # Esc clears it; Down and Enter go to the list
        ll.addWidget(self.search)
        self.noResults = plain(QLabel("No conversation holds these words."))
        self.noResults.setObjectName("noResultsNote")
        self.noResults.setWordWrap(True)
        self.noResults.setVisible(False)
        ll.addWidget(self.noResults)
        self.list = QListWidget()
        self.list.setObjectName("conversationList")
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.ElideRight)
        self.list.currentItemChanged.connect(self._picked)
        self.list.itemClicked.connect(self._picked)  # a hit in the one shown
        self.list.itemActivated.connect(self._picked)  # Enter, from the keyboard
        ll.addWidget(self.list)
        self.streaming: set[int] = set()  # conversations whose reply streams now (mark_streaming)
        self._dot, self._blank = dot(), dot("#00000000")
        row = QHBoxLayout()
        self.newButton = button("New", "newButton", window.new_conversation, row)
        self.renameButton = button("Rename", "renameButton", window.rename_conversation, row)
        self.deleteButton = button("Delete", "deleteButton", window.delete_conversation, row)
        ll.addLayout(row)
        row = QHBoxLayout()
        self.exportButton = button("Export…", "exportButton", lambda: window.export_conversation(), row)
        self.exportButton.setToolTip("Save this conversation as Markdown (the branch shown) or JSON (every branch)")
        self.importButton = button("Import…", "importButton", lambda: window.import_conversation(), row)
        ll.addLayout(row)
        self.undoButton = button("Undo delete", "undoDeleteButton", window.undo_delete, ll)
        self.undoButton.setVisible(False)

    def fill(self, conversations, hits: dict, current: int | None) -> None:
        """The conversations (newest first) with their search matches (`hits`: conversation id -> SearchHit),
        the one shown made current; no `picked` is said for it."""
        self.list.blockSignals(True)
        self.list.clear()
        conversations = list(conversations)
        by_title = defaultdict(list)
        for c in conversations:
            by_title[c.title].append(c)
        stamps = {t: starts(same) for t, same in by_title.items() if len(same) > 1}  # once a title, not per item
        for c in conversations:
            hit = hits.get(c.id)
            title = c.title if c.title not in stamps else f"{c.title}\n{told_apart(c, stamps[c.title])}"
            item = QListWidgetItem(title if hit is None else f"{title}\n{hit.snippet}")
            item.setData(Qt.UserRole, c.id)
            item.setToolTip(plain_tooltip(c.title))
            if hit is not None:  # a message matched: its words under the title; picking it shows that message
                item.setData(FOUND_ROLE, hit.message_id)
                item.setToolTip(plain_tooltip(f"{c.title}\n{hit.snippet}"))
            self.list.addItem(item)
            if c.id == current:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)
        self.noResults.setVisible(bool(self.search.text().strip()) and not conversations)
        self.mark_streaming(self.streaming, force=True)

    def mark_streaming(self, cids: set, force: bool = False) -> None:
        """A dot beside each conversation whose reply streams now (`cids`) and, while any does, an empty space
        beside the others, so that titles stay in line; only when that changed."""
        if set(cids) == self.streaming and not force:
            return
        self.streaming = set(cids)
        empty = self._blank if self.streaming else QIcon()
        for i in range(self.list.count()):
            item = self.list.item(i)
            on = item.data(Qt.UserRole) in self.streaming
            item.setIcon(self._dot if on else empty)
            item.setData(Qt.AccessibleDescriptionRole, STREAMING if on else "")
            tip = item.toolTip().removesuffix(f"\n({STREAMING})")
            item.setToolTip(f"{tip}\n({STREAMING})" if on else tip)

    def _picked(self, item, _prev=None) -> None:
        if item is not None:
            self.picked.emit(item.data(Qt.UserRole), item.data(FOUND_ROLE))

    def eventFilter(self, obj, event) -> bool:
        if obj is self.search and event.type() == QEvent.KeyPress:
            if event.key() == Qt.Key_Escape and self.search.text():
                self.search.clear()
                return True
            if event.key() in (Qt.Key_Down, Qt.Key_Return, Qt.Key_Enter) and self.list.count():
                self.list.setFocus()
                if self.list.currentRow() < 0 or event.key() != Qt.Key_Down:
                    self.list.setCurrentRow(max(self.list.currentRow(), 0))
                if event.key() != Qt.Key_Down:
                    self._picked(self.list.currentItem())
                return True
        return False

    def focus_search(self) -> None:
        self.search.setFocus()
        self.search.selectAll()


STARTS = ("%d %b %H:%M", "%d %b %H:%M:%S")  # when a conversation was started, to the minute, then the second


def starts(same_title: list) -> list[Counter]:
    """How many of the conversations sharing a title were started at each minute, and at each second."""
    return [Counter(time.strftime(shape, time.localtime(c.created)) for c in same_title) for shape in STARTS]


def told_apart(c, counts: list[Counter]) -> str:
    """The line under a title that others share (two trips to Chengdu cut to the same words; `counts`: their
    starts): when it was started, to the minute, or to the second where that is the same too (and its number,
    where even that is)."""
    for shape, seen in zip(STARTS, counts):
        when = time.strftime(shape, time.localtime(c.created))
        if seen[when] == 1:
            return f"started {when}"
    return f"started {when} · no. {c.id}"
