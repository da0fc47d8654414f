"""A cache only as big as attention needs: sliding layers keep a ring of W + spare slots (engine.kv_cache's
WindowedKVCache). The logits equal a full cache's; an edit is kept exactly while the ring holds the window before
it, and otherwise recomputed from 0 with the reason said; the prefix store copies a ring's window back."""

import pytest
import torch

import engine.kv_cache as kv_cache
from checkpoints import FAMILY_CASES, make_checkpoint
from engine.events import Finished, PrefillStarted
from engine.kv_cache import KVCache, WindowedKVCache, make_cache, payload_bytes
from engine.session import Request, Session
from engine.weights.loading import load_model

SPARE = 8  # slots past the window (RING_SPARE), small so that short prompts slide out
W = 6  # FAMILY_CASES' windows


@pytest.fixture(autouse=True)
def small_spare(monkeypatch):
    monkeypatch.setattr(kv_cache, "RING_SPARE", SPARE)


@pytest.fixture(scope="module", params=["gemma3", "gemma2", "mixtral-window"])
def windowed(request, tmp_path_factory):
    opts = dict(FAMILY_CASES[request.param.removesuffix("-window")])
    if request.param == "mixtral-window":
        opts["sliding_window"] = W
    path = make_checkpoint(tmp_path_factory.mktemp("tiny"), opts.pop("family"), **opts)
    return load_model(path, device="cpu", dtype="float32")


def reply(session, ids, n=8):
    events = list(session.generate(Request(prompt_ids=tuple(ids), max_new_tokens=n, ignore_eos=True)))
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1], next(e for e in events if isinstance(e, PrefillStarted)).reuse


@pytest.mark.parametrize("kv", ["none", "int8"])
def test_the_ring_gives_the_full_caches_logits_in_a_fraction_of_its_bytes(windowed, kv):
    cfg = windowed.config
    ring = make_cache(cfg, 200, torch.float32, "cpu", kv, chunk=4)
    full = kv_cache._layers_cache(cfg.num_layers, cfg, 200, torch.float32, "cpu", kv)
    assert isinstance(ring, WindowedKVCache) and ring.slots == W + SPARE and ring.max_chunk == SPARE + 1
    ids = torch.arange(5, 65).view(1, -1)  # 60 positions: several times round the ring, in steps of 9
    model = windowed.model
    torch.testing.assert_close(model(ids, ring), model(ids, full), rtol=1e-5, atol=1e-5)
    for token in range(7, 19):  # decode steps, one position each
        nxt = torch.tensor([[token]])
        torch.testing.assert_close(model(nxt, ring), model(nxt, full), rtol=1e-5, atol=1e-5)
    n_sliding = sum(w is not None for w in cfg.windows)
    if kv == "none":  # payload 2·L·T·H·d·b per kind, T = min(T, W) for the sliding layers; allocated: their rings
        each = lambda layers, t: payload_bytes(layers, t, cfg.num_kv_heads, cfg.head_dim, 4)
        assert ring.allocated_bytes == each(cfg.num_layers - n_sliding, 200) + each(n_sliding, W + SPARE)
        assert ring.payload_bytes == each(cfg.num_layers - n_sliding, 72) + each(n_sliding, W)
        assert full.allocated_bytes == each(cfg.num_layers, 200)
    kinds = {k["kind"]: k for k in ring.stats()["layer_kinds"]}
    assert kinds["sliding"]["layers"] == n_sliding and kinds["sliding"]["positions"] == W
    assert kinds["sliding"]["slots"] == W + SPARE


def test_an_edit_within_the_spare_is_kept_and_an_older_one_recomputed_from_0(windowed):
    session = Session(windowed, capacity=200, prefill_chunk=4)
    assert isinstance(session.cache, WindowedKVCache)
    prompt = list(range(5, 45))
    first, _ = reply(session, prompt)
    length = len(session.ids)  # 40 + 7
    recent = prompt[:-2] + [99, 98]  # the edit is 9 positions before the end: within the spare
    got, reuse = reply(session, recent)
    assert reuse.reused == 38 and reuse.slid_out == 0 and reuse.first_invalidated_position == 38
    assert got.token_ids == reply(Session(windowed, capacity=200, prefill_chunk=4), recent)[0].token_ids
    old = prompt[:20] + [99] + prompt[21:]  # position 20: slid out of the sliding layers' ring long ago
    got, reuse = reply(session, old)
    assert length > 20 + W + SPARE
    assert reuse.reused == 0 and reuse.slid_out == 20 and reuse.first_invalidated_position == 20
    assert reuse.computed == len(old) and "slid out" in reuse.reason
    assert got.token_ids == reply(Session(windowed, capacity=200, prefill_chunk=4), old)[0].token_ids


def test_the_prefix_store_brings_a_rings_window_back(windowed):
    session = Session(windowed, capacity=200, prefill_chunk=4)
    a, b = list(range(5, 45)), list(range(100, 130))
    first, _ = reply(session, a)
    reply(session, b)  # A's whole cache stashed, its ring parts held for its last positions
    back, reuse = reply(session, a + list(first.token_ids[:-1]) + [77])
    assert reuse.source == "store" and reuse.reused == len(a) + len(first.token_ids) - 1
    fresh = reply(Session(windowed, capacity=200, prefill_chunk=4), a + list(first.token_ids[:-1]) + [77])[0]
    assert back.token_ids == fresh.token_ids
    # a prompt that parts from A early: its stored blocks there lack the ring (taken after it slid out)
    early = a[:20] + [55]
    got, reuse = reply(session, early)
    assert reuse.source != "store" and reuse.reused == 0
    assert got.token_ids == reply(Session(windowed, capacity=200, prefill_chunk=4), early)[0].token_ids


def test_a_small_capacity_keeps_the_plain_cache_and_the_disk_tier_says_why_it_is_off(windowed, tmp_path):
    from engine.disk_store import DiskStore

    assert isinstance(make_cache(windowed.config, W + SPARE, torch.float32, "cpu"), KVCache)
    session = Session(windowed, capacity=200, prefill_chunk=4, disk=DiskStore(tmp_path / "kv", 10**8))
    assert session.disk is None
    assert "sliding-window" in session.cache_stats()["store"]["disk_off"]
