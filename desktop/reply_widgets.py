"""The widgets a message is drawn with, one per Markdown piece: paragraphs (Markdown, or a person's as typed), code
blocks (Pygments, Copy), folded thinking, plain text past the Markdown limits, and a reply body made of them
(desktop/README.md, "The seam", says why each is shaped so); the text views they build on are text_views'."""

from __future__ import annotations

from PySide6.QtCore import QEvent, Qt, Signal
from PySide6.QtGui import QFontDatabase, QGuiApplication, QTextCursor
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from engine.trace import now

from .core.markdown import Piece, pieces
from .outside_text import markdown_html, open_link, plain, too_big_for_markdown
from .style import code_style
from .text_views import GROW_LINES, FitTextEdit, StreamView, WrapLabel


def highlighted_html(code: str, lang: str) -> str:
    """The code as HTML with inline colours (Pygments; a language it does not know stays plain)."""
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import TextLexer, get_lexer_by_name
    from pygments.util import ClassNotFound

    try:
        lexer = get_lexer_by_name(lang) if lang else TextLexer()
    except ClassNotFound:
        lexer = TextLexer()
    formatter = HtmlFormatter(noclasses=True, nobackground=True, style=code_style())
    return highlight(code, lexer, formatter)


class CodeBlock(QFrame):
    """A fenced code block: its language, a Copy button that copies exactly the code, the code
    highlighted (once the block is closed; plain, appended, while it streams)."""

    def __init__(self, piece: Piece):
        super().__init__()
        self.setObjectName("codeBlock")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        head = QHBoxLayout()
        head.setContentsMargins(8, 2, 4, 2)
        self.language = plain(QLabel())
        self.language.setObjectName("codeLanguage")
        head.addWidget(self.language)
        head.addStretch(1)
        self.copyButton = QPushButton("Copy")
        self.copyButton.setObjectName("copyCodeButton")
        self.copyButton.setFlat(True)
        self.copyButton.setCursor(Qt.PointingHandCursor)
        self.copyButton.clicked.connect(self.copy)
        head.addWidget(self.copyButton)
        lay.addLayout(head)
        self.view = FitTextEdit(wrap=False)
        self.view.setObjectName("codeView")
        font = QFontDatabase.systemFont(QFontDatabase.FixedFont)
        self.view.setFont(font)
        self.view.document().setDefaultFont(font)
        lay.addWidget(self.view)
        self.piece: Piece | None = None
        self.set_piece(piece)

    @property
    def code(self) -> str:
        return self.piece.text

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.code)
        self.copyButton.setText("Copied")

    def rehighlight(self) -> None:
        """Colours again, in the theme now in use."""
        if self.piece.closed:
            self.view.setHtml(highlighted_html(self.piece.text, self.piece.lang))

    def set_piece(self, piece: Piece) -> None:
        old, self.piece = self.piece, piece
        self.language.setText(piece.lang or "code")
        self.copyButton.setAccessibleName(f"Copy the {piece.lang or 'code'} block")
        self.view.set_growing(0 if piece.closed else GROW_LINES)
        if piece.closed:
            self.view.setHtml(highlighted_html(piece.text, piece.lang))
        elif old is not None and not old.closed and piece.text.startswith(old.text):
            cursor = QTextCursor(self.view.document())
            cursor.movePosition(QTextCursor.End)
            cursor.insertText(piece.text[len(old.text) :])
        else:
            self.view.setPlainText(piece.text)


def fold_toggle(name: str) -> QToolButton:
    """The arrow and line a folded block opens by (thinking, a tool's result)."""
    toggle = QToolButton()
    toggle.setObjectName(name)
    toggle.setCheckable(True)
    toggle.setArrowType(Qt.RightArrow)
    toggle.setToolButtonStyle(Qt.ToolButtonTextBesideIcon)
    toggle.toggled.connect(lambda on: toggle.setArrowType(Qt.DownArrow if on else Qt.RightArrow))
    return toggle


class ThinkBlock(QFrame):
    """What a reasoning model thought (`<think>…</think>`), folded under "Thinking" with its token count."""

    def __init__(self, piece: Piece, count=None):
        super().__init__()
        self.setObjectName("thinkingBlock")
        self.count = count  # text -> tokens, when the model's tokenizer is at hand
        lay = QVBoxLayout(self)
        lay.setContentsMargins(8, 4, 8, 4)
        self.toggle = fold_toggle("thinkingToggle")
        self.toggle.toggled.connect(self._toggled)
        lay.addWidget(self.toggle)
        self.body = WrapLabel()
        self.body.setObjectName("thinkingText")
        self.body.setTextFormat(Qt.PlainText)
        self.body.setTextInteractionFlags(Qt.TextSelectableByMouse | Qt.TextSelectableByKeyboard)
        self.body.setVisible(False)
        lay.addWidget(self.body)
        self.piece: Piece | None = None
        self.set_piece(piece)

    def _toggled(self, shown: bool) -> None:
        self.body.setVisible(shown)

    def set_piece(self, piece: Piece) -> None:
        self.piece = piece
        n = self.count(piece.text) if self.count else None
        tokens = "" if n is None else f" · {n:,} tokens"
        self.toggle.setText(("Thinking" if piece.closed else "Thinking…") + tokens)
        self.toggle.setAccessibleName(f"Thinking{tokens}: show or hide what the model thought")
        self.body.setText(piece.text)


