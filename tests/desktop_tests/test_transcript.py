"""The transcript's message views: what a streaming reply costs the GUI thread, and what it shows."""

from desktop.store import Message
from desktop.transcript import MessageView, WrapLabel

WORDS = "the cache keeps every position it has seen and drops none of them until the prompt changes "


def test_a_streaming_reply_is_appended_to_its_document_not_laid_out_again(qtbot):
    view = MessageView(Message(1, 1, None, "assistant", "", status="streaming"), 0, 1)
    qtbot.addWidget(view)
    view.resize(500, 200)
    view.show()
    pieces = [WORDS if i % 4 else WORDS + "\n\n" for i in range(12)]
    view.set_content(pieces[0], "streaming", 1)  # replaces the "…" placeholder
    changes, heights = [], []
    view.stream.document().contentsChange.connect(lambda at, removed, added: changes.append((at, removed, added)))
    text = pieces[0]
    for i, piece in enumerate(pieces[1:], 2):
        view.set_content(text + piece, "streaming", i)
        qtbot.wait(1)
        heights.append(view.stream.height())
        step = view.stream.fontMetrics().lineSpacing() * view.stream.GROW_LINES  # it grows a few lines at a time
        assert heights[-1] % step == 0 and 0 <= heights[-1] - view.stream.document().size().height() < step
        text += piece
    # each update inserts only its new text, at the end: Qt lays out and paints the last paragraph alone
    ends = [len("".join(pieces[:i])) for i in range(1, len(pieces))]
    assert changes == [(at, 0, len(piece)) for at, piece in zip(ends, pieces[1:])]
    assert view.stream.toPlainText() == text and not view.body.isVisible()
    assert heights == sorted(heights) and heights[-1] > 2 * heights[0]  # the view grows with its text
    assert view.tokensLabel.text() == "12 tokens" and view.statusLabel.text() == "generating…"

    view.set_content(text, "complete", 12)  # the reply is done: Markdown in the label, the stream view gone
    assert view.stream is None and view.body.isVisible() and view.body.text() == text
    assert view.statusLabel.text() == ""


def test_a_wrapped_label_answers_heights_from_its_layout_and_forgets_them_when_its_text_changes(qtbot):
    label = WrapLabel()
    qtbot.addWidget(label)
    label.setText(WORDS)
    one = label.heightForWidth(200)
    assert one == label.heightForWidth(200) and one > label.heightForWidth(2000)
    label.setText(WORDS * 4)
    assert label.heightForWidth(200) > 3 * one  # not the remembered height of the shorter text
    assert label.minimumSizeHint().height() == label.fontMetrics().lineSpacing()
