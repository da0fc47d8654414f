"""A reply token by token in the real window: the panel's confidence figures against the engine's own, the
token colours switched on, a token's figures on the keyboard, and the figures kept with the reply."""

import dataclasses
import json
import math

from gui import BUDGET, panel, send
from PySide6.QtCore import Qt

from desktop.core.panel_words import fmt_figure
from desktop.token_view import BINS, bin_of
from engine.events import Finished
from engine.logprobs import LOW_CONFIDENCE


def test_a_reply_carries_each_tokens_figures_and_the_panel_sums_them(qtbot, make_window, spin_loop, demo_model_dir,
                                                                     tmp_path):  # fmt: skip
    w = make_window(demo_model_dir)
    final = send(qtbot, w, spin_loop, BUDGET)
    assert isinstance(final, Finished) and len(final.logprobs) == len(final.token_ids) > 3
    lps = [s.logprob for s in final.logprobs]
    mean = sum(lps) / len(lps)
    low = sum(lp < math.log(LOW_CONFIDENCE) for lp in lps)
    assert panel(w, "meanLogprobValue") == f"{fmt_figure(mean)} nats over {len(lps):,} tokens"  # never -0.000
    assert panel(w, "perplexityValue") == f"{math.exp(-mean):,.2f}"
    assert panel(w, "lowConfidenceValue").startswith(f"{low:,} of {len(lps):,}")
    assert all(len(s.top) == 5 for s in final.logprobs)  # the settings' default alternatives

    reply = w.transcript.views[1]
    kept = reply.message.trace["tokens"]  # stored with the reply
    assert [t["token_id"] for t in kept] == list(final.token_ids)
    assert "".join(t["shown"] for t in kept) == reply.message.content
    w.write_trace(tmp_path / "trace.json")
    exported = json.loads((tmp_path / "trace.json").read_text())
    assert [t["logprob"] for t in exported["tokens"]] == lps
    assert exported["confidence"]["low_confidence"] == low

    # Colours on: the reply is shown token by token, each token's background from its bin, the legend shown.
    assert not reply.tokenView or not reply.tokenView.isVisible()
    w.tokenColours.setCurrentIndex(w.tokenColours.findData("probability"))
    view = reply.tokenView
    assert view is not None and view.isVisibleTo(w) and not reply.reply.isVisibleTo(w)
    assert view.toPlainText() == reply.message.content
    assert w.tokenLegend.isVisibleTo(w) and "< 20%" in w.tokenLegend.accessibleDescription()
    for k, i in enumerate(view.at):
        cursor = view.textCursor()
        cursor.setPosition(view.starts[k] + 1)
        brush = cursor.charFormat().background()  # the format of the token's first character
        want = BINS["probability"][bin_of(kept[i], "probability")][1]
        assert (brush.color().name() if brush.style() != Qt.NoBrush else None) == want

    # The keyboard moves token by token, and the token's figures are said.
    view.setFocus()
    qtbot.keyClick(view, Qt.Key_Right)
    qtbot.keyClick(view, Qt.Key_Right)
    second = view.at[1]
    assert view.current == second
    said = view.accessibleDescription()
    assert f"Token {second + 1}: {kept[second]['text']!r}" in said
    assert f"p {100 * math.exp(kept[second]['logprob']):.1f}% raw" in said
    assert all(repr(a["text"]) in said for a in kept[second]["top"])

    w.tokenColours.setCurrentIndex(w.tokenColours.findData("entropy"))
    assert "nats" in w.tokenLegend.accessibleDescription() and view.mode == "entropy"
    w.tokenColours.setCurrentIndex(w.tokenColours.findData("off"))
    assert reply.reply.isVisibleTo(w) and not view.isVisibleTo(w) and not w.tokenLegend.isVisibleTo(w)
    assert w.settings.token_colours == "off"


def wait_reply(qtbot, w, spin_loop, click, timeout=120):
    got = []
    w.replyFinished.connect(got.append)
    click()
    spin_loop(lambda: got, timeout)
    w.replyFinished.disconnect(got.append)
    return got[0]


