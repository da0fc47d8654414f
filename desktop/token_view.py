"""A reply token by token: each token's text on a background coloured by its probability, by the entropy at its
step or by its part in speculative decoding (drafted and accepted, corrected by the model), and what the model
weighed there (the chosen token raw against sampled, the alternatives) on hover
or when the keyboard moves to it (Left/Right). The colours are translucent over the theme's own background, so
the text keeps the theme's contrast in both themes."""

from __future__ import annotations

import bisect
import html
import math

from PySide6.QtCore import QPoint, Qt, Signal
from PySide6.QtGui import QColor, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import QGridLayout, QLabel, QPushButton, QTextEdit, QToolTip, QWidget

from .core.panel_words import fmt_figure
from .outside_text import plain, rich
from .text_views import FitTextEdit

MODES = {"off": "Tokens: plain", "probability": "Tokens by probability", "entropy": "Tokens by entropy",
         "drafts": "Tokens by drafts", "grammar": "Tokens by grammar"}  # fmt: skip
# (lower bound, colour or None, words), most confident first: probability of the chosen token (raw), and the
# entropy of the step's distribution in nats
BINS = {
    "probability": ((0.9, None, "p ≥ 90%"), (0.5, "#e3c12f", "50–90%"), (0.2, "#f08a3c", "20–50%"),
                    (0.0, "#e0524a", "< 20%")),
    "entropy": ((0.0, None, "< 0.5 nats"), (0.5, "#6fa8e6", "0.5–1.5"), (1.5, "#4a6fd4", "1.5–3"),
                (3.0, "#9a5cd6", "≥ 3 nats")),
    "drafts": (("accepted", "#4fb36a", "drafted, accepted"), ("corrected", "#e0524a", "corrected by the model"),
               ("target", None, "the model's own")),  # each token's part in speculative decoding (Token.draft)
    "grammar": (("forced", "#6fa8e6", "the only one allowed"),  # what a grammar did at a token (its MaskStep)
                ("overridden", "#e0524a", "the model's choice forbidden"),
                ("shaped", "#e3c12f", "≥ 10% of the probability removed"), ("free", None, "the model's own")),
}  # fmt: skip
SHAPED = 0.1  # the probability a grammar removed from a step that makes the token "shaped"
DRAFT_WORDS = {"accepted": "drafted, and the model agreed: accepted", "corrected": "the model's own where it "
               "rejected a draft: corrected", "target": "the model's own: nothing drafted here"}  # fmt: skip
LEGEND_HEADS = {"probability": "chosen token's probability (raw):", "entropy": "entropy at the step:",
                "drafts": "speculative decoding:", "grammar": "what the grammar did:"}  # fmt: skip
ALPHA = 120  # of 255: translucent over the theme's background
TOKEN_PAGE = 5_000  # tokens drawn at a time (a reply of 65,536 is drawn a page at a time: show_more)
FORK_COLUMNS = 3  # fork buttons a row


def step_value(step: dict, mode: str) -> float | None:
    """What a token is coloured by: its raw probability, or the entropy at its step (None: not known)."""
    if mode == "probability":
        lp = step.get("logprob")
        return math.exp(lp) if isinstance(lp, (int, float)) else None
    value = step.get("entropy")
    return value if isinstance(value, (int, float)) else None


def bin_of(step: dict, mode: str) -> int | None:
    """The index in BINS[mode] a token falls in (None: its figure is not known)."""
    if mode == "drafts":
        return next((i for i, (kind, _, _) in enumerate(BINS[mode]) if kind == step.get("draft")), None)
    if mode == "grammar":
        kind = grammar_kind(step.get("grammar"))
        return None if kind is None else next(i for i, (k, _, _) in enumerate(BINS[mode]) if k == kind)
    value = step_value(step, mode)
    if value is None:
        return None
    bins = BINS[mode]
    if mode == "probability":
        return next(i for i, (low, _, _) in enumerate(bins) if value >= low or i == len(bins) - 1)
    return max(i for i, (low, _, _) in enumerate(bins) if value >= low)


