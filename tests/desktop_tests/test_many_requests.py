"""Many requests at once in the real window: two conversations streaming side by side, each with its own
figures; Alternatives ×3 as one batch sharing the prompt's prefill; the Requests view over them."""

from gui import send
from PySide6.QtCore import Qt


def tokens_of(w, mid):
    st = w.chat.streams.get(mid)
    return 0 if st is None else st.stats.tokens


def test_two_conversations_stream_at_once_each_with_its_own_figures(qtbot, make_window, spin_loop, llama_dir):
    w = make_window(llama_dir, max_new_tokens=3000, capacity=4000)
    finals = []
    w.replyFinished.connect(finals.append)
    qtbot.keyClicks(w.composer, "The first conversation")
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: w.chat.streaming_mid is not None and w.chat.streaming_stats.tokens >= 3)
    a_mid = w.chat.streaming_mid
    a_cid = w.chat.streams[a_mid].cid
    assert w.stopButton.isVisible() and not w.sendButton.isVisible()

    qtbot.mouseClick(w.sidebar.newButton, Qt.LeftButton)  # a new conversation while A streams
    assert w.sendButton.isVisible() and w.sendButton.isEnabled() and not w.stopButton.isVisible()
    qtbot.keyClicks(w.composer, "A second conversation, while the first one streams")
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: w.chat.streaming_mid not in (None, a_mid) and w.chat.streaming_stats.tokens >= 3)
    b_mid = w.chat.streaming_mid
    b_cid = w.chat.streams[b_mid].cid
    assert b_cid != a_cid == w.store.message(a_mid).conversation_id
    a_then = tokens_of(w, a_mid)
    spin_loop(lambda: tokens_of(w, a_mid) >= a_then + 5 and tokens_of(w, b_mid) >= 8)  # both stream, at once
    assert w.stopButton.isVisible()
    spin_loop(lambda: "2 replies streaming" in w.statusLine.text())  # at the panel's next redraw

    # The Requests tab: both in flight, on lanes of their own, decoding in one batch; the KV formula summed.
    w.panelTabs.setCurrentWidget(w.requestsView)
    w.pacer.draw_now()
    spin_loop(lambda: w.requestsView.table.topLevelItemCount() == 2 and "2 in flight" in w.requestsView.summary.text())
    rows = [w.requestsView.table.topLevelItem(i) for i in range(2)]
    b_title = w.store.conversation(b_cid).title
    assert [r.text(0) for r in rows] == ["decoding · “The first conversation”", f"decoding · “{b_title}”"]
    prefills = [r.child(0).text(1).split("/") for r in rows]
    assert all(done == of and int(of) > 0 for done, of in prefills)  # decoding: their prefills done
    lanes = w.client.in_flight()
    assert sorted(r["lane"] for r in lanes) == [0, 1]
    formula = w.requestsView.formula.text()
    assert formula.startswith("Σ over requests: 2 · ") and formula.count("+") >= 1, formula
    terms = formula.split("(")[1].split(")")[0].split(" + ")
    assert len(terms) == 2 and all(int(t.replace(",", "")) > 0 for t in terms)
    per = w.facts["kv_bytes_per_position"]
    assert int(formula.rsplit("= ", 1)[1].split(" B")[0].replace(",", "")) == per * sum(
        int(t.replace(",", "")) for t in terms
    )  # Σ T × bytes per position

    # Stop in B stops B alone: A goes on.
    qtbot.mouseClick(w.stopButton, Qt.LeftButton)
    spin_loop(lambda: len(finals) == 1)
    assert finals[0].reason == "cancelled" and b_mid not in w.chat.streams and a_mid in w.chat.streams
    assert w.sendButton.isVisible() and not w.stopButton.isVisible()  # B takes a Send again
    a_now = tokens_of(w, a_mid)
    spin_loop(lambda: tokens_of(w, a_mid) >= a_now + 5)
    b_trace = finals[0].trace
    assert b_trace["lane"] == 1 and 2 in b_trace["batch_sizes"]  # its decode steps ran beside A's

    # Back in A: its reply still streams there, the panel follows it (live), its Stop stops it.
    w.select_conversation(a_cid)
    assert w.stopButton.isVisible() and w.chat.stats is w.chat.streams[a_mid].stats
    w.pacer.draw_now()
    assert "The first conversation" in w.statsPanel.heading.text()
    qtbot.mouseClick(w.stopButton, Qt.LeftButton)
    spin_loop(lambda: len(finals) == 2 and not w.chat.busy)
    a_msg, b_msg = w.store.message(a_mid), w.store.message(b_mid)
    assert a_msg.status == b_msg.status == "stopped" and a_msg.token_count > b_msg.token_count
    w.select_message(a_mid)
    w.pacer.draw_now()
    assert w.statsPanel.values["tokensValue"].text().startswith(f"{a_msg.token_count:,}")
    assert "The first conversation" in w.statsPanel.heading.text()
    w.select_conversation(b_cid)
    w.pacer.draw_now()
    assert w.statsPanel.values["tokensValue"].text().startswith(f"{b_msg.token_count:,}")
    w.pacer.draw_now()
    table = w.requestsView.table
    states = [table.topLevelItem(i).text(0).split(" · ", 1)[0] for i in range(table.topLevelItemCount())]
    assert states == ["stopped", "stopped"]  # the ended ones stay listed, for their timeline


