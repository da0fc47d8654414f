"""A conversation that outgrows the cache in the real window: under the default policy (truncate the middle)
Send goes on, the meter says beforehand how many messages will be left out, the panel says how many were, the
transcript marks what the model no longer saw and the context map marks where the cache was cut; another
policy chosen in Settings for this conversation leaves out the oldest turns instead."""

from conversations import question
from gui import panel, send
from PySide6.QtCore import Qt

from desktop.core.settings import DEFAULT_OVERFLOW
from desktop.settings_dialog import SettingsDialog
from engine.events import Finished


def marked(w) -> list[int]:
    """The branch positions of the messages marked as not seen by the model."""
    return [k for k, v in enumerate(w.transcript.views) if v.leftOutLabel.isVisibleTo(w)]


def test_a_conversation_past_the_capacity_goes_on_and_shows_what_was_left_out(qtbot, make_window, spin_loop,
                                                                                demo_model_dir):  # fmt: skip
    w = make_window(demo_model_dir, capacity=200, max_new_tokens=16)
    assert DEFAULT_OVERFLOW == "truncate-middle" and w.chat.settings_for().policy == DEFAULT_OVERFLOW
    final = None
    for i in range(12):
        final = send(qtbot, w, spin_loop, question(i)["content"])
        assert isinstance(final, Finished), final
        if final.reuse.dropped_messages:
            break
    r = final.reuse
    assert r.dropped_messages and r.overflow == "truncate-middle"
    assert "when the cache is full: truncate the middle" in w.conversationSettingsLabel.text()
    n = len(r.dropped_messages)
    assert panel(w, "droppedValue") == f"{n:,} messages, {r.dropped_positions:,} positions (truncate the middle)"
    assert "left out to fit the cache" in panel(w, "reuseReasonValue")
    # No system prompt here: request message k is the branch's message k. The first turn stays, the middle goes.
    assert marked(w) == list(r.dropped_messages) and 0 not in marked(w) and 1 not in marked(w)
    note = w.transcript.views[r.dropped_messages[0]].leftOutLabel.text()
    assert note == "Not seen by the model for the last reply: left out to fit the cache (truncate the middle)"
    assert w.transcript.views[-2].leftOutLabel.isHidden()  # the last message is always seen
    m = w.chat.cache_map
    assert m.first_invalidated == r.first_invalidated_position and [x for _, _, x in m.origins()][:2] == [
        "kept",
        "computed",
    ]  # the first turn's positions kept, the cache cut where the first left-out turn began
    assert len(m.spans) == len(w.chat.branch()) - 1 - n  # the map's messages are those the model saw

    # Before the next Send the meter says what it will leave out.
    probed = []
    w.conversationProbed.connect(probed.append)
    qtbot.keyClicks(w.composer, "And one more question about the pandas?")
    spin_loop(lambda: probed and probed[-1].get("next_dropped"))
    assert "messages left out (truncate the middle)" in w.contextMeter.text() and w.contextMeter.level == "near"

    # Drop the oldest instead, for this conversation: the first turn goes now.
    dlg = SettingsDialog(w.chat.settings_for(), w.db_path, w)
    assert dlg.overflow.currentData() == "truncate-middle" and "(default)" in dlg.overflow.currentText()
    dlg.overflow.setCurrentIndex(dlg.overflow.findData("drop-oldest"))
    w.apply_settings(dlg.result_settings(), conversation=True)
    assert w.store.conversation(w.chat.current_cid).settings["overflow"] == "drop-oldest"
    final = send(qtbot, w, spin_loop, "")
    r = final.reuse
    assert isinstance(final, Finished) and r.overflow == "drop-oldest" and r.dropped_messages[:2] == (0, 1)
    assert marked(w) == list(r.dropped_messages) and panel(w, "droppedValue").endswith("(drop the oldest messages)")
    qtbot.mouseClick(w.transcript.views[1], Qt.LeftButton)  # an earlier reply: its own figures, nothing left out
    spin_loop(lambda: panel(w, "droppedValue") == "nothing (it fit)", 5)