def test_a_fork_from_a_token_reuses_every_position_before_it(qtbot, make_window, spin_loop, demo_model_dir):
    w = make_window(demo_model_dir)
    first = send(qtbot, w, spin_loop, BUDGET)
    prompt = first.trace["prompt_tokens"]
    w.tokenColours.setCurrentIndex(w.tokenColours.findData("probability"))
    view = w.transcript.views[1].tokenView
    kept = w.transcript.views[1].message.trace["tokens"]
    i = next(k for k in range(2, len(kept)) if len(kept[k]["top"]) > 1)  # a token with an alternative
    alt = next(a for a in kept[i]["top"] if a["token_id"] != kept[i]["token_id"])
    view.move_to(i)
    row = w.transcript.views[1].forkRow
    assert row.isVisibleTo(w) and f"Token {i + 1}" in row.label.text()
    button = next(b for b in row.buttons if b.text().startswith(repr(alt["text"])))
    final = wait_reply(qtbot, w, spin_loop, lambda: qtbot.mouseClick(button, Qt.LeftButton))
    assert isinstance(final, Finished)
    # Every position before the fork was reused (the prompt and the reply's first i tokens); the fork's token
    # alone was computed.
    assert final.reuse.reused == prompt + i and final.reuse.computed == 1
    assert panel(w, "reusedValue") == f"{prompt + i:,}" and panel(w, "recomputedValue") == "1"
    forked = w.transcript.views[1]
    assert forked.branchLabel.text() == "2/2" and forked.branchLabel.isVisible()
    steps = forked.message.trace["tokens"]
    assert [s["token_id"] for s in steps[:i]] == [s["token_id"] for s in kept[:i]]
    assert steps[i]["token_id"] == alt["token_id"] and steps[i]["forked"]
    assert [s["token_id"] for s in steps[i + 1 :]] == list(final.token_ids)
    assert forked.message.content == "".join(s["shown"] for s in steps)
    assert forked.message.content.startswith("".join(s["shown"] for s in kept[:i]))
    assert forked.message.token_count == len(steps)
    # The arrows go back to the reply it was forked from.
    qtbot.mouseClick(forked.prevButton, Qt.LeftButton)
    assert w.transcript.views[1].message.trace["tokens"][i]["token_id"] == kept[i]["token_id"]

    # Regenerate from here: the same positions kept, the token at i drawn again (greedy: the same token).
    view = w.transcript.views[1].tokenView
    view.move_to(i)
    again = w.transcript.views[1].forkRow.buttons[-1]
    assert again.text() == "Regenerate from here"
    final = wait_reply(qtbot, w, spin_loop, lambda: qtbot.mouseClick(again, Qt.LeftButton))
    assert final.reuse.reused == prompt + i - 1 and final.reuse.computed == 1  # the last kept position: its logits
    assert w.transcript.views[1].branchLabel.text() == "3/3"


def test_a_server_that_sends_no_logprobs_is_said_so_and_one_that_does_is_read(qtbot):
    from desktop.core.replies import ReplyStats
    from desktop.panel import NOT_REPORTED_LOGPROBS, StatsPanel
    from engine.events import ReuseReport, Token
    from engine.logprobs import StepLogprobs

    reuse = ReuseReport(0, 5, 0, None, None, None, None, source="unknown")
    cache = {"positions": 6, "capacity": 64}
    silent = ReplyStats(status="decoding")
    silent.apply(Token(1, -1, "Hi", 1.0, None))
    silent.apply(Finished("eos", "Hi", (), {"tokens": 1}, cache, reuse))
    assert silent.steps_reported is False and silent.steps == []
    p = StatsPanel()
    qtbot.addWidget(p)
    p.show_confidence(silent)
    assert p.values["meanLogprobValue"].text() == NOT_REPORTED_LOGPROBS

    told = ReplyStats(status="decoding")
    told.apply(Token(1, -1, "Hi", 1.0, None))
    step = StepLogprobs("Hi", math.log(0.25), None, None, None, None, ())  # OpenAI's fields only
    told.apply(Finished("eos", "Hi", (), {"tokens": 1}, cache, reuse, "", (step,)))
    assert told.steps_reported and told.steps[0]["shown"] == "Hi" and told.steps[0]["token_id"] == -1
    p.show_confidence(told)
    assert p.values["lowConfidenceValue"].text() == "1 of 1 (100%)"
    assert p.values["perplexityValue"].text() == "4.00"


