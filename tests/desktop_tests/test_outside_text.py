"""Text from outside is text, in the real window: a stored conversation whose messages name local files (an
image, a table's background, a stylesheet's url) opens at start and loads none of them; every label that
can show outside text shows it as characters; a link opens only as a web link the person agreed to; a
table too big for Markdown is plain text a page at a time; a piece that fails to render is shown plain."""

import os
import threading

import pytest
from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import QApplication, QLabel, QMessageBox

from desktop.core.store import Store
from desktop.outside_text import markdown_html
from desktop.reply_widgets import MarkdownLabel, PlainBlock


class Tripwire:
    """A named pipe that records whether anything opened it for reading: what Qt would do to load a file
    a message names (`/dev/zero` would never end; this ends, and says so)."""

    def __init__(self, path):
        self.path = str(path)
        os.mkfifo(self.path)
        self.opened = threading.Event()
        self.thread = threading.Thread(target=self._wait, daemon=True)
        self.thread.start()

    def _wait(self):
        with open(self.path, "wb") as f:  # blocks until a reader opens the pipe
            self.opened.set()
            f.write(b"GIF89a")

    def release(self):
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer go if nobody opened it
        self.thread.join(2)
        os.close(fd)


@pytest.fixture
def wires(tmp_path):
    made = []

    def make(name):
        made.append(Tripwire(tmp_path / name))
        return made[-1].path

    yield make, made
    for w in made:
        w.release()


def hostile(wire) -> list[str]:
    """A message per way a document names a file to load."""
    return [
        f"A diagram: ![the plan]({wire('md-image')}) and more.",
        f'Inline: <img src="{wire("html-img")}"> done.',
        f"<table background='{wire('table-bg')}'><tr><td background='{wire('cell-bg')}'>1</td></tr></table>",
        f"<p style='background-image: url({wire('css-bg')})'>styled</p>",
        f'<link rel="stylesheet" href="{wire("css-link")}">linked',
    ]


def test_a_conversation_naming_local_files_opens_at_start_and_loads_none_of_them(
    qtbot, make_window, demo_model_dir, wires, tmp_path, spin_loop
):
    wire, made = wires
    data = tmp_path / "data"
    data.mkdir()
    texts = hostile(wire)
    store = Store(data / "kvchat.db")
    c = store.new_conversation("poisoned")
    parent = None
    for text in texts:  # each both as a person's message and as a reply
        parent = store.add_message(c.id, parent.id if parent else None, "user", text).id
        parent = store.add_message(c.id, parent, "assistant", text)
    store.close()

    w = make_window(demo_model_dir, data=data)  # the app opens the newest conversation at start
    spin_loop(lambda: len(w.transcript.views) == 2 * len(texts), 60)
    qtbot.wait(200)  # laid out and painted
    w.transcript.views[0].grab()
    assert not [m.path for m in made if m.opened.is_set()]
    shown = [lbl.text() for v in w.transcript.views for lbl in v.findChildren(MarkdownLabel)]
    assert any("[image: the plan]" in t for t in shown)  # an image is its alt text
    assert all("<img" not in t and "background" not in t for t in shown)


def test_labels_showing_outside_text_show_it_as_characters(qtbot, make_window, demo_model_dir, wires):
    wire, made = wires
    w = make_window(demo_model_dir)
    poison = f'<img src="{wire("banner")}"> the server said no'
    w.show_error(poison)  # a remote server's error body, a template's raise_exception message
    w.statsPanel.show_reply(w.chat.stats, poison)  # the panel's heading
    w.statsPanel.set("modelNameValue", poison)  # a remote model's id
    qtbot.wait(100)
    w.grab()
    assert w.banner.text() == poison and w.statsPanel.heading.text() == poison
    assert not [m.path for m in made if m.opened.is_set()]
    # no label in the window guesses: each is plain text, or the app's own rich text with the outside escaped
    guessing = [
        label.objectName() or label.text()[:40]
        for label in w.findChildren(QLabel)
        if label.textFormat() == Qt.AutoText and label.buddy() is None  # a form's row names are the app's
    ]
    assert guessing == []


def click_link(qtbot, label, answer):
    """Tab to the label's link and press Enter, as a person with a keyboard would; `answer` is the button
    pressed in the dialog that comes up. Returns the dialog's text."""
    seen = []

    def respond():
        box = QApplication.activeModalWidget()
        if not isinstance(box, QMessageBox):
            QTimer.singleShot(20, respond)
            return
        seen.append(box.text())
        box.button(answer).click()

    QTimer.singleShot(20, respond)
    label.setFocus()
    qtbot.keyClick(label, Qt.Key_Tab)  # the first link
    qtbot.keyClick(label, Qt.Key_Return)
    qtbot.waitUntil(lambda: bool(seen), timeout=5000)
    return seen[0]


@pytest.mark.parametrize(
    "href",
    ["file:///bin/sh", "file:///etc/passwd", "../../../../bin/sh", "smb://10.0.0.1/share/x.exe", "javascript:alert(1)"],
)
def test_a_link_that_is_not_a_web_link_is_shown_never_opened(qtbot, monkeypatch, href):
    opened = []
    monkeypatch.setattr(QDesktopServices, "openUrl", lambda url: opened.append(url) or True)
    from desktop.core.markdown import Piece

    label = MarkdownLabel(Piece("text", f"Run [this]({href}) now."))
    qtbot.addWidget(label)
    label.show()
    said = click_link(qtbot, label, QMessageBox.Ok)
    assert "was not opened" in said and href in said and opened == []


