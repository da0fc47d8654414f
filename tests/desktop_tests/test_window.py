"""The real window, driven as a person drives it: type, click, wait, read the panel."""

import dataclasses
import json
import sqlite3

import pytest
from gui import BUDGET, BUDGET_EDITED, panel, send
from PySide6.QtCore import Qt

from desktop.core.panel_words import fmt_bytes, fmt_ms, fmt_rate, fmt_size
from desktop.core.replies import title_from
from desktop.core.store import Store
from desktop.models_dialog import COLUMNS
from engine.events import Failed, Finished

STATUS = COLUMNS.index("Status")  # the Models dialog's status column


def test_send_streams_a_reply_and_the_panel_matches_the_engine(qtbot, make_window, spin_loop, demo_model_dir):
    w = make_window(demo_model_dir)
    assert w.facts["architecture"] == "LlamaForCausalLM"
    final = send(qtbot, w, spin_loop, BUDGET)
    assert isinstance(final, Finished) and final.reason == "eos"
    t, cache = final.trace, final.cache
    assert panel(w, "ttftValue") == fmt_ms(t["ttft_ms"])
    assert panel(w, "tpotValue") == fmt_ms(t["tpot_ms"])
    assert panel(w, "tokensPerSecondValue") == fmt_rate(t["decode_tok_s"])
    assert panel(w, "cachePositionsValue") == f"{cache['positions']:,} / {cache['capacity']:,}"
    assert panel(w, "kvPayloadValue") == fmt_bytes(cache["payload_bytes"])
    assert panel(w, "kvAllocatedValue") == fmt_bytes(cache["allocated_bytes"])
    assert cache["payload_bytes"] == cache["positions"] * w.facts["kv_bytes_per_position"]
    assert panel(w, "reusedValue") == "0" and panel(w, "firstInvalidatedValue") == "—"
    assert panel(w, "recomputedValue") == str(t["prompt_tokens"])
    # TTFT counts from the Send click: it is longer than the engine's own part of it
    assert t["ttft_ms"] >= t["ttft_prefill_ms"] + t["ttft_first_token_ms"]
    views = w.transcript.views
    assert [v.message.role for v in views] == ["user", "assistant"]
    assert views[1].message.content == final.text and "600 yuan" in final.text
    assert views[1].tokensLabel.text() == f"{t['tokens']} tokens"
    from engine.tokenizer import Tokenizer

    n_user = len(Tokenizer.from_dir(demo_model_dir).encode(BUDGET))
    assert views[0].tokensLabel.text() == f"{n_user} tokens"
    assert w.sendButton.isVisible() and not w.stopButton.isVisible()
    assert w.conversationList.count() == 1


def test_enter_sends_and_shift_enter_is_a_newline(qtbot, make_window, spin_loop, demo_model_dir):
    w = make_window(demo_model_dir)
    qtbot.keyClicks(w.composer, "Hello")
    qtbot.keyClick(w.composer, Qt.Key_Return, Qt.ShiftModifier)
    qtbot.keyClicks(w.composer, "there")
    assert w.composer.toPlainText() == "Hello\nthere"
    got = []
    w.replyFinished.connect(got.append)
    qtbot.keyClick(w.composer, Qt.Key_Return)
    spin_loop(lambda: got)
    assert w.transcript.views[0].message.content == "Hello\nthere"
    assert w.composer.toPlainText() == ""


def test_edit_an_earlier_message_branches_and_shows_the_invalidation(qtbot, make_window, spin_loop, demo_model_dir):
    w = make_window(demo_model_dir)
    first = send(qtbot, w, spin_loop, BUDGET)
    assert "600 yuan" in first.text
    user_view = w.transcript.views[0]
    qtbot.mouseClick(user_view.editButton, Qt.LeftButton)
    user_view.editor.setPlainText(BUDGET_EDITED)
    got = []
    w.replyFinished.connect(got.append)
    qtbot.mouseClick(user_view.saveButton, Qt.LeftButton)
    spin_loop(lambda: got)
    final = got[0]
    r = final.reuse.to_dict()
    assert "750 yuan" in final.text and "600" not in final.text
    assert r["cached_token"]["text"].strip() == "6" and r["new_token"]["text"].strip() == "7"
    assert panel(w, "firstInvalidatedValue") == f"{r['first_invalidated_position']:,}"
    assert panel(w, "reusedValue") == f"{r['reused']:,}" and r["reused"] == r["first_invalidated_position"]
    assert panel(w, "recomputedValue") == f"{r['computed']:,}"
    assert int(panel(w, "discardedValue").replace(",", "")) == r["invalidated"] > 0
    user_view = w.transcript.views[0]
    assert user_view.branchLabel.text() == "2/2" and user_view.branchLabel.isVisible()
    assert user_view.property("invalidated") is True and user_view.highlight[0] == BUDGET.index("600")
    qtbot.mouseClick(user_view.prevButton, Qt.LeftButton)
    views = w.transcript.views
    assert views[0].branchLabel.text() == "1/2" and "600 yuan" in views[0].message.content
    assert views[1].message.content == first.text


def test_a_new_exchange_keeps_the_views_above_it_and_an_edit_rebuilds_from_the_edit(
    qtbot, make_window, spin_loop, demo_model_dir
):
    """Sending lays out only the new messages: a long conversation is not rebuilt from the top for each
    reply (it would block the GUI thread while the engine prefills)."""
    w = make_window(demo_model_dir)
    first = send(qtbot, w, spin_loop, BUDGET)
    kept = list(w.transcript.views)
    second = send(qtbot, w, spin_loop, "What should I see first?")
    views = w.transcript.views
    assert views[:2] == kept and len(views) == 4  # the same view objects, two new ones below
    assert views[1].reply.plain_text() == first.text and views[1].stream is None  # the finished reply, as Markdown
    assert views[3].message.content == second.text and views[3].stream is None
    assert views[3].tokensLabel.text() == f"{second.trace['tokens']} tokens"
    assert views[2].tokensLabel.text().endswith(" tokens")  # the count the engine reported for the prompt
    qtbot.mouseClick(views[2].editButton, Qt.LeftButton)
    views[2].editor.setPlainText("What should I eat first?")
    got = []
    w.replyFinished.connect(got.append)
    qtbot.mouseClick(views[2].saveButton, Qt.LeftButton)
    spin_loop(lambda: got)
    views = w.transcript.views
    assert views[:2] == kept and views[2] is not kept[0] and views[2].branchLabel.text() == "2/2"
    assert views[2].message.content == "What should I eat first?" and views[3].message.content == got[0].text


