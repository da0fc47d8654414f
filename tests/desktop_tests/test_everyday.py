"""The everyday flow as a new user met it: the branch arrows, the capacity setting, a Send that cannot fit,
exports, hovering tokens, the window's size, the sidebar and the panel after a change (the real window)."""

import dataclasses
import html
import json
import os
from pathlib import Path

from gui import BUDGET, edit, panel, save_as, send
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

LONG_EDIT = BUDGET + " I would like to see pandas, eat hotpot, walk the old streets, and take the train back on Sunday."


def probed_now(qtbot, w, spin_loop):
    """Wait for the answer to the probe the window asks next; it is returned."""
    got = []
    w.conversationProbed.connect(got.append)
    spin_loop(lambda: got and got[-1].get("asked") == w._asked and not w.probeTimer.isActive())
    w.conversationProbed.disconnect(got.append)
    return got[-1]


def test_the_branch_arrows_bring_back_that_branchs_meter_and_cached_rows(qtbot, make_window, spin_loop, demo_model_dir):
    w = make_window(demo_model_dir, max_new_tokens=4)
    send(qtbot, w, spin_loop, BUDGET)
    probed_now(qtbot, w, spin_loop)
    first = w.contextMeter.text(), panel(w, "conversationCachedValue")
    edit(qtbot, w, spin_loop, w.transcript.views[0], LONG_EDIT)
    probed_now(qtbot, w, spin_loop)
    second = w.contextMeter.text(), panel(w, "conversationCachedValue")
    assert second[0] != first[0]
    qtbot.mouseClick(w.transcript.views[0].prevButton, Qt.LeftButton)  # back to branch 1, nothing typed
    of = first[1].split(" of ")[1]  # "28 of 30 positions (working cache)": branch 1's length (its share cached
    # now is what branch 2 left in the working cache: their common prefix)
    qtbot.waitUntil(lambda: (w.contextMeter.text(), of in panel(w, "conversationCachedValue")) == (first[0], True))
    qtbot.mouseClick(w.transcript.views[0].nextButton, Qt.LeftButton)
    qtbot.waitUntil(lambda: w.contextMeter.text() == second[0], timeout=5000)


def test_the_capacity_set_back_to_the_model_default_is_the_default(qtbot, make_window, spin_loop, demo_model_dir):
    w = make_window(demo_model_dir)
    default = w.facts["capacity"]
    loaded = []
    w.modelReady.connect(loaded.append)
    w.apply_settings(dataclasses.replace(w.settings, model=dataclasses.replace(w.settings.model, capacity=384)))
    spin_loop(lambda: loaded)
    assert w.facts["capacity"] == 384 and "capacity 384 positions" in w.statusLine.text()
    loaded.clear()
    w.apply_settings(dataclasses.replace(w.settings, model=dataclasses.replace(w.settings.model, capacity=0)))
    spin_loop(lambda: loaded)
    assert w.facts["capacity"] == default and f"capacity {default:,} positions" in w.statusLine.text()


def test_a_send_over_the_capacity_under_stop_is_refused_before_anything_is_stored(
    qtbot, make_window, spin_loop, demo_model_dir
):
    """Typed and sent at once (before the meter's reading of the draft): the Send waits for it, refuses with
    the reason, keeps the draft and stores nothing; after a restart there is nothing either."""
    w = make_window(demo_model_dir, capacity=64, max_new_tokens=16, overflow="stop")
    send(qtbot, w, spin_loop, "Hi")
    cid, before = w.chat.current_cid, [m.id for m in w.store.branch(w.chat.current_cid)]
    draft = "word " * 80
    w.composer.setPlainText(draft)
    qtbot.keyClick(w.composer, Qt.Key_Return)  # the probe's timer has not fired: the Send asks and waits
    spin_loop(lambda: w.banner.isVisible())
    assert "Not sent" in w.banner.text() and "over the capacity of 64" in w.banner.text()
    assert w.composer.toPlainText() == draft and not w.generating and w._task.done()
    assert [m.id for m in w.store.branch(cid)] == before and not w.chat.can_continue()
    w.composer.setPlainText("Hi again")  # one that fits is sent as before
    assert isinstance(send(qtbot, w, spin_loop, ""), object) and len(w.store.branch(cid)) == len(before) + 2