class MarkdownLabel(WrapLabel):
    """A closed paragraph of a message as Markdown that loads nothing it names (outside_text.py); a click
    on a link asks before a web link opens in the system's browser, and shows any other link unopened."""

    def __init__(self, piece: Piece):
        super().__init__()
        self.setObjectName("replyText")
        self.setTextFormat(Qt.RichText)
        self.linkActivated.connect(lambda href: open_link(self.window(), href))
        select = Qt.TextSelectableByMouse | Qt.TextSelectableByKeyboard
        self.setTextInteractionFlags(select | Qt.LinksAccessibleByMouse | Qt.LinksAccessibleByKeyboard)
        self.set_piece(piece)

    def set_piece(self, piece: Piece) -> None:
        self.piece = piece
        text = markdown_html(piece.text)
        self.setText(text)
        # A tab stop only where it has a link to reach by keyboard; a paragraph is selectable by mouse, and the
        # message around it is the tab stop (Copy copies it).
        self.setFocusPolicy(Qt.StrongFocus if "<a " in text else Qt.ClickFocus)


class TypedText(WrapLabel):
    """A paragraph of a person's message as typed: its line breaks and indentation kept, nothing read as Markdown
    (a pasted function stays a function; `*` stays `*`), as chat apps show what a person sent."""

    def __init__(self, piece: Piece):
        super().__init__()
        self.setObjectName("replyText")
        self.setTextFormat(Qt.PlainText)
        self.setTextInteractionFlags(Qt.TextSelectableByMouse | Qt.TextSelectableByKeyboard)
        self.setFocusPolicy(Qt.ClickFocus)  # the message around it is the tab stop (Copy copies it)
        self.set_piece(piece)

    def set_piece(self, piece: Piece) -> None:
        self.piece = piece
        self.setText(piece.text)


PLAIN_LINES = 2_000  # a piece shown as plain text shows this many lines at a time
PLAIN_CHARS = 100_000  # or this many characters, where its lines are long (a 10 MB line is drawn in pages too)
PLAIN_WHOLE = 2_000_000  # a message longer is one plain block, never parsed into pieces (0.7 s for 10 MB)


class PlainBlock(QFrame):
    """A piece past what the window draws as Markdown (outside_text.too_big_for_markdown), or one that failed
    to render: its text as plain text, a page at a time (PLAIN_LINES lines or PLAIN_CHARS characters, *Show
    more*), under a note that says why."""

    def __init__(self, piece: Piece, why: str):
        super().__init__()
        self.setObjectName("plainBlock")
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        self.note = plain(QLabel())
        self.note.setObjectName("plainNote")
        self.note.setWordWrap(True)
        lay.addWidget(self.note)
        self.view = FitTextEdit()
        self.view.setObjectName("plainView")
        font = QFontDatabase.systemFont(QFontDatabase.FixedFont)  # Markdown source: tables line up
        self.view.setFont(font)
        self.view.document().setDefaultFont(font)
        lay.addWidget(self.view)
        self.moreButton = QPushButton()
        self.moreButton.setObjectName("plainMoreButton")
        self.moreButton.setFlat(True)
        self.moreButton.clicked.connect(self.show_more)
        lay.addWidget(self.moreButton, 0, Qt.AlignLeft)
        self.why = why
        self.piece: Piece | None = None
        self.set_piece(piece)

    def set_piece(self, piece: Piece) -> None:
        self.piece, self.text = piece, piece.text
        self.lines = self.text.count("\n") + 1
        self.end = 0  # text[:end] is shown; a page ends before a newline, the next begins with it
        self.view.clear()
        self.show_more()

    def _page_end(self) -> int:
        """Where the page after text[:end] ends: PLAIN_LINES more line ends, or PLAIN_CHARS on."""
        limit = min(len(self.text), self.end + PLAIN_CHARS)
        at = self.end + (1 if self.end else 0)  # past the newline the page begins with
        for _ in range(PLAIN_LINES):
            nl = self.text.find("\n", at, limit)
            if nl < 0:
                return limit
            at = nl + 1
        return at - 1

    def show_more(self) -> None:
        end = self._page_end()
        cursor = QTextCursor(self.view.document())
        cursor.movePosition(QTextCursor.End)
        cursor.insertText(self.text[self.end : end])
        self.end = end
        self.shown = self.text.count("\n", 0, end) + 1  # lines shown, the last maybe in part
        left = len(self.text) - end
        self.note.setText(f"Shown as plain text: {self.why}." + (f" {self.lines:,} lines." if left else ""))
        if self.lines > self.shown:
            more = self.lines - self.shown
            self.moreButton.setText(f"Show {min(more, PLAIN_LINES):,} more lines ({more:,} not shown)")
        else:
            self.moreButton.setText(f"Show more of this line ({left:,} characters not shown)")
        self.moreButton.setVisible(left > 0)


