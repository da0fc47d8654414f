"""The prefix store: conversations and branches come back from it, cached equals fresh at every
precision, a shared system prompt is stored once, a small budget evicts (and the reply is unchanged),
and a change of dtype drops what no longer matches with the reason."""

import random

import pytest
import torch

from engine.events import Finished, PrefillStarted
from engine.kv_cache import KVCache
from engine.prefix_store import BLOCK, PrefixStore
from engine.session import Request, Session
from engine.weights.loading import load_model

CAP = 512


def run(session, ids, n=8, label=None):
    events = list(session.generate(Request(prompt_ids=tuple(ids), max_new_tokens=n, label=label)))
    assert isinstance(events[-1], Finished), events[-1]
    start = next(e for e in events if isinstance(e, PrefillStarted))
    return list(events[-1].token_ids), start.reuse


def fresh(loaded, ids, n=8, kv="none"):
    return run(Session(loaded, capacity=CAP, kv=kv, cache_budget=0), ids, n)[0]


def conversation(seed, length, vocab=300, system=()):
    rnd = random.Random(seed)
    return list(system) + [rnd.randrange(5, vocab) for _ in range(length)]


@pytest.fixture(scope="module")
def loaded(llama_dir):
    return load_model(llama_dir, device="cpu", dtype="float32")


def turns(session, loaded, convs, rounds, kv="none"):
    """Alternate the conversations for `rounds`, each turn appending its reply and a new message;
    every reply is checked against a fresh session. Returns the reuse reports."""
    history = {k: list(v) for k, v in convs.items()}
    reports = []
    for r in range(rounds):
        for name, ids in history.items():
            out, reuse = run(session, ids, label=name)
            assert out == fresh(loaded, ids, kv=kv), (name, r)  # cached == fresh on every step
            reports.append((name, r, reuse, len(ids)))
            ids += out + conversation(r * 31 + len(name), 9)
    return reports


def test_alternating_conversations_come_back_from_the_store(loaded):
    session = Session(loaded, capacity=CAP)
    reports = turns(session, loaded, {"A": conversation(1, 70), "B": conversation(2, 80)}, rounds=3)
    for name, r, reuse, n in reports:
        if r == 0:
            assert reuse.source == "none" and reuse.reused == 0
            continue
        # each return finds its whole history: everything but the new message (and the last reply token)
        assert reuse.source == "store", (name, r, reuse)
        assert reuse.reused >= n - 9 - 1 - 1 and reuse.computed <= 11
        assert reuse.copied_positions == reuse.reused - reuse.first_invalidated_position
        # the KV pool's blocks themselves, held by reference: nothing copied
        assert reuse.shared_positions == reuse.copied_positions and reuse.copied_bytes == 0
        assert reuse.copy_ms is not None and reuse.stored_prefix >= reuse.reused
    assert session.store.stats()["prefixes"] >= 1 and session.store.evictions == 0


def test_a_return_to_an_earlier_branch_after_an_edit(loaded):
    session = Session(loaded, capacity=CAP)
    base = conversation(3, 60)
    first, _ = run(session, base)
    edited = base[:20] + [7, 8, 9] + base[23:]
    run(session, edited)  # the edit: the first branch goes to the store
    back = base + first + [11, 12, 13]
    out, reuse = run(session, back)  # ‹1/2›: back to the first branch, with a new message
    assert reuse.source == "store" and reuse.first_invalidated_position == 20
    assert reuse.reused == len(base) + len(first) - 1  # the last reply token was never consumed
    assert "taken from the prefix store" in reuse.reason and "by reference" in reuse.reason
    assert out == fresh(loaded, back)


