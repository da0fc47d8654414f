"""The Settings dialog's "Reply format" tab, the conversation's own as "This conversation" is: its replies as plain
text, any JSON object, JSON a schema validates, or text a Lark or GBNF grammar parses (engine.grammar). The schema
or grammar is checked as it is typed — it compiles, or the library says what and where — and kept whole with the
conversation."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QTimer
from PySide6.QtGui import QFontDatabase
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QWidget,
)

from engine.errors import EngineError
from engine.grammar import Grammar

from .core.settings import Settings
from .outside_text import plain, plain_tooltip

FORMATS = (("Text (no grammar)", ""), ("Any JSON object", "json_object"), ("JSON a schema validates", "json_schema"),
           ("Text a Lark grammar parses", "lark"), ("Text a GBNF grammar parses", "gbnf"))  # fmt: skip
PLACEHOLDERS = {
    "json_schema": '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}',
    "lark": 'start: "yes" | "no"',
    "gbnf": 'root ::= "yes" | "no"',
}
HELP = (
    "At each step the grammar says which tokens may come next and the model draws only among them, so a reply "
    "always parses — even a small model's. Each token's tooltip says how many tokens the grammar allowed, how much "
    "of the model's probability it removed and the token the model preferred where it was forbidden; the panel "
    "sums the reply. Drafts are off for a constrained reply. A string or number the schema does not bound can run "
    "to Max new tokens where the model repeats itself: give it maxLength or maximum."
)
CHECK_DELAY_MS = 300  # after the last keystroke, the schema or grammar is compiled


class ReplyFormatPage(QWidget):
    """The conversation's reply format (`kind()`, `text()`); `problem()`: why it would not compile, "" if it does."""

    def __init__(self, settings: Settings, parent=None):
        super().__init__(parent)
        form = QFormLayout(self)
        self.format = QComboBox()
        self.format.setObjectName("replyFormatCombo")
        self.format.setAccessibleName("Reply format")
        for words, key in FORMATS:
            self.format.addItem(words, key)
        self.format.setCurrentIndex(max(0, self.format.findData(settings.reply_format)))
        self.format.setToolTip(plain_tooltip(HELP))
        form.addRow("Replies are", self.format)
        self.source = QPlainTextEdit(settings.reply_grammar)
        self.source.setObjectName("replyGrammarEdit")
        self.source.setAccessibleName("The JSON schema or grammar")
        self.source.setFont(QFontDatabase.systemFont(QFontDatabase.FixedFont))
        self.openFile = QPushButton("Open a file…")
        self.openFile.setObjectName("replyGrammarFileButton")
        self.openFile.setAccessibleName("Open a JSON schema, Lark or GBNF file")
        self.openFile.clicked.connect(self.open_file)
        row = QHBoxLayout()
        row.addWidget(QLabel("The schema or grammar"), 1)
        row.addWidget(self.openFile)
        form.addRow(row)
        form.addRow(self.source)
        self.status = plain(QLabel(""))
        self.status.setObjectName("replyFormatStatus")
        self.status.setWordWrap(True)
        form.addRow(self.status)
        said = plain(QLabel(HELP))
        said.setWordWrap(True)
        form.addRow(said)
        self._timer = QTimer(self, singleShot=True, interval=CHECK_DELAY_MS)
        self._timer.timeout.connect(self.show_check)
        self.source.textChanged.connect(self._timer.start)
        self.format.currentIndexChanged.connect(lambda _: self.show_check())
        self.show_check()

    def kind(self) -> str:
        return self.format.currentData()

    def text(self) -> str:
        return self.source.toPlainText() if self.kind() in PLACEHOLDERS else ""

    def grammar(self) -> Grammar | None:
        return Settings(reply_format=self.kind(), reply_grammar=self.text()).grammar()

    def problem(self) -> str:
        """Why the format would not work ("" where it compiles), in the library's words."""
        if self.kind() in PLACEHOLDERS and not self.text().strip():
            return "write the schema or grammar, or open a file"
        try:
            grammar = self.grammar()
            if grammar is not None:
                grammar.check()
        except EngineError as e:
            return str(e)
        return ""

    def show_check(self) -> None:
        """The schema or grammar box shown only where the format takes one, and whether it compiles."""
        self._timer.stop()
        takes = self.kind() in PLACEHOLDERS
        self.source.setVisible(takes)
        self.openFile.setVisible(takes)
        self.source.setPlaceholderText(PLACEHOLDERS.get(self.kind(), ""))
        if not self.kind():
            self.status.setText("Replies are the model's own text.")
            return
        problem = self.problem()
        grammar = None if problem else self.grammar()
        self.status.setText(f"⚠ {problem}" if problem else f"✓ {grammar.describe()}: compiles")

    def open_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a JSON schema or grammar", "",
                                              "Schemas and grammars (*.json *.lark *.gbnf);;All files (*)")  # fmt: skip
        if path:
            self.load(Path(path))

    def load(self, path: Path) -> None:
        """A file's schema or grammar (its kind by its name), read within the size a grammar may take."""
        try:
            grammar = Grammar.from_file(path)
        except EngineError as e:
            self.status.setText(f"⚠ {e}")
            return
        self.format.setCurrentIndex(max(0, self.format.findData(grammar.kind)))
        self.source.setPlainText(grammar.source)
        self.show_check()
