"""What every scanning hybrid's tests check alike (Granite 4.0-H's Mamba-2 layers, Qwen3-Next's gated DeltaNets;
test_hybrid's LFM2 and the drafts of all three): a reply and its prefill report, the state's size beside K/V that
grow, cuts to snapshots and bases against transformers, an edit back to a snapshot and the store's return, the disk
tier's."""

import pytest
import torch
from conversations import BUDGET_CHAT

from engine.disk_store import DiskStore
from engine.events import Finished, PrefillStarted
from engine.kv_cache import make_cache
from engine.session import Request, Session


def reply(session, **kw) -> tuple[Finished, PrefillStarted]:
    """A request's Finished and its PrefillStarted (10 new tokens unless said, the end token ignored)."""
    kw.setdefault("max_new_tokens", 10)
    events = list(session.generate(Request(ignore_eos=True, **kw)))
    assert isinstance(events[-1], Finished), events[-1]
    return events[-1], next(e for e in events if isinstance(e, PrefillStarted))


def state_stays_beside_kv_that_grows(loaded, kind: str):
    """After 40 and 160 positions: the state layers' bytes the same (`kind`'s, its cache's state_bytes), one attention
    layer's K/V 4 times as many, and 1 then 5 snapshots (one every 32). Returns the cache for its own figures."""
    cache = make_cache(loaded.config, 512, torch.float32, "cpu")
    sizes = []
    for n in (40, 160):
        cache.truncate(0)
        with torch.no_grad():
            loaded.model(torch.arange(5, 5 + n)[None], cache)
        kinds = {k["kind"]: k for k in cache.kinds()}
        sizes.append((kinds[kind]["payload_bytes"], kinds["full"]["payload_bytes"], kinds[kind]["snapshots"]))
    assert sizes[0][0] == sizes[1][0] == cache.state_bytes
    assert sizes[1][1] == 4 * sizes[0][1]
    assert (sizes[0][2], sizes[1][2]) == (1, 5)
    return cache


def cuts_equal_transformers(loaded) -> None:
    """200 positions against transformers' own layers: a prompt of 150 (three chunks of the scan), then cuts back to
    positions among the last ones (a base's state, the inputs since run again) and to snapshots (every 32);
    elsewhere refused."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32).eval()
    ids = torch.randint(5, loaded.config.vocab_size, (1, 200), generator=torch.Generator().manual_seed(1))
    cache = make_cache(loaded.config, 512, torch.float32, "cpu")
    with torch.no_grad():
        want = ref(ids).logits
        torch.testing.assert_close(loaded.model(ids[:, :150], cache), want[:, :150], rtol=1e-4, atol=1e-4)
        for cut in (140, 128, 96, 64):  # among the last positions; then snapshots
            cache.truncate(cut)
            got = loaded.model(ids[:, cut : cut + 5], cache)
            torch.testing.assert_close(got, want[:, cut : cut + 5], rtol=1e-4, atol=1e-4)
            cache.truncate(cut)
        with pytest.raises(ValueError, match="no snapshot"):
            cache.truncate(40)  # neither a snapshot nor among the last positions
        torch.testing.assert_close(loaded.model(ids[:, 64:200], cache), want[:, 64:], rtol=1e-4, atol=1e-4)


def bfloat16_close_to_transformers(loaded) -> None:
    """The model in bfloat16, its prompt and a cached step, against transformers' in bfloat16: the same top token at
    more than 90% of the positions."""
    from engine.weights.loading import load_model

    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.bfloat16).eval()
    ours = load_model(loaded.path, dtype="bfloat16")
    ids = torch.arange(3, 90).view(1, -1) % 300 + 3
    cache = make_cache(ours.config, 128, torch.bfloat16, "cpu")
    with torch.no_grad():
        a = torch.cat([ours.model(ids[:, :-1], cache), ours.model(ids[:, -1:], cache)], dim=1).float()
        b = ref(ids).logits.float()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


TRIP = [{"role": "user", "content": "I am planning a trip to Chengdu for 3 nights, on a budget of 600 yuan, with two "
                                    "friends who like tea houses and long walks."}]  # fmt: skip


def edit_back_to_a_snapshot(loaded, layers: str, capacity: int = 512) -> None:
    """A scanning hybrid's edit: TRIP answered, then its words changed midway. The edit goes back to the last
    snapshot before the changed position (the reason names `layers`, e.g. "3 Mamba-2 layers", and the spacing) and
    replies as a fresh session does; the first branch again comes from the prefix store, up to a snapshot past the
    edit, and replies as a fresh session does."""

    def make_session():
        return Session(loaded, capacity=capacity)

    session = make_session()
    reply(session, messages=TRIP, max_new_tokens=40)
    edited = [{"role": "user", "content": TRIP[0]["content"].replace("tea houses", "opera nights")}]
    done, start = reply(session, messages=edited)
    r = start.reuse
    cut, every = r.first_invalidated_position, session.facts()["state"]["every"]
    assert r.reused == cut // every * every < cut and r.source == "working"
    assert f"the {layers} keep their state, and a snapshot of it every {every} positions" in r.reason
    assert done.token_ids == reply(make_session(), messages=edited)[0].token_ids
    back, start = reply(session, messages=TRIP)  # the first branch again: its blocks, the snapshots with them
    assert start.reuse.source == "store" and start.reuse.reused % every == 0 and start.reuse.reused > cut
    assert back.token_ids == reply(make_session(), messages=TRIP)[0].token_ids


def disk_tier_brings_snapshots_back(loaded, folder, every: int, capacity: int = 512, flushed=None) -> None:
    """BUDGET_CHAT answered and flushed to a disk store in `folder` (`flushed(folder)` then looks at its files); a new
    session brings the blocks back from disk up to a snapshot (a multiple of `every`) and replies as a fresh session
    does."""
    first = Session(loaded, capacity=capacity, disk=DiskStore(folder, 2**30))
    want, _ = reply(first, messages=BUDGET_CHAT)
    assert first.flush()
    if flushed is not None:
        flushed(folder)
    again = Session(loaded, capacity=capacity, disk=DiskStore(folder, 2**30))
    done, start = reply(again, messages=BUDGET_CHAT)
    assert start.reuse.source == "disk" and start.reuse.reused % every == 0 and start.reuse.reused > 0
    assert (
        done.token_ids == want.token_ids == reply(Session(loaded, capacity=capacity), messages=BUDGET_CHAT)[0].token_ids
    )