def test_a_shared_system_prompt_is_stored_once(loaded):
    session = Session(loaded, capacity=CAP)
    system = conversation(4, 3 * BLOCK + 5)
    convs = {k: conversation(10 + i, 40, system=system) for i, k in enumerate("ABC")}
    kept = []
    for name, ids in convs.items():
        out, reuse = run(session, ids, label=name)
        if name != "A":
            assert reuse.reused == len(system) and reuse.source == "working"  # computed once
        kept.append(ids + out[:-1])  # what the working cache held: the last reply token is never consumed
    run(session, conversation(99, 30))  # send the last one to the store too
    store = session.store
    # Every distinct block once: the system prompt's three whole blocks are shared by all three.
    blocks = {tuple(ids[: min(e, len(ids))]) for ids in kept for e in range(BLOCK, len(ids) + BLOCK, BLOCK)}
    assert store.nodes == len(blocks)
    positions = sum(len(b) - (len(b) - 1) // BLOCK * BLOCK for b in blocks)
    assert store.bytes == positions * session.cache.bytes_per_position
    assert store.bytes < sum(len(k) for k in kept) * session.cache.bytes_per_position
    tree = [s for s in session.cache_stats()["store"]["tree"] if not s["working"]]
    assert len(tree) == 1 and tree[0]["end"] == 3 * BLOCK  # one root segment: the shared blocks
    assert sorted(c["label"] for c in tree[0]["children"] if not c["working"]) == ["A", "B", "C"]


def test_a_small_budget_evicts_and_the_reply_is_unchanged(loaded):
    per = Session(loaded, capacity=CAP, cache_budget=0).cache.bytes_per_position
    budget = 120 * per  # room for about one conversation
    session = Session(loaded, capacity=CAP, cache_budget=budget)
    convs = {k: conversation(20 + i, 100) for i, k in enumerate("ABC")}
    for name, ids in convs.items():
        run(session, ids, label=name)
    store = session.store
    assert store.bytes <= budget and store.evictions > 0 and store.evicted_positions > 0
    b_again = convs["B"] + [5, 6, 7]  # B went to the store after A: still held
    out, reuse = run(session, b_again)
    assert reuse.source == "store" and reuse.reused == len(convs["B"])
    assert out == fresh(loaded, b_again)
    a_again = convs["A"] + [5, 6, 7]  # A was least recently used: evicted, so computed again
    out, reuse = run(session, a_again)
    assert reuse.source == "none" and reuse.computed == len(a_again)
    assert out == fresh(loaded, a_again)
    assert store.bytes <= budget


def test_budget_zero_keeps_nothing(loaded):
    session = Session(loaded, capacity=CAP, cache_budget=0)
    a, b = conversation(30, 60), conversation(31, 60)
    run(session, a)
    run(session, b)
    _, reuse = run(session, a + [5])
    assert reuse.source == "none" and session.store.bytes == 0


def test_a_dtype_change_drops_the_stored_prefixes_with_the_reason(llama_dir, loaded):
    session = Session(loaded, capacity=CAP)
    run(session, conversation(40, 60))
    run(session, conversation(41, 60))
    assert session.store.prefixes == 1
    session.set_model(load_model(llama_dir, device="cpu", dtype="bfloat16"))
    _, reuse = run(session, conversation(40, 60))
    assert reuse.reused == 0 and reuse.source == "none"
    assert "dtype changed (float32 → bfloat16)" in reuse.reason
    assert "1 stored prefixes" in reuse.reason and "dropped" in reuse.reason
    assert session.store.stats()["dropped"].endswith("dtype changed (float32 → bfloat16)")
    assert session.store.nodes == 0


def test_a_capacity_change_keeps_the_store(loaded):
    session = Session(loaded, capacity=CAP)
    a = conversation(50, 80)
    out, _ = run(session, a)
    session.set_model(loaded, capacity=CAP + 64)
    nxt = a + out + [9]
    got, reuse = run(session, nxt)
    assert reuse.source == "store" and reuse.reused == len(a) + len(out) - 1
    assert got == fresh(loaded, nxt)


@pytest.mark.parametrize(("weights", "kv"), [("none", "int8"), ("none", "int4"), ("int8", "none"), ("int4", "int8")])
def test_cached_equals_fresh_at_every_precision(llama_dir, weights, kv):
    q = load_model(llama_dir, device="cpu", dtype="float32", weights=weights)
    session = Session(q, capacity=CAP, kv=kv)
    reports = turns(session, q, {"A": conversation(60, 50), "B": conversation(61, 50)}, rounds=2, kv=kv)
    assert [r.source for _, rnd, r, _ in reports if rnd] == ["store", "store"]


def test_probe_says_how_much_of_a_conversation_is_cached(loaded):
    session = Session(loaded, capacity=CAP)
    a, b = conversation(70, 64), conversation(71, 40)
    out, _ = run(session, a)
    run(session, b)
    seen = session.cached_positions(Request(prompt_ids=tuple(a + out)))
    assert seen == {"positions": len(a) + len(out), "cached": len(a) + len(out) - 1, "source": "store"}
    assert session.cached_positions(Request(prompt_ids=tuple(b)))["source"] == "working"
    assert session.cached_positions(Request(prompt_ids=(1, 2, 3)))["cached"] == 0


def test_store_partial_tails_and_supersession():
    """Unit test of the tree itself on a stand-in cache: a partial tail block is replaced by the whole
    block that extends it, matches are exact to the token, LRU evicts leaves first."""

    class Cache(KVCache):  # one buffer holding each position's own number
        def __init__(self, n):
            self.k = torch.arange(n, dtype=torch.float32).reshape(1, 1, 1, n, 1).repeat(2, 1, 1, 1, 2)

        def buffers(self):
            return (self.k,)

    store = PrefixStore(budget=10**9, block=4)
    ids = list(range(100, 110))  # 10: two blocks and a tail of 2
    store.insert(ids, Cache(10), "x")
    assert store.nodes == 3 and store.match(ids).length == 10
    assert store.match(ids[:7] + [1]).length == 7  # exact to the token, inside a block
    longer = ids + [110, 111, 112]
    store.insert(longer, Cache(13), "x")
    assert store.nodes == 4  # the tail [108, 109] became the block [108..111], plus [112]
    assert store.match(longer).length == 13
    out = Cache(13)
    out.k.zero_()
    m = store.match(longer)
    assert store.copy_into(out, m, 0, 13) == (13 * 2 * 2 * 4, 0)  # bytes copied, none shared (no pool)
    assert torch.equal(out.k, Cache(13).k)
    store.insert([1, 2, 3, 4, 5], Cache(5), "y")
    store.set_budget(store.bytes - 1)  # one leaf must go: the least recently used
    assert store.match(longer).length == 12 and store.match([1, 2, 3, 4, 5]).length == 5
