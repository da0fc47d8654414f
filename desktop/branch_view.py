"""The branch on screen: the transcript's views for the current branch of the conversation shown. A
conversation opens with its last WINDOW messages at once (a long one from its tail, while a thread reads the
rest of its branch), the rest of that window added a CHUNK per turn of the event loop, earlier messages on
request; a redraw keeps the views that still show the same message at the same place."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QObject, Qt, QTimer, Signal

from .transcript import MessageView, Transcript

WINDOW = 16  # messages a conversation opens with (a few screens): a long one opens at once
CHUNK = 2  # views built in one turn of the event loop while a conversation opens
EARLIER = 40  # messages "Show earlier messages" (or Ctrl+Up at the top) adds


class BranchView(QObject):
    """Draws the chat controller's branch into `transcript`. `make_view(message, index, count)` builds a
    message's view (wired to the window), `fit_view(view)` sets its buttons to the window's state, `drawn()`
    is told after each draw, `closing()` says whether the window is going."""

    branchRead = Signal(int, object)  # a conversation's branch read on a thread: (its id, the future)

    def __init__(
        self,
        transcript: Transcript,
        chat: Callable,
        make_view: Callable[..., MessageView],
        fit_view: Callable[[MessageView], None],
        drawn: Callable[[], None],
        closing: Callable[[], bool],
    ):
        super().__init__(transcript)
        self.transcript, self.chat = transcript, chat
        self.make_view, self.fit_view, self.drawn, self.closing = make_view, fit_view, drawn, closing
        self.shown_cid = None  # the conversation the transcript's views belong to
        self.rows: list = []  # the branch as last drawn: (message, version index, versions)
        self.backfill_to = 0  # the branch index down to which views are being added, a chunk a turn
        self.reading = None  # the conversation drawn from its tail while its branch is read on a thread
        # queued: a read done before its callback is added calls `done` here, and the tail must be drawn first
        self.branchRead.connect(self._on_branch_read, Qt.QueuedConnection)
        transcript.earlierRequested.connect(self.show_earlier)

    def store(self):
        return self.chat().store

    def render(self, reveal: int | None = None, wait: bool = False) -> None:
        """Show the current branch: a conversation opens with its last WINDOW messages (earlier ones on
        request; `reveal`: from this branch index at least). Views that still show the same message at
        the same branch position are kept (their text updated if it changed), so sending, finishing or
        editing lays out only the messages that changed, not a long conversation from the top. A long
        conversation not read yet opens from its end at once while a thread reads the rest of it, and is
        drawn again when that read ends (`wait`: read it here now instead)."""
        cid = self.chat().current_cid
        reading = cid is not None and self.reading == cid == self.shown_cid and not self.store().kept(cid)
        if reading and reveal is None and not wait:
            return  # drawn from its tail: the thread reading the rest draws it when done
        if cid is not None and cid != self.shown_cid and not self.store().kept(cid):
            tail = self.chat().guard(self.store().tail, cid, WINDOW)
            if tail:
                self._draw(tail, more=tail[0][0].parent_id is not None)
                self._read_branch(cid)
                return
        rows = self.chat().rows()
        if self.reading == cid == self.shown_cid:
            self._place_tail(rows)
        self.reading = None
        self._draw(rows, reveal)

    def _read_branch(self, cid: int) -> None:
        """The branch of a conversation drawn from its tail, read on a thread (`branchRead` brings it back)."""
        self.reading = cid
        fut = self.store().read_later(cid)
        if fut is None:  # it cannot be read elsewhere: here, once this turn has drawn the tail
            QTimer.singleShot(0, self.transcript, lambda: self._on_branch_read(cid, None))  # dropped if it is gone
            return

        def done(f):
            try:
                self.branchRead.emit(cid, f)
            except RuntimeError:  # the window is gone
                pass

        fut.add_done_callback(done)

    def _on_branch_read(self, cid: int, fut) -> None:
        if self.closing():
            return
        if fut is not None and fut.exception() is None:
            self.store().adopt(fut.result())  # not if a message was written meanwhile: then read here
        if self.reading == cid == self.chat().current_cid:
            self.render(wait=True)

    def _place_tail(self, rows: list) -> None:
        """The views drawn from the tail, given their places in the whole branch (the earlier button
        counts what is above them now)."""
        tr = self.transcript
        first = tr.views[0].message.id if tr.views else None
        at = next((i for i in range(len(rows) - 1, -1, -1) if rows[i][0].id == first), None)
        if at is None:
            self.shown_cid = None  # nothing in common: drawn again
            return
        self.backfill_to += at - tr.first
        tr.set_first(at, more=False)
        self.rows = rows

    def whole_branch(self) -> None:
        """The branch read whole now if it is being read on a thread (what follows counts in it)."""
        if self.reading is not None and self.reading == self.chat().current_cid:
            self.render(wait=True)

    def _draw(self, rows: list, reveal: int | None = None, more: bool = False) -> None:
        """The transcript's views for `rows` (the branch, or its tail while the rest is read: `more`)."""
        tr = self.transcript
        self.rows = rows  # what the backfill prepends from
        if self.chat().current_cid != self.shown_cid or tr.first > max(0, len(rows) - 1):
            # Another conversation: its last CHUNK messages now, the rest of the WINDOW a CHUNK per turn
            # of the event loop (the window answers in between), newest first.
            self.shown_cid = self.chat().current_cid
            self.backfill_to = max(0, len(rows) - WINDOW)
            tr.clear(max(self.backfill_to, len(rows) - CHUNK), more)
            if tr.first > self.backfill_to:
                QTimer.singleShot(0, tr, self._backfill)  # with the transcript's life: a closed window's never runs
        if reveal is not None and reveal < tr.first:
            tr.prepend([self.make_view(*row) for row in rows[reveal : tr.first]])
        first, views = tr.first, tr.views
        keep = 0
        while keep < min(len(views), len(rows) - first) and views[keep].can_show(*rows[first + keep]):
            views[keep].show_message(rows[first + keep][0])
            keep += 1
        tr.truncate(keep)
        for row in rows[first + keep :]:
            tr.add(self.make_view(*row))
        for view in tr.views:
            self.fit_view(view)
        self.drawn()

    def _backfill(self) -> None:
        """The next CHUNK of the conversation's first WINDOW messages, above those shown."""
        tr, rows = self.transcript, self.rows
        first = tr.first
        if (
            first <= self.backfill_to
            or not tr.views
            or first >= len(rows)
            or rows[first][0].id != tr.views[0].message.id
        ):
            return  # done, or the transcript moved on (another conversation, a redraw): nothing to add
        start = max(self.backfill_to, first - CHUNK)
        tr.prepend([self.make_view(*row) for row in rows[start:first]])
        if start > self.backfill_to:
            QTimer.singleShot(0, tr, self._backfill)

    def show_earlier(self) -> None:
        """The EARLIER messages before those shown (the transcript's button, or Ctrl+Up at the top)."""
        self.whole_branch()
        self.render(reveal=max(0, self.transcript.first - EARLIER))
