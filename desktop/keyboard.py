"""The window's keyboard: Tab in the order things are on screen, Ctrl+Up/Down between messages, the search."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QApplication, QWidget


class Keyboard:
    """Moving by keyboard (mixed into the window). Tab and Shift+Tab go in the order things are on screen: the
    sidebar, the middle column top to bottom (the switcher, each message, the reply's actions, the message box
    and Send), the panel, the status bar; Qt's own chain follows when widgets were made, and a message drawn
    later (every reply) would come after the theme box. Ctrl+Up/Down go between messages, Ctrl+F to the search."""

    ROW = 12  # px: tab stops whose tops are this close count as one row, read left to right

    def tab_stops(self) -> list[QWidget]:
        zones = [self.sidebar, self.centerColumn, self.statsPanel, self.statusBar()]
        found, w = [], self.nextInFocusChain()
        while w is not None and w is not self:
            if w.focusPolicy() & Qt.TabFocus and w.isVisible() and w.isEnabled() and not w.focusProxy():
                zone = next((i for i, z in enumerate(zones) if z.isAncestorOf(w)), None)
                if zone is not None:
                    at = w.mapTo(self, w.rect().topLeft())
                    found.append(((zone, at.y() // self.ROW, at.x()), w))
            w = w.nextInFocusChain()
        return [w for _, w in sorted(found, key=lambda kw: kw[0])]

    def focusNextPrevChild(self, forward: bool) -> bool:
        stops = self.tab_stops()
        if not stops:
            return super().focusNextPrevChild(forward)
        now = QApplication.focusWidget()
        here = next((i for i, w in enumerate(stops) if w is now), None)  # the stop itself, else the one holding it
        if here is None and now is not None:
            here = next((i for i in range(len(stops) - 1, -1, -1) if stops[i].isAncestorOf(now)), None)
        i = (0 if forward else len(stops) - 1) if here is None else (here + (1 if forward else -1)) % len(stops)
        stops[i].setFocus(Qt.TabFocusReason if forward else Qt.BacktabFocusReason)
        if self.transcript.isAncestorOf(stops[i]):
            self.transcript.ensureWidgetVisible(stops[i])
        return True

    def previous_message(self) -> None:
        self._step_message(-1)

    def next_message(self) -> None:
        self._step_message(+1)

    def _step_message(self, delta: int) -> None:
        """Move the focus (and the panel, for replies) to the message above or below (Ctrl+Up/Down)."""
        self.branch.whole_branch()
        views = self.transcript.views
        if not views:
            return
        at = next((i for i, v in enumerate(views) if v.hasFocus()), None)
        if at == 0 and delta < 0 and self.transcript.first > 0:  # above the first shown: show earlier ones
            before = self.transcript.first
            self.show_earlier()
            views, at = self.transcript.views, before - self.transcript.first
        i = (len(views) - 1 if delta < 0 else 0) if at is None else max(0, min(len(views) - 1, at + delta))
        view = views[i]
        view.setFocus()
        QTimer.singleShot(0, lambda: view in self.transcript.views and self.transcript.ensureWidgetVisible(view))
        if view.message.role == "assistant":
            self.select_message(view.message.id)

    def focus_search(self) -> None:
        self.sidebar.focus_search()