def _pct(lp) -> str:
    return "—" if not isinstance(lp, (int, float)) else f"{100 * math.exp(lp):.1f}%"


def grammar_kind(g) -> str | None:
    """What the grammar did at a step: forced (one token allowed: the grammar alone chose), overridden (the model's
    first choice forbidden among several allowed), shaped (SHAPED or more of the probability removed) or free; None
    without a grammar's figures."""
    if not isinstance(g, dict) or not all(isinstance(g.get(k), (int, float)) for k in ("allowed", "removed")):
        return None
    if g["allowed"] == 1:
        return "forced"
    if isinstance(g.get("preferred_text"), str):
        return "overridden"
    return "shaped" if g["removed"] >= SHAPED else "free"


def grammar_words(g) -> list[str]:
    """What the reply's grammar did at a step, in lines ([] without one; a stored record's figures checked)."""
    if not isinstance(g, dict) or not all(isinstance(g.get(k), (int, float)) for k in ("allowed", "vocab", "removed")):
        return []
    lines = [f"Grammar: {g['allowed']:,} of {g['vocab']:,} tokens allowed · {100 * g['removed']:.1f}% of the "
             "model's probability removed"]  # fmt: skip
    if isinstance(g.get("preferred_text"), str):
        lines.append(f"  the model preferred {g['preferred_text']!r}: the grammar forbade it")
    return lines


def token_words(step: dict, index: int) -> list[str]:
    """What the model weighed at one step, in lines a person reads (the tooltip, the accessible description)."""
    lines = [f"Token {index + 1}: {step.get('text', '')!r}"]
    lp, sampled = step.get("logprob"), step.get("sampled_logprob")
    head = f"p {_pct(lp)} raw (log-probability {lp:.3f})" if isinstance(lp, (int, float)) else "p not known"
    lines.append(head + (f" · {_pct(sampled)} as sampled" if sampled is not None else " · sampled: not reported"))
    if step.get("draft") in DRAFT_WORDS:
        lines.append(DRAFT_WORDS[step["draft"]])
    lines += grammar_words(step.get("grammar"))
    if isinstance(step.get("entropy"), (int, float)):
        rank = step.get("rank")
        lines.append(
            f"entropy {fmt_figure(step['entropy'], 2)} nats" + (f" · rank {rank}" if isinstance(rank, int) else "")
        )
    top = step.get("top") or []
    if top:
        lines.append("Alternatives (raw · as sampled):")
        for a in top:
            mark = " ← chosen" if a.get("token_id") == step.get("token_id") and a.get("token_id", -1) >= 0 else ""
            lines.append(f"  {a.get('text', '')!r} {_pct(a.get('logprob'))} · {_pct(a.get('sampled_logprob'))}{mark}")
    return lines


