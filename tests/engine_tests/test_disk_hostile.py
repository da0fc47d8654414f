"""The disk tier's folder, planted: a FIFO, a link to /dev/zero and a 3 GB sparse file named as blocks, a
10-byte file with a forged header length, a block of NaN, the person's own files with ".tmp" in their names,
two processes on one budget, a deep rates file, and an exit while the writer writes. Each is refused (and
removed where it is the tier's), nothing hangs, reads past a block's size or raises into a request, and the
process ends with 0."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from engine.disk_files import HEADER_BYTES, metadata
from engine.disk_store import DiskStore
from engine.kv_cache import KVCache

FP = {"model": "x"}
IDS = list(range(64))


def filled(seed=0) -> KVCache:
    torch.manual_seed(seed)
    cache = KVCache(2, 2, 16, 256, torch.float32, "cpu")
    for b in cache.buffers():
        b.normal_()
    return cache


def written(tmp_path, budget=2**30) -> tuple[DiskStore, list]:
    store = DiskStore(tmp_path, budget)
    store.save(IDS, FP, filled(), len(IDS))
    assert store.close()
    blocks = [p for p in tmp_path.iterdir() if p.suffix == ".kv"]
    return store, sorted(blocks, key=lambda p: int(p.stem.rsplit("-", 1)[1]))  # by position


def load_within(store, seconds=20):
    """store.load on a thread: (its answer, or None when it did not come back in `seconds`)."""
    out = []
    t = threading.Thread(target=lambda: out.append(store.load(IDS, FP, KVCache(2, 2, 16, 256, torch.float32, "cpu"),
                                                              0, len(IDS))), daemon=True)  # fmt: skip
    t.start()
    t.join(seconds)
    return out[0] if out else None


@pytest.mark.parametrize("plant", ["fifo", "link to /dev/zero", "sparse 3 GB"])
def test_a_planted_file_named_as_a_block_is_refused_never_read_and_removed(tmp_path, plant):
    _, blocks = written(tmp_path)
    store = DiskStore(tmp_path, 2**30)  # a running tier: the file is planted after its scan
    victim = blocks[1]
    victim.unlink()
    if plant == "fifo":
        os.mkfifo(victim)
    elif plant == "link to /dev/zero":
        os.symlink("/dev/zero", victim)
    else:
        with open(victim, "wb") as f:
            f.truncate(3 << 30)
    answer = load_within(store)
    assert answer is not None, "the load hung"
    upto, _, why = answer
    assert upto == 16 and "refused and removed" in why and not os.path.lexists(victim)
    assert store.close()
    if plant != "sparse 3 GB":  # the next run's scan refuses it before any read too
        os.mkfifo(victim) if plant == "fifo" else os.symlink("/dev/zero", victim)
        later = DiskStore(tmp_path, 2**30)
        assert not os.path.lexists(victim) and "not a regular file" in later.refused[-1]
        assert later.held(IDS, FP) == 16


@pytest.mark.parametrize("length", [2**62, 2**63, 2**64 - 1])
def test_a_forged_header_length_under_another_fingerprint_is_refused_and_removed(tmp_path, length):
    _, blocks = written(tmp_path)
    key = blocks[0].name.split("-")[0]
    forged = tmp_path / f"{key}-{'f' * 16}-0.kv"
    forged.write_bytes(length.to_bytes(8, "little") + b"{}")  # 10 bytes
    for p in blocks:  # the forged file the only one under another fingerprint holding the first block
        p.unlink()
    store = DiskStore(tmp_path, 2**30)
    assert store.other_fingerprint(IDS, {"model": "y"}) is None  # the only other one is the forged file
    assert not forged.exists() and "refused and removed" in store.refused[-1]
    with pytest.raises(Exception, match="header"):
        metadata(length.to_bytes(8, "little") + b"{}")
    assert HEADER_BYTES <= 1 << 20


def test_a_well_formed_block_of_nan_is_refused(tmp_path):
    _, blocks = written(tmp_path)
    data = blocks[2].read_bytes()
    meta = metadata(data)
    tensors = {k: torch.full_like(v, float("nan")) for k, v in load_tensors(data).items()}
    blocks[2].write_bytes(save_tensors(tensors, metadata=meta))
    upto, _, why = load_within(DiskStore(tmp_path, 2**30))
    assert upto == 32 and "NaN" in why and not blocks[2].exists()


def test_only_the_tiers_own_temporary_files_are_removed(tmp_path):
    _, blocks = written(tmp_path)
    mine = tmp_path / f"{blocks[0].name}.tmp4242"
    for name in ("report.tmp.docx", "index.tmpl", "notes.tmp", mine.name, "prefill-rates.json.tmp7"):
        (tmp_path / name).write_bytes(b"the person's words")
    DiskStore(tmp_path, 2**30)
    left = {p.name for p in tmp_path.iterdir()}
    assert {"report.tmp.docx", "index.tmpl", "notes.tmp"} <= left
    assert mine.name not in left and "prefill-rates.json.tmp7" not in left


def test_two_processes_on_one_folder_keep_its_budget(tmp_path):
    one, _ = written(tmp_path / "probe")
    block = one.stats()["bytes"] // 4
    budget = 6 * block  # room for six of the eight blocks the two write
    a, b = DiskStore(tmp_path / "kv", budget), DiskStore(tmp_path / "kv", budget)
    a.save(IDS, FP, filled(1), len(IDS))
    b.save([i + 1000 for i in IDS], FP, filled(2), len(IDS))
    assert a.close() and b.close()
    on_disk = sum(p.stat().st_size for p in (tmp_path / "kv").iterdir() if p.suffix == ".kv")
    assert 0 < on_disk <= budget


def test_a_deep_rates_file_is_ignored_not_a_failure(tmp_path):
    (tmp_path / "prefill-rates.json").write_text("[" * 100_000 + "]" * 100_000)
    store = DiskStore(tmp_path, 2**30)
    assert store.prefill_rate(FP) is None


EXITS = textwrap.dedent(
    """
    import sys, torch
    from engine.disk_store import DiskStore
    from engine.kv_cache import KVCache
    cache = KVCache(4, 4, 64, 2048, torch.float32, "cpu")
    for b in cache.buffers():
        b.normal_()
    store = DiskStore(sys.argv[1], 2**34)
    store.note_prefill_rate({"model": "x"}, 123.0)
    store.save(list(range(2048)), {"model": "x"}, cache, 2048)  # exits while the writer writes
    """
)


def test_the_process_ends_cleanly_while_the_writer_writes(tmp_path):
    for i in range(4):
        r = subprocess.run([sys.executable, "-c", EXITS, str(tmp_path / f"kv{i}")], capture_output=True, timeout=120)
        assert r.returncode == 0, r.stderr.decode()[-500:]
        assert (tmp_path / f"kv{i}" / "prefill-rates.json").exists()  # the rates job done before the exit
