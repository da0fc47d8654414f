"""The transcript: one widget per message on the current branch, Markdown bodies, edit in place."""

from __future__ import annotations

import dataclasses
import html

from PySide6.QtCore import QEvent, Qt, QTimer, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from .attachments import MessageImages
from .core.replies import reply_footer
from .outside_text import plain, rich
from .reply_widgets import ReplyBody
from .text_views import ElidedLabel, StreamView, WrapLabel
from .token_view import TOKEN_PAGE, ForkRow, TokenView
from .tool_blocks import tool_block

DEMO_HINT = (
    "Ask the demo model to plan a trip, for example:<br><i>I am planning a trip to Chengdu "
    "for 3 nights. My budget is 600 yuan.</i><br><br>Then edit 600 to 750 and watch the "
    "panel: where the cache is cut, what is kept, what is recomputed."
)
ROLE_NAMES = {"user": "You", "assistant": "Assistant", "system": "System", "tool": "Tool result"}
STATUS_NOTES = {
    "stopped": "stopped",
    "incomplete": "incomplete (the app closed mid-reply)",
    "failed": "failed",
    "length": "stopped at the token limit",
    "streaming": "generating…",
}


class MessageView(QFrame):
    editSubmitted = Signal(int, str)
    compareRequested = Signal(int)
    branchRequested = Signal(int, int)  # message id, +1 / -1
    selected = Signal(int)
    forkRequested = Signal(int, int, object)  # message id, token index, the alternative (None: drawn again)
    firstTextPainted = Signal(float)  # the streaming reply's first text reached the screen (trace.now)

    def __init__(self, message, branch_index: int, branch_count: int, count=None):
        """`count(text) -> tokens` (the model's tokenizer, when it is here) for thinking blocks' counts."""
        super().__init__()
        self.message = message
        self.count = count
        self.branch = (branch_index, branch_count)
        self.setObjectName(f"message-{message.role}")
        self.setProperty("role", message.role)
        self.setFrameShape(QFrame.StyledPanel)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(10, 6, 10, 8)
        head = QHBoxLayout()
        self.roleLabel = rich(QLabel(f"<b>{html.escape(ROLE_NAMES.get(message.role, message.role))}</b>"))
        head.addWidget(self.roleLabel)
        self.modelLabel = plain(ElidedLabel())  # the reply's model: cut ("…") before the row widens the transcript
        self.modelLabel.setObjectName("replyModel")
        self.modelLabel.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)
        self.modelLabel.setMinimumWidth(0)
        head.addWidget(self.modelLabel, 10)  # most of the row's free room: clipped only when the row is narrow
        self.statusLabel = plain(QLabel())
        self.statusLabel.setObjectName("messageStatus")
        head.addWidget(self.statusLabel)
        self.statusLabel.setSizePolicy(QSizePolicy.Ignored, QSizePolicy.Preferred)  # a narrow window clips it
        self.statusLabel.setMinimumWidth(0)  # (the footer says it too), never the transcript's width
        head.addStretch(1)
        self.prevButton = QPushButton("‹")
        self.prevButton.setObjectName("branchPrev")
        self.branchLabel = plain(QLabel(f"{branch_index + 1}/{branch_count}"))
        self.branchLabel.setObjectName("branchLabel")
        self.nextButton = QPushButton("›")
        self.nextButton.setObjectName("branchNext")
        for w in (self.prevButton, self.branchLabel, self.nextButton):
            w.setVisible(branch_count > 1)
            head.addWidget(w)
        self.prevButton.setEnabled(branch_index > 0)
        self.nextButton.setEnabled(branch_index < branch_count - 1)
        self.prevButton.clicked.connect(lambda: self.branchRequested.emit(self.message.id, -1))
        self.nextButton.clicked.connect(lambda: self.branchRequested.emit(self.message.id, +1))
        self.tokensLabel = plain(QLabel())
        self.tokensLabel.setObjectName("tokenCount")
        self.tokensLabel.setSizePolicy(QSizePolicy.Minimum, QSizePolicy.Preferred)
        head.addWidget(self.tokensLabel)
        self.copyButton = QPushButton("Copy")
        self.copyButton.setObjectName("copyButton")
        self.copyButton.clicked.connect(lambda: QGuiApplication.clipboard().setText(self.message.content))
        head.addWidget(self.copyButton)
        self.compareButton = QPushButton("Compare")
        self.compareButton.setObjectName("compareButton")
        self.compareButton.setToolTip("Rerun this prompt at the other precision and compare, token by token")
        self.compareButton.clicked.connect(lambda: self.compareRequested.emit(self.message.id))
        self.compareButton.setVisible(message.role == "assistant")
        head.addWidget(self.compareButton)
        self.editButton = QPushButton("Edit")
        self.editButton.setObjectName("editButton")
        self.editButton.clicked.connect(self.begin_edit)
        self.editButton.setVisible(message.role != "tool")  # a result is the tool's: a person's edit is not one
        head.addWidget(self.editButton)
        who = ROLE_NAMES.get(message.role, message.role).lower()
        for b, name in (
            (self.prevButton, f"Previous version of this message ({who})"),
            (self.nextButton, f"Next version of this message ({who})"),
            (self.copyButton, f"Copy this message ({who})"),
            (self.compareButton, "Compare this reply at the other precision"),
            (self.editButton, f"Edit this message ({who})"),
        ):
            b.setFlat(True)
            b.setCursor(Qt.PointingHandCursor)
            b.setAccessibleName(name)
        lay.addLayout(head)
        self.body = WrapLabel()
        self.body.setObjectName("messageBody")
        self.body.setTextInteractionFlags(
            Qt.TextSelectableByMouse | Qt.TextSelectableByKeyboard | Qt.LinksAccessibleByMouse
        )
        self.setFocusPolicy(Qt.StrongFocus)  # Ctrl+Up/Down moves between messages
        self.setAccessibleName(f"{ROLE_NAMES.get(message.role, message.role)} message")
        self.body.setSizePolicy(QSizePolicy.Preferred, QSizePolicy.Minimum)
        self.body.setTextFormat(Qt.RichText)  # the highlight of an invalidated token: escaped text in a span
        lay.addWidget(self.body)
        # the message as pieces: Markdown, code blocks, thinking (a reply's), plain text past the limits
        self.reply = ReplyBody(count, thinking=message.role == "assistant", typed=message.role == "user")
        self.reply.firstPainted.connect(self.firstTextPainted)
        lay.addWidget(self.reply)
        self.body.setVisible(False)
        self.modelChangeLabel = plain(QLabel())  # this reply's model is not the previous reply's
        self.modelChangeLabel.setObjectName("modelChangeNote")
        self.modelChangeLabel.setWordWrap(True)
        self.modelChangeLabel.setVisible(False)
        lay.insertWidget(0, self.modelChangeLabel)
        self.leftOutLabel = plain(QLabel())  # the last reply's prompt left this message out (the overflow policy)
        self.leftOutLabel.setObjectName("leftOutNote")
        self.leftOutLabel.setWordWrap(True)
        self.leftOutLabel.setVisible(False)
        lay.insertWidget(2, self.leftOutLabel)  # under the role row
        self.footerLabel = plain(QLabel())  # a reply's figures (chat.reply_footer); a person's message has none
        self.footerLabel.setObjectName("replyFooter")
        self.footerLabel.setWordWrap(True)
        self.footerLabel.setToolTip("This reply's figures, as it ended: select the reply for all of them in the panel")
        lay.addWidget(self.footerLabel)
        self.token_mode = "off"  # the window's token colours (token_view.MODES)
        self.tokenView: TokenView | None = None  # made when a reply is first shown token by token
        self.editor: QPlainTextEdit | None = None  # made when an edit begins: a long transcript builds fast
        self.editRow: QWidget | None = None
        self.highlight: tuple[int, int] | None = None
        self.toolBlock = None  # a reply's calls, or a tool's result (tool_blocks), once the record has them
        self.imagesRow: MessageImages | None = None  # a person's message's images (show_images)
        self.set_content(message.content, message.status, message.token_count)

    def show_images(self, files) -> None:
        """A person's message's images, as thumbnails under its role row (`files`: kvchat's image folder)."""
        record = self.message.trace if isinstance(self.message.trace, dict) else {}
        refs = record.get("images") if self.message.role == "user" else None
        if refs and self.imagesRow is None:
            self.imagesRow = MessageImages(refs, files)
            self.layout().insertWidget(3, self.imagesRow)

    def set_model(self, name: str | None, changed: str) -> None:
        """A reply's model beside its role ("Assistant · SmolLM2…"), and the line where the model changed."""
        text = f"· {name}" if name else ""
        if self.modelLabel.text() != text:
            self.modelLabel.setText(text)
            self.modelLabel.setToolTip(f"Made by {name}" if name else "")
        if self.modelChangeLabel.text() != changed:
            self.modelChangeLabel.setText(changed)
            self.modelChangeLabel.setVisible(bool(changed))

    def set_left_out(self, note: str) -> None:
        """Marked (a note, a dashed frame) when the last reply's prompt left this message out; "" clears it."""
        if self.leftOutLabel.text() == note:
            return
        self.leftOutLabel.setText(note)
        self.leftOutLabel.setVisible(bool(note))
        self.setProperty("leftOut", bool(note))
        self.style().unpolish(self)
        self.style().polish(self)
        self.setAccessibleDescription(note)

    def mousePressEvent(self, e):
        self.selected.emit(self.message.id)
        super().mousePressEvent(e)

    def set_content(self, text: str, status: str, tokens: int | None) -> None:
        self.message = dataclasses.replace(self.message, content=text, status=status)
        if self.highlight is not None:
            a, b = self.highlight
            self.body.setTextFormat(Qt.RichText)
            self.body.setText(
                html.escape(text[:a]).replace("\n", "<br>")
                + f"<span style='background:#f0c05a;color:#111'>{html.escape(text[a:b]) or '&#8203;'}</span>"
                + html.escape(text[b:]).replace("\n", "<br>")
            )
        else:  # pieces: only the last one changes while the reply streams
            streaming = status == "streaming"
            self.reply.show_reply(text or ("…" if streaming else ""), streaming)
        steps = self.token_steps(status)
        if steps:
            if self.tokenView is None:
                self.tokenView = TokenView()
                self.forkRow = ForkRow()
                self.tokenMore = QPushButton()  # the next page of a long reply's tokens
                self.tokenMore.setObjectName("tokenMoreButton")
                self.tokenMore.setFlat(True)
                self.tokenMore.clicked.connect(self.tokenView.show_more)
                self.tokenView.pageDrawn.connect(self._token_page)
                at = self.layout().indexOf(self.reply) + 1
                self.layout().insertWidget(at, self.tokenView)
                self.layout().insertWidget(at + 1, self.tokenMore, 0, Qt.AlignLeft)
                self.layout().insertWidget(at + 2, self.forkRow)
                self.tokenView.tokenFocused.connect(lambda i: self.forkRow.show_token(i, self.tokenView.steps[i]))
                self.forkRow.forkRequested.connect(lambda i, a: self.forkRequested.emit(self.message.id, i, a))
            self.tokenView.set_tokens(steps, self.token_mode)
        if self.tokenView is not None:
            self.tokenView.setVisible(bool(steps) and not self.editing)
            if not steps:
                self.forkRow.setVisible(False)
            self._token_page(self.tokenView.drawn, len(self.tokenView.steps))
        if self.toolBlock is None and status != "streaming":
            self.toolBlock = tool_block(self.message)
            if self.toolBlock is not None:
                self.layout().insertWidget(self.layout().indexOf(self.footerLabel), self.toolBlock)
        self.reply.setVisible(self.highlight is None and not self.editing and not steps and self.message.role != "tool")
        self.body.setVisible(self.highlight is not None and not self.editing and not steps)
        self.statusLabel.setText(STATUS_NOTES.get(status, ""))
        self.tokensLabel.setText("" if tokens is None else f"{tokens} tokens")
        self.shown = (text, status, tokens)
        footer = "" if status == "streaming" or self.message.role != "assistant" else reply_footer(self.message.trace)
        self.footerLabel.setText(footer)
        self.footerLabel.setVisible(bool(footer))

    def _token_page(self, drawn: int, total: int) -> None:
        left = total - drawn
        self.tokenMore.setText(f"Show {min(left, TOKEN_PAGE):,} more tokens ({drawn:,} of {total:,} shown)")
        self.tokenMore.setVisible(left > 0 and self.tokenView.isVisibleTo(self))

    def token_steps(self, status: str) -> list[dict]:
        """The reply's tokens when it is shown token by token: the colours on, a finished reply that kept them."""
        record = self.message.trace if isinstance(self.message.trace, dict) else {}
        steps = record.get("tokens")
        wanted = self.token_mode != "off" and status != "streaming" and self.message.role == "assistant"
        return steps if wanted and isinstance(steps, list) and steps else []

    def set_token_mode(self, mode: str) -> None:
        """Colour this reply's tokens by probability or entropy, or show it as Markdown again ("off")."""
        if mode == self.token_mode:
            return
        shown = bool(self.token_steps(self.message.status))
        self.token_mode = mode
        if shown or self.token_steps(self.message.status):  # a view without tokens looks the same either way
            self.set_content(self.message.content, self.message.status, self.message.token_count)

    def can_show(self, message, branch_index: int, branch_count: int) -> bool:
        """Whether this view can show `message` at that branch position by updating its text alone (no
        highlight): a redraw of the transcript keeps such views instead of rebuilding them, an open
        editor and its unsaved text included."""
        return (self.message.id, self.branch) == (message.id, (branch_index, branch_count)) and self.highlight is None

    def show_message(self, message) -> None:
        """The stored state of the message this view shows (its text, status and token count)."""
        stamped = message.trace is not self.message.trace
        self.message = message
        if stamped or self.shown != (message.content, message.status, message.token_count):
            self.set_content(message.content, message.status, message.token_count)

    def _mark(self, name: str, on: bool) -> None:
        """A style-sheet property of the frame (found, invalidated), applied at once."""
        self.setProperty(name, on)
        self.style().unpolish(self)
        self.style().polish(self)

    def set_found(self, found: bool) -> None:
        """Mark (or unmark) this message as the one a search found."""
        if bool(self.property("found")) != found:
            self._mark("found", found)

    def set_highlight(self, start: int, end: int) -> None:
        """Mark where invalidation began: the message glows, the changed token is highlighted."""
        self.highlight = (start, end)
        self._mark("invalidated", True)
        self.set_content(self.message.content, self.message.status, self.message.token_count)

    @property
    def stream(self) -> StreamView | None:
        """The streaming reply's open paragraph, if it is streaming into one."""
        return self.reply.stream

    @property
    def shown_body(self) -> QWidget:
        """What shows the message's text now: its tokens, its pieces, or the highlight's label."""
        if self.tokenView is not None and self.token_steps(self.message.status):
            return self.tokenView
        return self.reply if self.highlight is None else self.body

    @property
    def editing(self) -> bool:
        return self.editor is not None and self.editor.isVisible()

    def _make_editor(self) -> None:
        self.editor = QPlainTextEdit()
        self.editor.setObjectName("messageEditor")
        self.editor.installEventFilter(self)  # Ctrl+Enter saves, as the button does; Esc cancels
        self.layout().addWidget(self.editor)
        row = QHBoxLayout()
        self.saveButton = QPushButton("Save && regenerate" if self.message.role == "user" else "Save as new branch")
        self.saveButton.setObjectName("saveEditButton")
        self.cancelButton = QPushButton("Cancel")
        self.saveButton.clicked.connect(self._submit)
        self.cancelButton.clicked.connect(self.end_edit)
        row.addStretch(1)
        row.addWidget(self.cancelButton)
        row.addWidget(self.saveButton)
        self.editRow = QWidget()
        self.editRow.setLayout(row)
        self.layout().addWidget(self.editRow)

    def eventFilter(self, obj, event) -> bool:
        if obj is self.editor and event.type() == QEvent.KeyPress:
            if event.key() in (Qt.Key_Return, Qt.Key_Enter) and event.modifiers() & Qt.ControlModifier:
                self._submit()
                return True
            if event.key() == Qt.Key_Escape:
                self.end_edit()
                return True
        return False

    def begin_edit(self) -> None:
        if self.editor is None:
            self._make_editor()
        self.editor.setPlainText(self.message.content)
        self.editor.setVisible(True)
        self.editRow.setVisible(True)
        self.shown_body.setVisible(False)
        self.editor.setFocus()
        area = self.parentWidget()
        while area is not None and not isinstance(area, Transcript):
            area = area.parentWidget()
        if area is not None:
            area.show_whole(self)  # the "You" header and the editor's first lines in sight, not the end

    def end_edit(self) -> None:
        if self.editor is None:
            return
        self.editor.setVisible(False)
        self.editRow.setVisible(False)
        self.shown_body.setVisible(True)

    def _submit(self) -> None:
        text = self.editor.toPlainText().strip()
        self.end_edit()
        if text and text != self.message.content:
            self.editSubmitted.emit(self.message.id, text)