def test_stop_mid_reply_keeps_the_text_and_marks_it_stopped(qtbot, make_window, spin_loop, llama_dir):
    w = make_window(llama_dir, max_new_tokens=3000, capacity=4000)
    qtbot.keyClicks(w.composer, "Hello")
    got = []
    w.replyFinished.connect(got.append)
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: w.stats.tokens >= 5)
    assert w.stopButton.isVisible() and not w.sendButton.isVisible()
    qtbot.mouseClick(w.stopButton, Qt.LeftButton)
    spin_loop(lambda: got)
    assert got[0].reason == "cancelled"
    msg = w.transcript.views[-1].message
    assert msg.status == "stopped" and 5 <= msg.token_count < 3000
    assert w.statsPanel.values["failedValue"].text() == "0 · 1"
    assert w.continueButton.isEnabled()


def test_model_settings_change_drops_the_cache_with_its_reason(qtbot, make_window, spin_loop, demo_model_dir):
    w = make_window(demo_model_dir)
    send(qtbot, w, spin_loop, BUDGET)
    ready = []
    w.modelReady.connect(ready.append)
    from dataclasses import replace

    w.apply_settings(replace(w.settings, model=replace(w.settings.model, dtype="bfloat16")))
    spin_loop(lambda: ready, 120)
    assert w.facts["dtype"] == "bfloat16"
    assert "dtype changed (float32 → bfloat16)" in panel(w, "reuseReasonValue")
    final = send(qtbot, w, spin_loop, "What is my budget?")
    assert final.reuse.reused == 0 and "dtype changed" in final.reuse.reason
    assert panel(w, "dtypeValue") == "bfloat16"
    assert "dtype changed" in panel(w, "reuseReasonValue")
    from engine.backends import kernels

    k = kernels.load()  # what decodes is said: kvchat's kernels where they build, else torch and why
    want = f"kvchat ({k.isa}; {kernels.built(k)})" if k else kernels.status()
    assert panel(w, "kernelsValue") == want == w.facts["decode_kernels"]


def test_a_corrupt_model_folder_shows_the_error_and_keeps_the_old_model(
    qtbot, make_window, spin_loop, demo_model_dir, tmp_path
):
    import shutil

    w = make_window(demo_model_dir)
    bad = tmp_path / "bad"
    shutil.copytree(demo_model_dir, bad)
    (bad / "model.safetensors").write_bytes(b"\x00" * 64)
    ready = []
    w.modelReady.connect(ready.append)
    from dataclasses import replace

    w.apply_settings(replace(w.settings, model=replace(w.settings.model, path=str(bad))))
    spin_loop(lambda: ready, 60)
    assert "corrupt or truncated safetensors" in w.banner.text() and "previous model" in w.banner.text()
    assert w.banner.isVisible() and w.facts["name"] == "kvchat-demo"
    final = send(qtbot, w, spin_loop, BUDGET)
    assert isinstance(final, Finished)


def test_over_capacity_prompt_is_explained_and_the_panel_shows_the_failed_request(
    qtbot, make_window, spin_loop, demo_model_dir, monkeypatch
):
    """A prompt that cannot fit even with turns left out is refused before anything is stored (the draft kept,
    the panel on the previous reply). Where the probe could not say so (a server that does not report), the
    engine's own refusal is a failed request showing its own figures (where it failed, nothing reused), never
    the previous reply's; its footer says it failed; the previous reply keeps its own."""
    from desktop.panel import REUSE_ROWS
    from engine.session import Session

    w = make_window(demo_model_dir, capacity=64, max_new_tokens=32)
    ok = send(qtbot, w, spin_loop, "Hi")
    assert isinstance(ok, Finished) and panel(w, "reusedValue") != "—"
    long = BUDGET + " " + BUDGET
    qtbot.keyClicks(w.composer, long)
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: w.banner.isVisible())
    assert "Not sent: even with only the system prompt and the last turn" in w.banner.text()
    assert w.composer.toPlainText() == long and len(w.transcript.views) == 2
    assert panel(w, "tokensValue") == str(ok.trace["tokens"])  # still the reply before
    w.composer.clear()

    monkeypatch.setattr(Session, "cached_positions", lambda self, req: {"error": "not reported"})
    w.client.worker._conversation_seen = None  # the conversation as stored is asked again
    final = send(qtbot, w, spin_loop, long)
    assert isinstance(final, Failed) and "capacity is 64" in final.error
    assert "capacity is 64" in w.banner.text() and w.banner.isVisible()
    failed = w.transcript.views[-1]
    assert failed.message.status == "failed"
    assert w.statsPanel.values["failedValue"].text() == "1 · 0"
    assert w.sendButton.isEnabled()
    heading = w.statsPanel.heading.text().split("\n")
    assert heading[0].startswith("Reply · failed: ") and heading[0].endswith("(before its prefill)")
    assert heading[1].endswith("message 4 of 4")
    assert all(panel(w, name) == "—" for name in REUSE_ROWS)  # the previous request's reuse is not this one's
    assert panel(w, "tokensValue") == "0" and panel(w, "ttftValue") == "—"
    assert "failed: even with only the system prompt and the last turn" in failed.footerLabel.text()
    assert "kvchat-demo" in failed.footerLabel.text()
    qtbot.mouseClick(w.transcript.views[1], Qt.LeftButton)  # the first reply: its own figures again
    spin_loop(lambda: panel(w, "reusedValue") != "—", 5)
    assert panel(w, "tokensValue") == str(ok.trace["tokens"])


def test_close_mid_generation_then_reopen_restores_everything(qtbot, make_window, spin_loop, llama_dir, tmp_path):
    data = tmp_path / "data"
    w = make_window(llama_dir, data=data, max_new_tokens=3000, capacity=4000)
    qtbot.keyClicks(w.composer, "Hello")
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    spin_loop(lambda: w.stats.tokens >= 5)
    w.close()
    assert not w.client.running
    store = Store(data / "kvchat.db")
    conv = store.conversations()[0]
    path = store.branch(conv.id)
    assert [m.role for m in path] == ["user", "assistant"]
    assert path[1].status == "stopped" and path[1].token_count >= 5
    store.close()
    w2 = make_window(llama_dir, data=data)
    assert w2.conversationList.count() == 1
    assert [v.message.role for v in w2.transcript.views] == ["user", "assistant"]
    assert w2.transcript.views[1].statusLabel.text() == "stopped"


