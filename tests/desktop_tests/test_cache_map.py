"""The context map in the real window: after a fresh request, an edit and a return to a stored conversation,
each position's fill (where it came from) and band (whose text) against the engine's own reuse report, the
painted pixels, the first invalidated position marked, and a cell's words on the keyboard."""

from gui import BUDGET, BUDGET_EDITED, edit, send
from PySide6.QtCore import Qt

from desktop.cache_map_view import BAND, MARK, ORIGIN_COLOURS, QUIET, ROLE_COLOURS
from desktop.core.cache_map import CacheMap
from desktop.style import current_theme
from engine.events import PrefillDone, PrefillProgress, PrefillStarted, ReuseReport, Token


def runs(m: CacheMap) -> list[tuple[int, int, str]]:
    return [r for r in m.origins() if r[2] != "empty"]


def painted(grid, i: int, band: bool = False) -> str:
    """The colour painted in cell i's body (or its band)."""
    r = grid.cell_rect(i)
    image = grid.grab().toImage()
    return image.pixelColor(r.x() + r.width() // 2, r.y() + (1 if band else BAND + 4)).name()


def test_the_map_shows_a_fresh_request_an_edit_and_a_return_to_a_stored_conversation(
    qtbot, make_window, spin_loop, demo_model_dir
):
    w = make_window(demo_model_dir, max_new_tokens=24, capacity=256)
    grid = w.statsPanel.cacheMap.grid
    m = w.chat.cache_map
    assert m.capacity == 256 and m.origins() == [(0, 256, "empty")]
    assert grid.per == 1 and len(grid._cells) == 256  # one cell per position: the capacity drawn as free cells

    # Fresh: every prompt position computed, the reply's decoded; the bands say whose text each holds.
    final = send(qtbot, w, spin_loop, BUDGET)
    prompt, length = final.trace["prompt_tokens"], final.cache["positions"]
    assert runs(m) == [(0, prompt, "computed"), (prompt, length, "generated")]
    roles = m.roles()
    assert [r for _, _, r in roles] == ["template", "user", "template", "reply"]
    (_, _, _), (ua, ub, _), _, (ra, rb, _) = roles
    assert w.client.token_text(list(m.ids[ua:ub])).strip() == BUDGET and (ra, rb) == (prompt, length)
    assert painted(grid, 0) == ORIGIN_COLOURS["computed"] and painted(grid, length - 1) == ORIGIN_COLOURS["generated"]
    assert (
        painted(grid, ua, band=True) == ROLE_COLOURS["user"] and painted(grid, ra, band=True) == ROLE_COLOURS["reply"]
    )
    assert painted(grid, length) != ORIGIN_COLOURS["generated"]  # free: an outline only
    caption = w.statsPanel.cacheMap.caption.text()
    assert caption.startswith(f"in the cache now: {length:,} / 256 positions · a cell is 1 position")
    assert "message 2" in caption and w.statsPanel.cacheBar.text() == f"at this reply: {length:,} / 256 positions"

    # An edit: kept up to the first changed position, computed from there, the rest of the old cache thrown away.
    old_length = length
    final = edit(qtbot, w, spin_loop, w.transcript.views[0], BUDGET_EDITED)
    r = final.reuse
    first, length = r.first_invalidated_position, final.cache["positions"]
    assert first == r.reused and r.source == "working"
    want = [
        (0, first, "kept"),
        (first, r.reused + r.computed, "computed"),
        (r.reused + r.computed, length, "generated"),
    ]
    if old_length > length:
        want.append((length, old_length, "invalidated"))
    assert runs(m) == want and m.first_invalidated == first
    assert painted(grid, first - 1) == ORIGIN_COLOURS["kept"] and painted(grid, first) == ORIGIN_COLOURS["computed"]
    marker = grid.cell_rect(first)
    assert grid.grab().toImage().pixelColor(marker.x(), marker.y() + BAND + 4).name() == MARK

    # Its words: the keyboard goes to the first invalidated cell; the token, the message and the cut are said.
    grid.setFocus()
    qtbot.keyClick(grid, Qt.Key_Home)
    for _ in range(first):
        qtbot.keyClick(grid, Qt.Key_Right)
    said = grid.accessibleDescription()
    token = w.client.token_text([m.ids[first]])
    assert said.startswith(f"Position {first}: “{token}”") and "Message 1 of 1 (your message)" in said
    assert "computed now" in said and f"The first invalidated position ({first})" in said
    assert f"{r.cached_token['text']!r} → {r.new_token['text']!r}" in said

    # Another conversation, then back to the first: its prefix comes from the prefix store.
    qtbot.mouseClick(w.newButton, Qt.LeftButton)
    send(qtbot, w, spin_loop, "Tell me about the pandas in Chengdu.")
    back = next(c for c in w.store.conversations() if c.title.startswith("I am planning"))
    w.select_conversation(back.id)
    final = send(qtbot, w, spin_loop, "And for 900 yuan?")
    r = final.reuse
    kept, length = r.reused - r.copied_positions, final.cache["positions"]
    assert r.source == "store" and r.copied_positions > 0
    assert runs(m)[:3] == [(0, kept, "kept"), (kept, r.reused, "copied"), (r.reused, r.reused + r.computed, "computed")]
    assert painted(grid, r.reused - 1) == ORIGIN_COLOURS["copied"]
    assert [x for _, _, x in m.roles()] == ["template", "user", "template", "assistant", "template", "user",
                                             "template", "reply"]  # fmt: skip
    said = grid.describe(kept)
    assert "taken from the prefix store" in said and "Message 1 of 3" in said

    # One box, two figures, each named: the bar the selected reply's (the first, shorter), the map the cache now.
    qtbot.mouseClick(w.transcript.views[1], Qt.LeftButton)
    at = w.transcript.views[1].message.trace["cache"]["positions"]
    spin_loop(lambda: w.statsPanel.cacheBar.text() == f"at this reply: {at:,} / 256 positions", 5)
    assert at < length and w.statsPanel.cacheMap.caption.text().startswith(f"in the cache now: {length:,} / 256")

    # The theme's own quiet colour for free cells, in both themes.
    for theme in ("light", "dark"):
        w.set_theme(theme)
        w._redraw(panel=True)
        assert current_theme() == theme and painted(grid, 255).startswith("#")
        image = grid.grab().toImage()
        edge = grid.cell_rect(255)
        assert image.pixelColor(edge.x(), edge.y() + BAND + 4).name() == QUIET[theme]


def test_the_map_follows_a_request_live_and_a_model_switch_shows_the_cache_thrown_away():
    """Qt-free: the positions move from pending to computed as the prefill goes, the reply's positions fill as
    tokens come; a model switch that empties the cache shows what it held as thrown away, with the reason."""
    m = CacheMap(capacity=64)
    m.start([{"role": "user", "content": "hello there"}], 0, "the reply to “t”, message 2")
    reuse = ReuseReport(0, 40, 0, None, None, None, None)
    m.apply(PrefillStarted(40, reuse, tuple(range(40)), "", ((3, 30),)))
    assert m.running and m.caption.startswith("Filling for") and runs(m) == [(0, 40, "pending")]
    m.apply(PrefillProgress(16, 40, 16))
    assert runs(m) == [(0, 16, "computed"), (16, 40, "pending")]
    m.apply(PrefillDone(0, 40, 0.1, 40))
    m.apply(Token(1, 7, "x", 0.0, 40))
    m.apply(Token(2, 8, "y", 0.0, 41))
    assert runs(m) == [(0, 40, "computed"), (40, 41, "generated")] and m.ids[40:] == [7, 8]
    assert [x for _, _, x in m.roles()] == ["template", "user", "template", "reply"]
    assert m.cells(16) == [("computed", "user"), ("computed", "user"), ("computed", "template"), ("empty", None)]

    m.loaded({"capacity": 64, "cache": {"positions": 0}, "cache_dropped": "cache dropped: the weights changed"})
    assert runs(m) == [(0, 41, "invalidated")] and m.first_invalidated == 0
    assert m.caption == "for the next request: cache dropped: the weights changed"
    assert m.describe(40, 41, lambda ids: f"<{ids}>").startswith("Position 40: “<[7]>”  (what it held)")
    m.loaded({"backend": "remote", "capacity": None})
    assert not m.reported and "not reported by this server" in m.caption
