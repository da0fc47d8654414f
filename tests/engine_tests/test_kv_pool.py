"""The KV pool (engine.kv_pool): a sequence's K/V in blocks of 16 positions wherever the pool has them gives what a
cache of its own gives — on the torch path and through the kernels' block tables — a block shared by two holders
is copied before either writes into it, the pool grows to its limit and then says it is full, and the prefix store
holds a prefix by reference and gives the blocks back (as copies of its own) when the pool needs them."""

import pytest
import torch

from engine.errors import EngineError
from engine.events import Finished, PrefillStarted
from engine.kv_cache import KVCache
from engine.kv_pool import BLOCK, BlockPool, PagedKVCache, PoolFull, blocks_for
from engine.session import Request, Session
from engine.weights.loading import load_model


@pytest.fixture(scope="module")
def loaded(llama_dir):
    return load_model(llama_dir, device="cpu", dtype="float32")


def scattered(loaded, capacity: int, kv: str = "none") -> PagedKVCache:
    """A sequence whose blocks lie out of order in its pool: every other block is held by someone else first."""
    pool = BlockPool(loaded.config, loaded.dtype, "cpu", kv)
    others = [pool.alloc() for _ in range(blocks_for(capacity) * 2)]
    for b in others[::2]:
        pool.release(b)  # holes at 0, 2, 4, ...: the sequence takes those, highest-numbered others between them
    cache = PagedKVCache(pool, capacity)
    return cache