def test_export_writes_the_file_type_chosen_in_the_dialog(qtbot, make_window, spin_loop, demo_model_dir, tmp_path):
    w = make_window(demo_model_dir, max_new_tokens=4, system_prompt="Be brief.", temperature=0.5)
    send(qtbot, w, spin_loop, BUDGET)

    save_as(w.exportButton, tmp_path, "JSON, every branch, importable (*.json)", "trip")
    data = json.loads((tmp_path / "trip.json").read_text(encoding="utf-8"))
    assert data["format"] == "kvchat-conversation" and not (tmp_path / "trip").exists()
    assert data["settings"]["system_prompt"] == "Be brief." and data["settings"]["temperature"] == 0.5
    save_as(w.exportButton, tmp_path, "Markdown, the branch shown (*.md)", "trip notes")
    text = (tmp_path / "trip notes.md").read_text(encoding="utf-8")
    assert text.startswith(f"# {BUDGET}\n")  # the title whole, not the list's cut one


def coloured_reply(qtbot, make_window, spin_loop, demo_model_dir):
    """The demo's reply to BUDGET, its tokens coloured by probability: the window and the reply's token view."""
    w = make_window(demo_model_dir, max_new_tokens=24)
    send(qtbot, w, spin_loop, BUDGET)
    w.tokenColours.setCurrentIndex(w.tokenColours.findData("probability"))
    return w, w.transcript.views[1].tokenView


def test_the_pointer_picks_the_token_under_it_to_the_right_edge_of_its_last_character(
    qtbot, make_window, spin_loop, demo_model_dir
):
    from PySide6.QtCore import QPoint
    from PySide6.QtGui import QTextCursor

    w, view = coloured_reply(qtbot, make_window, spin_loop, demo_model_dir)
    qtbot.waitUntil(lambda: view.isVisible() and bool(view.at))

    def edge(position: int, share: float) -> QPoint:
        c = QTextCursor(view.document())
        c.setPosition(position)
        a = view.cursorRect(c)
        c.setPosition(position + 1)
        b = view.cursorRect(c)
        return QPoint(int(a.x() + share * (b.x() - a.x())), a.center().y()) if a.top() == b.top() else None

    checked = 0
    for k, i in enumerate(view.at[:-1]):
        last = view.starts[k + 1] - 1  # the token's last character
        right, left = edge(last, 0.8), edge(view.starts[k], 0.2)
        if right is None or left is None or right.x() <= left.x():
            continue  # a wrapped line, or a character with no width
        assert (view.index_at(right), view.index_at(left)) == (i, i)
        checked += 1
    assert checked >= 10
    k = len(view.at) // 2
    qtbot.mouseClick(view.viewport(), Qt.LeftButton, pos=edge(view.starts[k + 1] - 1, 0.8))
    assert view.current == view.at[k]


def cut_labels(w):
    """The panel's word-wrapped labels drawn shorter than their words need (the last lines cut off)."""
    from PySide6.QtWidgets import QLabel

    labels = w.statsPanel.widget().findChildren(QLabel)
    return [
        x.objectName() for x in labels if x.wordWrap() and x.isVisible() and x.height() < x.heightForWidth(x.width())
    ]


def test_the_window_fits_1000_by_700_with_tokens_coloured_and_a_long_model_name(
    qtbot, make_window, spin_loop, smollm2_gguf
):
    w = make_window(smollm2_gguf, max_new_tokens=24)
    w.resize(1000, 700)
    send(qtbot, w, spin_loop, BUDGET)
    for mode in ("off", "probability", "entropy"):
        w.tokenColours.setCurrentIndex(w.tokenColours.findData(mode))
        w.resize(1000, 700)
        qtbot.wait(50)
        assert (w.width(), w.height()) == (1000, 700), mode
        assert not w.transcript.horizontalScrollBar().isVisible()  # every message's row in view
        assert w.statsPanel.width() <= w.statsPanel.minimumWidth() + 10
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in w.modelSwitch.combo.toolTip()  # cut in the box, whole here
    label = w.transcript.views[1].modelLabel  # beside "Assistant": cut with "…", not mid-letter, whole in its tooltip
    assert label.fontMetrics().horizontalAdvance(label.text()) > label.contentsRect().width()
    assert label.shown() in ("", label.shown()[:-1] + "…") and label.shown() != label.text()
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in label.toolTip()
    from desktop.text_views import ElidedLabel

    alone = ElidedLabel("· SmolLM2-135M-Instruct.Q4_1.gguf")
    qtbot.addWidget(alone)
    widths = {}
    for px in (12, 110, 1000):
        alone.resize(px, 20)
        widths[px] = alone.shown()
    assert widths[12] == "" and widths[110].endswith("…") and len(widths[110]) > 4 and widths[1000] == alone.text()


