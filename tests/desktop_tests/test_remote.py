"""The app on a remote engine, driven as a person drives it: against kvchat's own `engine serve` every
figure of the local panel appears; against a vLLM-like server the panel shows what it reports and says
what it does not; Stop closes the stream; a server that is down, refuses or breaks off is a clear
message with the partial reply kept and marked."""

import json

import pytest
from gui import BUDGET, panel, send
from PySide6.QtCore import Qt

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from desktop.core.panel_words import NOT_REPORTED, fmt_bytes, fmt_ms
from desktop.core.settings import Settings
from desktop.settings_dialog import SettingsDialog
from engine.events import Failed, Finished
from engine.session import Request, Session
from engine.weights.loading import load_model


def test_the_app_on_a_remote_kvchat_server_shows_every_figure_of_the_local_panel(qtbot, make_window, spin_loop, serve):
    server = serve()
    w = make_window(backend="remote", remote_url=server.url)
    assert w.facts["server_kind"] == "kvchat" and w.facts["name"] == "kvchat-demo"
    assert "Connected: kvchat-demo" in w.statusBar().currentMessage()
    assert panel(w, "architectureValue") == "LlamaForCausalLM"
    assert panel(w, "kvPerPositionValue") == fmt_bytes(6144)
    first = send(qtbot, w, spin_loop, BUDGET)
    assert isinstance(first, Finished) and first.reason == "eos"
    local = Session(load_model(None))
    want = list(local.generate(Request(messages=[{"role": "user", "content": BUDGET}])))[-1]
    assert first.text == want.text and w.transcript.views[1].message.content == want.text
    assert "client-side" in w.statsPanel.timingBox.title()
    assert panel(w, "ttftValue") == fmt_ms(first.trace["ttft_ms"])
    assert panel(w, "serverTimingValue").startswith(f"TTFT {fmt_ms(first.trace['server']['ttft_ms'])}")
    cache = first.cache
    assert panel(w, "cachePositionsValue") == f"{cache['positions']:,} / {cache['capacity']:,}"
    assert panel(w, "kvPayloadValue") == fmt_bytes(cache["payload_bytes"])
    assert panel(w, "kvAllocatedValue") == fmt_bytes(cache["allocated_bytes"])
    # What the model weighed, as the server reports it: the token view and the Confidence rows, as on a local engine.
    steps = w.transcript.views[1].message.trace["tokens"]
    assert len(steps) == first.trace["tokens"] > 3 and all(len(s["top"]) == 5 for s in steps)
    assert "".join(s["shown"] for s in steps) == want.text
    assert panel(w, "meanLogprobValue").endswith(f"nats over {len(steps):,} tokens")
    w.tokenColours.setCurrentIndex(w.tokenColours.findData("probability"))
    view = w.transcript.views[1].tokenView
    assert view is not None and view.isVisibleTo(w) and view.toPlainText() == want.text
    assert not w.chat.cache_map.reported  # the server's cache is its own: the map says so
    assert w.statsPanel.cacheMap.caption.text().endswith("not reported by this server")

    second = send(qtbot, w, spin_loop, "And a fourth night?")
    turn2 = [
        {"role": "user", "content": BUDGET},
        {"role": "assistant", "content": want.text},
        {"role": "user", "content": "And a fourth night?"},
    ]
    want2 = list(local.generate(Request(messages=turn2)))[-1]
    assert second.text == want2.text and second.reuse.reused == want2.reuse.reused > 0
    assert panel(w, "reusedValue") == f"{want2.reuse.reused:,}" and panel(w, "reuseSourceValue") == "working cache"
    assert panel(w, "storeBytesValue") != "—" and w.statsPanel.storeTree.topLevelItemCount() >= 1
    assert panel(w, "requestsValue") == "2"
    # the conversation's cached positions, asked of the server as the local engine is asked
    spin_loop(lambda: "positions" in panel(w, "conversationCachedValue"))
    assert panel(w, "conversationCachedValue").endswith("positions (working cache)")