def test_conversations_new_rename_search_delete_undo(qtbot, make_window, spin_loop, demo_model_dir, monkeypatch):
    w = make_window(demo_model_dir)
    send(qtbot, w, spin_loop, BUDGET)
    qtbot.mouseClick(w.newButton, Qt.LeftButton)
    send(qtbot, w, spin_loop, "Hello!")
    assert w.conversationList.count() == 2
    from PySide6.QtWidgets import QInputDialog

    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: ("Greeting chat", True))
    qtbot.mouseClick(w.renameButton, Qt.LeftButton)
    titles = [w.conversationList.item(i).text() for i in range(2)]
    assert "Greeting chat" in titles
    qtbot.keyClicks(w.search, "Greet")
    assert w.conversationList.count() == 1
    w.search.clear()
    qtbot.mouseClick(w.deleteButton, Qt.LeftButton)
    assert w.conversationList.count() == 1 and w.undoButton.isVisible()
    qtbot.mouseClick(w.undoButton, Qt.LeftButton)
    assert w.conversationList.count() == 2


def test_copy_and_export_trace(qtbot, make_window, spin_loop, demo_model_dir, tmp_path):
    from PySide6.QtGui import QGuiApplication

    w = make_window(demo_model_dir)
    final = send(qtbot, w, spin_loop, BUDGET)
    qtbot.mouseClick(w.transcript.views[1].copyButton, Qt.LeftButton)
    assert QGuiApplication.clipboard().text() == final.text
    out = tmp_path / "trace.json"
    w.write_trace(out)
    data = json.loads(out.read_text())
    assert data["trace"]["ttft_ms"] == final.trace["ttft_ms"] and data["model"]["name"] == "kvchat-demo"


def test_unreadable_database_is_moved_aside(qtbot, make_window, demo_model_dir, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "kvchat.db").write_bytes(b"this is not a database" * 100)
    w = make_window(demo_model_dir, data=data)
    assert "moved aside" in w.banner.text()
    aside = list(data.glob("kvchat.db.unreadable-*"))
    assert len(aside) == 1 and aside[0].read_bytes().startswith(b"this is not a database")


def test_locked_database_is_explained_and_the_app_keeps_running(
    qtbot, make_window, spin_loop, demo_model_dir, tmp_path
):
    data = tmp_path / "data"
    data.mkdir()
    Store(data / "kvchat.db").close()
    holder = sqlite3.connect(str(data / "kvchat.db"), isolation_level=None)
    holder.execute("PRAGMA locking_mode=EXCLUSIVE")
    holder.execute("BEGIN EXCLUSIVE")
    try:
        w = make_window(demo_model_dir, data=data)
        assert "locked" in w.banner.text()
        final = send(qtbot, w, spin_loop, BUDGET)
        assert isinstance(final, Finished)
    finally:
        holder.rollback()
        holder.close()


def test_panel_updates_are_throttled(qtbot, make_window, spin_loop, llama_dir, monkeypatch):
    w = make_window(llama_dir, max_new_tokens=400, capacity=1000)
    calls = []
    original = w.statsPanel.show_reply
    monkeypatch.setattr(w.statsPanel, "show_reply", lambda *a, **k: (calls.append(1), original(*a, **k)))
    final = send(qtbot, w, spin_loop, "Hello")
    n = final.trace["tokens"]
    seconds = final.trace["e2e_ms"] / 1000
    assert n >= 100
    assert len(calls) <= seconds * 20 + 5 and len(calls) < n / 2
    # with nothing left to redraw the timer stops (an idle timer costs the GUI thread under qasync);
    # selecting a message starts it again and the panel shows that message's figures
    spin_loop(lambda: not w.pacer.timer.isActive(), 5)
    calls.clear()
    w.select_message(w.transcript.views[1].message.id)  # the reply: it has figures to show
    assert w.pacer.timer.isActive()
    spin_loop(lambda: calls and not w.pacer.timer.isActive(), 5)
    assert len(calls) == 1


def test_precision_switch_and_compare_with_full_precision(qtbot, make_window, spin_loop, demo_model_dir):
    w = make_window(demo_model_dir)
    full_bytes = w.facts["weight_bytes"]
    send(qtbot, w, spin_loop, BUDGET)
    ready = []
    w.modelReady.connect(ready.append)
    from dataclasses import replace

    w.apply_settings(replace(w.settings, model=replace(w.settings.model, weights="int4", kv="int8", group_size=32)))
    spin_loop(lambda: ready, 120)
    assert panel(w, "precisionValue") == "int4/g32, head int8/g32 · int8"
    assert w.facts["weight_bytes"] < full_bytes / 2
    reason = panel(w, "reuseReasonValue")
    assert (
        "weight precision changed (none → int4/g32)" in reason and "KV cache precision changed (none → int8)" in reason
    )
    final = send(qtbot, w, spin_loop, "What is my budget?")
    per = w.facts["kv_bytes_per_position"]
    assert per == 2 * w.facts["layers"] * w.facts["kv_heads"] * (w.facts["head_dim"] + 4)
    assert panel(w, "kvPayloadValue") == fmt_bytes(final.cache["positions"] * per)
    assert "int8 + scales" in panel(w, "kvFormulaValue")
    qtbot.mouseClick(w.transcript.views[-1].compareButton, Qt.LeftButton)
    spin_loop(lambda: getattr(w, "last_comparison", None) is not None, 120)
    r = w.last_comparison
    assert "error" not in r and r["weights"] == "int4/g32" and r["kv"] == "int8" and r["current_is_quantized"]
    assert 0 <= r["top1_agreement"] <= 1 and len(r["kl_per_token"]) == len(r["full_tokens"])
    assert w.compareDialog.isVisible() and "agreement" in w.compareDialog.summary.text()


def test_two_regenerate_clicks_start_one_reply_and_an_open_editor_keeps_its_text(
    qtbot, make_window, spin_loop, demo_model_dir
):
    w = make_window(demo_model_dir)
    send(qtbot, w, spin_loop, BUDGET)
    user_view = w.transcript.views[0]
    qtbot.mouseClick(user_view.editButton, Qt.LeftButton)
    user_view.editor.setPlainText("half-typed edit")  # not saved yet
    got = []
    w.replyFinished.connect(got.append)
    qtbot.mouseClick(w.regenerateButton, Qt.LeftButton)
    w.regenerate()  # a second click in the same event-loop turn
    spin_loop(lambda: got)
    spin_loop(lambda: not w.generating)
    assert len(got) == 1
    reply = w.transcript.views[1].message
    assert reply.status == "complete" and len(w.store.siblings(reply)) == 2  # one new reply, not two
    assert w.transcript.views[0] is user_view and user_view.editor.isVisible()
    assert user_view.editor.toPlainText() == "half-typed edit"


