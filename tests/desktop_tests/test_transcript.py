"""The transcript's message views: what a streaming reply costs the GUI thread, and what it shows."""

import math

from desktop.core.store import Message
from desktop.reply_widgets import MarkdownLabel
from desktop.text_views import WrapLabel
from desktop.transcript import MessageView

WORDS = "the cache keeps every position it has seen and drops none of them until the prompt changes "


def test_a_streaming_reply_appends_to_its_open_paragraph_and_renders_closed_pieces_once(qtbot):
    view = MessageView(Message(1, 1, None, "assistant", "", status="streaming"), 0, 1)
    qtbot.addWidget(view)
    view.resize(500, 200)
    view.show()
    words = (WORDS * 10).split()
    text = words[0]
    view.set_content(text, "streaming", 1)  # replaces the "…" placeholder
    stream = view.stream
    changes, heights = [], []
    stream.document().contentsChange.connect(lambda at, removed, added: changes.append((at, removed, added)))
    for k, word in enumerate(words[1:], 2):
        view.set_content(text + " " + word, "streaming", k)
        qtbot.wait(1)
        heights.append(stream.height())
        step = stream.fontMetrics().lineSpacing() * stream.grow_lines  # it grows a few lines at a time
        assert heights[-1] % step == 0 and 0 <= heights[-1] - stream.document().size().height() < step
        assert changes[-1] == (len(text), 0, len(word) + 1)  # only the new text, at the end: no layout again
        text += " " + word
    assert view.stream is stream and stream.toPlainText() == text
    assert heights == sorted(heights) and heights[-1] > 2 * heights[0]  # the view grows with its text
    assert view.tokensLabel.text() == f"{len(words)} tokens" and view.statusLabel.text() == "generating…"

    # A blank line closes the paragraph: it is rendered as Markdown once, and never again while the rest grows.
    text += "\n\nA **second** paragraph"
    view.set_content(text, "streaming", 100)
    first = view.reply.widgets[0]
    assert isinstance(first, MarkdownLabel) and first.piece.text == " ".join(words) and view.stream is not stream
    text += " grows.\n\n```python\ndef add(a, b):\n"
    view.set_content(text, "streaming", 101)
    block = view.reply.widgets[2]
    assert view.reply.widgets[0] is first and block.objectName() == "codeBlock" and not block.piece.closed
    assert block.view.toPlainText() == "def add(a, b):\n" and block.language.text() == "python"
    step = block.view.fontMetrics().lineSpacing() * block.view.grow_lines  # an open block grows in steps too
    assert block.view.grow_lines > 1 and block.view.height() % step == 0
    text += "    return a + b\n```\nDone."
    view.set_content(text, "complete", 110)  # the reply ends: every piece closed, the code highlighted
    assert view.reply.widgets[0] is first and view.reply.widgets[2] is block and view.stream is None
    assert block.piece.closed and block.view.toPlainText().rstrip() == "def add(a, b):\n    return a + b"
    assert "<span" in block.view.toHtml()  # Pygments' colours
    assert block.view.grow_lines == 0  # closed: exactly as tall as its code
    exact = math.ceil(block.view.document().size().height()) + 2
    assert block.view.height() == exact or block.view.horizontalScrollBar().isVisible()
    assert [type(w).__name__ for w in view.reply.widgets] == [
        "MarkdownLabel",
        "MarkdownLabel",
        "CodeBlock",
        "MarkdownLabel",
    ]
    assert view.statusLabel.text() == "" and not view.body.isVisible() and view.reply.isVisible()


def test_a_wrapped_label_answers_heights_from_its_layout_and_forgets_them_when_its_text_changes(qtbot):
    label = WrapLabel()
    qtbot.addWidget(label)
    label.setText(WORDS)
    one = label.heightForWidth(200)
    assert one == label.heightForWidth(200) and one > label.heightForWidth(2000)
    label.setText(WORDS * 4)
    assert label.heightForWidth(200) > 3 * one  # not the remembered height of the shorter text
    assert label.minimumSizeHint().height() == label.fontMetrics().lineSpacing()


def test_a_persons_message_shows_as_typed_its_lines_and_indentation_kept(qtbot, make_window, demo_model_dir,
                                                                        spin_loop):  # fmt: skip
    """A message typed with Shift+Enter line breaks and indented code (no fence) is shown as it was typed: its
    lines apart, its indentation kept, `*` as `*` (Markdown would join the lines into one paragraph and drop the
    spaces); a fenced block in it is a code block; the reply beside it is still Markdown."""
    from PySide6.QtCore import Qt

    from desktop.reply_widgets import CodeBlock, TypedText

    w = make_window(demo_model_dir, max_new_tokens=4)
    lines = ["Rename prices to amounts:", "", "def total(prices, tax):", "    result = 0", "    return *result*",
             "", "```", "x = 1", "```"]  # fmt: skip
    got = []
    w.replyFinished.connect(got.append)
    for i, line in enumerate(lines):
        qtbot.keyClicks(w.composer, line)
        if i < len(lines) - 1:
            qtbot.keyClick(w.composer, Qt.Key_Return, Qt.ShiftModifier)
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: got, 120)
    person, reply = w.transcript.views[0], w.transcript.views[1]
    kinds = [type(x) for x in person.reply.widgets]
    assert kinds == [TypedText, TypedText, CodeBlock], kinds
    code = person.reply.widgets[1]
    assert code.text() == "def total(prices, tax):\n    result = 0\n    return *result*"
    assert code.textFormat() == Qt.PlainText and person.reply.widgets[2].piece.text == "x = 1"
    assert code.height() > 2.5 * code.fontMetrics().lineSpacing()  # three lines drawn, not one
    assert not reply.findChildren(TypedText)  # the model's reply: Markdown