def test_a_vllm_like_server_shows_what_it_reports_and_says_what_it_does_not(
    qtbot, make_window, spin_loop, scripted_server, tmp_path, monkeypatch
):
    hub = tmp_path / "hub"  # the model's config in the local Hugging Face cache: KV bytes from it
    snap = hub / "models--org--tiny-remote" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256}
    (snap / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    remote = scripted_server(mode="ok")
    w = make_window(backend="remote", remote_url=remote.url, remote_api_key="k1", temperature=0.5, top_k=40)
    per = 2 * 4 * 2 * 32 * 2
    assert w.facts["kv_bytes_per_position"] == per and panel(w, "kvPerPositionValue").startswith(fmt_bytes(per))
    assert panel(w, "architectureValue") == NOT_REPORTED and panel(w, "dtypeValue") == "bfloat16"
    final = send(qtbot, w, spin_loop, BUDGET)
    assert isinstance(final, Finished) and final.reason == "eos"
    assert final.text == "Chengdu in three nights: pandas, hotpot, teahouses."
    body = remote.requests[-1]
    assert body["model"] == "org/tiny-remote" and body["stream"] and body["temperature"] == 0.5
    assert body["top_k"] == 40 and "min_p" not in body  # extensions only when set
    assert body["messages"] == [{"role": "user", "content": BUDGET}]
    assert panel(w, "reusedValue") == "32" and panel(w, "recomputedValue") == "8"
    for row in ("meanLogprobValue", "perplexityValue", "lowConfidenceValue"):  # it sent no logprobs
        assert panel(w, row) == NOT_REPORTED
    assert panel(w, "reuseSourceValue") == "the server's cache (as it reports it)"
    assert panel(w, "serverTimingValue") == NOT_REPORTED and panel(w, "storeBytesValue") == NOT_REPORTED
    positions = 40 + 11 - 1
    assert panel(w, "kvPayloadValue") == fmt_bytes(positions * per)
    assert panel(w, "kvAllocatedValue") == NOT_REPORTED and panel(w, "tokensValue") == "11"
    spin_loop(lambda: panel(w, "conversationCachedValue") == NOT_REPORTED)


def test_stop_closes_the_remote_stream_and_keeps_the_partial_reply(qtbot, make_window, spin_loop, scripted_server):
    remote = scripted_server(mode="slow")
    w = make_window(backend="remote", remote_url=remote.url)
    got = []
    w.replyFinished.connect(got.append)
    qtbot.keyClicks(w.composer, BUDGET)
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: w.stats.tokens >= 3)
    qtbot.mouseClick(w.stopButton, Qt.LeftButton)
    spin_loop(lambda: got, 10)
    assert isinstance(got[0], Finished) and got[0].reason == "cancelled"
    assert remote.disconnected.wait(5)  # the server saw the stream closed
    reply = w.store.message(w.transcript.views[1].message.id)
    assert reply.status == "stopped" and reply.content.startswith("Chengdu in")
    assert w.sendButton.isEnabled()


def test_a_server_that_breaks_off_or_refuses_is_a_clear_message_with_the_text_kept(
    qtbot, make_window, spin_loop, scripted_server
):
    remote = scripted_server(mode="drop")
    w = make_window(backend="remote", remote_url=remote.url)
    final = send(qtbot, w, spin_loop, BUDGET)
    assert isinstance(final, Failed) and final.kind == "RemoteError"
    reply = w.store.message(w.transcript.views[1].message.id)
    assert reply.status == "failed" and reply.content == "Chengdu in three"  # what streamed is kept, marked
    assert w.banner.isVisible() and "The reply failed" in w.banner.text()
    remote.mode = "error"
    final = send(qtbot, w, spin_loop, "Again?")
    assert isinstance(final, Failed) and "500" in final.error and "the GPU fell over" in final.error
    remote.mode = "ok"
    final = send(qtbot, w, spin_loop, "Once more?")  # the app is still usable
    assert isinstance(final, Finished)


