"""A long conversation in the real window: it opens with its last messages, earlier ones come on
request (button, Ctrl+Up, a search's match), and sending in it keeps the views it has."""

import threading

from PySide6.QtCore import Qt

from desktop.branch_view import EARLIER, WINDOW
from desktop.core.store import Store

N = 150  # messages: more than three windows


def long_conversation(data, n=N):
    """A conversation of `n` messages (user and assistant in turn, "message 0" … "message n-1"), the
    reply at index 3 edited once (so it has two versions, the second shown), and a short one."""
    st = Store(data / "kvchat.db")
    conv = st.new_conversation("Long")
    parent, ids = None, []
    for i in range(n):
        m = st.add_message(conv.id, parent, "user" if i % 2 == 0 else "assistant", f"message {i} word{i}x")
        ids.append(m.id)
        parent = m.id
        if i == 3:  # a second version of this reply, on the branch shown
            m = st.add_message(conv.id, ids[2], "assistant", "message 3 word3x, the second version")
            ids[3] = parent = m.id
    st.set_leaf(conv.id, parent)
    short = st.new_conversation("Short")
    u = st.add_message(short.id, None, "user", "Hello")
    st.add_message(short.id, u.id, "assistant", "Hi")
    st.set_leaf(short.id, u.id + 1)
    st.close()
    return conv.id, short.id, ids


def test_a_long_conversation_opens_with_its_last_messages_and_shows_earlier_ones_on_request(
    qtbot, make_window, spin_loop, demo_model_dir, tmp_path
):
    from gui import send

    data = tmp_path / "data"
    data.mkdir()
    cid, short, ids = long_conversation(data)
    w = make_window(demo_model_dir, data=data)
    readers = []
    read = w.store._read_kept
    w.store._read_kept = lambda *a: readers.append(threading.current_thread() is threading.main_thread()) or read(*a)
    w.select_conversation(cid)
    tr = w.transcript
    assert 0 < len(tr.views) < WINDOW  # the last few at once, drawn before the rest is built
    assert [v.message.id for v in tr.views] == ids[N - len(tr.views) :]
    button = tr.findChild(type(tr.earlierButton), "earlierButton")
    assert tr.more and button.text() == "Show earlier messages"  # the branch is being read: how many, not yet
    qtbot.waitUntil(lambda: len(tr.views) == WINDOW and not tr.more)  # the rest, a few per turn of the loop
    assert readers == [False]  # read on another thread, the window drawing meanwhile
    assert tr.first == N - WINDOW
    assert [v.message.id for v in tr.views] == ids[-WINDOW:]  # the last ones, in order
    assert button.isVisible() and f"{N - WINDOW:,} not shown" in button.text()

    kept = tr.views[-1]
    qtbot.mouseClick(button, Qt.LeftButton)  # earlier ones, the ones shown kept
    assert len(tr.views) == WINDOW + EARLIER and tr.first == N - WINDOW - EARLIER and tr.views[-1] is kept
    assert [v.message.id for v in tr.views] == ids[-WINDOW - EARLIER :]

    w.activateWindow()
    qtbot.waitUntil(lambda: w.isActiveWindow())
    tr.views[0].setFocus()  # the first shown (prepended views are shown at once: focusable)
    assert tr.views[0].hasFocus()
    qtbot.keyClick(tr.views[0], Qt.Key_Up, Qt.ControlModifier)  # Ctrl+Up at the top: earlier ones, and up one
    assert tr.first == N - WINDOW - 2 * EARLIER
    qtbot.waitUntil(lambda: w.focusWidget() is tr.view_for(ids[tr.first + EARLIER - 1]))

    w.select_conversation(short)  # another conversation, and back: the last window again, kept
    assert [v.message.content for v in tr.views] == ["Hello", "Hi"] and not button.isVisible()
    w.select_conversation(cid)
    assert not tr.more and readers == [False]
    qtbot.waitUntil(lambda: tr.first == N - WINDOW)

    w.search.setText("word5x")  # a search's match far above the window: the transcript reaches back to it
    w.conversationList.itemClicked.emit(w.conversationList.item(0))  # as a click on it
    found = tr.view_for(ids[5])
    assert found is not None and tr.first == 5 and found.property("found") is True
    qtbot.waitUntil(lambda: button.height() > 0)  # laid out again
    qtbot.mouseClick(button, Qt.LeftButton)  # the rest: from the start, the reply with two versions among them
    assert tr.first == 0 and not button.isVisible()
    edited = tr.view_for(ids[3])
    assert edited.branchLabel.text() == "2/2" and edited.branchLabel.isVisible()
    assert [v.message.id for v in tr.views] == ids[tr.first :]
    w.search.clear()

    shown = list(tr.views)  # sending keeps every view and adds the new two
    send(qtbot, w, spin_loop, "One more")
    assert tr.views[: len(shown)] == shown and len(tr.views) == len(shown) + 2
    assert readers == [False]  # the branch kept follows what is written, not read again