@pytest.mark.parametrize("kv", ["none", "int8", "int4"])
def test_a_sequence_scattered_over_the_pool_gives_its_own_caches_logits(loaded, kv):
    """A prompt in two chunks and ten decode steps: the logits over blocks 0, 2, 4, … of a pool (the kernels' table
    on float K/V, a gather on the torch path for codes) equal those over a cache of its own, bit for bit."""
    from engine.kv_cache import make_cache

    ids = torch.randint(5, loaded.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    own, paged = make_cache(loaded.config, 64, loaded.dtype, "cpu", kv), scattered(loaded, 64, kv)
    got, want = [], []
    for cache, out in ((own, want), (paged, got)):
        out.append(loaded.model(ids[:, :21], cache, last_only=True))
        out.append(loaded.model(ids[:, 21:], cache, last_only=True))
        for t in range(10):
            out.append(loaded.model(torch.tensor([[7 + t]]), cache, last_only=True))
    assert paged.table[1] != paged.table[0] + 1  # really out of order: the kernels read it through its table
    kernels = loaded.model.decode_step is not None and loaded.model.decode_step.usable(paged)
    assert kernels == (kv == "none" and loaded.kernels is not None)
    assert paged.length == own.length == 50 and len(paged.table) == blocks_for(50)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_a_shared_block_is_copied_before_a_write_and_the_other_holder_keeps_it(loaded):
    """Two sequences on one prompt's blocks (by reference): the second's writes past the prompt copy the partly
    filled block first, and the first's K/V stay as they were; truncation gives blocks back."""
    pool = BlockPool(loaded.config, loaded.dtype, "cpu")
    a, b = PagedKVCache(pool, 64), PagedKVCache(pool, 64)
    prompt = torch.arange(5, 25)[None]  # 20 positions: a whole block and 4 of the next
    loaded.model(prompt, a)
    before = a.take(0, 20)
    for block in a.table:
        b.adopt(block)
    b.length = 20
    assert pool.held == 2 and all(pool.refs[x] == 2 for x in a.table) and b.shared_positions == 20
    loaded.model(torch.tensor([[9]]), b)  # position 20 lies in the shared second block: copied first
    assert b.copies_on_write == 1 and b.table[0] == a.table[0] and b.table[1] != a.table[1]
    assert all(torch.equal(x, y) for x, y in zip(a.take(0, 20), before))  # the first holder's K/V untouched
    assert all(torch.equal(x, y) for x, y in zip(b.take(0, 20), before))  # the copy carried them over
    assert pool.held == 3 and b.shared_positions == 16
    b.truncate(0)
    a.release()
    assert pool.held == 0 and pool.refs == [0] * pool.blocks


def test_the_pool_grows_to_its_limit_keeps_what_it_holds_and_then_says_it_is_full(loaded):
    pool = BlockPool(loaded.config, loaded.dtype, "cpu", limit=100)
    cache = PagedKVCache(pool, 100 * BLOCK)
    loaded.model(torch.arange(3, 67)[None], cache)  # 64 positions: 4 blocks of the first 64
    first = cache.take(0, 64)
    while len(cache.table) < 70:
        cache.table.append(pool.alloc())  # past the first 64: the pool doubles (64 -> 100, its limit)
    assert pool.blocks == 100 and pool.growths == 2 and all(torch.equal(x, y) for x, y in zip(cache.take(0, 64), first))
    while pool.free_blocks:
        pool.alloc()
    with pytest.raises(PoolFull, match="the KV pool is full: 100 of 100 blocks of 16 positions held") as err:
        pool.alloc()
    assert isinstance(err.value, EngineError)  # a request that meets it fails with this reason, the engine goes on


def test_the_store_holds_a_prefix_by_reference_and_gives_it_back_when_the_pool_needs_room(loaded):
    """Two conversations through one session: the first goes to the store as the pool's blocks themselves (no copy),
    and comes back the same way; a pool at its limit takes the store's blocks back (the store keeps copies), and
    the conversation still comes back exactly."""

    def run(session, ids):
        events = list(session.generate(Request(prompt_ids=tuple(ids), max_new_tokens=6, ignore_eos=True)))
        assert isinstance(events[-1], Finished), events[-1]
        return list(events[-1].token_ids), next(e for e in events if isinstance(e, PrefillStarted)).reuse

    def fresh(ids):
        return run(Session(loaded, capacity=512, cache_budget=0), ids)[0]

    a, b = list(range(5, 75)), list(range(100, 160))
    session = Session(loaded, capacity=512)  # a pool of 32 blocks: room for both and the store
    pool = session.pool
    out_a, _ = run(session, a)
    held = pool.held
    run(session, b)  # A's positions go to the store: by reference
    store = session.store.stats()
    assert store["by_reference"] == store["bytes"] > 0 and pool.held >= held
    back = a + out_a[:-1] + [5, 6]
    got, reuse = run(session, back)
    assert reuse.source == "store" and reuse.shared_positions == reuse.copied_positions > 0 and reuse.copied_bytes == 0
    assert "by reference" in reuse.reason and got == fresh(back)

    pool.limit = pool.blocks  # no growth, and every free block held elsewhere: the store must give some back
    hog = [pool.alloc() for _ in range(pool.free_blocks)]
    again = b + [9, 9, 9]
    got, reuse = run(session, again)  # B's return needs blocks: the store gives its own back, as copies it keeps
    assert got == fresh(again)
    stats = session.store.stats()
    assert stats["by_reference"] < stats["bytes"]  # some of the store's blocks are its own copies now
    assert len(hog) > 0 and pool.blocks == pool.limit


def test_a_shared_system_prompt_is_held_once_in_the_pool(loaded):
    """Three conversations on one system prompt, one after another in one session, then all of them again: the
    system prompt's whole blocks are one set of pool blocks, held by the store and every return by reference."""
    system = list(range(200, 200 + 3 * BLOCK))
    convs = [system + list(range(10 * i + 5, 10 * i + 30)) for i in range(3)]
    session = Session(loaded, capacity=256)
    for ids in convs + convs:
        list(session.generate(Request(prompt_ids=tuple(ids), max_new_tokens=4, ignore_eos=True)))
    first = session.cache.table[:3]
    node = session.store.match(system).path
    assert [n.block for n in node[:3]] == first  # the store's blocks are the working cache's own
    assert all(session.pool.refs[b] >= 2 for b in first)


def test_a_cache_of_its_own_needs_no_table():
    cache = KVCache(1, 1, 2, 8, torch.float32, "cpu")
    cache.reserve(0, 8)
    assert cache.kernel_table() is None and cache.shared_positions == 0


def test_a_write_past_the_blocks_held_takes_the_blocks_before_it_too(loaded):
    """Positions are in blocks in order: writable positions 64–79 of an empty sequence are its 5th block, the four
    before it held too (never a table with a hole)."""
    cache = PagedKVCache(BlockPool(loaded.config, loaded.dtype, "cpu"), 256)
    cache.reserve(64, 80)
    assert len(cache.table) == 5 and len(set(cache.table)) == 5