def test_a_server_that_is_down_is_a_clear_message_and_settings_pick_the_backend(
    qtbot, make_window, spin_loop, scripted_server, demo_model_dir
):
    from servers import free_port

    w = make_window(backend="remote", remote_url=f"127.0.0.1:{free_port()}")
    assert w.facts is None and "cannot reach http://127.0.0.1:" in w.banner.text()
    assert not w.sendButton.isEnabled()
    # Settings: choose Remote, fetch the list from the server, pick the model, OK.
    remote = scripted_server(mode="ok")
    dlg = SettingsDialog(w.settings, w.db_path, w)
    qtbot.addWidget(dlg)
    assert dlg.remoteUrl.isEnabled() and not dlg.modelDir.isEnabled()
    dlg.remoteUrl.setText(remote.url)
    qtbot.mouseClick(dlg.fetchModels, Qt.LeftButton)
    spin_loop(lambda: dlg.remoteModel.count() == 1)
    assert dlg.remoteModel.currentText() == "org/tiny-remote" and "1 model" in dlg.remoteStatus.text()
    ready = []
    w.modelReady.connect(ready.append)
    w.apply_settings(dlg.result_settings())
    spin_loop(lambda: ready)
    assert w.facts["model_id"] == "org/tiny-remote" and w.sendButton.isEnabled()
    saved = Settings.load(w.qsettings)
    assert (saved.backend, saved.remote_url, saved.remote_model) == ("remote", remote.url, "org/tiny-remote")
    assert w.qsettings.value("backend") == "remote" and w.qsettings.value("remote_model") == "org/tiny-remote"
    # and back to the local engine
    dlg = SettingsDialog(w.settings, w.db_path, w)
    qtbot.addWidget(dlg)
    dlg.backend.setCurrentIndex(0)
    assert dlg.modelDir.isEnabled() and not dlg.remoteUrl.isEnabled()
    ready.clear()
    w.apply_settings(dlg.result_settings())
    spin_loop(lambda: ready)
    assert w.facts.get("backend") is None and w.facts["architecture"] == "LlamaForCausalLM"
    assert isinstance(send(qtbot, w, spin_loop, BUDGET), Finished)


def test_edit_continue_and_regenerate_work_the_same_on_a_remote_kvchat_server(qtbot, make_window, spin_loop, serve):
    server = serve()
    w = make_window(backend="remote", remote_url=server.url, max_new_tokens=8)
    local = Session(load_model(None))
    first = send(qtbot, w, spin_loop, BUDGET)
    msgs = [{"role": "user", "content": BUDGET}]
    want = list(local.generate(Request(messages=msgs, max_new_tokens=8)))[-1]
    assert first.reason == "max_new_tokens" and first.text == want.text
    assert w.continueButton.isEnabled()
    got = []
    w.replyFinished.connect(got.append)
    qtbot.mouseClick(w.continueButton, Qt.LeftButton)  # extend the reply: the server continues the final message
    spin_loop(lambda: got)
    cont = Request(
        messages=msgs + [{"role": "assistant", "content": want.text}],
        max_new_tokens=8,
        continue_final_message=True,
        add_generation_prompt=False,
    )
    more = list(local.generate(cont))[-1]
    assert got[0].text == more.text and w.transcript.views[1].message.content == want.text + more.text
    got.clear()
    qtbot.mouseClick(w.regenerateButton, Qt.LeftButton)  # greedy: the same first reply again
    spin_loop(lambda: got)
    assert got[0].text == want.text and w.transcript.views[1].branchLabel.text() == "3/3"  # continue, regenerate
    got.clear()
    user_view = w.transcript.views[0]  # edit the message: a branch, and the server's reuse report on the panel
    qtbot.mouseClick(user_view.editButton, Qt.LeftButton)
    user_view.editor.setPlainText(BUDGET.replace("600", "750"))
    qtbot.mouseClick(user_view.saveButton, Qt.LeftButton)
    spin_loop(lambda: got)
    r = got[0].reuse
    assert r.first_invalidated_position is not None and r.cached_token["text"].strip() == "6"
    assert panel(w, "firstInvalidatedValue") == f"{r.first_invalidated_position:,}"
    assert w.transcript.views[0].branchLabel.text() == "2/2"