class ReplyBody(QWidget):
    """An assistant's reply as pieces (markdown.py): Markdown paragraphs, code blocks, thinking. While it
    streams only the last piece changes: closed pieces are rendered once, the open paragraph is plain
    text appended (a StreamView), an open code block is appended too. `firstPainted` (trace.now) is
    when the first text reached the screen. `typed`: a person's message, its paragraphs as typed (TypedText)
    and its fenced code as code blocks."""

    firstPainted = Signal(float)

    def __init__(self, count=None, thinking: bool = True, typed: bool = False):
        super().__init__()
        self.setObjectName("replyBody")
        self.count = count
        self.thinking = thinking  # whether <think> blocks are folded (a reply's; a person's message is text)
        self.typed = typed
        self.lay = QVBoxLayout(self)
        self.lay.setContentsMargins(0, 0, 0, 0)
        self.lay.setSpacing(6)
        self.widgets: list[QWidget] = []
        self.waiting_for_paint = False
        self.text = ""
        self.streaming: bool | None = None

    @property
    def stream(self) -> StreamView | None:
        """The open paragraph's view while the reply streams into it."""
        last = self.widgets[-1] if self.widgets else None
        return last if isinstance(last, StreamView) else None

    def show_reply(self, text: str, streaming: bool) -> None:
        if (text, streaming) == (self.text, self.streaming):
            return  # drawn already (a 10 MB message is 0.7 s of parsing into pieces)
        self.streaming = streaming
        if streaming and text and not self.text.strip("…") and text != "…":
            self.waiting_for_paint = True
        self.text = text
        waiting = text == "…"  # the reply's placeholder until its first text: an open paragraph
        if len(text) > PLAIN_WHOLE and not streaming:  # not parsed into pieces: a second a 10 MB message
            self._show_pieces([])
            why = f"{len(text):,} characters is past what the window draws as Markdown ({PLAIN_WHOLE:,})"
            self._show_pieces([Piece("text", text, closed=True)], why)
            return
        try:
            self._show_pieces([Piece("text", "…", closed=False)] if waiting else pieces(text, streaming, self.thinking))
        except Exception as e:  # whatever a message holds, it is shown: as plain text, with what went wrong
            self._show_pieces([])
            self._show_pieces([Piece("text", text, closed=not streaming)], f"it could not be drawn ({e!r})")

    def _show_pieces(self, shown: list[Piece], plain_why: str | None = None) -> None:
        """Draw `shown`, keeping the widgets of pieces that did not change; with `plain_why`, as plain text."""
        for i, piece in enumerate(shown):
            w = self.widgets[i] if i < len(self.widgets) else None
            if w is not None and getattr(w, "piece", None) == piece:
                continue
            kind, why = (PlainBlock, plain_why) if plain_why else self._form(piece)
            if plain_why is None and isinstance(w, kind):
                if why:
                    w.why = why
                w.set_piece(piece)
                continue
            new = self._make(piece, kind, why)
            if w is not None:
                self.lay.replaceWidget(w, new)
                w.setParent(None)
                w.deleteLater()
                self.widgets[i] = new
            else:
                self.lay.addWidget(new)
                self.widgets.append(new)
        for w in self.widgets[len(shown) :]:
            w.setParent(None)
            w.deleteLater()
        del self.widgets[len(shown) :]

    def _form(self, piece: Piece) -> tuple[type, str | None]:
        """The widget a piece is drawn with, and why, when it is plain text past the Markdown limits."""
        if piece.kind != "text":
            return (CodeBlock if piece.kind == "code" else ThinkBlock), None
        if not piece.closed:
            return StreamView, None
        why = too_big_for_markdown(piece.text)
        return (PlainBlock, why) if why else (TypedText if self.typed else MarkdownLabel, None)

    def _make(self, piece: Piece, kind: type, why: str | None) -> QWidget:
        if kind is CodeBlock:
            w = CodeBlock(piece)
        elif kind is ThinkBlock:
            w = ThinkBlock(piece, self.count)
        elif kind is PlainBlock:
            w = PlainBlock(piece, why)
        elif kind in (MarkdownLabel, TypedText):
            w = kind(piece)
        else:
            w = StreamView()
            w.setObjectName("messageStream")
            w.set_piece(piece)
            w.firstPainted.connect(self._painted)  # a text view paints its viewport: it says so itself
            return w
        (w.view.viewport() if isinstance(w, (CodeBlock, PlainBlock)) else w).installEventFilter(self)
        return w

    def eventFilter(self, obj, event) -> bool:
        if self.waiting_for_paint and event.type() == QEvent.Paint:
            self._painted(now())
        return False

    def _painted(self, t: float) -> None:
        if self.waiting_for_paint:
            self.waiting_for_paint = False
            self.firstPainted.emit(t)

    def plain_text(self) -> str:
        """The reply as shown, piece by piece (tests read it back)."""
        return "\n\n".join(w.piece.text for w in self.widgets)