def test_a_branch_read_that_ends_before_its_callback_is_added_still_draws_the_tail_first(
    qtbot, make_window, spin_loop, demo_model_dir, tmp_path
):
    """A loaded machine can finish the thread's read before the window adds its callback (the callback then runs at
    once, on the GUI thread): the conversation still opens from its tail, and the rest lands on a later turn."""
    data = tmp_path / "data"
    data.mkdir()
    cid, short, ids = long_conversation(data)
    w = make_window(demo_model_dir, data=data)
    read_later = w.store.read_later

    def done_at_once(c):
        fut = read_later(c)
        fut.result(timeout=30)  # the read is over before add_done_callback
        return fut

    w.store.read_later = done_at_once
    w.select_conversation(cid)
    tr = w.transcript
    assert 0 < len(tr.views) < WINDOW and tr.more  # the tail, drawn first
    qtbot.waitUntil(lambda: len(tr.views) == WINDOW and not tr.more)
    assert [v.message.id for v in tr.views] == ids[-WINDOW:]


def test_what_is_done_while_a_long_branch_is_being_read_lands_in_its_place(
    qtbot, make_window, spin_loop, demo_model_dir, tmp_path
):
    """Sending, or asking for earlier messages, before the thread's read is back: the branch is read
    at once then, and the views drawn from the tail keep their places in it."""
    from gui import send

    data = tmp_path / "data"
    data.mkdir()
    cid, short, ids = long_conversation(data)
    w = make_window(demo_model_dir, data=data)
    w.select_conversation(cid)
    tr = w.transcript
    assert tr.more
    w.show_earlier()  # before the read is back
    assert not tr.more and tr.first == N - len(tr.views) and [v.message.id for v in tr.views] == ids[tr.first :]
    w.select_conversation(short)
    w.store._branches.clear()  # as if never read
    w.select_conversation(cid)
    assert tr.more
    send(qtbot, w, spin_loop, "One more")
    qtbot.waitUntil(lambda: not tr.more and len(tr.views) >= WINDOW)
    path = w.store.branch(cid)
    assert len(path) == N + 2 and [v.message.id for v in tr.views] == [m.id for m in path[tr.first :]]


def test_only_the_latest_probe_is_answered(qtbot):
    """Switching through long conversations asks the worker for each one's cached share; the questions
    a later one makes stale are dropped, not tokenized ahead of the person's next reply."""
    import threading

    from PySide6.QtCore import Qt

    from desktop.worker import EngineWorker

    class Session:
        asked = []

        def cached_positions(self, request):
            self.asked.append(request.messages)
            return {"positions": 1}

    w = EngineWorker()
    w.engine.session = Session()
    answered = []
    w.probed.connect(lambda cid, seen: answered.append(cid), Qt.DirectConnection)
    release = threading.Event()
    w.engine.call(release.wait, 30)  # the engine thread busy with a reply meanwhile
    for cid in (1, 2, 3):
        w.probe(cid, [{"role": "user", "content": f"conversation {cid}"}])
    release.set()
    w.engine.call(lambda: None).result(30)
    conversation = [{"role": "user", "content": "conversation 3"}]
    assert answered == [3] and Session.asked == [conversation, [*conversation, {"role": "user", "content": ""}]]
    w.probe(3, conversation, "Hello")  # typing: only the draft changed, the conversation is not asked again
    assert w.close()
    assert Session.asked[2:] == [[*conversation, {"role": "user", "content": "Hello"}]] and answered == [3, 3]


def test_history_bench_runs_end_to_end():
    """The long-conversation measurement runs (its figures are benchmark figures, not asserted)."""
    import json
    import os
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "desktop.tools.history_bench", "--messages", "60", "--repeats", "1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "QT_QPA_PLATFORM": "offscreen"},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (report,) = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["messages"] == 60
    for step in ("open_empty", "open_full", "to_long", "to_short", "send_long"):
        assert report[step]["ms_p50"] > 0
    for step in ("to_long", "to_short", "send_long"):  # the GUI loop's stall, measured in each step
        assert 0 <= report[step]["stall_ms_p50"] <= report[step]["stall_ms_max"] < 60_000
    assert report["open_full"]["stall_ms_max"] is None  # window openings are timed, their stall is not