class TokenView(FitTextEdit):
    """A finished reply's tokens, coloured (BINS); hover or Left/Right shows a token's figures."""

    tokenFocused = Signal(int)  # the token the keyboard moved to
    pageDrawn = Signal(int, int)  # tokens drawn, tokens in the reply

    def __init__(self):
        super().__init__()
        self.setObjectName("tokenView")
        self.setAccessibleName("The reply, token by token: Left and Right move between tokens")
        self.setMouseTracking(True)
        self.viewport().setMouseTracking(True)
        self.setFocusPolicy(Qt.StrongFocus)
        self.steps: list[dict] = []
        self.starts: list[int] = []  # each shown token's first character; tokens that show nothing are skipped
        self.at: list[int] = []  # the token index of each entry of starts
        self.mode = "off"
        self.drawn = 0  # steps[:drawn] are in the document (a page at a time)
        self.current: int | None = None  # the token the keyboard is on

    def set_tokens(self, steps: list[dict], mode: str) -> None:
        if steps is self.steps and mode == self.mode:
            return
        self.steps, self.mode, self.starts, self.at = steps, mode, [], []
        self.drawn = 0
        self.clear()
        self.current = None
        self.show_more()

    def show_more(self) -> None:
        """Draw the next TOKEN_PAGE tokens, in one edit of the document (Qt lays it out once, not per token)."""
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.End)
        cursor.beginEditBlock()
        end = min(len(self.steps), self.drawn + TOKEN_PAGE)
        for i in range(self.drawn, end):
            step = self.steps[i]
            shown = str(step.get("shown", step.get("text", "")))
            if not shown:
                continue
            fmt = QTextCharFormat()
            b = bin_of(step, self.mode) if self.mode in BINS else None
            colour = BINS[self.mode][b][1] if b is not None else None
            if colour:
                c = QColor(colour)
                c.setAlpha(ALPHA)
                fmt.setBackground(c)
            self.starts.append(cursor.position())
            self.at.append(i)
            cursor.insertText(shown, fmt)
        cursor.endEditBlock()
        self.drawn = end
        self.pageDrawn.emit(self.drawn, len(self.steps))

    def _entry(self, index: int | None) -> int | None:
        """Where token `index` is in starts/at (None: it shows nothing, or is not drawn yet)."""
        k = bisect.bisect_left(self.at, index) if index is not None else len(self.at)
        return k if k < len(self.at) and self.at[k] == index else None

    def index_at_position(self, position: int) -> int | None:
        """The token whose text holds character `position`."""
        k = bisect.bisect_right(self.starts, position) - 1
        return self.at[k] if 0 <= k < len(self.at) else None

    def index_at(self, point: QPoint) -> int | None:
        """The token under `point` (the viewport's): the character the pointer is on, not the caret position
        nearest to it (on a character's right half that is the next character, the next token's)."""
        at = self.character_at(point)
        return None if at is None else self.index_at_position(at)

    def character_at(self, point: QPoint) -> int | None:
        """The document position of the character under `point`, None between lines or past a line's end."""
        near = self.cursorForPosition(point).position()
        cursor = QTextCursor(self.document())
        for c in (near - 1, near):
            if c < 0 or c + 1 >= self.document().characterCount():
                continue
            cursor.setPosition(c)
            left = self.cursorRect(cursor)
            cursor.setPosition(c + 1)
            right = self.cursorRect(cursor)
            if (
                left.top() == right.top()
                and left.x() <= point.x() < right.x()
                and left.top() <= point.y() <= left.bottom()
            ):
                return c
        return None

    def details(self, index: int) -> str:
        lines = token_words(self.steps[index], index)
        return "<br>".join(html.escape(line).replace("  ", "&nbsp;&nbsp;") for line in lines)

    def mouseReleaseEvent(self, e) -> None:
        super().mouseReleaseEvent(e)
        i = self.index_at(e.position().toPoint())
        if i is not None and not self.textCursor().hasSelection():  # a click on a token, not a selection
            self.move_to(i)

    def mouseMoveEvent(self, e) -> None:
        super().mouseMoveEvent(e)
        i = self.index_at(e.position().toPoint())
        if i is None:
            QToolTip.hideText()
        else:
            QToolTip.showText(e.globalPosition().toPoint(), self.details(i), self.viewport())

    def move_to(self, index: int) -> None:
        """Put the keyboard on token `index`: outlined, its figures shown and said."""
        if not self.at:
            return
        self.current = index
        k = self._entry(index)
        k = k if k is not None else 0
        start = self.starts[k]
        end = self.starts[k + 1] if k + 1 < len(self.starts) else self.document().characterCount() - 1
        sel = QTextEdit.ExtraSelection()
        cursor = QTextCursor(self.document())
        cursor.setPosition(start)
        cursor.setPosition(end, QTextCursor.KeepAnchor)
        sel.cursor = cursor
        sel.format.setFontUnderline(True)
        sel.format.setUnderlineStyle(QTextCharFormat.SingleUnderline)
        sel.format.setFontWeight(700)
        self.setExtraSelections([sel])
        words = token_words(self.steps[index], index)
        self.setAccessibleDescription(" · ".join(w.strip() for w in words))
        rect = self.cursorRect(cursor)
        QToolTip.showText(self.viewport().mapToGlobal(rect.bottomLeft()), self.details(index), self.viewport())
        self.tokenFocused.emit(index)

    def keyPressEvent(self, e) -> None:
        if e.key() in (Qt.Key_Left, Qt.Key_Right) and self.at and not e.modifiers() & Qt.ControlModifier:
            step = 1 if e.key() == Qt.Key_Right else -1
            k = self._entry(self.current)
            k = k if k is not None else (-1 if step > 0 else len(self.at))
            if k + step >= len(self.at) and self.drawn < len(self.steps):
                self.show_more()  # Right past the page drawn: the next page
            k = max(0, min(len(self.at) - 1, k + step))
            self.move_to(self.at[k])
            return
        super().keyPressEvent(e)