def test_the_panel_says_when_token_1_reached_the_screen(qtbot, make_window, spin_loop, demo_model_dir):
    """On screen: Send to token 1 painted, on TTFT's clock, with the seam's latency beside it."""
    w = make_window(demo_model_dir)
    final = send(qtbot, w, spin_loop, BUDGET)
    shown = w.stats.on_screen_ms
    assert shown is not None and shown >= final.trace["ttft_ms"]
    assert panel(w, "onScreenValue") == f"{fmt_ms(shown)} · seam {shown - final.trace['ttft_ms']:,.1f} ms"


def test_switching_conversations_reuses_the_prefix_store_and_the_panel_shows_it(
    qtbot, make_window, spin_loop, demo_model_dir
):
    """Three conversations; going back to the first shows, before anything is sent, that it is cached,
    and its next reply comes from the prefix store — the panel's tree names all three."""
    w = make_window(demo_model_dir, max_new_tokens=24)
    texts = [BUDGET, "Tell me about the pandas in Chengdu.", "What should I eat in Chengdu on a budget?"]
    for i, text in enumerate(texts):
        if i:
            qtbot.mouseClick(w.newButton, Qt.LeftButton)
        send(qtbot, w, spin_loop, text)
    titles = [title_from(t) for t in texts]
    first = next(c for c in w.store.conversations() if c.title == titles[0])
    seen = []
    w.conversationProbed.connect(seen.append)
    w.select_conversation(first.id)
    spin_loop(lambda: seen)
    n, cached = seen[0]["positions"], seen[0]["cached"]
    assert seen[0]["source"] == "store" and cached >= n - 2  # all of it but the reply's last token or two
    assert panel(w, "conversationCachedValue") == f"{cached:,} of {n:,} positions (prefix store)"
    final = send(qtbot, w, spin_loop, "And for 750 yuan?")
    r = final.reuse
    assert r.source == "store" and r.reused >= cached - 1 and r.copied_bytes > 0
    assert panel(w, "reuseSourceValue").startswith(f"prefix store · {r.copied_positions:,} positions copied")
    store = final.cache["store"]
    assert store["prefixes"] >= 2 and store["bytes"] > 0
    assert w.statsPanel.storeBar.format() == f"{fmt_size(store['bytes'])} of {fmt_size(store['budget'])}"
    assert panel(w, "storePrefixesValue") == f"{store['prefixes']:,} in {store['nodes']:,} blocks of 16 positions"
    tree = w.statsPanel.storeTree
    names = []

    def walk(item):
        names.append(item.text(0))
        for k in range(item.childCount()):
            walk(item.child(k))

    for k in range(tree.topLevelItemCount()):
        walk(tree.topLevelItem(k))
    for title in titles:
        assert any(name.startswith(title) for name in names), (title, names)
    assert any(name.endswith("· working cache") for name in names)
    bold = [n for n in names if tree.findItems(n, Qt.MatchExactly | Qt.MatchRecursive)[0].font(0).bold()]
    assert any(n.startswith(titles[0]) for n in bold), (bold, names)  # what this request took from the store


def test_the_prefix_store_budget_is_a_setting_that_keeps_the_weights(qtbot, make_window, spin_loop, demo_model_dir):
    """The budget set in the settings dialog reaches the store without reloading the model; a budget too
    small for a conversation evicts it, and the panel counts the evictions."""
    from dataclasses import replace

    from desktop.settings_dialog import SettingsDialog

    w = make_window(demo_model_dir)
    send(qtbot, w, spin_loop, BUDGET)
    weights = w.client.worker.loaded
    dialog = SettingsDialog(w.settings, w.db_path, w)
    assert dialog.cacheBudget.text() == "automatic (¼ of free memory)"
    dialog.cacheBudget.setValue(1)  # MiB
    new = dialog.result_settings()
    assert new.model.cache_budget == 2**20
    ready = []
    w.modelReady.connect(ready.append)
    w.apply_settings(new)
    spin_loop(lambda: ready, 120)
    assert w.client.worker.loaded is weights  # only the cache's settings changed: no reload
    assert w.statsPanel.storeBar.format().endswith("of 1.0 MiB")
    w.apply_settings(replace(new, model=replace(new.model, cache_budget=4096)))  # less than one conversation
    spin_loop(lambda: len(ready) == 2, 120)
    qtbot.mouseClick(w.newButton, Qt.LeftButton)
    final = send(qtbot, w, spin_loop, "Tell me about the pandas in Chengdu.")
    store = final.cache["store"]
    assert store["budget"] == 4096 and store["bytes"] <= 4096 and store["evictions"] > 0
    assert (
        panel(w, "storeEvictionsValue") == f"{store['evictions']:,} blocks ({store['evicted_positions']:,} positions)"
    )


def test_int8_activations_are_chosen_in_the_settings_dialog_and_shown_in_the_panel(
    qtbot, make_window, spin_loop, demo_model_dir
):
    """Weights int8 and activations int8, chosen in the dialog: the model reloads, the panel names both and
    what runs the integer products, a reply streams, and the exact path is one choice away again."""
    from desktop.settings_dialog import SettingsDialog
    from engine.backends import kernels

    k = kernels.load()
    if k is None or "int8" not in k.integer_modes:
        pytest.skip(kernels.status())
    w = make_window(demo_model_dir)
    ready = []
    w.modelReady.connect(ready.append)
    dialog = SettingsDialog(w.settings, w.db_path, w)
    assert dialog.activations.currentText() == "float32"  # the exact path by default
    dialog.weights.setCurrentText("int8")
    dialog.group.setCurrentText("32")
    dialog.activations.setCurrentText("int8")
    w.apply_settings(dialog.result_settings())
    spin_loop(lambda: ready, 120)
    assert panel(w, "precisionValue") == "int8/g32, head int8/g32, int8 activations · none"
    tiles = "; int8 in 16-row tiles" if k.int8_integer_tiles else ""  # int8 codes by int8 activations: tiled
    assert panel(w, "kernelsValue") == f"kvchat ({k.isa}; int8 activations: {k.int_isa}{tiles}; {kernels.built(k)})"
    final = send(qtbot, w, spin_loop, BUDGET)
    assert final.token_ids and w.transcript.views[-1].message.status == "complete"
    dialog = SettingsDialog(w.settings, w.db_path, w)
    assert dialog.activations.currentText() == "int8"  # kept in the settings
    dialog.activations.setCurrentText("float32")
    w.apply_settings(dialog.result_settings())
    spin_loop(lambda: len(ready) == 2, 120)
    assert panel(w, "precisionValue") == "int8/g32, head int8/g32 · none"