def test_a_web_link_opens_after_the_person_sees_the_whole_address_and_agrees(qtbot, monkeypatch):
    opened = []
    monkeypatch.setattr(QDesktopServices, "openUrl", lambda url: opened.append(url.toString()) or True)
    from desktop.core.markdown import Piece

    href = "https://docs.python.org/3/library/html.html?q=escape#html.escape"
    label = MarkdownLabel(Piece("text", f"See [the docs]({href})."))
    qtbot.addWidget(label)
    label.show()
    assert href in click_link(qtbot, label, QMessageBox.Cancel) and opened == []
    assert href in click_link(qtbot, label, QMessageBox.Open) and opened == [href]


def test_a_table_too_big_for_markdown_is_plain_text_a_page_at_a_time(qtbot, make_window, demo_model_dir, tmp_path):
    rows = 50_000
    table = "| n | square |\n|---|---|\n" + "\n".join(f"| {i} | {i * i} |" for i in range(rows))
    data = tmp_path / "data"
    data.mkdir()
    store = Store(data / "kvchat.db")
    c = store.new_conversation("big table")
    m = store.add_message(c.id, None, "user", "Squares, please.")
    store.add_message(c.id, m.id, "assistant", f"Here:\n\n{table}\n\nDone.")
    store.close()
    w = make_window(demo_model_dir, data=data)
    qtbot.waitUntil(lambda: len(w.transcript.views) == 2, timeout=60000)
    block = w.transcript.views[1].findChild(PlainBlock)
    assert block is not None and "a table of 50,002 lines" in block.note.text()
    page = block.view.toPlainText().split("\n")
    assert len(page) == block.shown < rows and page[0] == "| n | square |"
    qtbot.mouseClick(block.moreButton, Qt.LeftButton)
    assert len(block.view.toPlainText().split("\n")) == 2 * len(page)
    assert [type(x).__name__ for x in w.transcript.views[1].reply.widgets] == [
        "MarkdownLabel",
        "PlainBlock",
        "MarkdownLabel",
    ]
    assert block.moreButton.text().startswith("Show 2,000 more lines")


def test_a_piece_that_fails_to_render_is_shown_as_plain_text_with_a_note(
    qtbot, make_window, demo_model_dir, monkeypatch
):
    import desktop.reply_widgets as reply_widgets

    def broken(text):
        raise ValueError("the renderer broke")

    monkeypatch.setattr(reply_widgets, "markdown_html", broken)
    make_window(demo_model_dir)  # the app's style applied, as where a reply is drawn
    from desktop.core.store import Message
    from desktop.transcript import MessageView

    view = MessageView(Message(1, 1, None, "assistant", "**bold** and a [link](https://x.org)"), 0, 1)
    qtbot.addWidget(view)
    block = view.findChild(PlainBlock)
    assert block is not None and "could not be drawn" in block.note.text() and "the renderer broke" in block.note.text()
    assert block.view.toPlainText() == "**bold** and a [link](https://x.org)"


def test_markdown_html_keeps_what_markdown_means_and_names_nothing_to_load():
    out = markdown_html("**bold** `code` [a link](https://example.org) ![alt text](/etc/passwd)")
    assert "font-weight" in out and 'href="https://example.org"' in out and "[image: alt text]" in out
    assert "/etc/passwd" not in out


def test_the_app_restarts_on_a_conversation_naming_dev_zero_within_a_memory_cap(tmp_path, demo_model_dir):
    """The probe's case as a person meets it: a stored reply with `![x](/dev/zero)` and `<img src=/dev/zero>`
    (Qt would read it without end: 8 GB in 20 s). The real app starts on it, draws it and quits (`--check`),
    within a minute and under 3 GB (the model, torch and Qt themselves take about 0.6 GB)."""
    import resource
    import subprocess
    import sys

    data = tmp_path / "data"
    data.mkdir()
    store = Store(data / "kvchat.db")
    c = store.new_conversation("poisoned")
    m = store.add_message(c.id, None, "user", 'Look: <img src="/dev/zero">')
    store.add_message(
        c.id, m.id, "assistant", "![x](/dev/zero)\n\n<table background='/dev/zero'><tr><td>1</td></tr></table>"
    )
    store.close()
    env = {**os.environ, "KVCHAT_DATA_DIR": str(data), "QT_QPA_PLATFORM": "offscreen"}
    out = subprocess.run(
        [sys.executable, "-m", "desktop", "--check", "--model", str(demo_model_dir)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss < 3 * 1024 * 1024  # KiB


def test_markdown_nested_past_the_limit_is_plain_text():
    from desktop.outside_text import MARKDOWN_DEPTH, too_big_for_markdown

    deep = MARKDOWN_DEPTH + 1
    assert "nests deeper" in too_big_for_markdown(">" * deep + " a quote in a quote in …")
    assert "nests deeper" in too_big_for_markdown("\n".join("  " * i + "- level" for i in range(deep + 1)))
    assert too_big_for_markdown("> a quote\n\n- a list\n  - in a list\n    - and one more") is None
