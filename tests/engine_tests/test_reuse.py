"""Prefix reuse: cached output equals a recompute from scratch; edits cut the cache exactly."""

import pytest
import torch
from conftest import DEVICES
from conversations import BUDGET_CHAT, edit_the_first_message

from engine.events import Finished, PrefillStarted
from engine.kv_cache import KVCache
from engine.session import Request, Session
from engine.weights.loading import load_model


def reply(session, **kw):
    kw.setdefault("max_new_tokens", 12)
    events = list(session.generate(Request(**kw)))
    assert isinstance(events[-1], Finished), events[-1]
    start = next(e for e in events if isinstance(e, PrefillStarted))
    return events[-1], start


def greedy_uncached(loaded, prompt_ids, n):
    ids = torch.tensor([prompt_ids], device=loaded.device)
    out = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(loaded.model(ids)[0, -1].argmax())  # the whole prefix, every step
            if nxt in loaded.tokenizer.stop_ids:
                break
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]], device=loaded.device)], dim=1)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_cached_equals_uncached_every_step(llama_dir, device):
    loaded = load_model(llama_dir, device=device, dtype="float32")
    cfg = loaded.config
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 128, torch.float32, device)
    ids = torch.tensor([[3, 17, 42, 99, 7, 250, 31]], device=device)
    with torch.no_grad():
        logits = loaded.model(ids, cache)
        for _ in range(25):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            logits = loaded.model(nxt, cache)
            full = loaded.model(ids)
            torch.testing.assert_close(logits[:, -1], full[:, -1], rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_one_pass(llama_dir):
    loaded = load_model(llama_dir, device="cpu", dtype="float32")
    prompt = tuple(range(5, 60))
    a, _ = reply(Session(loaded, capacity=128, prefill_chunk=7), prompt_ids=prompt)
    b, _ = reply(Session(loaded, capacity=128, prefill_chunk=512), prompt_ids=prompt)
    assert a.token_ids == b.token_ids
    assert list(a.token_ids) == greedy_uncached(loaded, list(prompt), 12)


CHAT = BUDGET_CHAT


def test_edit_then_reuse_equals_fresh_run(llama_dir):
    loaded = load_model(llama_dir, device="cpu", dtype="float32")
    _, follow, (again, start), fresh = edit_the_first_message(loaded, reply, lambda: Session(loaded, capacity=256))
    assert again.token_ids == fresh.token_ids
    prompt = list(start.prompt_token_ids)
    old_prompt = loaded.tokenizer.apply_chat_template(follow)
    first_diff = next(i for i, (a, b) in enumerate(zip(old_prompt, prompt)) if a != b)
    r = start.reuse
    assert r.first_invalidated_position == first_diff == r.reused
    assert r.computed == len(prompt) - first_diff
    assert r.cached_token["id"] == old_prompt[first_diff] and r.new_token["id"] == prompt[first_diff]
    assert "6" in r.cached_token["text"] and "7" in r.new_token["text"]
    assert again.cache["positions"] == len(prompt) + len(again.token_ids) - 1


def test_follow_up_reuses_whole_history(llama_dir):
    loaded = load_model(llama_dir, device="cpu", dtype="float32")
    session = Session(loaded, capacity=256)
    first, start1 = reply(session, messages=CHAT)
    assert start1.reuse.first_invalidated_position is None and start1.reuse.reused == 0
    cached = list(session.ids)
    follow = CHAT + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Thanks"}]
    _, start = reply(session, messages=follow)
    prompt = list(start.prompt_token_ids)
    lcp = next((i for i, (a, b) in enumerate(zip(cached, prompt)) if a != b), min(len(cached), len(prompt)))
    assert start.reuse.reused == lcp >= len(loaded.tokenizer.apply_chat_template(CHAT))
    assert start.reuse.invalidated == len(cached) - lcp


def test_identical_prompt_recomputes_only_the_last_position(llama_dir):
    loaded = load_model(llama_dir, device="cpu", dtype="float32")
    session = Session(loaded, capacity=256)
    a, s1 = reply(session, prompt_ids=tuple(range(10, 30)))
    b, s2 = reply(session, prompt_ids=tuple(range(10, 30)))
    assert a.token_ids == b.token_ids
    r = s2.reuse
    assert (r.reused, r.computed, r.first_invalidated_position) == (19, 1, 19)
    assert r.invalidated == 20 + len(a.token_ids) - 1 - 19
    assert r.cached_token == r.new_token  # same token: cut only because its logits are needed
    assert "last" in r.reason


def test_shorter_prompt(llama_dir):
    loaded = load_model(llama_dir, device="cpu", dtype="float32")
    session = Session(loaded, capacity=256)
    reply(session, prompt_ids=tuple(range(10, 30)))
    b, s = reply(session, prompt_ids=tuple(range(10, 20)))
    assert (s.reuse.reused, s.reuse.computed, s.reuse.first_invalidated_position) == (9, 1, 9)
    fresh, _ = reply(Session(loaded, capacity=256), prompt_ids=tuple(range(10, 20)))
    assert b.token_ids == fresh.token_ids


def test_change_at_position_0_and_at_the_last_position(llama_dir):
    loaded = load_model(llama_dir, device="cpu", dtype="float32")
    session = Session(loaded, capacity=256)
    base = list(range(10, 30))
    reply(session, prompt_ids=tuple(base))
    _, s = reply(session, prompt_ids=tuple([99] + base[1:]))
    assert (s.reuse.reused, s.reuse.first_invalidated_position, s.reuse.computed) == (0, 0, 20)
    assert s.reuse.cached_token["id"] == 10 and s.reuse.new_token["id"] == 99
    before = list(session.ids)
    last = [99] + base[1:-1] + [77]
    out, s = reply(session, prompt_ids=tuple(last))
    assert (s.reuse.reused, s.reuse.first_invalidated_position, s.reuse.computed) == (19, 19, 1)
    assert s.reuse.cached_token["id"] == before[19] and s.reuse.new_token["id"] == 77
    fresh, _ = reply(Session(loaded, capacity=256), prompt_ids=tuple(last))
    assert out.token_ids == fresh.token_ids


def test_edit_of_an_assistant_message(llama_dir):
    loaded = load_model(llama_dir, device="cpu", dtype="float32")
    session = Session(loaded, capacity=256)
    convo = CHAT + [{"role": "assistant", "content": "Chengdu is lovely."}, {"role": "user", "content": "And food?"}]
    reply(session, messages=convo)
    edited = CHAT + [{"role": "assistant", "content": "Chengdu is spicy."}, {"role": "user", "content": "And food?"}]
    out, s = reply(session, messages=edited)
    expect = loaded.tokenizer.apply_chat_template(edited)
    old = loaded.tokenizer.apply_chat_template(convo)
    diff = next(i for i, (a, b) in enumerate(zip(old, expect)) if a != b)
    assert s.reuse.first_invalidated_position == diff > len(loaded.tokenizer.apply_chat_template(CHAT))
    fresh, _ = reply(Session(loaded, capacity=256), messages=edited)
    assert out.token_ids == fresh.token_ids


def test_dtype_change_drops_the_cache_with_its_reason(llama_dir):
    session = Session(load_model(llama_dir, device="cpu", dtype="float32"), capacity=256)
    reply(session, messages=CHAT)
    n = len(session.ids)
    session.set_model(load_model(llama_dir, device="cpu", dtype="bfloat16"))
    _, s = reply(session, messages=CHAT)
    assert s.reuse.reused == 0 and s.reuse.invalidated == n and s.reuse.first_invalidated_position == 0
    assert "dtype changed (float32 → bfloat16)" in s.reuse.reason
    _, s = reply(session, messages=CHAT)  # and then reuse resumes
    assert s.reuse.reused > 0 and "dropped" not in (s.reuse.reason or "")


def test_a_rotary_change_drops_the_cache_with_the_settings_in_words(llama_dir):
    from engine.config import RopeConfig
    from engine.session import fingerprint_change

    loaded = load_model(llama_dir, device="cpu", dtype="float32")
    old = loaded.fingerprint
    new = {**old, "rope": RopeConfig(theta=500000.0, type="llama3", factor=32.0).describe()}
    reason = fingerprint_change(old, new)
    assert reason.startswith("cache dropped: rotary embedding changed (θ 10,000 → θ 500,000, llama3 scaling ×32")
    assert "RopeConfig" not in reason and "=" not in reason  # written for people, not a repr
    # exact, as the fingerprint must be: settings that differ anywhere never read as the same
    variants = [
        RopeConfig(theta=10000.0),
        RopeConfig(theta=10000.000001),
        RopeConfig(factors=(1.0, 2.0)),
        RopeConfig(factors=(1.0, 2.5)),
        RopeConfig(type="yarn", factor=4.0),
        RopeConfig(type="llama3", factor=4.0),
        RopeConfig(type="llama3", factor=4.0, low_freq_factor=1.5),
    ]
    assert len({r.describe() for r in variants}) == len(variants)


def test_other_weights_drop_the_cache(llama_dir, tmp_path):
    from checkpoints import make_checkpoint

    other = make_checkpoint(tmp_path / "other", "llama", seed=1)
    session = Session(load_model(llama_dir, device="cpu", dtype="float32"), capacity=256)
    reply(session, messages=CHAT)
    session.set_model(load_model(other, device="cpu", dtype="float32"))
    _, s = reply(session, messages=CHAT)
    assert s.reuse.reused == 0 and "weights changed" in s.reuse.reason


def test_capacity_refused_before_compute(llama_dir):
    session = Session(load_model(llama_dir, device="cpu", dtype="float32"), capacity=32)
    events = list(session.generate(Request(prompt_ids=tuple(range(5, 25)), max_new_tokens=20)))
    assert [type(e).__name__ for e in events] == ["Failed"]
    assert "capacity is 32" in events[0].error and events[0].kind == "CapacityError"
    assert session.cache.length == 0  # nothing computed
    events = list(session.generate(Request(prompt_ids=tuple(range(5, 25)), max_new_tokens=20, stop_on_capacity=True)))
    fin = events[-1]
    assert fin.reason == "capacity" and fin.cache["positions"] == 32 and len(fin.token_ids) == 13


def test_exact_fit_is_allowed(llama_dir):
    session = Session(load_model(llama_dir, device="cpu", dtype="float32"), capacity=32)
    fin = list(session.generate(Request(prompt_ids=tuple(range(5, 25)), max_new_tokens=13)))[-1]
    assert fin.reason == "max_new_tokens" and fin.cache["positions"] == 32


def test_cancel_between_tokens_and_in_prefill(llama_dir):
    import threading

    session = Session(load_model(llama_dir, device="cpu", dtype="float32"), capacity=256, prefill_chunk=4)
    cancel = threading.Event()
    got = []
    for ev in session.generate(Request(prompt_ids=tuple(range(5, 25)), max_new_tokens=50), cancel):
        got.append(ev)
        if type(ev).__name__ == "Token" and ev.index == 3:
            cancel.set()
    assert got[-1].reason == "cancelled" and len(got[-1].token_ids) == 3
    assert session.traces[-1].status == "cancelled"
    cancel = threading.Event()
    got = []
    for ev in session.generate(Request(prompt_ids=tuple(range(30, 70)), max_new_tokens=5), cancel):
        got.append(ev)
        if type(ev).__name__ == "PrefillProgress":
            cancel.set()
    assert got[-1].reason == "cancelled" and got[-1].token_ids == ()
    assert len(session.ids) == session.cache.length == 4  # the first chunk stays cached and valid