def test_llama_server_timings_show_as_the_server_side_figures(qtbot, make_window, spin_loop, scripted_server):
    remote = scripted_server(mode="llamacpp")
    w = make_window(backend="remote", remote_url=remote.url)
    assert w.facts["server_kind"] == "llama-server"
    final = send(qtbot, w, spin_loop, BUDGET)
    assert isinstance(final, Finished) and final.reuse.reused == 30 and final.reuse.computed == 10
    assert "timings: cache_n" in panel(w, "reuseReasonValue")
    assert panel(w, "serverTimingValue") == "prompt 10 positions in 12.5 ms (cached 30) · 11 tokens in 80.0 ms"
    assert panel(w, "kvPerPositionValue") == NOT_REPORTED and panel(w, "cachePositionsValue").startswith("50 ")
    # its drafts, under llama.cpp's names: the same rows as kvchat's own; what it does not report said so
    assert final.trace["speculative"]["drafted"] == 8 and final.trace["speculative"]["accepted"] == 5
    assert panel(w, "draftValue") == "the server's own draft (llama.cpp's draft_n)"
    assert panel(w, "acceptedValue") == "5 of 8 drafted (62%)"
    assert panel(w, "draftCostValue") == panel(w, "speedupValue") == NOT_REPORTED


def test_the_app_on_llama_cpp_python_s_server(qtbot, make_window, spin_loop, tmp_path, demo_model_dir):
    """The real llama.cpp server where the bench extra installed it, on an F32 GGUF of the demo model."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("sse_starlette")
    pytest.importorskip("starlette_context")
    pytest.importorskip("pydantic_settings")
    from servers import llama_cpp_serve

    from engine.tools.gguf_export import write_gguf

    gguf = write_gguf(demo_model_dir, tmp_path / "demo-f32.gguf", "F32", tokenizer=True)
    server = llama_cpp_serve(tmp_path, gguf, "--n_ctx", "2048")
    try:
        w = make_window(backend="remote", remote_url=server.url)
        assert w.facts["server_kind"] == "llama-cpp-python"
        final = send(qtbot, w, spin_loop, BUDGET)
        want = list(Session(load_model(None)).generate(Request(messages=[{"role": "user", "content": BUDGET}])))[-1]
        assert isinstance(final, Finished) and final.text == want.text
        assert panel(w, "reuseSourceValue") == NOT_REPORTED and panel(w, "kvPayloadValue") == NOT_REPORTED
        assert panel(w, "reusedValue") == NOT_REPORTED and panel(w, "cachePositionsValue") == NOT_REPORTED
        assert w.facts["name"] == "demo-f32.gguf"  # the server's id is the file's path
        assert panel(w, "ttftValue") == fmt_ms(final.trace["ttft_ms"])
    finally:
        server.stop()


def test_a_trickling_server_is_cut_off_and_the_app_goes_on(qtbot, make_window, spin_loop, demo_model_dir):
    """A server that sends its model list a byte at a time: the load fails at the deadline with the reason,
    the local engine loads after it, and the window closes at once."""
    import time

    from servers import HostileServer

    from engine.http.remote import CONNECT_TIMEOUT_S

    server = HostileServer("trickle-models", trickle=0.5)
    try:
        t0 = time.monotonic()
        w = make_window(backend="remote", remote_url=server.url)
        assert time.monotonic() - t0 < CONNECT_TIMEOUT_S + 10
        assert w.facts is None and f"did not answer within {CONNECT_TIMEOUT_S:g} s" in w.banner.text()
        dlg = SettingsDialog(w.settings, w.db_path, w)
        qtbot.addWidget(dlg)
        dlg.backend.setCurrentIndex(0)
        ready = []
        w.modelReady.connect(ready.append)
        w.apply_settings(dlg.result_settings())
        spin_loop(lambda: ready)
        assert w.facts["architecture"] == "LlamaForCausalLM" and w.sendButton.isEnabled()
        t0 = time.monotonic()
        w.close()
        assert time.monotonic() - t0 < 5 and not w.worker_left_running and not w.isVisible()
    finally:
        server.stop()


def test_closing_while_the_engine_is_stuck_in_a_load_hides_the_window_at_once(qtbot, loop, tmp_path, monkeypatch):
    """The worker inside a call it cannot leave (here a model list that trickles for 5 s): closing hides
    the window at once, waits CLOSE_WAIT_MS for the worker and leaves it (the app then ends without it)."""
    import time

    from servers import HostileServer

    from desktop.core.settings import Settings
    from desktop.settings_dialog import open_settings
    from desktop.window import MainWindow
    from desktop.worker import CLOSE_WAIT_MS

    server = HostileServer("trickle-models", trickle=0.5)
    data = tmp_path / "data"
    monkeypatch.setenv("KVCHAT_DATA_DIR", str(data))
    Settings(backend="remote", remote_url=server.url).save(open_settings(data))
    try:
        w = MainWindow(data)
        w.show()
        qtbot.wait(300)  # the load has begun on the worker
        t0 = time.monotonic()
        w.close()
        took = time.monotonic() - t0
        assert not w.isVisible() and w.worker_left_running and took < CLOSE_WAIT_MS / 1000 + 1.5
        assert w.client.worker.engine.join(15)  # it ends at the model list's deadline, on its own
    finally:
        server.stop()


def test_a_reply_keeps_its_engine_and_figures_after_an_engine_switch_and_a_restart(
    qtbot, make_window, spin_loop, serve, tmp_path
):
    """A reply made on the server stays described as the server's (its timing rows, its heading, its
    footer) after the app switches to the local engine, and after a restart; the local reply is its own."""
    import dataclasses

    server = serve()
    data = tmp_path / "data"
    w = make_window(data=data, backend="remote", remote_url=server.url, max_new_tokens=8)
    url = w.facts["server"]
    first = send(qtbot, w, spin_loop, BUDGET)
    maker = f"by kvchat-demo (float32) · remote kvchat server at {url}"
    server_row = panel(w, "serverTimingValue")
    assert server_row.startswith(f"TTFT {fmt_ms(first.trace['server']['ttft_ms'])}")
    assert w.statsPanel.heading.text().endswith(maker) and w.transcript.views[1].footerLabel.text().endswith(maker[3:])

    def shows_the_remote_reply():
        spin_loop(lambda: panel(w, "serverTimingValue") == server_row, 5)  # at the panel's next redraw
        assert "client-side" in w.statsPanel.timingBox.title()
        assert w.statsPanel.heading.text().endswith(maker)
        assert panel(w, "ttftValue") == fmt_ms(first.trace["ttft_ms"])

    ready = []
    w.modelReady.connect(ready.append)
    w.apply_settings(dataclasses.replace(w.settings, backend="local"))
    spin_loop(lambda: ready)
    assert w.facts.get("backend") is None
    w.render_transcript()
    shows_the_remote_reply()  # not relabelled "same process"
    second = send(qtbot, w, spin_loop, "And a fourth night?")
    assert isinstance(second, Finished)
    assert panel(w, "serverTimingValue") == "same process" and w.statsPanel.timingBox.title() == "Timing"
    assert w.statsPanel.heading.text().endswith("by kvchat-demo (float32) · same process")
    qtbot.mouseClick(w.transcript.views[1], Qt.LeftButton)  # the server's reply again: its own figures
    shows_the_remote_reply()
    w.close()

    w = make_window(data=data)  # a restart, on the local engine
    assert w.transcript.views[1].footerLabel.text().endswith(maker[3:])
    qtbot.mouseClick(w.transcript.views[1], Qt.LeftButton)
    shows_the_remote_reply()


def test_the_requests_tab_shows_what_a_kvchat_server_runs_for_all_its_clients(qtbot, make_window, spin_loop, serve):
    """The server's own /kvchat/stats, read at the tab's pace: two requests another client streams there appear
    with their state, tokens and K/V bytes, beside this window's own (none)."""
    import threading

    import httpx

    server = serve("--parallel", "4")
    w = make_window(backend="remote", remote_url=server.url)
    w.panelTabs.setCurrentWidget(w.requestsView)
    view = w.requestsView
    spin_loop(lambda: "0 of 4 running" in view.serverLine.text(), 30)
    assert view.serverLine.text().startswith("kvchat's own report (/kvchat/stats), all its clients:")

    def other_client(i):  # another program using the same server
        body = {"model": "kvchat-demo", "messages": [{"role": "user", "content": f"Story {i}"}], "stream": True,
                "max_tokens": 1500, "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=other_client, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    spin_loop(lambda: view.serverTable.topLevelItemCount() == 2, 60)
    heads = [view.serverTable.topLevelItem(i) for i in range(2)]
    assert all(h.text(0).split(" · ")[0] in ("prefilling", "decoding") for h in heads)
    assert "2 of 4 running" in view.serverLine.text()
    spin_loop(lambda: all(view.serverTable.topLevelItem(i).child(0).text(3) != "—" for i in range(2)), 30)  # K/V
    for t in threads:
        t.join(120)
    spin_loop(lambda: "0 of 4 running" in view.serverLine.text() and not view.serverTable.isVisibleTo(w), 30)


@pytest.mark.parametrize(
    "mode, said",
    [("ok", "vLLM's own report (/metrics), all its clients: 1 running, 0 waiting, KV cache 25% used"),
     ("llamacpp", "llama-server's own report (/slots), all its clients: 1 of 2 running")],
)  # fmt: skip
def test_the_requests_tab_reads_vllm_metrics_and_llama_server_slots(qtbot, make_window, spin_loop, scripted_server,
                                                                    mode, said):  # fmt: skip
    server = scripted_server(mode=mode, reply="word " * 120, delay=0.03)
    w = make_window(backend="remote", remote_url=server.url)
    w.panelTabs.setCurrentWidget(w.requestsView)
    view = w.requestsView
    idle = said.replace("1 running", "0 running").replace("1 of 2", "0 of 2").replace("25%", "0%")
    spin_loop(lambda: view.serverLine.text() == idle, 30)
    finals = []
    w.replyFinished.connect(finals.append)
    qtbot.keyClicks(w.composer, "Hi")
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: view.serverLine.text() == said, 30)
    if mode == "llamacpp":  # a row a slot: the busy one with its tokens, the idle one
        heads = [view.serverTable.topLevelItem(i).text(0) for i in range(view.serverTable.topLevelItemCount())]
        assert heads == ["running · slot 0", "idle · slot 1"]
        assert view.serverTable.topLevelItem(0).child(0).text(2) == "7"
    spin_loop(lambda: finals, 60)