def test_the_models_dialog_lists_what_is_on_disk_and_opens_one_with_a_click(
    qtbot, make_window, spin_loop, demo_model_dir, tmp_path, monkeypatch
):
    """Models in the Hugging Face cache, LM Studio, Ollama and an added folder (a temporary HOME): the
    dialog lists them with their facts while the window stays live; a double-click loads one, with
    the load's progress shown as a percentage and the file's name."""
    import sys

    sys.path.insert(0, str(tmp_path.parent))
    from model_layouts import NAMES, build

    home = tmp_path / "home"
    where = build(home, tmp_path / "work")
    for var in ("HF_HOME", "HF_HUB_CACHE", "OLLAMA_MODELS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / ".cache"))
    w = make_window(demo_model_dir, model_folders=str(home / "models"), max_new_tokens=16)  # the tiny models hold 256
    dlg = w.open_models_dialog()
    assert w.isEnabled() and dlg.isVisible()  # not modal on the scan: the window is not waiting
    with qtbot.waitSignal(dlg.scanned, timeout=60000):
        pass
    table = dlg.table
    names = [table.item(r, 0).text() for r in range(table.rowCount())]
    assert names[0] == "kvchat-demo" and table.item(0, COLUMNS.index("Source")).text() == "bundled"  # listed first
    assert table.item(0, STATUS).text() == "in use" and table.item(0, 0).font().bold()  # the model loaded now
    assert set(names[1:]) == NAMES and dlg.note.text().startswith(f"{len(NAMES)} models found")
    row = {n: r for r, n in enumerate(names)}
    cells = [table.item(row["tiny-qwen2:q8_0"], c).text() for c in range(table.columnCount())]
    assert [cells[COLUMNS.index(c)] for c in ("Source", "Format", "Architecture", "Quantization")] == [
        "ollama", "gguf", "qwen2", "Q8_0"]  # fmt: skip
    assert cells[STATUS] == "ready"
    view = table.viewport().width()  # at the default size, what a person looks for first is in view
    for column in ("Name", "Status", "Memory"):
        c = COLUMNS.index(column)
        assert table.horizontalHeader().sectionViewportPosition(c) + table.columnWidth(c) <= view, column
    assert cells[COLUMNS.index("KV / position")] == fmt_size(2 * 2 * 2 * 16 * 4)  # 2·L·H_kv·d·b, float32 K/V
    assert cells[COLUMNS.index("Memory")].startswith(("fits", "free memory not known"))
    assert "Weights once loaded: " in table.item(row["tiny-qwen2:q8_0"], 0).toolTip()  # codes and scales, not the file
    assert table.item(row["tiny-gemma"], STATUS).text().startswith("cannot open: unsupported architecture")
    table.selectRow(row["tiny-gemma"])
    assert not dlg.openButton.isEnabled()
    progress, ready = [], []
    w.client.modelLoadProgress.connect(lambda f, what: progress.append((f, what)))
    w.modelReady.connect(ready.append)
    item = table.item(row["tiny-qwen2:q8_0"], 0)
    at = table.visualItemRect(item).center()
    qtbot.mouseClick(table.viewport(), Qt.LeftButton, pos=at)  # a view takes a double-click on what was pressed
    qtbot.mouseDClick(table.viewport(), Qt.LeftButton, pos=at)
    assert dlg.chosen == str(where["ollama"])
    spin_loop(lambda: ready, 120)
    assert w.facts["path"] == str(where["ollama"]) and w.facts["format"] == "gguf"
    assert w.facts["weights"] == "gguf Q8_0" and w.settings.model.path == str(where["ollama"])
    assert progress[0][0] == 0.0 and progress[-1] == (1.0, where["ollama"].name)
    assert w.loadProgress.value() == 100 and w.loadProgress.format() == "100%"
    final = send(qtbot, w, spin_loop, "Hello there")
    assert isinstance(final, Finished)
    assert panel(w, "modelNameValue") == w.facts["name"]


def test_kvchat_starts_on_the_model_it_is_given(tmp_path, smollm2_gguf):
    """`kvchat --model FILE.gguf`: the real SmolLM2 file, offscreen, as a person would start it."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", KVCHAT_DATA_DIR=str(tmp_path / "data"))
    cmd = [sys.executable, "-m", "desktop", "--check", "--model", str(smollm2_gguf)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    facts = json.loads(r.stdout.strip().splitlines()[-1])
    assert facts["name"] == smollm2_gguf.name and facts["format"] == "gguf"
    assert facts["architecture"] == "LlamaForCausalLM"
    assert "QObject" not in r.stderr and "malformed" not in r.stderr  # it quits cleanly (Qt says nothing)


def test_a_rename_a_lock_holds_back_shows_the_banner_and_is_saved_when_the_lock_goes(
    qtbot, make_window, spin_loop, demo_model_dir, monkeypatch
):
    """Another program holds the database: the window says how many changes wait, shows them as written
    (the list has the new title), offers the copy elsewhere, and saves them once the lock is gone."""
    from PySide6.QtWidgets import QInputDialog

    w = make_window(demo_model_dir)
    send(qtbot, w, spin_loop, "Hello")
    cid = w.chat.current_cid
    other = sqlite3.connect(str(w.db_path), isolation_level=None, timeout=0.1)
    other.execute("BEGIN EXCLUSIVE")  # another program's lock
    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: ("Held title", True))
    qtbot.mouseClick(w.renameButton, Qt.LeftButton)
    banner = w.findChild(type(w.heldBanner.label), "heldBanner")
    assert w.heldBanner.isVisible() and banner.text().startswith("1 change not saved yet")
    assert w.findChild(type(w.sendButton), "saveCopyButton").isVisible()
    assert w.conversationList.currentItem().text() == "Held title"  # read as written
    other.execute("ROLLBACK")  # the lock goes: the next retry (every second) writes it
    qtbot.waitUntil(lambda: not w.heldBanner.isVisible(), timeout=5000)
    other.close()
    check = sqlite3.connect(str(w.db_path))
    assert check.execute("SELECT title FROM conversations WHERE id=?", (cid,)).fetchone()[0] == "Held title"
    check.close()
    assert "every change is saved" in w.statusBar().currentMessage()


def test_a_send_the_database_refuses_is_a_banner_and_the_text_stays_in_the_box(qtbot, make_window, demo_model_dir):
    """A database with a trigger (or a NOT NULL column) that refuses new messages: Send says why in the
    banner and keeps what was typed; nothing is raised past the window."""
    w = make_window(demo_model_dir)
    w.store.db.execute(
        "CREATE TRIGGER refuse BEFORE INSERT ON messages BEGIN SELECT RAISE(ABORT, 'read-only by policy'); END"
    )
    qtbot.keyClicks(w.composer, "Plan three nights in Chengdu.")
    qtbot.mouseClick(w.sendButton, Qt.LeftButton)
    qtbot.waitUntil(lambda: w.banner.isVisible(), timeout=5000)
    assert "read-only by policy" in w.banner.text() and w.composer.toPlainText() == "Plan three nights in Chengdu."
    assert not w.generating


def test_a_second_kvchat_on_the_same_data_folder_brings_the_first_forward_and_ends(
    qtbot, make_window, demo_model_dir, tmp_path
):
    import os
    import subprocess
    import sys

    from desktop.single_instance import SingleInstance

    data = tmp_path / "data"
    w = make_window(demo_model_dir, data=data)
    first = SingleInstance(data)
    assert first.acquire()
    first.listen(w)
    try:
        env = {**os.environ, "KVCHAT_DATA_DIR": str(data), "QT_QPA_PLATFORM": "offscreen"}
        out = subprocess.run(
            [sys.executable, "-m", "desktop", "--check"], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 1 and "kvchat is already open on" in out.stdout and str(os.getpid()) in out.stdout
        w.hide()
        second = SingleInstance(data)
        assert not second.acquire() and second.holder() == os.getpid()
        assert second.wake_other()
        qtbot.waitUntil(w.isVisible, timeout=5000)  # the first came forward
    finally:
        first.release()
    assert SingleInstance(data).acquire()  # released: the next start takes it


def test_the_panel_describes_the_reply_on_screen_after_a_conversation_or_branch_switch(
    qtbot, make_window, spin_loop, demo_model_dir
):
    """The panel's figures are always those of the last reply shown: another conversation's, another
    branch's or the previous request's never stay. Each reply's figures are its own, stored with it."""
    from gui import edit

    from desktop.panel import fmt_ms

    def shown():
        return panel(w, "tokensValue"), panel(w, "ttftValue")

    def stored(mid):
        trace = w.store.message(mid).trace["trace"]
        return str(trace["tokens"]), fmt_ms(trace["ttft_ms"])

    def shows(mid):
        qtbot.waitUntil(lambda: shown() == stored(mid), timeout=3000)

    w = make_window(demo_model_dir, max_new_tokens=6)
    send(qtbot, w, spin_loop, BUDGET)
    a_cid, a_reply = w.chat.current_cid, w.transcript.views[-1].message.id
    shows(a_reply)
    t = w.store.message(a_reply).trace["trace"]  # the reply's footer: its own figures, as stored
    assert w.transcript.views[-1].footerLabel.text() == (
        f"6 tokens · {t['decode_tok_s']:,.1f} tok/s after the first · TTFT {t['ttft_ms']:,.1f} ms · token limit · "
        "kvchat-demo (float32) · same process"
    )
    assert not w.transcript.views[0].footerLabel.isVisible()  # a person's message has none
    qtbot.mouseClick(w.newButton, Qt.LeftButton)
    qtbot.waitUntil(lambda: w.statsPanel.heading.text() == "No reply yet", timeout=3000)  # nothing to describe
    assert panel(w, "tokensValue") != stored(a_reply)[0]
    send(qtbot, w, spin_loop, "Hello there")
    b_reply = w.transcript.views[-1].message.id
    shows(b_reply)
    w.select_conversation(a_cid)  # back to the first conversation: its reply's figures, not the last request's
    shows(a_reply)
    title = w.store.conversation(a_cid).title
    assert w.statsPanel.heading.text().split("\n") == [  # which reply: its state, place and maker
        "Reply · token limit",
        f"“{title}”, message 2 of 2",
        "by kvchat-demo (float32) · same process",
    ]
    # an edit makes a second branch with its own reply; the arrows bring back the first one's figures
    edit(
        qtbot,
        w,
        spin_loop,
        w.transcript.views[0],
        BUDGET_EDITED,
    )
    second = w.transcript.views[-1].message.id
    assert second != a_reply
    shows(second)
    assert w.statsPanel.heading.text().split("\n")[1] == f"“{title}”, message 2 of 2, branch ‹2/2›"
    qtbot.mouseClick(w.transcript.views[0].prevButton, Qt.LeftButton)
    shows(a_reply)
    assert w.transcript.views[-1].message.id == a_reply
    assert w.statsPanel.heading.text().split("\n")[1] == f"“{title}”, message 2 of 2, branch ‹1/2›"


def test_focus_stays_in_the_message_box_after_an_edit_and_a_branch_click(qtbot, make_window, spin_loop, demo_model_dir):
    """The views an edit or a branch arrow rebuilds had the focus: it goes to the message box, not to the
    search field (where the next keystrokes filtered the conversation list to nothing)."""
    from gui import send_then_edit

    w = make_window(demo_model_dir, max_new_tokens=4)
    w.activateWindow()
    qtbot.waitUntil(lambda: w.isActiveWindow())
    send_then_edit(qtbot, w, spin_loop)
    qtbot.waitUntil(lambda: w.focusWidget() is w.composer, timeout=3000)  # the window's focus, active or not
    qtbot.mouseClick(w.transcript.views[0].prevButton, Qt.LeftButton)
    qtbot.waitUntil(lambda: "600 yuan" in w.transcript.views[0].message.content, timeout=3000)
    assert w.focusWidget() is w.composer


def test_the_panel_never_shows_a_negative_seam_a_no_change_change_or_another_replys_reuse(
    qtbot, make_window, demo_model_dir
):
    """A reply shown after one with a reuse report, with none of its own (it failed before its prefill),
    shows no reuse figures; a "change" of a token for itself is no change; a first paint measured before the
    engine's first token (a Continue's) is no seam below zero."""
    from desktop.core.replies import ReplyStats
    from desktop.panel import DASH

    w = make_window(demo_model_dir)
    p = w.statsPanel
    token = {"text": "\n", "id": 198}
    reuse = {"first_invalidated_position": 18, "cached_token": token, "new_token": dict(token), "reused": 18,
             "computed": 4, "invalidated": 3, "reason": "edited", "source": "working"}  # fmt: skip
    trace = {"ttft_ms": 193.4, "tokens": 3}
    p.show_reply(ReplyStats(trace=trace, reuse=reuse, status="finished", reason="eos", stored_on_screen_ms=95.6))
    assert p.values["tokenChangeValue"].text() == DASH and p.values["reusedValue"].text() == "18"
    assert "seam" not in p.values["onScreenValue"].text() and p.values["onScreenValue"].text().startswith("95.6")
    p.show_reply(ReplyStats(status="failed", error="the server went away"))
    for name in ("firstInvalidatedValue", "reusedValue", "recomputedValue", "discardedValue", "reuseReasonValue"):
        assert p.values[name].text() == DASH, name


def test_the_search_field_and_the_editor_answer_the_keyboard(qtbot, make_window, spin_loop, demo_model_dir):
    """Esc clears the search, Down goes to the list and Enter opens the match; a search that finds nothing
    says so; Ctrl+Enter saves an edit; a file name and an imported copy's title read as a person would."""

    from desktop.export_import import file_name

    w = make_window(demo_model_dir, max_new_tokens=4)
    send(qtbot, w, spin_loop, BUDGET)
    first = w.chat.current_cid
    qtbot.mouseClick(w.newButton, Qt.LeftButton)
    send(qtbot, w, spin_loop, "Hello there")
    w.search.setFocus()
    qtbot.keyClicks(w.search, "zebra unicorn")
    qtbot.waitUntil(lambda: w.sidebar.noResults.isVisible(), timeout=3000)
    assert w.conversationList.count() == 0 and "No conversation" in w.sidebar.noResults.text()
    qtbot.keyClick(w.search, Qt.Key_Escape)
    assert w.search.text() == "" and w.conversationList.count() == 2 and not w.sidebar.noResults.isVisible()
    qtbot.keyClicks(w.search, "Chengdu")
    qtbot.waitUntil(lambda: w.conversationList.count() == 1, timeout=3000)
    qtbot.keyClick(w.search, Qt.Key_Return)  # opens the match
    qtbot.waitUntil(lambda: w.chat.current_cid == first, timeout=3000)
    user = w.transcript.views[0]
    qtbot.mouseClick(user.editButton, Qt.LeftButton)
    user.editor.setPlainText(BUDGET_EDITED)
    got = []
    w.replyFinished.connect(got.append)
    qtbot.keyClick(user.editor, Qt.Key_Return, Qt.ControlModifier)
    spin_loop(lambda: got)
    assert "750 yuan" in w.transcript.views[0].message.content
    assert (
        file_name("I am planning a trip to Chengdu for 3 nights. My…")
        == "I am planning a trip to Chengdu for 3 nights My"
    )


def test_every_panel_row_says_what_it_measures(qtbot, make_window, demo_model_dir):
    """Each row of the panel has a tooltip, on its name and on its value, and the same sentence as the value's
    accessible description; positions say that they count the template's tokens, token ids are ids."""
    import html

    from PySide6.QtWidgets import QFormLayout

    from desktop.core.panel_help import ROW_HELP

    w = make_window(demo_model_dir)
    values = w.statsPanel.values
    assert set(values) == set(ROW_HELP)
    for name, v in values.items():
        said = v.accessibleDescription()
        assert len(said) > 20 and said == ROW_HELP[name] and html.unescape(v.toolTip()).endswith(said + "</p>"), name
        form = v.parentWidget().layout()
        assert isinstance(form, QFormLayout) and form.labelForField(v).toolTip() == v.toolTip(), name
    assert "template" in ROW_HELP["firstInvalidatedValue"] and "ids" in ROW_HELP["tokenChangeValue"]


def test_the_context_meter_counts_what_the_next_send_needs_and_warns_before_the_wall(
    qtbot, make_window, spin_loop, demo_model_dir
):
    """Under the message box: the positions the next Send would need (the template's prompt with the
    draft, plus the reply's tokens) against the capacity; near the limit it warns, over it it says Send
    will be refused, and Send is refused with the same number (under the policy that stops at the limit)."""
    w = make_window(demo_model_dir, capacity=160, max_new_tokens=16, overflow="stop")
    tok = w.client.worker.loaded.tokenizer
    probed = []
    w.conversationProbed.connect(probed.append)

    def reads(draft, typed=False):
        probed.clear()
        if typed:
            qtbot.keyClicks(w.composer, draft)
        else:
            w.composer.setPlainText(draft)
        spin_loop(lambda: probed and probed[-1].get("next_positions") is not None and w.composer.toPlainText() == draft)
        return w.contextMeter.text(), w.contextMeter.level

    def need(history, draft):
        return len(tok.apply_chat_template([*history, {"role": "user", "content": draft.strip()}])) + 16 - 1

    text, level = reads("Hi", typed=True)
    assert (text, level) == (f"Next Send: {need([], 'Hi'):,} / 160 positions", "ok")
    assert "+ up to 16 new tokens" in w.contextMeter.toolTip()
    ok = send(qtbot, w, spin_loop, "")  # the composer's text is sent as typed
    assert isinstance(ok, Finished)
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": w.transcript.views[-1].message.content},
    ]
    words = next(k for k in range(1, 200) if need(history, "word " * k) >= 0.85 * 160)
    text, level = reads("word " * words)
    assert level == "near" and text.startswith(f"Next Send: {need(history, 'word ' * words):,} / 160 positions")
    assert "near the limit" in text
    over = next(k for k in range(words, 400) if need(history, "word " * k) > 160)
    text, level = reads("word " * over)
    assert level == "over" and "Send will be refused" in text
    before = w.store.branch(w.chat.current_cid)
    qtbot.keyClick(w.composer, Qt.Key_Return)  # refused before anything is stored: the draft stays, and why
    assert w.banner.isVisible() and f"needs {need(history, 'word ' * over):,} cache positions" in w.banner.text()
    assert w.composer.toPlainText() == "word " * over and not w.generating
    assert w.store.branch(w.chat.current_cid) == before


