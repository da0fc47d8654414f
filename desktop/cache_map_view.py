"""The context map in the panel: a grid over the KV cache, one cell per position (or per 2, 4, 8… when there
are thousands), filled by where each position came from in the last request and banded on top by whose text
it holds, the first invalidated position marked, the capacity drawn as free cells. Hovering a cell, or
Left/Right once it has the focus, names the tokens there and their message. It paints from a CacheMap
(cache_map.py) only when that changed: a few hundred rectangles, off the engine's thread."""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QPoint, QRect, Qt
from PySide6.QtGui import QColor, QPainter, QPen, QPixmap
from PySide6.QtWidgets import QLabel, QSizePolicy, QToolTip, QVBoxLayout, QWidget

from .core.cache_map import ORIGINS, ROLES, CacheMap, cell_size
from .outside_text import plain, plain_tooltip
from .style import current_theme

ORIGIN_COLOURS = {
    "kept": "#3f9f6b",
    "copied": "#3a83cf",
    "disk": "#7a6fe0",
    "computed": "#e0862f",
    "generated": "#d9bd2c",
    "pending": None,  # an outline in the computed colour
    "invalidated": None,  # an outline in the marker colour, crossed
    "rejected": None,  # drafted and rejected: thrown away too, drawn so
    "empty": None,  # an outline in the theme's quiet colour
}
ROLE_COLOURS = {
    "system": "#a77ee8",
    "user": "#41b8d4",
    "assistant": "#8cc152",
    "reply": "#e86a9a",
    "template": "#8a93a6",
    "call": "#f0a030",
    "tool": "#2fc4a0",
    "image": "#ff4fd8",
}
MARK = "#e0484a"  # the first invalidated position, and what was thrown away
QUIET = {"dark": "#4a5263", "light": "#b3bac6"}  # free cells' outline
FOCUS = {"dark": "#5b9cf0", "light": "#2f6fc4"}  # the style sheets' focus mark
CELL_W, CELL_H, GAP, BAND = 7, 11, 1, 3  # pixels: a cell, the space between cells, the role band on top
EDGE = 3  # pixels around the cells: room for the focus frame and the marker
MAX_ROWS = 16