def test_two_conversations_stream_at_once_from_one_remote_server(qtbot, make_window, spin_loop, scripted_server):
    """A remote server runs its own batch: the app streams a reply in each of two conversations at once, a
    connection each, and Stop in one closes that one's stream alone."""
    server = scripted_server(mode="slow")
    w = make_window(backend="remote", remote_url=server.url)
    finals = []
    w.replyFinished.connect(finals.append)
    qtbot.keyClicks(w.composer, "First")
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: w.chat.streaming_mid is not None and w.chat.streaming_stats.tokens >= 2, 30)
    a_mid = w.chat.streaming_mid
    qtbot.mouseClick(w.sidebar.newButton, Qt.LeftButton)
    qtbot.keyClicks(w.composer, "Second")
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: w.chat.streaming_mid not in (None, a_mid) and w.chat.streaming_stats.tokens >= 2, 30)
    b_mid = w.chat.streaming_mid
    spin_loop(lambda: server.streaming == 2, 30)  # two streams open on the server at once
    a_then = w.chat.streams[a_mid].stats.tokens
    spin_loop(lambda: w.chat.streams[a_mid].stats.tokens >= a_then + 3, 30)  # A goes on while B streams
    qtbot.mouseClick(w.stopButton, Qt.LeftButton)  # B's Stop
    spin_loop(lambda: len(finals) == 1, 30)
    assert finals[0].reason == "cancelled" and a_mid in w.chat.streams and b_mid not in w.chat.streams
    spin_loop(lambda: server.streaming == 1, 30)  # B's stream closed, A's open
    a_now = w.chat.streams[a_mid].stats.tokens
    spin_loop(lambda: w.chat.streams[a_mid].stats.tokens >= a_now + 3, 30)
    w.select_conversation(w.store.message(a_mid).conversation_id)
    qtbot.mouseClick(w.stopButton, Qt.LeftButton)
    spin_loop(lambda: len(finals) == 2 and server.streaming == 0, 30)