def test_after_a_model_switch_the_panel_shows_every_line_of_its_words(qtbot, make_window, spin_loop, demo_model_dir,
                                                                      smollm2_gguf):  # fmt: skip
    """A switch's burst of changes relaid the panel after its labels were last checked, leaving four of them cut
    in about a third of quick switches (0.3 s); each of four switches back and forth, after a reply, is checked."""
    w = make_window(demo_model_dir, max_new_tokens=8)
    loaded = []
    w.modelReady.connect(loaded.append)
    for model in (smollm2_gguf, demo_model_dir, smollm2_gguf, demo_model_dir):
        send(qtbot, w, spin_loop, BUDGET)
        loaded.clear()
        w.switch_model(str(model))
        spin_loop(lambda: loaded)
        assert "cache dropped" in w.statsPanel.cacheMap.caption.text()
        qtbot.waitUntil(lambda: not cut_labels(w), timeout=2000)
        qtbot.wait(300)  # and it stays so
        assert not cut_labels(w), model.name


def test_the_greedy_hint_is_one_line_under_the_buttons_and_stays_with_its_conversation(
    qtbot, make_window, spin_loop, demo_model_dir
):
    w = make_window(demo_model_dir, max_new_tokens=4)
    w.resize(1000, 700)
    send(qtbot, w, spin_loop, BUDGET)
    got = []
    w.replyFinished.connect(got.append)
    qtbot.mouseClick(w.regenerateButton, Qt.LeftButton)
    spin_loop(lambda: got)
    qtbot.wait(50)
    assert w.regenerateHint.isVisible()
    assert w.regenerateHint.height() <= 4 * w.regenerateHint.fontMetrics().height()  # three lines, not fifteen
    assert w.transcript.height() >= 250
    qtbot.mouseClick(w.newButton, Qt.LeftButton)
    assert not w.regenerateHint.isVisible()


def test_a_click_in_the_list_opens_the_conversation_under_the_pointer(qtbot, make_window, spin_loop, demo_model_dir):
    """After a Regenerate in the older conversation (its time now the newest), a click on the other one opens
    that one and highlights it: the list is not re-sorted between the press and the release."""
    w = make_window(demo_model_dir, max_new_tokens=4)
    send(qtbot, w, spin_loop, "The older conversation")
    older = w.chat.current_cid
    qtbot.mouseClick(w.newButton, Qt.LeftButton)
    send(qtbot, w, spin_loop, "The newer conversation")
    newer = w.chat.current_cid
    lst = w.conversationList

    def click_on(cid):  # as a hand clicks: press, the pointer moves a pixel, release
        from PySide6.QtCore import QPoint

        row = next(i for i in range(lst.count()) if lst.item(i).data(Qt.UserRole) == cid)
        at = lst.visualItemRect(lst.item(row)).center()
        qtbot.mousePress(lst.viewport(), Qt.LeftButton, pos=at)
        qtbot.mouseMove(lst.viewport(), at + QPoint(1, 1))
        qtbot.mouseRelease(lst.viewport(), Qt.LeftButton, pos=at + QPoint(1, 1))

    click_on(older)
    assert w.chat.current_cid == older
    got = []
    w.replyFinished.connect(got.append)
    qtbot.mouseClick(w.regenerateButton, Qt.LeftButton)
    spin_loop(lambda: got)
    click_on(newer)
    qtbot.wait(50)
    assert w.chat.current_cid == newer and lst.currentItem().data(Qt.UserRole) == newer
    assert "newer" in w.transcript.views[0].message.content


