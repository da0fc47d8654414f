"""The prefix store's disk tier: blocks of K/V written to files so that a conversation's cache outlives the
process. A later run under the same weights and settings reads them back instead of prefilling again.

A block is BLOCK positions of one prompt. Its file is named by a hash that chains the token ids of every
block from position 0 up to and including it (K/V at a position depend on all the ids before it), salted
with a digest of the fingerprint the K/V are valid under: weights, dtype, precisions, tokenizer, rotary and
attention settings, device, and the decode kernels that computed them. A prefix shared by conversations is
stored once. Files are safetensors (no pickle); each holds its block's ids, position and fingerprint, and
all of them are checked against the prompt and the cache's layout before a byte is used. A file that does
not read back whole is refused and removed. Writes go to a temporary file and are renamed into place, so a
kill at any moment loses at most the block being written; a byte budget is kept by evicting the least
recently used blocks (the deepest first among those used together), and is never exceeded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import queue
import threading
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from .prefix_store import BLOCK

FORMAT = "kvchat-kv/1"
ROOT = hashlib.sha256(FORMAT.encode()).digest()  # the chain of block hashes starts here, "before" position 0

SUFFIX = ".kv"
RATES = "prefill-rates.json"  # each fingerprint's prefill rate measured here: a return's cost before any prefill
QUEUE_BYTES = 256 * 2**20  # blocks waiting for the writer at most; past it a block waits for a later request
EVICT_TO = 0.9  # evicting for room frees down to this share of the budget (fewer passes over the index)


def fingerprint_digest(fingerprint: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def _packed(ids) -> bytes:
    """Token ids as the hash reads them: 4-byte little-endian signed integers, packed in one call."""
    return np.asarray(ids, dtype="<i4").tobytes()


def next_hash(h: bytes | None, piece) -> bytes:
    """The chain's hash after one more block of ids (None: the chain's start)."""
    return hashlib.sha256((ROOT if h is None else h) + _packed(piece)).digest()


def block_keys(ids, block: int = BLOCK) -> list[str]:
    """The hash of each whole block of `ids`, chained over every id before it (the ids packed once: this
    runs on the request's path, before its prefill)."""
    data, h, keys = _packed(ids), ROOT, []
    for start in range(0, len(ids) - block + 1, block):
        h = hashlib.sha256(h + data[4 * start : 4 * (start + block)]).digest()
        keys.append(h[:16].hex())
    return keys


@dataclasses.dataclass
class Entry:
    path: Path
    nbytes: int
    start: int  # the block's first position
    used: float  # when it was last written or read (the file's mtime)


class DiskEntryError(Exception):
    """A file that cannot be used: damaged, truncated, or not what its name says."""


class DiskStore:
    """Blocks of K/V in `directory`, at most `budget` bytes. Reading happens on the caller's thread; writing
    on a thread of its own, so a request never waits for the disk."""

    def __init__(self, directory: str | os.PathLike, budget: int, block: int = BLOCK):
        if budget < 0:
            raise ValueError("the disk tier's budget cannot be negative")
        self.dir, self.budget, self.block = Path(directory), budget, block
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.index: dict[str, dict[str, Entry]] = {}  # fingerprint digest -> block key -> entry
        self.bytes = 0
        self.evictions = 0
        self.refused: list[str] = []  # files refused and removed, with the reason (the newest last)
        self.read_bytes, self.read_s = 0, 0.0  # what reads took: the rate a return is estimated from
        self.written = 0
        self._fingerprints: dict[str, dict] = {}  # digest -> the fingerprint, as files under it say
        self._queue: queue.Queue = queue.Queue()
        self._queued: dict[tuple[str, str], int] = {}  # (digest, key) -> bytes, waiting to be written
        self._idle = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self._scan()
        self._rates = self._read_rates()
        with self._lock:
            self._evict(0)

    # --- the index -----------------------------------------------------------------------------------
    def _scan(self) -> None:
        """The files already here (a temporary file is what a killed write left: removed)."""
        for path in self.dir.iterdir():
            if ".tmp" in path.name:
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            parts = path.name.removesuffix(SUFFIX).split("-")
            if not path.name.endswith(SUFFIX) or len(parts) != 3 or not parts[2].isdigit():
                continue
            try:
                st = path.stat()
            except OSError:
                continue
            key, digest, start = parts
            self.index.setdefault(digest, {})[key] = Entry(path, st.st_size, int(start), st.st_mtime)
            self.bytes += st.st_size

    def _read_rates(self) -> dict[str, float]:
        try:
            rates = json.loads((self.dir / RATES).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(rates, dict):
            return {}
        return {k: float(v) for k, v in rates.items() if isinstance(k, str) and isinstance(v, (int, float)) and v > 0}

    def note_prefill_rate(self, fingerprint: dict, tok_s: float) -> None:
        """This model's prefill rate as just measured, kept (written on the writer's thread) for later runs."""
        self._rates[fingerprint_digest(fingerprint)] = float(tok_s)
        self._queue.put(("rates",))
        self._start_writer()

    def prefill_rate(self, fingerprint: dict) -> float | None:
        return self._rates.get(fingerprint_digest(fingerprint))

    def _name(self, key: str, digest: str, start: int) -> Path:
        return self.dir / f"{key}-{digest}-{start}{SUFFIX}"

    def held(self, ids, fingerprint: dict) -> int:
        """How many leading positions of `ids` are on disk for this fingerprint (whole blocks, from 0)."""
        digest = fingerprint_digest(fingerprint)
        with self._lock:
            have = self.index.get(digest, {})
            n = 0
            for key in block_keys(ids, self.block):
                if key not in have:
                    break
                n += self.block
        return n

    def chain(self, fingerprint: dict):
        """step(hash, block ids) -> (the next hash, whether that block is on disk): walking a tree of blocks from
        step(None, the first block's ids), one hash per block (the prefix store's picture marks what is on disk
        too)."""
        with self._lock:
            have = set(self.index.get(fingerprint_digest(fingerprint), {}))

        def step(h: bytes, piece) -> tuple[bytes, bool]:
            nxt = next_hash(h, piece)
            return nxt, len(piece) == self.block and nxt[:16].hex() in have

        return step

    def other_fingerprint(self, ids, fingerprint: dict) -> dict | None:
        """When this prompt's first block is on disk only under other settings: those settings (the caller
        says what differs); None when it is not on disk at all, or is for these settings."""
        keys = block_keys(ids[: self.block], self.block)
        if not keys:
            return None
        digest = fingerprint_digest(fingerprint)
        with self._lock:
            if keys[0] in self.index.get(digest, {}):
                return None
            others = [d for d, have in self.index.items() if d != digest and keys[0] in have]
        return next((f for f in map(self._fingerprint_of, others) if f is not None), None)

    def _fingerprint_of(self, digest: str) -> dict | None:
        if digest not in self._fingerprints:
            with self._lock:
                entry = next(iter(self.index.get(digest, {}).values()), None)
            if entry is None:
                return None
            try:
                meta = _metadata(_header(entry.path))
                self._fingerprints[digest] = json.loads(meta["fingerprint"])
            except (OSError, DiskEntryError, ValueError, KeyError):
                return None
        return self._fingerprints[digest]

    # --- reading -------------------------------------------------------------------------------------
    def load(self, ids, fingerprint: dict, cache, start: int, end: int) -> tuple[int, int, str | None]:
        """Copy the stored K/V of positions start..end-1 (whole blocks of `ids`) into the working cache's
        buffers. Returns (the position loaded up to, bytes read, why it stopped short: a file refused and
        removed). Blocks are checked whole before any is copied in."""
        digest = fingerprint_digest(fingerprint)
        keys = block_keys(ids[:end], self.block)
        bufs = cache.buffers()
        pos, read, why = start - start % self.block, 0, None
        t0 = time.perf_counter()
        while pos < end:
            k = pos // self.block
            with self._lock:
                entry = self.index.get(digest, {}).get(keys[k]) if k < len(keys) else None
            if entry is None:
                break
            try:
                data = entry.path.read_bytes()
                tensors = _check(data, ids[pos : pos + self.block], pos, digest, bufs)
            except (OSError, DiskEntryError) as e:
                why = f"a disk block at position {pos} was refused and removed ({e})"
                self._forget(digest, keys[k], why)
                break
            lo, hi = max(start, pos), min(end, pos + self.block)
            for buf, t in zip(bufs, tensors):
                buf[:, :, :, lo:hi].copy_(t[:, :, :, lo - pos : hi - pos])
            read += len(data)
            self._touch(entry)
            pos += self.block
        self.read_bytes += read
        self.read_s += time.perf_counter() - t0
        return max(start, min(pos, end)), read, why

    def _touch(self, entry: Entry) -> None:
        entry.used = time.time()
        with contextlib.suppress(OSError):
            os.utime(entry.path)

    def _forget(self, digest: str, key: str, why: str) -> None:
        with self._lock:
            entry = self.index.get(digest, {}).pop(key, None)
            if entry is not None:
                self.bytes -= entry.nbytes
        if entry is not None:
            with contextlib.suppress(OSError):
                entry.path.unlink()
        self.refused = [*self.refused[-9:], why]

    def measure_read(self, ids, fingerprint: dict) -> float | None:
        """Read the prompt's first block from disk now, timed (a read rate before any load has run)."""
        keys = block_keys(ids[: self.block], self.block)
        with self._lock:
            entry = self.index.get(fingerprint_digest(fingerprint), {}).get(keys[0]) if keys else None
        if entry is None:
            return None
        t0 = time.perf_counter()
        try:
            n = len(entry.path.read_bytes())
        except OSError:
            return None
        self.read_bytes += n
        self.read_s += time.perf_counter() - t0
        return self.read_rate

    @property
    def read_rate(self) -> float | None:
        """Bytes a second the reads so far took (None before any)."""
        return self.read_bytes / self.read_s if self.read_bytes and self.read_s > 0 else None

    # --- writing -------------------------------------------------------------------------------------
    def save(self, ids, fingerprint: dict, cache, upto: int) -> int:
        """Queue the whole blocks of positions 0..upto-1 not on disk yet (copies of the working cache's K/V:
        the cache may change before they are written); returns the bytes queued."""
        if self.budget == 0:
            return 0
        digest = fingerprint_digest(fingerprint)
        bufs = cache.buffers()
        queued = 0
        with self._lock:
            have = self.index.get(digest, {})
            waiting = sum(self._queued.values())
        for k, key in enumerate(block_keys(ids[:upto], self.block)):
            if key in have or (digest, key) in self._queued:
                continue
            s = k * self.block
            tensors = tuple(b[:, :, :, s : s + self.block].to("cpu", copy=True).contiguous() for b in bufs)
            n = sum(t.numel() * t.element_size() for t in tensors)
            if waiting + queued + n > QUEUE_BYTES or n > self.budget:
                break
            with self._lock:
                self._queued[(digest, key)] = n
            self._queue.put((digest, key, s, tuple(ids[s : s + self.block]), tensors, fingerprint))
            queued += n
        if queued:
            self._start_writer()
        return queued

    def _start_writer(self) -> None:
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(target=self._write_loop, name="kvchat-disk-writer", daemon=True)
            self._writer.start()

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job[0] == "rates":
                with contextlib.suppress(OSError):
                    tmp = self.dir / f"{RATES}.tmp{os.getpid()}"
                    tmp.write_text(json.dumps(dict(self._rates)))
                    os.replace(tmp, self.dir / RATES)
                continue
            digest, key = job[0], job[1]
            try:
                self._write(*job)
            except OSError as e:  # a full or read-only disk: the block stays in memory's tiers only
                self.refused = [*self.refused[-9:], f"a block could not be written: {e}"]
            finally:
                with self._lock:
                    self._queued.pop((digest, key), None)
                    if not self._queued:
                        self._idle.notify_all()

    def _write(self, digest, key, start, ids, tensors, fingerprint) -> None:
        meta = {"format": FORMAT, "fingerprint": json.dumps(fingerprint, sort_keys=True), "ids": json.dumps(ids),
                "start": str(start)}  # fmt: skip
        data = save_tensors({f"t{i}": t for i, t in enumerate(tensors)}, metadata=meta)
        with self._lock:
            if key in self.index.get(digest, {}):
                return
            self._evict(len(data))
            if self.bytes + len(data) > self.budget:
                return  # larger than what eviction could free
            self.bytes += len(data)  # held for this block while it is written: the budget is never exceeded
        final = self._name(key, digest, start)
        tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError:
            with self._lock:
                self.bytes -= len(data)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        with self._lock:
            self.index.setdefault(digest, {})[key] = Entry(final, len(data), start, time.time())
            self._fingerprints.setdefault(digest, fingerprint)
            self.written += len(data)

    def _evict(self, room: int) -> None:
        """With the lock held: remove the least recently used blocks (deepest first among those used at the
        same time) until `room` more bytes fit, down to EVICT_TO of the budget when it has to evict at all."""
        if self.bytes + room <= self.budget:
            return
        target = min(self.budget - room, int(self.budget * EVICT_TO))
        entries = sorted(
            ((e.used, -e.start, d, k) for d, have in self.index.items() for k, e in have.items()),
        )
        for _, _, d, k in entries:
            if self.bytes <= target:
                break
            e = self.index[d].pop(k)
            self.bytes -= e.nbytes
            self.evictions += 1
            with contextlib.suppress(OSError):
                e.path.unlink()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued block is written (at exit); False when `timeout` ran out first."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._queued:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def set_budget(self, budget: int) -> None:
        with self._lock:
            self.budget = budget
            self._evict(0)

    def stats(self, fingerprint: dict | None = None) -> dict:
        digest = fingerprint_digest(fingerprint) if fingerprint else None
        with self._lock:
            mine = self.index.get(digest, {}) if digest else {}
            blocks = sum(len(h) for h in self.index.values())
            return {
                "directory": str(self.dir),
                "bytes": self.bytes,
                "budget": self.budget,
                "blocks": blocks,
                "blocks_this_model": len(mine),
                "bytes_this_model": sum(e.nbytes for e in mine.values()),
                "evictions": self.evictions,
                "queued_blocks": len(self._queued),  # waiting for the writer
                "refused": list(self.refused),
                "read_rate": self.read_rate,
            }


def _header(path: Path) -> bytes:
    """A safetensors file's length field and header, without its tensors (what _metadata reads)."""
    with open(path, "rb") as f:
        head = f.read(8)
        return head + f.read(int.from_bytes(head, "little")) if len(head) == 8 else head


def _metadata(data: bytes) -> dict:
    """A safetensors file's metadata, from its header alone."""
    if len(data) < 8:
        raise DiskEntryError("shorter than a header")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise DiskEntryError("the header runs past the file's end")
    try:
        return json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    except ValueError as e:
        raise DiskEntryError(f"a damaged header: {e}") from None


def _check(data: bytes, ids, start: int, digest: str, bufs) -> tuple[torch.Tensor, ...]:
    """The block's tensors, once the file is whole and says it holds these ids at this position, under this
    fingerprint, in the working cache's layout."""
    meta = _metadata(data)
    if meta.get("format") != FORMAT:
        raise DiskEntryError(f"not a {FORMAT} file")
    try:
        fingerprint = json.loads(meta["fingerprint"])
        held_ids, held_start = json.loads(meta["ids"]), int(meta["start"])
    except (KeyError, ValueError) as e:
        raise DiskEntryError(f"its metadata does not read: {e}") from None
    if fingerprint_digest(fingerprint) != digest or held_ids != list(ids) or held_start != start:
        raise DiskEntryError("it holds other tokens, another position or other settings than its name says")
    try:
        tensors = load_tensors(data)
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise DiskEntryError(f"it does not read whole: {e}") from None
    out = []
    for i, buf in enumerate(bufs):
        t = tensors.get(f"t{i}")
        want = (*buf.shape[:3], len(ids), buf.shape[4])
        if t is None or tuple(t.shape) != want or t.dtype != buf.dtype:
            raise DiskEntryError(f"tensor {i} is not the cache's layout {want} {buf.dtype}")
        out.append(t)
    if len(tensors) != len(bufs):
        raise DiskEntryError("it holds more tensors than the cache has")
    return tuple(out)
