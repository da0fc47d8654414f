"""Small widgets the panel and its neighbours draw with: the chart of a reply's token gaps, a progress bar
set without a paint of its own, and the relayout of boxes whose wrapped words changed."""

from __future__ import annotations

from PySide6.QtCore import QEvent, QObject, QRectF, Qt, QTimer
from PySide6.QtGui import QBrush, QColor, QFont, QPainter, QPen
from PySide6.QtWidgets import QFormLayout, QLabel, QProgressBar, QTreeWidgetItem, QWidget

from .core.panel_words import fmt_size, percentile
from .outside_text import plain_tooltip
from .style import current_theme


def chart_painter(widget: QWidget, colours: dict, empty: str | None) -> QPainter | None:
    """A chart's painter on its background; with `empty` (nothing to draw yet), those words in the middle instead,
    and None."""
    p = QPainter(widget)
    p.fillRect(widget.rect(), QColor(colours["back"]))
    if empty is None:
        return p
    p.setPen(QColor(colours["words"]))
    p.drawText(widget.rect(), Qt.AlignCenter, empty)
    return None


class Refit(QObject):
    """The panel's boxes (a QFormLayout each) laid out again once this turn of the event loop ends, after their
    words changed or the panel's width did: a QFormLayout keeps the heights it computed for a width, so a value
    that grew from one line to three, or a box narrowed by the scroll bar appearing, was drawn in the old
    heights (cut) until the next resize. After every layout of the panel (its LayoutRequest) the wrapped labels
    are checked too: a layout that came from elsewhere (a box shown, a model switch's burst of changes) could
    leave one cut with no word of it changed since."""

    TRIES = 4

    def __init__(self, body: QWidget):
        super().__init__(body)
        self.body, self.tries = body, 0
        self.heights: dict[QLabel, tuple[tuple, int]] = {}  # label -> ((words, width, font), the height they need)
        self.timer = self._next_turn(self.refit)
        self.checker = self._next_turn(self.check)  # a burst of layout requests: one check
        body.installEventFilter(self)

    def _next_turn(self, slot) -> QTimer:
        timer = QTimer(self)
        timer.setSingleShot(True)
        timer.setInterval(0)
        timer.timeout.connect(slot)
        return timer

    def eventFilter(self, obj, e) -> bool:
        if e.type() == QEvent.Resize and e.size().width() != e.oldSize().width():
            self.mark()
        elif e.type() == QEvent.LayoutRequest:
            self.checker.start()  # once the layout has run
        return False

    def mark(self) -> None:
        self.tries = 0
        self.timer.start()

    def refit(self) -> None:
        """Lay the boxes out again, and again next turn while a wrapped label is still cut (a relayout can move
        the scroll bar, and with it every width: at most TRIES times in a row)."""
        for form in self.body.findChildren(QFormLayout):
            form.invalidate()
        self.body.layout().invalidate()
        self.tries += 1
        self.checker.start()

    def check(self) -> None:
        """A cut label: lay out again (unless TRIES in a row have not helped); none: the tries start over."""
        if not self.cut():
            self.tries = 0
        elif self.tries < self.TRIES:
            self.refit()

    def cut(self) -> list[QLabel]:
        """The visible word-wrapped labels drawn shorter than their words need. The height a label's words need
        at its width is kept while its words, width and font stay: each check after a layout would otherwise lay
        every wrapped label's words out again (kept for the labels of this check only)."""
        held, self.heights = self.heights, {}
        out = []
        for x in self.body.findChildren(QLabel):
            if not (x.wordWrap() and x.isVisible()):
                continue
            key = (x.text(), x.width(), x.font().key())
            known = held.get(x)
            self.heights[x] = known if known is not None and known[0] == key else (key, x.heightForWidth(x.width()))
            if x.height() < self.heights[x][1]:
                out.append(x)
        return out


CHART_COLOURS = {  # the chart's background, words, bars and its p50 and p95 lines, in each theme
    "dark": {"back": "#1f2430", "words": "#8a93a6", "bar": "#5ab0f0", 0.5: "#f0c05a", 0.95: "#f06a5a"},
    "light": {"back": "#f3f5f9", "words": "#5b6475", "bar": "#2f7fc0", 0.5: "#a87400", 0.95: "#c8372a"},
}


