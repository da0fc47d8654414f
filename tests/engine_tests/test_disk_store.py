"""The prefix store's disk tier: a new process reads a conversation's K/V back instead of prefilling it, with
the very reply a fresh run gives; entries computed under other settings are not used, and the report says why;
a damaged or truncated file is refused and removed; a kill while writing loses nothing but that block; the
budget is never exceeded."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import torch
from conversations import long_conversation

from engine.disk_store import DiskStore
from engine.events import Finished
from engine.kv_cache import KVCache
from engine.session import Request, Session
from engine.weights.loading import load_model

PROMPT = "I am planning a trip to Chengdu for 3 nights. My budget is 600 yuan. What should I see and eat, and where?"


def cli(*args) -> dict:
    r = subprocess.run([sys.executable, "-m", "engine", "generate", "--max-new-tokens", "12", "--json", *args],
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def written(directory, messages):
    """The demo model, and its reply to `messages` from a session whose disk tier is `directory`, flushed."""
    loaded = load_model(None)
    s = Session(loaded, disk=DiskStore(directory, 2**30))
    want = reply(s, messages)
    assert s.flush()
    return loaded, want


def reply(session, messages, **kw):
    final = list(session.generate(Request(messages=messages, max_new_tokens=12, **kw)))[-1]
    assert isinstance(final, Finished), final
    return final


def test_a_new_process_reads_the_cache_back_from_disk_and_replies_as_a_fresh_run(tmp_path):
    first = cli("--prompt", PROMPT, "--disk-cache", tmp_path)
    second = cli("--prompt", PROMPT, "--disk-cache", tmp_path)
    fresh = cli("--prompt", PROMPT)
    n = len(second["prompt_token_ids"])
    r = second["reuse"]
    assert first["reuse"]["source"] == "none" and r["source"] == "disk"
    assert r["reused"] == min(n // 16 * 16, n - 1) > 0 and r["copied_bytes"] > 0 and r["copy_ms"] is not None
    assert "read from the disk tier" in r["reason"]
    assert second["token_ids"] == first["token_ids"] == fresh["token_ids"]
    disk = second["cache"]["store"]["disk"]
    assert disk["blocks_this_model"] >= n // 16 and disk["bytes"] <= disk["budget"]
    files = sorted(p.name for p in tmp_path.iterdir())
    others = [f for f in files if not f.endswith(".kv")]
    assert set(others) <= {"prefill-rates.json", ".kvchat-lock"}
    assert len(files) - len(others) == disk["blocks"]  # none half-written


def test_entries_made_under_other_settings_are_not_used_and_the_report_says_why(tmp_path):
    msgs = long_conversation(3)
    loaded, want = written(tmp_path, msgs)
    store = DiskStore(tmp_path, 2**30)
    assert reply(Session(loaded, disk=store), msgs).reuse.source == "disk"
    assert store.flush()
    for kv in ("int8", "int4"):  # each on a copy of these entries: what one writes is never the other's "other"
        home = shutil.copytree(tmp_path, tmp_path.with_name(f"{tmp_path.name}-{kv}"),
                               ignore=shutil.ignore_patterns(".kvchat-lock"))  # fmt: skip
        other = Session(loaded, kv=kv, disk=DiskStore(home, 2**30))
        final = reply(other, msgs)
        assert final.reuse.source == "none" and final.reuse.reused == 0
        assert f"on disk for other settings, not used: KV cache precision changed (none → {kv})" in final.reuse.reason
    bf16 = Session(load_model(None, dtype="bfloat16"), disk=DiskStore(tmp_path, 2**30))
    final = reply(bf16, msgs)
    assert final.reuse.source == "none" and "dtype changed (float32 → bfloat16)" in final.reuse.reason
    assert reply(Session(loaded, disk=DiskStore(tmp_path, 2**30)), msgs).token_ids == want.token_ids


def test_a_damaged_or_truncated_block_is_refused_removed_and_computed_again(tmp_path):
    msgs = long_conversation(4)
    loaded, want = written(tmp_path, msgs)
    by_start = {int(p.name.split("-")[2].removesuffix(".kv")): p for p in tmp_path.glob("*.kv")}
    truncated, garbled = by_start[32], by_start[64]
    truncated.write_bytes(truncated.read_bytes()[:-100])  # a write cut short (what a failing disk leaves)
    data = bytearray(garbled.read_bytes())
    data[8:20] = b"not a header"
    garbled.write_bytes(bytes(data))
    again = Session(loaded, disk=DiskStore(tmp_path, 2**30))
    final = reply(again, msgs)
    r = final.reuse
    assert r.source == "disk" and r.reused == 32 and "a disk block at position 32 was refused and removed" in r.reason
    assert "positions 0–31 read from the disk tier" in r.reason  # what was read, not what was planned
    assert not truncated.exists() and garbled.exists()  # only what was read is judged; the chain stopped at 32
    assert final.token_ids == want.token_ids
    assert again.flush()  # the block is written again, whole, after the reply
    third = Session(loaded, disk=DiskStore(tmp_path, 2**30))
    final = reply(third, msgs)
    assert final.reuse.reused == 64 and "refused" in final.reuse.reason and not garbled.exists()
    first = min(int(p.name.split("-")[2].removesuffix(".kv")) for p in tmp_path.glob("*.kv"))
    zero = next(p for p in tmp_path.glob("*.kv") if p.name.endswith(f"-{first}.kv"))
    zero.write_bytes(b"\0" * 10)  # the first block refused: nothing is read from the disk tier
    r = reply(Session(loaded, disk=DiskStore(tmp_path, 2**30)), msgs).reuse
    assert r.reused == 0 and "a disk block at position 0 was refused" in r.reason
    assert "read from the disk" not in r.reason
    assert final.token_ids == want.token_ids


WRITER = textwrap.dedent(
    """
    import sys, torch
    from engine.disk_store import DiskStore
    from engine.kv_cache import KVCache
    torch.manual_seed(0)
    cache = KVCache(4, 4, 64, 4096, torch.float32, "cpu")
    for b in cache.buffers():
        b.normal_()
    store = DiskStore(sys.argv[1], 2**34)
    ids = list(range(4096))
    for upto in range(16, 4097, 16):  # a block at a time, each waited for: a kill lands inside some write
        store.save(ids, {"model": "x"}, cache, upto)
        store.flush()
    """
)


def test_a_kill_while_writing_loses_only_the_block_being_written(tmp_path):
    cache_dir = tmp_path / "kv"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(cache_dir)])
    try:
        end = time.monotonic() + 120
        blocks = lambda: [n for n in os.listdir(cache_dir) if n.endswith(".kv")] if cache_dir.exists() else []
        while time.monotonic() < end and len(blocks()) < 24:  # whole blocks: the folder holds its lock file too
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    left = os.listdir(cache_dir)
    store = DiskStore(cache_dir, 2**34)  # a new run: what the kill left is checked
    assert not any(".tmp" in n for n in os.listdir(cache_dir))  # a write cut short was removed
    held = store.held(list(range(4096)), {"model": "x"})
    assert held >= 16 * 23 and held == 16 * len([n for n in left if n.endswith(".kv")])
    torch.manual_seed(0)
    want = KVCache(4, 4, 64, 4096, torch.float32, "cpu")
    for b in want.buffers():
        b.normal_()
    got = KVCache(4, 4, 64, 4096, torch.float32, "cpu")
    loaded_to, nbytes, why = store.load(list(range(4096)), {"model": "x"}, got, 0, held)
    assert (loaded_to, why) == (held, None) and nbytes > 0
    for a, b in zip(got.buffers(), want.buffers()):
        assert torch.equal(a[:, :, :, :held], b[:, :, :, :held])


def test_the_budget_is_never_exceeded_and_the_least_recently_used_blocks_go_first(tmp_path):
    cache = KVCache(2, 2, 32, 512, torch.float32, "cpu")
    for b in cache.buffers():
        b.normal_()
    probe = DiskStore(tmp_path / "probe", 2**30)
    probe.save(list(range(16)), {"m": 1}, cache, 16)
    assert probe.flush()
    block = probe.bytes
    store = DiskStore(tmp_path / "kv", int(block * 4.5))
    ids = list(range(512))
    for upto in range(16, 161, 16):
        store.save(ids, {"m": 1}, cache, upto)
        assert store.flush()
        assert store.bytes <= store.budget
        assert sum(p.stat().st_size for p in (tmp_path / "kv").iterdir()) <= store.budget
    assert store.evictions > 0
    other = list(range(1000, 1512))  # another prompt, used after: the first prompt's blocks are older
    store.save(other, {"m": 1}, cache, 32)
    assert store.flush() and store.held(other, {"m": 1}) == 32
    assert DiskStore(tmp_path / "kv", int(block * 4.5)).bytes == store.bytes  # what a restart counts
    shrunk = DiskStore(tmp_path / "kv", block)  # a smaller budget at start: evicted down to it
    assert shrunk.bytes <= block