def test_after_a_fork_the_header_footer_panel_and_confidence_count_the_same_tokens(
    qtbot, make_window, spin_loop, demo_model_dir
):
    w, view = coloured_reply(qtbot, make_window, spin_loop, demo_model_dir)
    kept = w.transcript.views[1].message.trace["tokens"]
    i = next(k for k in range(3, len(kept)) if len(kept[k]["top"]) > 1)
    view.move_to(i)
    button = w.transcript.views[1].forkRow.buttons[0]
    got = []
    w.replyFinished.connect(got.append)
    qtbot.mouseClick(button, Qt.LeftButton)
    spin_loop(lambda: got)
    forked = w.transcript.views[1]
    total = len(forked.message.trace["tokens"])
    made = got[0].trace["tokens"]
    assert total > made  # the tokens before the fork were kept, not made again
    assert forked.tokensLabel.text() == f"{total} tokens"
    assert forked.footerLabel.text().startswith(f"{total} tokens ({made} made now) · ")
    assert panel(w, "tokensValue") == f"{total} ({made} made now)"
    assert f"over {total} tokens" in panel(w, "meanLogprobValue")


def test_editing_an_early_message_shows_its_header_and_editor_not_the_end(
    qtbot, make_window, spin_loop, demo_model_dir
):
    w = make_window(demo_model_dir, max_new_tokens=48)
    w.resize(1000, 700)
    w.show()
    for text in (BUDGET, "What should I eat?", "And where should I stay?", "How do I get there?"):
        send(qtbot, w, spin_loop, text)
    bar = w.transcript.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0 and bar.value() == bar.maximum())  # following the end
    first = w.transcript.views[0]
    qtbot.mouseClick(first.editButton, Qt.LeftButton)
    top = first.mapTo(w.transcript.widget(), first.rect().topLeft()).y()
    height = w.transcript.viewport().height()
    qtbot.waitUntil(lambda: bar.value() <= top)  # the "You" header in sight
    editor = first.editor.mapTo(w.transcript.widget(), first.editor.rect().topLeft()).y()
    assert editor + 40 <= bar.value() + height and w.focusWidget() is first.editor  # and the editor's first lines
    QApplication.processEvents()
    assert bar.value() <= top  # it stays there as the layout settles


