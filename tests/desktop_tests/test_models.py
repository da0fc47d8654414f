"""Models in the chat: the bundled demo model is always in the Models dialog and loads back; the model in use is
shown above the conversation, with a quick switch to the recent ones; a switch mid-conversation is marked in the
transcript where the new model's first reply starts; Regenerate with… makes a new branch labelled with its model,
and each branch keeps its own model's figures."""

from gui import BUDGET, send
from PySide6.QtCore import Qt

from desktop.model_switch import model_name
from desktop.models_dialog import COLUMNS

STATUS = COLUMNS.index("Status")  # the Models dialog's status column


def test_the_demo_model_is_listed_and_loads_back(qtbot, make_window, spin_loop, llama_dir, tmp_path, monkeypatch):
    for var in ("HF_HOME", "HF_HUB_CACHE", "OLLAMA_MODELS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # nothing else on this machine
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home" / ".cache"))
    w = make_window(llama_dir)
    assert w.facts["name"] == llama_dir.name and w.modelSwitch.combo.currentText() == llama_dir.name
    dlg = w.open_models_dialog()
    with qtbot.waitSignal(dlg.scanned, timeout=60000):
        pass
    t = dlg.table
    assert t.rowCount() == 1 and t.item(0, 0).text() == "kvchat-demo" and t.item(0, STATUS).text() == "ready"
    assert "the bundled demo model is always here" in dlg.note.text()
    ready = []
    w.modelReady.connect(ready.append)
    at = t.visualItemRect(t.item(0, 0)).center()
    qtbot.mouseClick(t.viewport(), Qt.LeftButton, pos=at)
    qtbot.mouseDClick(t.viewport(), Qt.LeftButton, pos=at)
    spin_loop(lambda: ready, 120)
    assert w.facts["name"] == "kvchat-demo" and w.settings.model.path is None
    combo = w.modelSwitch.combo
    items = [combo.itemText(k) for k in range(combo.count())]
    assert items == [model_name(None), llama_dir.name, "Other models…"]  # the one in use, then the recent one


def test_a_switch_mid_conversation_is_marked_and_regenerate_with_makes_a_labelled_branch(
    qtbot, make_window, spin_loop, demo_model_dir, llama_dir
):
    w = make_window(demo_model_dir, max_new_tokens=8)
    first = send(qtbot, w, spin_loop, BUDGET)
    ready = []
    w.modelReady.connect(ready.append)
    w.switch_model(str(llama_dir))  # as the switcher's pick does (its item's data)
    spin_loop(lambda: ready, 120)
    assert w.modelSwitch.combo.currentText() == llama_dir.name
    second = send(qtbot, w, spin_loop, "And for 750 yuan?")
    assert second.reuse.first_invalidated_position == 0 and "cache dropped" in second.reuse.reason
    views = w.transcript.views
    assert "kvchat-demo" in views[1].modelLabel.text() and llama_dir.name in views[3].modelLabel.text()
    assert views[1].modelChangeLabel.isHidden() and views[3].modelChangeLabel.isVisibleTo(w)
    assert views[3].modelChangeLabel.text().startswith(f"Model changed: kvchat-demo → {llama_dir.name}")
    assert first.text in views[1].message.content  # the demo's reply stays as it was

    # Regenerate with the demo model: the last reply made again, a new branch, labelled with its model.
    menu = w.regenerateWith.menu()
    items = [a.text() for a in menu.actions() if not a.isSeparator()]
    assert items == [*(f"{n} alternatives" for n in (2, 3, 4)), f"{model_name(None)} (and keep it loaded)"]
    assert "stays on that model" in w.regenerateWith.toolTip()  # it says it switches the app for good
    w.regenerateWith.setEnabled(False)
    off = w.regenerateWith.grab().toImage()
    w.regenerateWith.setEnabled(True)
    assert off != w.regenerateWith.grab().toImage()  # disabled, it looks it
    done = []
    w.replyFinished.connect(done.append)
    menu.actions()[-1].trigger()
    spin_loop(lambda: done, 120)
    views = w.transcript.views
    last = views[-1]
    assert w.facts["name"] == "kvchat-demo" and last.branchLabel.text() == "2/2"
    assert "kvchat-demo" in last.modelLabel.text() and last.modelChangeLabel.isHidden()  # demo after demo
    assert "kvchat-demo" in last.footerLabel.text()
    assert w.regenerateHint.isHidden()  # another model: not "the same reply again" under greedy sampling
    qtbot.mouseClick(last.prevButton, Qt.LeftButton)  # the other branch keeps its model and its figures
    spin_loop(lambda: w.transcript.views[-1].branchLabel.text() == "1/2", 10)
    other = w.transcript.views[-1]
    assert llama_dir.name in other.modelLabel.text() and llama_dir.name in other.footerLabel.text()
    assert other.modelChangeLabel.isVisibleTo(w)
