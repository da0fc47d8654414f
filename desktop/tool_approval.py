"""The question a tool call puts to the person before it runs: which tool, of which server, with every argument in
full; allow it once, allow that tool for the rest of this conversation, or deny it. Nothing runs until a button is
clicked; closing the question denies the call."""

from __future__ import annotations

import asyncio
import json

from PySide6.QtCore import Qt
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import QDialog, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout

from .outside_text import plain

ARGUMENTS_SHOWN = 64 * 1024  # characters of the arguments in the question (the rest is said, not hidden silently)


def pretty_arguments(arguments: str) -> str:
    """A call's arguments as indented JSON (as sent where they are not JSON)."""
    try:
        return json.dumps(json.loads(arguments), indent=2, ensure_ascii=False)
    except (ValueError, RecursionError):
        return arguments


class ToolApproval(QDialog):
    """One call's question; `answer` (a Future) gets once, conversation or deny."""

    def __init__(self, title: str, call, tool, parent=None):
        super().__init__(parent)
        self.answer: asyncio.Future = asyncio.get_event_loop().create_future()
        self.setObjectName("toolApproval")
        self.setWindowTitle("Run this tool?")
        self.setWindowModality(Qt.NonModal)
        lay = QVBoxLayout(self)
        head = plain(QLabel(f"The model in “{title}” asks to run {call.name} from the MCP server {tool.server}."))
        head.setObjectName("toolApprovalHead")
        head.setWordWrap(True)
        lay.addWidget(head)
        if tool.tool.description:
            desc = plain(QLabel(tool.tool.description[:500]))
            desc.setObjectName("toolApprovalDescription")
            desc.setWordWrap(True)
            lay.addWidget(desc)
        shown = pretty_arguments(call.arguments)
        self.arguments = QPlainTextEdit(shown[:ARGUMENTS_SHOWN])
        self.arguments.setObjectName("toolApprovalArguments")
        self.arguments.setAccessibleName("The call's arguments")
        self.arguments.setReadOnly(True)
        self.arguments.setFont(QFontDatabase.systemFont(QFontDatabase.FixedFont))
        lay.addWidget(self.arguments)
        if len(shown) > ARGUMENTS_SHOWN:
            more = plain(QLabel(f"The arguments are {len(shown):,} characters; the first {ARGUMENTS_SHOWN:,} shown."))
            lay.addWidget(more)
        row = QHBoxLayout()
        self.allowOnce = QPushButton("Allow once")
        self.allowOnce.setObjectName("allowOnceButton")
        self.allowAlways = QPushButton(f"Allow {call.name} in this conversation")
        self.allowAlways.setObjectName("allowConversationButton")
        self.deny = QPushButton("Deny")
        self.deny.setObjectName("denyButton")
        for button, answer in ((self.allowOnce, "once"), (self.allowAlways, "conversation"), (self.deny, "deny")):
            button.clicked.connect(lambda _=False, a=answer: self._answer(a))
            row.addWidget(button)
        row.addStretch(1)
        lay.addLayout(row)
        self.deny.setDefault(True)  # Enter does not run anything
        self.resize(560, 360)

    def _answer(self, answer: str) -> None:
        if not self.answer.done():
            self.answer.set_result(answer)
        self.close()

    def settle(self) -> None:
        """The call was answered elsewhere (Stop): the question goes away."""
        self.close()

    def done(self, result: int) -> None:  # closed by its title bar or Escape: denied
        if not self.answer.done():
            self.answer.set_result("deny")
        super().done(result)