@pytest.mark.parametrize("theme", ["dark", "light"])
def test_every_tab_stop_shows_where_the_focus_is(qtbot, make_window, spin_loop, demo_model_dir, theme):
    """Tab through the whole window: each widget it reaches looks different with the focus than without."""
    from PySide6.QtWidgets import QApplication

    w = make_window(demo_model_dir, theme=theme)
    send(qtbot, w, spin_loop, "Hi")
    w.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is w, timeout=3000)
    w.composer.setFocus()
    qtbot.waitUntil(lambda: QApplication.focusWidget() is w.composer)
    stops, unmarked = [], []
    while (f := QApplication.focusWidget()) not in stops and len(stops) < 80:
        stops.append(f)
        with_focus = f.grab().toImage()
        f.clearFocus()
        qtbot.wait(10)
        if f.grab().toImage() == with_focus:
            unmarked.append(f.objectName() or type(f).__name__)
        f.setFocus(Qt.TabFocusReason)
        qtbot.wait(10)
        qtbot.keyClick(f, Qt.Key_Tab)
    assert len(stops) >= 20 and not unmarked


def test_the_panel_cannot_be_dragged_away_and_the_status_bar_says_what_is_in_use(
    qtbot, make_window, spin_loop, demo_model_dir
):
    """A drag of the divider stops at the panel's (and the list's) minimum width; after a reply, and once
    any passing message is gone, the status bar still says which model is in use."""
    w = make_window(demo_model_dir)
    split = w.splitter
    split.moveSplitter(split.width(), 2)  # the panel's divider dragged to the window's right edge
    split.moveSplitter(0, 1)  # the list's to the left edge
    qtbot.wait(50)
    assert w.statsPanel.width() >= w.statsPanel.minimumWidth() > 0
    assert w.sidebar.width() >= w.sidebar.minimumSizeHint().width() > 0
    send(qtbot, w, spin_loop, "Hi")
    w.statusBar().clearMessage()
    assert w.statusLine.isVisible() and w.statusLine.text() == "Ready · kvchat-demo on cpu · capacity 2,048 positions"