class Transcript(QScrollArea):
    """The messages of the branch shown, from `first` (its index in the branch) to the end: a long
    conversation opens with its last messages, and earlier ones come a window at a time
    (`earlierButton`)."""

    earlierRequested = Signal()

    def __init__(self):
        super().__init__()
        self.setObjectName("transcript")
        self.setWidgetResizable(True)
        self.inner = QWidget()
        self.inner.setObjectName("transcriptInner")
        self.lay = QVBoxLayout(self.inner)
        self.lay.setSpacing(8)
        self.first = 0  # the branch index of views[0]
        self.more = False  # the branch's beginning is still being read: earlier messages, how many not known
        self.earlierButton = QPushButton()
        self.earlierButton.setObjectName("earlierButton")
        self.earlierButton.setFlat(True)
        self.earlierButton.setCursor(Qt.PointingHandCursor)
        self.earlierButton.clicked.connect(lambda: self.earlierRequested.emit())
        self.earlierButton.setVisible(False)
        self.lay.addWidget(self.earlierButton, 0, Qt.AlignHCenter)
        self.hint = rich(QLabel(DEMO_HINT))  # the app's own words; the model's name in it is escaped
        self.hint.setObjectName("transcriptHint")
        self.hint.setAlignment(Qt.AlignCenter)
        self.hint.setWordWrap(True)
        self.lay.addWidget(self.hint)
        self.lay.addStretch(1)
        self.setWidget(self.inner)
        self.views: list[MessageView] = []
        self._follow = True
        bar = self.verticalScrollBar()
        bar.valueChanged.connect(self._on_scroll)
        bar.rangeChanged.connect(self._on_range)

    def show_start(self, facts: dict) -> None:
        """The empty conversation's page, for the model loaded: the demo model's example, or any other
        model's name, size and precision with a neutral hint."""
        if facts.get("path", "").endswith("kvchat-demo") and facts.get("backend") != "remote":
            self.hint.setText(DEMO_HINT)
            return
        size = facts.get("parameters")
        size = f"{size / 1e9:,.1f}B" if size and size >= 1e9 else f"{size / 1e6:,.0f}M" if size else None
        precision = facts.get("weights") if facts.get("weights") not in (None, "none") else facts.get("dtype")
        where = f"on {facts['server']}" if facts.get("backend") == "remote" else f"on {facts.get('device')}"
        details = " · ".join(str(x) for x in (size and f"{size} parameters", precision, where) if x)
        self.hint.setText(
            f"<b>{html.escape(str(facts.get('name', 'The model')))}</b><br>{html.escape(details)}<br><br>"
            "Send a message to start. Edit any earlier message and the panel shows where the cache is cut, "
            "what is kept and what is recomputed."
        )

    def _on_scroll(self, value: int) -> None:
        bar = self.verticalScrollBar()
        self._follow = value >= bar.maximum() - 4  # scrolled up: stop following

    def _on_range(self, _lo: int, hi: int) -> None:
        if self._follow:
            self.verticalScrollBar().setValue(hi)

    def clear(self, first: int = 0, more: bool = False) -> None:
        """No views; the next ones added start at branch index `first` (`more`: of a branch whose
        beginning is still being read, so how many come before is not known yet)."""
        self.truncate(0)
        self.set_first(first, more)

    def set_first(self, first: int, more: bool | None = None) -> None:
        """The branch index of the first view (and whether the branch's beginning is still being read)."""
        self.first = first
        self.more = self.more if more is None else more
        self.earlierButton.setVisible(self.first > 0 or self.more)
        label, n = "Show earlier messages", self.first
        self.earlierButton.setText(label if self.more else f"{label} ({n:,} not shown)")
        self.earlierButton.setAccessibleName(label if self.more else f"{label}: {n} are not shown")

    def prepend(self, views: list[MessageView]) -> None:
        """Views for the messages just before `first`, keeping what is on screen where it is."""
        if not views:
            return
        bar = self.verticalScrollBar()
        anchor = self.views[0] if self.views else None
        offset = (anchor.y() - bar.value()) if anchor is not None else 0
        at = self.lay.indexOf(self.hint) + 1
        for i, view in enumerate(views):
            self.lay.insertWidget(at + i, view)
            view.show()  # now, not at the layout's next pass: Ctrl+Up focuses one at once
        self.views[:0] = views
        self.set_first(self.first - len(views))
        self.hint.setVisible(False)
        if anchor is not None and not self._follow:  # following the end: it stays at the end
            QTimer.singleShot(0, lambda: anchor in self.views and bar.setValue(anchor.y() - offset))  # once laid out

    def truncate(self, keep: int) -> None:
        """Remove the views after the first `keep`: hidden and out of the layout now, deleted by the event
        loop (taking a view's parent away at once re-parents its whole widget tree on the GUI thread)."""
        for v in self.views[keep:]:
            v.hide()
            self.lay.removeWidget(v)
            v.deleteLater()
        del self.views[keep:]
        self.hint.setVisible(not self.views)

    def add(self, view: MessageView) -> None:
        self.lay.insertWidget(self.lay.count() - 1, view)
        view.show()  # now, not at the layout's next pass (a queued show): what is in `views` is on screen
        self.views.append(view)
        self.hint.setVisible(False)

    def show_whole(self, view: MessageView) -> None:
        """Scroll `view` into sight once laid out, its top first when it is taller than the viewport; the end is
        no longer followed (an editor opened on an early message would otherwise be scrolled past)."""
        self._follow = False

        def scroll():
            if view not in self.views:
                return
            bar, height = self.verticalScrollBar(), self.viewport().height()
            top, bottom = view.y() - 8, view.y() + view.height() + 8
            if top < bar.value() or bottom - top > height:
                bar.setValue(top)
            elif bottom > bar.value() + height:
                bar.setValue(bottom - height)

        QTimer.singleShot(0, scroll)

    def view_for(self, mid: int) -> MessageView | None:
        return next((v for v in self.views if v.message.id == mid), None)

    @property
    def following(self) -> bool:
        return self._follow