def test_kvchat_help_names_the_data_folder_and_a_missing_x11_library_is_one_install_line(tmp_path):
    """`kvchat --help` says where the data lives; where Qt's xcb support cannot load for a missing system
    library, the app says which and the one apt line, instead of Qt's abort naming only its plugin."""
    import shutil
    import subprocess
    import sys

    from desktop.platform_libs import INSTALL, advice, uses_xcb, xcb_problem

    shown = subprocess.run([sys.executable, "-m", "desktop", "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "KVCHAT_DATA_DIR" in shown.stdout
    said = advice("libxcb-cursor.so.0: cannot open shared object file: No such file or directory")
    assert "libxcb-cursor.so.0 (package libxcb-cursor0)" in said and INSTALL in said and "libxcb-cursor0" in INSTALL
    assert advice("invalid ELF header") is None
    assert uses_xcb({"DISPLAY": ":0"}, "linux") and uses_xcb({"DISPLAY": ":0", "QT_QPA_PLATFORM": "xcb"}, "linux")
    assert not uses_xcb({"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"}, "linux")
    assert not uses_xcb({"DISPLAY": ":0", "WAYLAND_DISPLAY": "wayland-0"}, "linux") and not uses_xcb({}, "linux")
    assert not uses_xcb({"DISPLAY": ":0"}, "darwin")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return
    # A library that links one which is then gone: the loader's own error, read as a person needs it.
    (tmp_path / "ghost.c").write_text("int ghost(void) { return 1; }\n")
    (tmp_path / "needs.c").write_text("int ghost(void);\nint needs(void) { return ghost(); }\n")
    subprocess.run([cc, "-shared", "-fPIC", "-o", tmp_path / "libghost.so", tmp_path / "ghost.c"], check=True)
    subprocess.run([cc, "-shared", "-fPIC", "-o", tmp_path / "libneeds.so", tmp_path / "needs.c",
                    f"-L{tmp_path}", "-lghost"], check=True)  # fmt: skip
    (tmp_path / "libghost.so").unlink()
    problem = xcb_problem(tmp_path / "libneeds.so")
    assert problem is not None and "needs libghost.so, which is not installed" in problem
    assert xcb_problem(tmp_path / "nothing-here.so") is None


def test_the_small_things_read_right_figures_tooltips_arrows_and_long_status_messages(
    qtbot, make_window, demo_model_dir
):
    import re

    from PySide6.QtWidgets import QStatusBar

    from desktop.core.panel_words import fmt_figure, ttft_parts
    from desktop.style import style_sheet

    assert fmt_figure(-0.0004) == "0.000" and fmt_figure(-0.5) == "-0.500" and fmt_figure(-0.004, 2) == "0.00"
    parts = {"queue": 0.1, "template": 0.4, "prefill": None, "1st token": None}
    assert ttft_parts(parts, True) == "queue 0.1 · template 0.4 ms · not reached: prefill, 1st token"
    assert ttft_parts(parts, False) == "queue 0.1 · template 0.4 · prefill — · 1st token — ms"
    for theme in ("dark", "light"):  # the spin boxes' arrows: images that are there, in each theme's colour
        sheet = style_sheet(theme)
        arrows = re.findall(r"url\(([^)]+)\)", sheet)
        assert "@STYLES@" not in sheet and len(arrows) == 4 and all(Path(a).is_file() for a in arrows)

    w = make_window(demo_model_dir)
    w.resize(1000, 700)
    w.show()
    qtbot.waitExposed(w)
    p = w.statsPanel
    for widget in (p.cacheBar, p.storeBar, p.storeTree, w.loadProgress, p.gapChart):
        assert len(html.unescape(widget.toolTip())) > 30, widget.objectName()
    p.gapChart.set_gaps([10.0, 10.0, 10.0, 12.0, 80.0])
    assert "the median (p50, 10.0 ms, yellow)" in html.unescape(p.gapChart.toolTip())
    said = "The model could not be loaded: " + "a reason that goes on " * 30
    bar = w.statusBar()
    bar.showMessage(said)
    shown = QStatusBar.currentMessage(bar)  # what is drawn: cut before the theme box
    assert shown.endswith("…") and bar.fontMetrics().horizontalAdvance(shown) < bar.width() - w.themeSwitch.width()
    assert bar.currentMessage() == said and bar.toolTip() == said  # and whole where it is asked for


def test_tab_follows_the_screen_and_the_message_box_has_the_focus_after_a_fork_and_a_restart(
    qtbot, make_window, spin_loop, demo_model_dir, tmp_path
):
    w = make_window(demo_model_dir, max_new_tokens=24)
    w.resize(1200, 800)
    w.activateWindow()
    qtbot.waitUntil(lambda: w.isActiveWindow())
    assert QApplication.focusWidget() is w.composer  # a fresh start: where a person types
    send(qtbot, w, spin_loop, BUDGET)
    stops = w.tab_stops()
    views = w.transcript.views
    order = [w.search, w.conversationList, w.newButton, w.modelSwitch.combo, w.tokenColours, views[0], views[1],
             w.regenerateButton, w.composer, w.sendButton]  # fmt: skip
    at = [stops.index(s) for s in order]
    assert at == sorted(at) and at[0] == 0 and stops[-1] is w.themeSwitch
    panel_stops = [i for i, s in enumerate(stops) if w.statsPanel.isAncestorOf(s)]
    assert panel_stops and at[-1] < min(panel_stops) and max(panel_stops) < len(stops) - 1
    assert not any(s.objectName() == "replyText" for s in stops)  # a paragraph is not a tab stop of its own
    w.activateWindow()  # the offscreen platform drops the active window while a reply streams
    qtbot.waitUntil(lambda: w.isActiveWindow())
    w.composer.setFocus()
    qtbot.keyClick(w.composer, Qt.Key_Tab)  # the real key, from the message box on
    assert QApplication.focusWidget() is w.sendButton
    qtbot.keyClick(w.sendButton, Qt.Key_Tab)
    assert QApplication.focusWidget() is stops[panel_stops[0]]
    w.search.setFocus()
    qtbot.keyClick(w.search, Qt.Key_Backtab, Qt.ShiftModifier)  # and back round from the first to the last
    assert QApplication.focusWidget() is w.themeSwitch

    # A fork from a token: the views are rebuilt, and the focus goes to the message box, not the search box.
    w.tokenColours.setCurrentIndex(w.tokenColours.findData("probability"))
    kept = w.transcript.views[1].message.trace["tokens"]
    i = next(k for k in range(1, len(kept)) if len(kept[k]["top"]) > 1)
    w.transcript.views[1].tokenView.move_to(i)
    row = w.transcript.views[1].forkRow
    done = []
    w.replyFinished.connect(done.append)
    qtbot.mouseClick(row.buttons[-1], Qt.LeftButton)
    spin_loop(lambda: done)
    w.activateWindow()
    qtbot.waitUntil(lambda: w.isActiveWindow())
    assert w.transcript.views[1].branchLabel.text() == "2/2" and QApplication.focusWidget() is w.composer
    w.close()
    again = make_window(demo_model_dir, data=tmp_path / "data")  # a restart on the same data
    again.activateWindow()
    qtbot.waitUntil(lambda: again.isActiveWindow())
    assert again.transcript.views and QApplication.focusWidget() is again.composer


def test_two_conversations_whose_titles_cut_the_same_are_told_apart_in_the_sidebar(
    qtbot, make_window, spin_loop, demo_model_dir
):
    w = make_window(demo_model_dir, max_new_tokens=4)
    send(qtbot, w, spin_loop, BUDGET)
    qtbot.mouseClick(w.newButton, Qt.LeftButton)
    send(qtbot, w, spin_loop, BUDGET.replace("600", "900"))  # the same first 48 characters: the same title
    qtbot.mouseClick(w.newButton, Qt.LeftButton)
    send(qtbot, w, spin_loop, "Hi")
    items = [w.conversationList.item(i) for i in range(w.conversationList.count())]
    title = BUDGET[:48] + "…"
    twins = [it.text() for it in items if it.text().startswith(title)]
    assert len(twins) == 2 and twins[0] != twins[1] and all(t.split("\n")[1].startswith("started ") for t in twins)
    assert [it.text() for it in items if it.text().startswith("Hi")] == ["Hi"]  # a title of its own: one line
    assert all(title in html.unescape(it.toolTip()) for it in items if it.text().startswith(title))


def test_the_model_is_warmed_up_at_load_and_the_status_bar_says_so(qtbot, make_window, spin_loop, demo_model_dir):
    w = make_window(demo_model_dir, max_new_tokens=4)
    assert w.facts["warm_up_ms"] > 0 and "warmed up in" in w.statusBar().currentMessage()
    first = send(qtbot, w, spin_loop, BUDGET)
    assert first.trace["computed"] == first.trace["prompt_tokens"]  # the warm-up left the working cache empty


def test_the_screenshot_tool_takes_every_picture_from_the_real_window(tmp_path):
    """`python -m desktop.tools.screenshots OUT`, offscreen: each picture written, the window at 1000×700."""
    import subprocess
    import sys

    from PySide6.QtGui import QImage

    run = subprocess.run([sys.executable, "-m", "desktop.tools.screenshots", str(tmp_path), "--new-tokens", "8"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    names = sorted(Path(line).name for line in run.stdout.split())
    assert names == sorted(["reply-footer-meter-dark-1000.png", "reply-footer-meter-light-1000.png",
                            "settings-sampling.png", "settings-sampling-light.png", "models-dialog.png",
                            "hub-offline.png"])  # fmt: skip
    shot = QImage(str(tmp_path / "reply-footer-meter-light-1000.png"))
    assert (shot.width(), shot.height()) == (1000, 700)
    dark = QImage(str(tmp_path / "reply-footer-meter-dark-1000.png"))
    assert dark.pixelColor(5, 690) != shot.pixelColor(5, 690)  # the two themes
