"""Overflow policies: a conversation far over a small capacity still gets a reply — the prompt leaves whole turns
out (never the system prompt nor the last turn), the reply equals a fresh session's fed the same shortened
conversation, and the cache follows the validity rule: reuse stops at the first position that changed."""

import pytest
from conversations import SYSTEM, long_conversation, question

from engine.errors import CapacityError
from engine.events import Failed, Finished, PrefillStarted
from engine.session import OVERFLOW_POLICIES, Request, Session, turns
from engine.weights.loading import load_model


def run(session, messages, **kw):
    kw.setdefault("max_new_tokens", 16)
    events = list(session.generate(Request(messages=messages, **kw)))
    start = next((e for e in events if isinstance(e, PrefillStarted)), None)
    return events[-1], start


@pytest.fixture(scope="module")
def demo():
    return load_model(None)


@pytest.mark.parametrize("policy", ["drop-oldest", "truncate-middle"])
def test_each_policy_fits_a_conversation_far_over_the_capacity_and_replies_as_a_fresh_session(demo, policy):
    msgs = long_conversation(8)
    s = Session(demo, capacity=160)
    final, start = run(s, msgs, overflow=policy)
    assert isinstance(final, Finished), final
    r = final.reuse
    full = len(Session(demo, capacity=4096).tokenize(Request(messages=msgs)))
    assert full > 2 * 160  # far over the capacity
    assert start.prompt_tokens + 16 - 1 <= 160 and r.dropped_positions == full - start.prompt_tokens
    gone = set(r.dropped_messages)
    assert 0 not in gone and len(msgs) - 1 not in gone  # the system prompt and the last turn stay
    kept_turns = [t for t in turns(msgs) if not gone & set(t)]
    assert all(set(t) <= gone for t in turns(msgs) if gone & set(t))  # whole turns, never half of one
    if policy == "truncate-middle":
        assert kept_turns[0] == turns(msgs)[0]  # the first turn is kept while the middle can go
    else:
        assert kept_turns == turns(msgs)[-len(kept_turns) :]  # the newest turns
    assert r.overflow == policy and "left out to fit the cache" in r.reason

    kept = [m for i, m in enumerate(msgs) if i not in gone]
    fresh, fresh_start = run(Session(demo, capacity=160), kept)
    assert fresh.token_ids == final.token_ids and fresh_start.prompt_token_ids == start.prompt_token_ids
    # One turn more would not have fitted: as few messages left out as it takes.
    back = min(gone) if policy == "drop-oldest" else max(gone)
    turn = next(t for t in turns(msgs) if back in t)
    wider = [m for i, m in enumerate(msgs) if i not in gone or i in turn]
    assert len(Session(demo, capacity=160).tokenize(Request(messages=wider))) + 16 - 1 > 160


@pytest.mark.parametrize("policy", ["drop-oldest", "truncate-middle"])
def test_reuse_stops_at_the_first_position_the_dropping_changed(demo, policy):
    """A chat that grows past the capacity turn by turn on one session: when turns start to be left out, the
    cache is cut where the new prompt first differs from what it holds — at the first dropped turn — and every
    reply equals a fresh session's on the same shortened conversation."""
    s = Session(demo, capacity=200)
    msgs, seen_drop = [SYSTEM], False
    for i in range(10):
        msgs.append(question(i))
        before = list(s.ids)
        final, start = run(s, msgs, overflow=policy)
        assert isinstance(final, Finished), final
        r = final.reuse
        prompt = list(start.prompt_token_ids)
        lcp = next((k for k, (a, b) in enumerate(zip(before, prompt)) if a != b), min(len(before), len(prompt)))
        assert r.reused == min(lcp, len(prompt) - 1)
        if r.dropped_messages and not seen_drop:
            seen_drop = True
            first = min(r.dropped_messages)
            # The first dropped turn began right after what stays the same: the system prompt (and, under
            # truncate-middle, the first turn), all of which the cache keeps.
            kept_before = Session(demo).tokenize(Request(messages=msgs[:first], add_generation_prompt=False))
            assert r.first_invalidated_position is not None and r.first_invalidated_position >= len(kept_before) - 1
            assert r.reused >= len(kept_before) - 1
            if policy == "truncate-middle":
                assert r.reused > len(Session(demo).tokenize(Request(messages=[SYSTEM])))  # the first turn kept
        gone = set(r.dropped_messages)
        kept = [m for k, m in enumerate(msgs) if k not in gone]
        fresh, _ = run(Session(demo, capacity=200), kept)
        assert fresh.token_ids == final.token_ids
        msgs.append({"role": "assistant", "content": final.text})
    assert seen_drop


def test_stop_refuses_and_a_last_turn_too_long_is_a_clear_error(demo):
    msgs = long_conversation(8)
    final, _ = run(Session(demo, capacity=160), msgs)  # the default: stop at the limit, as before
    assert isinstance(final, Failed) and final.kind == "CapacityError"
    huge = [SYSTEM, {"role": "user", "content": "plan " * 400}]
    for policy in ("drop-oldest", "truncate-middle"):
        final, _ = run(Session(demo, capacity=160), huge, overflow=policy)
        assert isinstance(final, Failed) and "even with only the system prompt and the last turn" in final.error
    final, _ = run(Session(demo, capacity=160), msgs, overflow="rolling")
    assert isinstance(final, Failed) and "overflow must be one of" in final.error
    assert set(OVERFLOW_POLICIES) == {"stop", "drop-oldest", "truncate-middle"}


def test_a_raw_prompt_loses_its_oldest_or_middle_tokens(demo):
    s = Session(demo, capacity=64)
    text = " ".join(f"word{i}" for i in range(200))
    ids = s.tokenize(Request(prompt=text))
    for policy, want in (
        ("drop-oldest", ids[len(ids) - (64 - 8 + 1) :]),
        ("truncate-middle", ids[: (64 - 8 + 1) // 2] + ids[len(ids) - (64 - 8 + 1 - (64 - 8 + 1) // 2) :]),
    ):
        final, start = run(Session(demo, capacity=64), None, prompt=text, max_new_tokens=8, overflow=policy)
        assert isinstance(final, Finished) and list(start.prompt_token_ids) == want
        assert final.reuse.dropped_positions == len(ids) - len(want) and final.reuse.dropped_messages == ()


def test_the_probe_counts_the_prompt_a_policy_would_send(demo):
    msgs = long_conversation(8)
    s = Session(demo, capacity=160)
    seen = s.cached_positions(Request(messages=msgs, max_new_tokens=16, overflow="drop-oldest"))
    final, start = run(s, msgs, overflow="drop-oldest")
    assert seen["positions"] == start.prompt_tokens and seen["dropped_messages"] == list(final.reuse.dropped_messages)
    assert "error" in s.cached_positions(Request(messages=[SYSTEM, {"role": "user", "content": "plan " * 400}],
                                                 overflow="drop-oldest"))  # fmt: skip
    with pytest.raises(CapacityError):
        s.fit(Request(messages=[SYSTEM, {"role": "user", "content": "plan " * 400}], overflow="truncate-middle"))