def test_a_reply_too_short_to_draft_says_so_in_the_panel(qtbot, make_window, spin_loop, llama_dir):
    """A reply of two tokens with lookup drafts ends before its first drafting round (token 1 from the prompt, the
    next the model's own step that drafting is weighed against): the panel says that, not that drafts did not pay,
    and shows no by-position rates or speed ratio for it."""
    from desktop.core.panel_words import draft_rows

    w = make_window(llama_dir, max_new_tokens=2, speculative="lookup", draft_tokens=4)
    final = send(qtbot, w, spin_loop, "the cache the cache the cache")
    spec = final.trace["speculative"]
    assert spec["drafted"] == 0 and spec["plain_steps"] == 1
    assert panel(w, "draftValue") == "n-gram lookup in the conversation · up to 4 a round"
    assert panel(w, "acceptedValue") == (
        "nothing drafted: the reply ended before its first drafting round (its first steps are the model's own)"
    )
    assert panel(w, "byPositionValue") == "—" and panel(w, "draftCostValue") == "—"
    assert panel(w, "speedupValue") == "— (the model ran alone)"
    # the other reasons, from the counts alone: lookup that never matched, no room, a server's report
    longer = {**spec, "plain_steps": 40}
    assert "never occurred earlier in the conversation" in draft_rows(longer, [])["acceptedValue"]
    assert "no room to draft" in draft_rows({**longer, "draft": "int4"}, [])["acceptedValue"]
    server = {"draft": "the server's", "label": "the server's own draft", "drafted": 0, "accepted": 0}
    assert draft_rows(server, [])["acceptedValue"] == "nothing drafted: the server drafted none for this reply"


def test_a_reply_with_drafts_shows_them_token_by_token_and_in_the_panel(qtbot, make_window, spin_loop, llama_dir):
    """Drafts from the model itself in int4 (Settings' Drafts tab): the reply is the model's own token for token
    (Regenerate without drafts gives the same), its footer names the draft, the panel's Speculative decoding rows
    give the engine's counts and what the acceptance means, and *Tokens by drafts* colours each token by its part
    in them, with the legend."""
    from desktop.token_view import DRAFT_WORDS

    w = make_window(llama_dir, max_new_tokens=60, speculative="int4", draft_tokens=3)
    final = send(qtbot, w, spin_loop, "the cache the cache the cache")
    spec = final.trace["speculative"]
    assert spec["draft"] == "int4" and spec["k"] == 3 and spec["drafted"] > 0 and spec["accepted"] > 0
    assert panel(w, "draftValue") == "the model itself in int4 · up to 3 a round"
    accepted = panel(w, "acceptedValue")
    assert accepted.startswith(f"{spec['accepted']:,} of {spec['drafted']:,} drafted ({spec['acceptance']:.0%})")
    assert "4-bit weights agree with the full ones" in accepted
    assert panel(w, "byPositionValue").startswith("1st ") and "drafting " in panel(w, "draftCostValue")
    assert panel(w, "speedupValue").endswith("both measured in this reply")
    reply = w.transcript.views[1]
    assert f"drafts: int4, {spec['acceptance']:.0%} accepted" in reply.footerLabel.text()
    kept = reply.message.trace["tokens"]
    assert {t["draft"] for t in kept} <= {"accepted", "corrected", "target"} and any(
        t["draft"] == "accepted" for t in kept
    )
    w.tokenColours.setCurrentIndex(w.tokenColours.findData("drafts"))
    view = reply.tokenView
    assert "drafted, accepted" in w.tokenLegend.accessibleDescription()
    for k, i in enumerate(view.at):
        cursor = view.textCursor()
        cursor.setPosition(view.starts[k] + 1)
        brush = cursor.charFormat().background()
        want = BINS["drafts"][bin_of(kept[i], "drafts")][1]
        assert (brush.color().name() if brush.style() != Qt.NoBrush else None) == want
    first = next(k for k, i in enumerate(view.at) if kept[i]["draft"] == "accepted")
    assert DRAFT_WORDS["accepted"] in view.details(view.at[first])

    got = []
    w.replyFinished.connect(got.append)
    w.apply_settings(dataclasses.replace(w.settings, speculative=""))
    qtbot.mouseClick(w.regenerateButton, Qt.LeftButton)
    spin_loop(lambda: got)
    assert got[0].token_ids == final.token_ids and got[0].trace["speculative"] is None  # greedy: the same reply
    assert panel(w, "draftValue") == "none (Settings → Speculative decoding)"