class ForkRow(QWidget):
    """Under a reply shown token by token: the token the keyboard or a click is on, and a button per
    alternative that makes a new branch going on from it there, and one that draws that token again."""

    forkRequested = Signal(int, object)  # the token's index, the alternative (a dict) or None: drawn again

    def __init__(self):
        super().__init__()
        self.setObjectName("forkRow")
        self.lay = QGridLayout(self)  # FORK_COLUMNS buttons a row: the row never widens the transcript
        self.lay.setContentsMargins(0, 0, 0, 0)
        self.buttons: list[QPushButton] = []
        self.label = plain(QLabel())
        self.label.setObjectName("forkLabel")
        self.label.setWordWrap(True)
        self.lay.addWidget(self.label, 0, 0, 1, FORK_COLUMNS)
        self.setVisible(False)

    def show_token(self, index: int, step: dict) -> None:
        for b in self.buttons:
            b.setParent(None)
            b.deleteLater()
        self.buttons = []
        self.label.setText(f"Token {index + 1} {step.get('text', '')!r}: a new branch from here, going on with")
        chosen = step.get("token_id")
        for a in step.get("top") or []:
            if a.get("token_id") == chosen or type(a.get("token_id")) is not int or a["token_id"] < 0:
                continue
            b = QPushButton(f"{a.get('text', '')!r} {_pct(a.get('logprob'))}")
            b.setObjectName("forkButton")
            b.setAccessibleName(f"A new branch from token {index + 1}, going on with {a.get('text', '')!r}")
            b.clicked.connect(lambda _=False, a=a: self.forkRequested.emit(index, a))
            self._place(b)
        again = QPushButton("Regenerate from here")
        again.setObjectName("regenerateFromHereButton")
        again.setAccessibleName(f"A new branch from token {index + 1}, that token drawn again")
        again.clicked.connect(lambda: self.forkRequested.emit(index, None))
        self._place(again)
        self.setVisible(True)

    def _place(self, button: QPushButton) -> None:
        k = len(self.buttons)
        self.lay.addWidget(button, 1 + k // FORK_COLUMNS, k % FORK_COLUMNS)
        self.buttons.append(button)


class TokenLegend(QLabel):
    """What the colours of the token view mean, for the mode in use: one label of the app's own words that
    wraps in a narrow window (a row of swatches once set the window's minimum width)."""

    def __init__(self):
        super().__init__()
        rich(self)
        self.setObjectName("tokenLegend")
        self.setWordWrap(True)

    def show_mode(self, mode: str) -> None:
        words = []
        if mode in BINS:
            words = [LEGEND_HEADS[mode]]
            swatches = []
            for _, colour, text in BINS[mode]:
                c = QColor(colour or "#00000000")
                look = f"background-color: rgba({c.red()},{c.green()},{c.blue()},{ALPHA})" if colour else ""
                swatches.append(f'<span style="{look}">&nbsp;{html.escape(text)}&nbsp;</span>')
                words.append(text)
            self.setText(f"{html.escape(words[0])} " + " ".join(swatches))
        else:
            self.clear()
        self.setAccessibleDescription(" ".join(words))
        self.setVisible(mode in BINS)