def test_alternatives_x3_are_three_branches_from_one_prefill(qtbot, make_window, spin_loop, llama_dir):
    w = make_window(llama_dir, max_new_tokens=300, capacity=2000, temperature=0.8, seed=7)
    send(qtbot, w, spin_loop, "Tell me about the cache")
    user = w.chat.last_message().parent_id
    three = next(a for a in w.regenerateWith.menu().actions() if a.text() == "3 alternatives")
    assert w.regenerateWith.isVisible() and w.regenerateWith.isEnabled() and three.isEnabled()
    finals, shown = [], []
    w.replyFinished.connect(finals.append)
    draw = w.requestsView.show_streams

    def drawn(*args):  # what the Requests tab said at each of its redraws
        draw(*args)
        shown.append((w.requestsView.summary.text(), w.requestsView.formula.text()))

    w.requestsView.show_streams = drawn
    three.trigger()
    assert w.chat.generating and w.stopButton.isVisible()
    w.panelTabs.setCurrentWidget(w.requestsView)
    spin_loop(lambda: len(finals) == 3 and not w.chat.busy, 120)
    # While they streamed, the prompt's blocks were held once for the three: said, and the Σ formula subtracts them.
    together = [(s, f) for s, f in shown if "3 in flight" in s and "shared, held once" in s]
    assert together, shown[-5:]
    summary, formula = together[-1]
    terms, shared = formula.split("(")[1].split(")")[0].split(" − ")
    ts = [int(t.replace(",", "")) for t in terms.split(" + ")]
    s = int(shared.split()[0].replace(",", ""))
    per = w.facts["kv_bytes_per_position"]
    assert len(ts) == 3 and s > 0 and s % 16 == 0 and f"{s:,} positions shared" in summary
    assert int(formula.rsplit("= ", 1)[1].split(" B")[0].replace(",", "")) == per * (sum(ts) - s)
    replies = [m for m in w.store.siblings(w.store.message(w.chat.last_message().id)) if m.role == "assistant"]
    assert len(replies) == 4 and {m.parent_id for m in replies} == {user}  # the first reply and three alternatives
    alts = sorted(replies, key=lambda m: m.id)[1:]
    assert w.chat.last_message().id == alts[0].id  # the first alternative is on screen
    traces = [m.trace["trace"] for m in alts]
    reuses = [m.trace["reuse"] for m in alts]
    assert reuses[1]["source"] == reuses[2]["source"] == "store"  # the others copied the first's prompt
    assert all(r["computed"] <= 16 for r in reuses[1:])  # at most the last, partial block computed again
    assert max(max(t["batch_sizes"]) for t in traces) >= 2  # their decode steps ran together
    assert len({m.content for m in alts}) > 1  # seeds 7, 8, 9: not one reply three times
    w.pacer.draw_now()
    names = [w.requestsView.table.topLevelItem(i).text(0) for i in range(w.requestsView.table.topLevelItemCount())]
    assert [n.split(" · ")[2] for n in names[-3:]] == ["alternative 1/3", "alternative 2/3", "alternative 3/3"]


