"""What the GUI tests do as a person does: type and send, read the panel."""

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QApplication, QFileDialog, QLineEdit

BUDGET = "I am planning a trip to Chengdu for 3 nights. My budget is 600 yuan."  # the demo's edit, before
BUDGET_EDITED = BUDGET.replace("600", "750")  # and after


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
    """The text the panel shows in row `name` (without the places it may wrap a long word)."""
    return w.statsPanel.values[name].text().replace("\u200b", "")


def send_then_edit(qtbot, w, spin_loop):
    """The demo's path: send BUDGET, then edit it to BUDGET_EDITED (a second branch); the edit's last event."""
    send(qtbot, w, spin_loop, BUDGET)
    return edit(qtbot, w, spin_loop, w.transcript.views[0], BUDGET_EDITED)


def save_as(button, folder, kind: str, name: str) -> None:
    """Click `button`, and in the save dialog it opens choose the file type `kind`, the folder and the `name`, as a
    person does (the name typed without an extension), then Save."""

    def answer():
        d = QApplication.activeModalWidget()
        if not isinstance(d, QFileDialog):
            QTimer.singleShot(20, answer)
            return
        d.setDirectory(str(folder))
        d.selectNameFilter(kind)
        d.filterSelected.emit(kind)
        d.findChild(QLineEdit, "fileNameEdit").setText(name)
        d.accept()

    QTimer.singleShot(20, answer)
    button.click()