def test_regenerate_under_greedy_sampling_says_why_it_repeats(qtbot, make_window, spin_loop, demo_model_dir):
    from dataclasses import replace

    w = make_window(demo_model_dir, max_new_tokens=8)
    first = send(qtbot, w, spin_loop, BUDGET)
    assert not w.regenerateHint.isVisible() and "temperature 0" in w.regenerateButton.toolTip()
    got = []
    w.replyFinished.connect(got.append)
    qtbot.mouseClick(w.regenerateButton, Qt.LeftButton)
    spin_loop(lambda: got)
    assert got[0].text == first.text  # greedy: the same reply, and the window says why
    assert w.regenerateHint.isVisible() and "Raise the temperature" in w.regenerateHint.text()
    w.apply_settings(replace(w.settings, temperature=0.8), conversation=True)
    assert not w.regenerateHint.isVisible() and "temperature 0" not in w.regenerateButton.toolTip()


def test_the_settings_dialog_fits_a_laptop_screen_and_parts_this_conversation_from_the_engine(qtbot, tmp_path):
    from desktop.core.settings import Settings
    from desktop.settings_dialog import SettingsDialog

    dlg = SettingsDialog(Settings(), tmp_path / "kvchat.db")
    qtbot.addWidget(dlg)
    tabs = dlg.tabs
    assert [tabs.tabText(i) for i in range(tabs.count())] == ["This conversation", "Reply format", "Tools",
                                                               "Engine (all conversations)",
                                                               "Drafts (all conversations)"]  # fmt: skip
    assert tabs.widget(0).isAncestorOf(dlg.temperature) and tabs.widget(0).isAncestorOf(dlg.system)
    assert tabs.widget(3).isAncestorOf(dlg.capacity) and tabs.widget(3).isAncestorOf(dlg.backend)
    assert tabs.widget(4).isAncestorOf(dlg.speculative) and tabs.widget(4).isAncestorOf(dlg.draftTokens)
    # the Drafts tab: off by default; lookup; a draft model's path, typed where "A draft model…" is chosen
    assert dlg.result_settings().speculative == "" and not dlg.draftPath.isEnabled()
    dlg.speculative.setCurrentIndex(dlg.speculative.findData("lookup"))
    dlg.draftTokens.setValue(8)
    assert (dlg.result_settings().speculative, dlg.result_settings().draft_tokens) == ("lookup", 8)
    dlg.speculative.setCurrentIndex(dlg.speculative.findData("model"))
    assert dlg.draftPath.isEnabled()
    qtbot.keyClicks(dlg.draftPath, "/models/small.gguf")
    assert dlg.result_settings().speculative == "/models/small.gguf"
    assert dlg.sizeHint().height() <= 700  # was ~980 px, one long form
    assert dlg.capacity.specialValueText() == "model default: min(context, 4,096)"