def test_alternatives_are_off_under_greedy_sampling_and_say_why(make_window, demo_model_dir, qtbot, spin_loop):
    w = make_window(demo_model_dir, max_new_tokens=4)
    send(qtbot, w, spin_loop, "Hi")
    three = next(a for a in w.regenerateWith.menu().actions() if a.text() == "3 alternatives")
    assert w.regenerateWith.isEnabled() and not three.isEnabled() and "temperature above 0" in three.toolTip()


def test_the_list_marks_each_conversation_whose_reply_streams(qtbot, make_window, spin_loop, llama_dir):
    w = make_window(llama_dir, max_new_tokens=3000, capacity=4000)
    qtbot.keyClicks(w.composer, "Streams a while")
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: w.chat.streaming_mid is not None)
    a_cid = w.chat.streams[w.chat.streaming_mid].cid
    qtbot.mouseClick(w.sidebar.newButton, Qt.LeftButton)  # B, idle, shown

    def marked():
        items = [w.sidebar.list.item(i) for i in range(w.sidebar.list.count())]
        return {it.data(Qt.UserRole): (not it.icon().isNull(), it.data(Qt.AccessibleDescriptionRole)) for it in items}

    spin_loop(lambda: marked().get(a_cid, (False,))[1] == "a reply is streaming here")
    b_cid = w.chat.current_cid
    assert marked()[b_cid] == (True, "")  # a blank beside it: the titles stay in line
    assert "a reply is streaming here" in next(w.sidebar.list.item(i) for i in range(w.sidebar.list.count()) if
                                               w.sidebar.list.item(i).data(Qt.UserRole) == a_cid).toolTip()  # fmt: skip
    w.select_conversation(a_cid)
    qtbot.mouseClick(w.stopButton, Qt.LeftButton)
    spin_loop(lambda: not w.chat.busy)
    spin_loop(lambda: all(v == (False, "") for v in marked().values()))  # none streams: no dots, no indent


def test_each_streaming_reply_shows_the_context_map_of_its_own_lane(qtbot, make_window, spin_loop, llama_dir):
    """Two replies at once fill two lanes' caches: the panel's map is the lane of the reply it describes."""
    w = make_window(llama_dir, max_new_tokens=3000, capacity=4000)
    qtbot.keyClicks(w.composer, "Lane zero")
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: w.chat.streaming_mid is not None and w.chat.streaming_stats.tokens >= 2)
    a_mid = w.chat.streaming_mid
    qtbot.mouseClick(w.sidebar.newButton, Qt.LeftButton)
    qtbot.keyClicks(w.composer, "Lane one")
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: w.chat.streaming_mid not in (None, a_mid) and w.chat.streaming_stats.tokens >= 2)
    b_mid = w.chat.streaming_mid
    assert (w.chat.streams[a_mid].lane, w.chat.streams[b_mid].lane) == (0, 1)
    w.pacer.draw_now()
    spin_loop(lambda: "Lane one" in w.statsPanel.cacheMap.caption.text())  # B's reply, B's lane
    assert w.chat.cache_map is w.chat.lane_maps.of(1) and "Lane zero" not in w.statsPanel.cacheMap.caption.text()
    w.select_conversation(w.store.message(a_mid).conversation_id)
    w.pacer.draw_now()
    spin_loop(lambda: "Lane zero" in w.statsPanel.cacheMap.caption.text())  # A's reply, A's lane
    assert w.chat.cache_map is w.chat.lane_maps.of(0)
    w.chat.stop()
    w.select_conversation(w.store.message(b_mid).conversation_id)
    w.chat.stop()
    spin_loop(lambda: not w.chat.busy)
