"""When the window redraws while a reply streams: at most every REFRESH_MS, stretching to STEADY_REFRESH_MS
while the GUI thread takes more than its CPU budget, past it (to SLOWEST_REFRESH_MS) only while it takes more
than its ceiling, and only when something changed (desktop/README.md, "The seam", has the measurements behind
each figure)."""

from __future__ import annotations

import time
from collections.abc import Callable

from PySide6.QtCore import QObject, QTimer

from engine.trace import now

REFRESH_MS = 60  # the fastest the streaming text redraws (≥ 15 updates a second)
STEADY_REFRESH_MS = 100  # the slowest while the GUI thread stays under its ceiling: a stream reads as flowing
SLOWEST_REFRESH_MS = 400  # the slowest, when redraws cost more than the ceiling (a long transcript, a slow paint)
GUI_CPU_BUDGET = 0.08  # share of one core the GUI thread aims at while a reply streams
GUI_CPU_CEILING = 0.2  # the share past which the text redraws less than 10 times a second


class RedrawPacer(QObject):
    """A timer that calls `draw(panel)` when something was marked dirty, and adapts its interval to the GUI
    thread's own CPU time (paint included) while `streaming()` holds. It runs only while there is something
    to redraw: an idle timer costs the GUI thread CPU under qasync."""

    def __init__(self, parent: QObject, draw: Callable[[bool], None], streaming: Callable[[], bool]):
        super().__init__(parent)
        self.draw, self.streaming = draw, streaming
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self.tick)
        self.dirty = False
        self.stopped = False
        self.cpu_mark = (now(), time.thread_time())

    def mark_dirty(self) -> None:
        """Something the redraw shows changed: redraw at the next tick."""
        self.dirty = True
        if not self.timer.isActive() and not self.stopped:
            self.timer.start()

    def draw_now(self) -> None:
        """Draw at once, the panel too (token 1 is not left for the next tick)."""
        self.dirty = True
        self.tick(panel=True)

    def tick(self, panel: bool = False) -> None:
        self.adapt()
        if not self.dirty:
            if not self.streaming():
                self.timer.stop()
            return
        self.dirty = False
        self.draw(panel)

    def adapt(self) -> None:
        """Stretch the interval while the GUI thread uses more than its budget (to STEADY_REFRESH_MS; past it only
        over the ceiling), shrink it back when it uses less (measured with the thread's own CPU clock, over at
        least half a second)."""
        wall, cpu = now(), time.thread_time()
        span = wall - self.cpu_mark[0]
        if span < 0.5:
            return
        busy = (cpu - self.cpu_mark[1]) / span
        self.cpu_mark = (wall, cpu)
        interval = self.timer.interval()
        if not self.streaming():
            interval = REFRESH_MS
        elif busy > GUI_CPU_CEILING:
            interval = min(SLOWEST_REFRESH_MS, int(interval * 1.5))
        elif busy > GUI_CPU_BUDGET:  # towards the steady cadence, from either side
            interval = min(STEADY_REFRESH_MS, int(interval * 1.5)) if interval < STEADY_REFRESH_MS else max(
                STEADY_REFRESH_MS, int(interval / 1.5))  # fmt: skip
        elif busy < GUI_CPU_BUDGET / 2:
            interval = max(REFRESH_MS, int(interval / 1.5))
        if interval != self.timer.interval():
            self.timer.setInterval(interval)

    def stop(self) -> None:
        """For good (the window is closing)."""
        self.stopped = True
        self.timer.stop()