class CacheMapGrid(QWidget):
    """The grid itself (focusable: Left/Right/Home/End move from cell to cell)."""

    def __init__(self):
        super().__init__()
        self.setObjectName("cacheMap")
        self.setAccessibleName("Context map")
        self.setFocusPolicy(Qt.StrongFocus)
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Expanding, QSizePolicy.Fixed)
        self.map = CacheMap()
        self.name: Callable[[list], str] | None = None  # token ids → text (the loaded model's tokenizer)
        self.per = 1  # positions a cell holds
        self.current: int | None = None  # the cell the keyboard is on
        self._cells: list[tuple[str, str | None]] = []
        self._seen = (-1, -1, -1)  # (map version, width, per) the cells were computed for
        self._pixmap: QPixmap | None = None  # the cells as last drawn: a redraw paints only the cells that changed
        self._drawn: list[tuple[str, str | None]] = []
        self._drawn_for = None  # (size, ratio, theme) the pixmap was drawn at

    # --- geometry -------------------------------------------------------------------------------------
    @property
    def columns(self) -> int:
        return max(8, (self.width() - 2 * EDGE + GAP) // (CELL_W + GAP))

    def _layout(self) -> None:
        """The cells for the map's current version and this width (computed only when either changed)."""
        per = cell_size(self.map.extent, self.columns, MAX_ROWS)
        key = (self.map.version, self.width(), per)
        if key != self._seen:
            self.per, self._seen = per, key
            self._cells = self.map.cells(per) if self.map.reported else []
            rows = max(1, -(-len(self._cells) // self.columns))
            height = rows * (CELL_H + GAP) + 2 * EDGE
            if self.height() != height:
                self.setFixedHeight(height)

    def cell_rect(self, i: int) -> QRect:
        r, c = divmod(i, self.columns)
        return QRect(EDGE + c * (CELL_W + GAP), EDGE + r * (CELL_H + GAP), CELL_W, CELL_H)

    def cell_at(self, point: QPoint) -> int | None:
        c, r = (point.x() - EDGE) // (CELL_W + GAP), (point.y() - EDGE) // (CELL_H + GAP)
        i = r * self.columns + c
        return i if 0 <= c < self.columns and r >= 0 and i < len(self._cells) else None

    def show_map(self, m: CacheMap) -> None:
        self.map = m
        if (m.version, self.width()) != self._seen[:2]:
            self._layout()
            self.update()
            if self.current is not None:
                self.current = min(self.current, len(self._cells) - 1) if self._cells else None

    def resizeEvent(self, e) -> None:
        self._layout()
        super().resizeEvent(e)

    # --- painting -------------------------------------------------------------------------------------
    def _draw_cells(self) -> QPixmap:
        """The cells on the kept pixmap: all of them after a resize or a theme change, else only those whose
        fill or band changed since the last paint (a token adds one; a whole repaint is ~3 ms of Python)."""
        ratio = self.devicePixelRatioF()
        key = (self.size(), ratio, current_theme())
        if self._pixmap is None or key != self._drawn_for:
            self._pixmap = QPixmap(self.size() * ratio)
            self._pixmap.setDevicePixelRatio(ratio)
            self._pixmap.fill(Qt.transparent)
            self._drawn, self._drawn_for = [], key
        cells, drawn = self._cells, self._drawn
        changed = [
            i for i in range(max(len(cells), len(drawn))) if i >= len(drawn) or i >= len(cells) or cells[i] != drawn[i]
        ]
        if changed:
            p = QPainter(self._pixmap)
            quiet = QColor(QUIET[current_theme()])
            for i in changed:
                r = self.cell_rect(i)
                p.setCompositionMode(QPainter.CompositionMode_Source)
                p.fillRect(r, Qt.transparent)
                p.setCompositionMode(QPainter.CompositionMode_SourceOver)
                if i >= len(cells):
                    continue
                origin, role = cells[i]
                colour = ORIGIN_COLOURS[origin]
                if colour:
                    p.fillRect(r, QColor(colour))
                else:
                    edge = {"pending": ORIGIN_COLOURS["computed"], "invalidated": MARK, "rejected": MARK}.get(origin)
                    p.setPen(QPen(QColor(edge) if edge else quiet, 1))
                    p.setBrush(Qt.NoBrush)
                    p.drawRect(r.adjusted(0, 0, -1, -1))
                    if origin in ("invalidated", "rejected"):
                        p.drawLine(r.bottomLeft(), r.topRight())
                if role:
                    p.fillRect(QRect(r.x(), r.y(), r.width(), BAND), QColor(ROLE_COLOURS[role]))
            p.end()
            self._drawn = list(cells)
        return self._pixmap

    def paintEvent(self, _) -> None:
        self._layout()
        p = QPainter(self)
        if not self.map.reported:
            p.setPen(self.palette().color(self.foregroundRole()))
            p.drawText(self.rect(), Qt.AlignCenter | Qt.TextWordWrap, "not reported by this server")
            return
        p.drawPixmap(0, 0, self._draw_cells())
        first = self.map.first_invalidated
        if first is not None and first < self.map.extent:
            r = self.cell_rect(first // self.per)
            p.fillRect(QRect(r.x() - 1, r.y() - 3, 3, r.height() + 6), QColor(MARK))
        if self.hasFocus():  # the style sheets' focus mark around the grid, and the cell the keyboard is on
            p.setPen(QPen(QColor(FOCUS[current_theme()]), 1))
            p.setBrush(Qt.NoBrush)
            p.drawRect(self.rect().adjusted(0, 0, -1, -1))
            if self.current is not None and self.current < len(self._cells):
                p.setPen(QPen(self.palette().color(self.foregroundRole()), 2))
                p.drawRect(self.cell_rect(self.current).adjusted(-1, -1, 1, 1))

    # --- what a cell holds ----------------------------------------------------------------------------
    def describe(self, i: int) -> str:
        start = i * self.per
        text = self.map.describe(start, start + self.per, self.name)
        return text + (f"\n(a cell holds {self.per} positions)" if self.per > 1 else "")

    def mouseMoveEvent(self, e) -> None:
        i = self.cell_at(e.position().toPoint())
        if i is None:
            QToolTip.hideText()
            return
        QToolTip.showText(e.globalPosition().toPoint(), plain_tooltip(self.describe(i)), self, self.cell_rect(i))

    def keyPressEvent(self, e) -> None:
        n = len(self._cells)
        if not n or e.key() not in (Qt.Key_Left, Qt.Key_Right, Qt.Key_Home, Qt.Key_End, Qt.Key_Up, Qt.Key_Down):
            return super().keyPressEvent(e)
        i = self.current if self.current is not None else -1
        step = {Qt.Key_Left: -1, Qt.Key_Right: 1, Qt.Key_Up: -self.columns, Qt.Key_Down: self.columns}
        i = 0 if e.key() == Qt.Key_Home else n - 1 if e.key() == Qt.Key_End else i + step[e.key()]
        self.focus_cell(max(0, min(n - 1, i)))

    def focusInEvent(self, e) -> None:
        """Reached by the keyboard: on the first invalidated position when there is one, else the first cell."""
        super().focusInEvent(e)
        if self.current is None and self._cells:
            first = self.map.first_invalidated
            self.focus_cell(first // self.per if first is not None and first < self.map.extent else 0)
        self.update()

    def focusOutEvent(self, e) -> None:
        super().focusOutEvent(e)
        self.update()

    def focus_cell(self, i: int) -> None:
        """The keyboard is on cell `i`: said (accessible description) and shown (tooltip)."""
        self.current = i
        said = self.describe(i)
        self.setAccessibleDescription(said)
        under = QPoint(0, self.height() + 2)  # below the grid: the map stays in sight
        QToolTip.showText(self.mapToGlobal(under), plain_tooltip(said), self, self.cell_rect(i))
        self.update()


FILL_WORDS = (
    ("kept", "kept"),
    ("copied", "from the store"),
    ("disk", "from disk"),
    ("computed", "computed now"),
    ("generated", "decoded now"),
)
BAND_WORDS = (("system", "system"), ("user", "you"), ("assistant", "earlier replies"), ("reply", "this reply"),
              ("template", "template"), ("call", "tool calls"), ("tool", "tool results"),
              ("image", "images"))  # fmt: skip


def legend_html() -> str:
    """What the fills and the bands mean: lines of swatches (a label's rich text draws no borders: glyphs)."""

    def swatch(colour: str, words: str, glyph: str = "■") -> str:
        return f'<span style="color:{colour}">{glyph}</span>&nbsp;{words}'

    fills = [swatch(ORIGIN_COLOURS[o], words) for o, words in FILL_WORDS]
    fills += [swatch(MARK, "thrown away", "☒"), swatch(QUIET[current_theme()], "free", "□")]
    bands = [swatch(ROLE_COLOURS[r], words, "▀") for r, words in BAND_WORDS]
    lines = ("Fill, where it came from: " + " · ".join(fills), "Top band, whose text: " + " · ".join(bands),
             swatch(MARK, "the first invalidated position", "▍"))  # fmt: skip
    return "<br>".join(lines)


class CacheMapView(QWidget):
    """The caption (which request, the count against the capacity, the cell size), the grid, the legend."""

    def __init__(self):
        super().__init__()
        self.setObjectName("cacheMapView")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 4, 0, 0)
        self.caption = plain(QLabel("empty: nothing cached yet"))
        self.caption.setObjectName("cacheMapCaption")
        self.caption.setWordWrap(True)
        lay.addWidget(self.caption)
        self.grid = CacheMapGrid()
        lay.addWidget(self.grid)
        self.legend = QLabel(legend_html())
        self.legend.setObjectName("cacheMapLegend")
        self.legend.setTextFormat(Qt.RichText)  # the app's own words and colours, nothing from outside
        self.legend.setWordWrap(True)
        words = "; ".join(f"{w}" for w in ORIGINS.values()) + ". Bands: " + "; ".join(ROLES.values())
        self.legend.setAccessibleDescription(f"Cell fills: {words}.")
        lay.addWidget(self.legend)
        self._theme = current_theme()

    def show_map(self, m: CacheMap, name: Callable[[list], str] | None) -> bool:
        """Show `m`; True when the caption's words changed (the box around is laid out again: Refit)."""
        self.grid.name = name
        if self._theme != current_theme():  # the theme changed: the free cells' outline with it
            self._theme = current_theme()
            self.legend.setText(legend_html())
            self.grid._seen = (-1, -1, -1)
        self.grid.show_map(m)
        text = self.caption_text(m)
        changed = self.caption.text() != text
        if changed:
            self.caption.setText(text)
        self.legend.setVisible(m.reported)
        return changed

    def caption_text(self, m: CacheMap) -> str:
        if not m.reported:
            return m.caption
        held = f"{m.length:,} / {m.capacity:,} positions" if m.capacity else f"{m.length:,} positions"
        held = f"in the cache now: {held}"  # the bar above may be a reply's figure: this is the live cache
        per = self.grid.per
        cell = " · a cell is 1 position" if per == 1 else f" · a cell is {per} positions"
        return f"{held}{cell}\n{m.caption}" if m.caption else held + cell
