"""What the GUI tests do as a person does: type and send, read the panel."""

from PySide6.QtCore import Qt


def send(qtbot, w, spin_loop, text, timeout=120):
    """Type `text`, click Send, wait for the reply's last event and return it."""
    got = []
    w.replyFinished.connect(got.append)
    qtbot.keyClicks(w.composer, text)
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: got, timeout)
    w.replyFinished.disconnect(got.append)
    return got[0]


def edit(qtbot, w, spin_loop, view, text, timeout=120):
    """Edit message `view` to `text` with its Edit and Save buttons, wait for the reply and return its last event."""
    got = []
    w.replyFinished.connect(got.append)
    qtbot.mouseClick(view.editButton, Qt.LeftButton)
    view.editor.setPlainText(text)
    qtbot.mouseClick(view.saveButton, Qt.LeftButton)
    spin_loop(lambda: got, timeout)
    w.replyFinished.disconnect(got.append)
    return got[0]


def panel(w, name):
    """The text the panel shows in row `name`."""
    return w.statsPanel.values[name].text()
