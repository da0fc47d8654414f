"""A tool loop in the transcript: the calls a reply made (each tool and its arguments in full) and each result, a
block folded to one line — the tool, its server, its size, how long it took, cut or failed — that opens to the
result's text. A result is outside text: shown as plain text, never as Markdown or a link, and bounded."""

from __future__ import annotations

from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import QFrame, QLabel, QPlainTextEdit, QVBoxLayout

from .outside_text import plain
from .reply_widgets import fold_toggle
from .tool_approval import pretty_arguments

SHOWN = 32_000  # characters of a result or a call's arguments in the transcript (the stored result is no longer)
DECISION_WORDS = {"once": "allowed once", "conversation": "allowed in this conversation", "deny": "denied",
                  "stop": "not run: stopped", "missing": "not run: no such tool"}  # fmt: skip


def size_words(n: int) -> str:
    """Bytes in a person's words: 812 B, 4.2 KB, 52.4 MB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def result_line(record: dict) -> str:
    """A result's folded line: the tool and server, what the person decided, its size and time, cut or failed."""
    call = record.get("tool_call") or {}
    parts = [f"{call.get('name', '?')} · {record.get('server') or 'no server'}"]
    decision = record.get("decision")
    if decision in DECISION_WORDS:
        parts.append(DECISION_WORDS[decision])
    size, seconds = record.get("size"), record.get("seconds")
    if isinstance(size, int) and decision in ("once", "conversation"):
        parts.append(size_words(size))
    if isinstance(seconds, (int, float)) and decision in ("once", "conversation"):
        parts.append(f"{seconds:.2f} s")
    if record.get("cut"):
        parts.append("cut")
    if record.get("failed") and decision in ("once", "conversation"):
        parts.append("failed")
    return " · ".join(parts)


def _mono(text: str, name: str) -> QPlainTextEdit:
    box = QPlainTextEdit(text)
    box.setObjectName(name)
    box.setReadOnly(True)
    box.setFont(QFontDatabase.systemFont(QFontDatabase.FixedFont))
    box.setLineWrapMode(QPlainTextEdit.WidgetWidth)
    lines = min(12, text.count("\n") + 2)
    box.setFixedHeight(box.fontMetrics().lineSpacing() * lines + 12)
    return box


class CallsBlock(QFrame):
    """The calls a reply made: `name` and its arguments, one after another."""

    def __init__(self, calls: list[dict]):
        super().__init__()
        self.setObjectName("toolCalls")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 4, 0, 0)
        for c in calls:
            label = plain(QLabel(f"Calls {c.get('name', '?')}"))
            label.setObjectName("toolCallName")
            lay.addWidget(label)
            lay.addWidget(_mono(pretty_arguments(str(c.get("arguments", "")))[:SHOWN], "toolCallArguments"))


class ResultBlock(QFrame):
    """A tool's result, folded to its line; the toggle shows its text."""

    def __init__(self, text: str, record: dict):
        super().__init__()
        self.setObjectName("toolResult")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 2, 0, 0)
        self.toggle = fold_toggle("toolResultToggle")
        self.toggle.setAutoRaise(True)
        self.toggle.setText(result_line(record))
        self.toggle.setAccessibleName(f"Show the result: {result_line(record)}")
        lay.addWidget(self.toggle)
        shown = text[:SHOWN] + (f"\n… {len(text) - SHOWN:,} more characters" if len(text) > SHOWN else "")
        self.body = _mono(shown, "toolResultText")
        self.body.setVisible(False)
        lay.addWidget(self.body)
        self.toggle.toggled.connect(self.body.setVisible)


def tool_block(message) -> QFrame | None:
    """The block a message shows for its part in a tool loop (None: it has none)."""
    record = message.trace if isinstance(message.trace, dict) else {}
    if message.role == "tool":
        return ResultBlock(message.content, record)
    calls = record.get("tool_calls")
    if message.role == "assistant" and isinstance(calls, list) and calls:
        return CallsBlock(calls)
    return None
