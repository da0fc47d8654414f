"""The prefix store's disk tier in the app: on by default in the data folder; after a restart, opening a
conversation says what a return costs (read against prefill, both measured), and its next reply reads the
conversation's positions back from disk; the panel's tree marks what is on disk; a budget of 0 turns it off."""

from conversations import long_conversation
from gui import panel, send

from desktop.cache_map_view import ORIGIN_COLOURS
from desktop.core.settings import DISK_FOLDER
from engine.events import Finished


def test_a_conversation_returns_from_disk_after_a_restart(qtbot, make_window, spin_loop, demo_model_dir, tmp_path):
    data = tmp_path / "data"
    w = make_window(demo_model_dir, data=data, max_new_tokens=16)
    first = " ".join(m["content"] for m in long_conversation(4, None)[1:])  # a long first message: ≥ 64 computed
    send(qtbot, w, spin_loop, first)
    final = send(qtbot, w, spin_loop, "And for 750 yuan?")
    assert isinstance(final, Finished)
    disk = final.cache["store"]["disk"]
    assert disk["directory"] == str(data / DISK_FOLDER) and disk["budget"] > 0
    w.close()
    assert not w.client.running
    assert len(list((data / DISK_FOLDER).glob("*.kv"))) >= final.cache["positions"] // 16  # flushed at close

    w2 = make_window(demo_model_dir, data=data, max_new_tokens=16)
    seen = []
    w2.conversationProbed.connect(seen.append)
    w2.select_conversation(w2.store.conversations()[0].id)
    spin_loop(lambda: seen and seen[-1].get("source") == "disk")
    s = seen[-1]
    assert s["cached"] >= s["positions"] - 16 and s["disk_read_ms"] is not None and s["prefill_ms"] is not None
    text = panel(w2, "conversationCachedValue")
    assert text.startswith(f"{s['cached']:,} of {s['positions']:,} positions (on disk): ≈ ") and "to prefill" in text
    final = send(qtbot, w2, spin_loop, "And a fourth night?")
    r = final.reuse
    assert r.source == "disk" and r.reused >= s["cached"] - 16 and r.copied_bytes > 0
    assert panel(w2, "reuseSourceValue").startswith(f"disk tier · {r.copied_positions:,} positions read")
    runs = [x for x in w2.chat.cache_map.origins() if x[2] != "empty"]
    assert runs[0] == (0, r.reused, "disk")  # the context map: read from disk, its own colour
    grid = w2.statsPanel.cacheMap.grid
    cell = grid.cell_rect(0)
    assert grid.grab().toImage().pixelColor(cell.center().x(), cell.bottom() - 2).name() == ORIGIN_COLOURS["disk"]
    assert "blocks of this model" in panel(w2, "diskValue") and "read at" in panel(w2, "diskValue")
    tree = w2.statsPanel.storeTree
    rows = [(tree.topLevelItem(k).text(0), tree.topLevelItem(k).text(3)) for k in range(tree.topLevelItemCount())]
    assert any(disk for _, disk in rows), rows  # the working cache's row: its positions on disk too
    assert "being written" in panel(w2, "diskValue") or final.cache["store"]["disk"]["queued_blocks"] == 0


def test_a_disk_budget_of_zero_turns_the_tier_off(qtbot, make_window, spin_loop, demo_model_dir, tmp_path):
    data = tmp_path / "data"
    w = make_window(demo_model_dir, data=data, disk_budget=0)
    final = send(qtbot, w, spin_loop, "Hello there")
    assert "disk" not in final.cache["store"] and panel(w, "diskValue") == "off"
    assert not (data / DISK_FOLDER).exists()