class GapChart(QWidget):
    """A strip of a reply's per-token figures (the gaps between tokens, or a comparison's KL per token): one
    bar each, the p50 and p95 as dashed lines that the legend in its corner and its tooltip name."""

    def __init__(self, what: str = "the gap before each token", unit: str = "ms", digits: int = 1):
        super().__init__()
        self.setObjectName("gapChart")
        self.setMinimumHeight(56)
        self.what, self.unit, self.digits = what, unit, digits
        self.gaps: list[float] = []
        self.setToolTip(plain_tooltip(f"A bar for {what} (the last 200). Nothing yet."))

    def set_gaps(self, gaps):
        self.gaps = list(gaps)[-200:]
        if self.gaps:
            p50, p95 = (self.figure(percentile(self.gaps, q)) for q in (0.5, 0.95))
            self.setToolTip(plain_tooltip(
                f"A bar for {self.what} (the last 200, tallest = {self.figure(max(self.gaps))}). "
                f"The dashed lines: the median (p50, {p50}, yellow) and the 95th percentile (p95, {p95}, red); "
                "bars far above p95 are stalls."
            ))  # fmt: skip
        self.update()

    def figure(self, v: float) -> str:
        return f"{v:.{self.digits}f} {self.unit}".rstrip()

    def paintEvent(self, _):
        colours = CHART_COLOURS[current_theme()]
        p = chart_painter(self, colours, None if self.gaps else "gaps between tokens appear here")
        if p is None:
            return
        top = max(self.gaps) or 1.0
        w, h = self.width(), self.height() - 4
        bw = w / max(len(self.gaps), 1)
        p.setPen(Qt.NoPen)
        p.setBrush(QColor(colours["bar"]))
        for i, g in enumerate(self.gaps):
            bh = max(1.0, g / top * h)
            p.drawRect(QRectF(i * bw, h - bh + 2, max(bw - 1, 1), bh))
        font = QFont(p.font())
        font.setPointSizeF(max(6.0, font.pointSizeF() * 0.8))
        p.setFont(font)
        x = w - 4
        for q, name in ((0.95, "p95"), (0.5, "p50")):  # the legend, right to left
            y = h - percentile(self.gaps, q) / top * h + 2
            p.setPen(QPen(QColor(colours[q]), 1, Qt.DashLine))
            p.drawLine(0, int(y), w, int(y))
            label = f"╌ {name}"
            x -= p.fontMetrics().horizontalAdvance(label) + 6
            p.drawText(int(x), p.fontMetrics().ascent() + 1, label)


def set_bar(bar: QProgressBar, maximum: int, value: int, text: str) -> None:
    """A progress bar's range, value and text, painted with the rest of the window: QProgressBar
    repaints itself at once on setValue, which under a style sheet costs a paint of its own."""
    if (bar.maximum(), bar.value(), bar.format()) == (maximum, value, text):
        return
    bar.setUpdatesEnabled(False)
    try:
        bar.setRange(0, maximum)
        bar.setValue(value)
        bar.setFormat(text)
    finally:
        bar.setUpdatesEnabled(True)  # schedules the one paint
        bar.update()


def add_store_segment(parent, seg: dict, per: int) -> None:
    """One segment of the prefix store's tree and its children as rows under `parent` (a tree or an item): the part
    the last request took from the store in bold, the working cache's own positions in italics; `per`: bytes a
    position."""
    n = seg["end"] - seg["start"]
    kids = len(seg["children"])
    text = " ".join(str(seg.get("text") or "").split())  # what it starts with: where it parts from its siblings
    starts = f"“{text[:40]}{'…' if len(text) > 40 else ''}”" if text else ""
    name = seg["label"] or (f"shared by {kids} prefixes" if kids > 1 else starts or "a prompt without a title")
    if seg["start"] > 0 and starts and starts not in name:
        name += f" · from {starts}"  # two leaves of the same title differ here
    if seg["working"]:
        name += "  · working cache"
    on_disk = seg.get("disk") or 0  # whole blocks only: a partial last block is never on disk
    disk = "" if not on_disk else "all" if on_disk >= n - n % 16 else f"{on_disk:,}"
    size = fmt_size(seg["bytes"] if seg["bytes"] is not None else n * per)
    if seg["working"]:  # the working cache's own positions: not in the store, not counted in Held
        size = f"({size})"
    item = QTreeWidgetItem([name, f"{seg['start']:,}–{seg['end'] - 1:,}", size, disk])
    reused = f", {seg['reused']:,} reused by the last request" if seg["reused"] else ""
    where = "\nheld by the working cache, outside the store: not counted in Held" if seg["working"] else ""
    where += f"\n{on_disk:,} of its positions on disk too (whole blocks of 16)" if on_disk else ""
    tip = plain_tooltip(f"{name}\n{n:,} positions from position {seg['start']:,}{reused}{where}")
    for col in range(4):
        item.setToolTip(col, tip)
    if seg["reused"] or seg["working"]:
        font = QFont(item.font(0))
        font.setBold(bool(seg["reused"]))
        font.setItalic(seg["working"])
        for col in range(4):
            item.setFont(col, font)
        if seg["reused"]:
            for col in range(4):
                item.setForeground(col, QBrush(QColor("#7fd08a")))
    parent.addChild(item) if isinstance(parent, QTreeWidgetItem) else parent.addTopLevelItem(item)
    for c in seg["children"]:
        add_store_segment(item, c, per)