def test_the_app_and_the_server_take_the_same_capacity_by_default(smollm2_gguf, tmp_path, monkeypatch):
    """One default for the same file: the app's settings (capacity left to the model) and `engine serve`; the app
    alone keeps a disk tier, in its data folder."""
    from desktop.core.settings import DISK_FOLDER, Settings
    from desktop.settings_dialog import open_settings
    from engine.cli import parser
    from engine.spec import LoadSpec

    monkeypatch.setenv("KVCHAT_DATA_DIR", str(tmp_path))
    app = dataclasses.replace(Settings.load(open_settings(tmp_path)).engine(), path=str(smollm2_gguf))
    served = LoadSpec.from_args(parser().parse_args(["serve", "--model", str(smollm2_gguf)]))
    assert app.disk_cache == str(tmp_path / DISK_FOLDER) and served.disk_cache is None
    assert dataclasses.replace(app, disk_cache=None) == served  # the same spec: capacity left to the engine in both
    _, a = app.open()
    _, b = served.open()
    assert a.cache.capacity == b.cache.capacity == 4096  # min(its context 8,192, 4,096)


def test_long_values_wrap_in_the_panel_instead_of_scrolling_it_sideways(qtbot, make_window, demo_model_dir):
    w = make_window(demo_model_dir)
    path = "/home/someone/models/" + "very-long-model-name-" * 6 + "Q4_K_M.gguf"
    w.statsPanel.show_model({**w.facts, "name": path, "decode_kernels": "x" * 120})
    w.statsPanel.set("reuseReasonValue", "cache dropped: " + "rotary_embedding_changed_" * 8)
    qtbot.wait(100)
    body, view = w.statsPanel.widget(), w.statsPanel.viewport()
    assert body.width() <= view.width() and not w.statsPanel.horizontalScrollBar().isVisible()
    assert panel(w, "modelNameValue") == path  # all of it, wrapped
    label = w.statsPanel.values["modelNameValue"]
    assert label.height() > label.fontMetrics().height() * 2 and label.width() <= view.width()


def test_the_prefix_store_tells_apart_two_prompts_of_the_same_title(qtbot, make_window, spin_loop, demo_model_dir):
    """Two conversations whose titles are cut to the same words: their leaves in the store's tree say
    where they part (the text each starts with), so they are not two identical rows."""
    w = make_window(demo_model_dir, max_new_tokens=4)
    for text in (BUDGET, "Hello there", BUDGET_EDITED, "Hi"):  # each switch moves the one before into the store
        if text != BUDGET:
            qtbot.mouseClick(w.newButton, Qt.LeftButton)
        final = send(qtbot, w, spin_loop, text)
    assert title_from(BUDGET) == title_from(BUDGET_EDITED)
    tree = w.statsPanel.storeTree
    leaves = []

    def walk(item):
        if not item.childCount():
            leaves.append(item.text(0))
        for k in range(item.childCount()):
            walk(item.child(k))

    for k in range(tree.topLevelItemCount()):
        walk(tree.topLevelItem(k))
    same = [leaf for leaf in leaves if leaf.startswith(title_from(BUDGET))]
    assert len(same) == 2 and same[0] != same[1], leaves
    assert any("600" in leaf for leaf in same) and any("750" in leaf for leaf in same), leaves
    assert final.cache["store"]["tree"][0]["text"]  # the engine names what each segment starts with
