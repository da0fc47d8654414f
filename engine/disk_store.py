"""The prefix store's disk tier: blocks of K/V written to files so that a conversation's cache outlives the
process. A later run under the same weights and settings reads them back instead of prefilling again.

A block is BLOCK positions of one prompt. Its file is named by a hash that chains the token ids of every
block from position 0 up to and including it (K/V at a position depend on all the ids before it), salted
with a digest of the fingerprint the K/V are valid under: weights, dtype, precisions, tokenizer, rotary and
attention settings, device, and the decode kernels that computed them. A prefix shared by conversations is
stored once. Files are safetensors (no pickle); each holds its block's ids, position and fingerprint, and
all of them are checked against the prompt and the cache's layout before a byte is used. The folder is
trusted no more than a download: only regular files of at most a block's size are opened (never a link, a
FIFO or a device), a header's length is bounded before it is read, and a file that does not read back whole
and finite is refused and removed, with the reason. Writes go to a temporary file of the tier's own name and
are renamed into place, so a kill at any moment loses at most the block being written; a byte budget is kept
by evicting the least recently used blocks (the deepest first among those used together), across processes
sharing the folder (a lock file, and the folder counted again before each write), and is never exceeded.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import os
import queue
import re
import stat
import threading
import time
import weakref
from pathlib import Path

import numpy as np
from safetensors.torch import save as save_tensors

from .disk_files import (
    FORMAT,
    HEADER_BYTES,
    DiskEntryError,
    block_bytes,
    check_block,
    fingerprint_digest,
    folder_lock,
    metadata,
    read_header,
    read_regular,
    said,
)
from .prefix_store import BLOCK

ROOT = hashlib.sha256(FORMAT.encode()).digest()  # the chain of block hashes starts here, "before" position 0

SUFFIX = ".kv"
RATES = "prefill-rates.json"  # each fingerprint's prefill rate measured here: a return's cost before any prefill
QUEUE_BYTES = 256 * 2**20  # blocks waiting for the writer at most; past it a block waits for a later request
EVICT_TO = 0.9  # evicting for room frees down to this share of the budget (fewer passes over the index)
RATES_BYTES = 1 << 20
LOCK = ".kvchat-lock"  # the processes sharing a folder write one at a time
BLOCK_NAME = re.compile(r"([0-9a-f]{32})-([0-9a-f]{16})-(\d{1,12})" + re.escape(SUFFIX))
OWN_TEMPORARY = re.compile(rf"(?:{BLOCK_NAME.pattern}|{re.escape(RATES)})\.tmp\d+")  # what a killed write left


def _packed(ids) -> bytes:
    """Token ids as the hash reads them: 4-byte little-endian signed integers, packed in one call; 8-byte ones for
    a block that holds an image's positions (their ids are negative and wide: engine.images)."""
    packed = np.asarray(ids, dtype="<i8")
    return (packed if len(packed) and packed.min() < 0 else packed.astype("<i4")).tobytes()


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


class DiskStore:
    """Blocks of K/V in `directory`, at most `budget` bytes. Reading happens on the caller's thread; writing
    on a thread of its own, so a request never waits for the disk."""

    def __init__(self, directory: str | os.PathLike, budget: int, block: int = BLOCK):
        if budget < 0:
            raise ValueError("the disk tier's budget cannot be negative")
        self.dir, self.budget, self.block = Path(directory), budget, block
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.refused: list[str] = []  # files refused and removed, with the reason (the newest last)
        self.index: dict[str, dict[str, Entry]] = {}  # fingerprint digest -> block key -> entry
        self.bytes = 0
        self.evictions = 0
        self.read_bytes, self.read_s = 0, 0.0  # what reads took: the rate a return is estimated from
        self.written = 0
        self._fingerprints: dict[str, dict] = {}  # digest -> the fingerprint, as files under it say
        self._queue: queue.Queue = queue.Queue()
        self._queued: dict[tuple[str, str], int] = {}  # (digest, key) -> bytes, waiting to be written
        self._jobs = 0  # jobs put and not yet done (blocks and the rates file): what flush() waits for
        self._idle = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self._scan()
        self._stamp = self._folder_stamp()  # what the folder was when last counted (_write_locked)
        self._rates = self._read_rates()
        with self._lock:
            self._evict(0)
        atexit.register(_close_at_exit, weakref.ref(self))  # the writer joined before the interpreter ends

    # --- the index -----------------------------------------------------------------------------------
    def _scan(self) -> None:
        """The blocks already here. A temporary file of the tier's own name is what a killed write left: removed
        (another program's files are never touched); a block's name on what is not a regular file (a link, a
        FIFO, a device) is refused and removed."""
        index, total = self._listing(clean=True)
        self.index, self.bytes = index, total

    def _listing(self, clean: bool = False) -> tuple[dict[str, dict[str, Entry]], int]:
        """The folder's blocks as they are now (another process may have written or evicted), and their bytes."""
        index: dict[str, dict[str, Entry]] = {}
        total = 0
        try:
            names = os.listdir(self.dir)
        except OSError:
            return index, 0
        for name in names:
            path = self.dir / name
            if clean and OWN_TEMPORARY.fullmatch(name):
                with contextlib.suppress(OSError):
                    if stat.S_ISREG(os.lstat(path).st_mode):
                        path.unlink()
                continue
            m = BLOCK_NAME.fullmatch(name)
            if m is None:
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                with contextlib.suppress(OSError):
                    path.unlink()
                self.refused = [*self.refused[-9:], f"{name} is not a regular file: removed"]
                continue
            key, digest, start = m.groups()
            old = self.index.get(digest, {}).get(key)
            used = max(st.st_mtime, old.used) if old is not None else st.st_mtime
            index.setdefault(digest, {})[key] = Entry(path, st.st_size, int(start), used)
            total += st.st_size
        return index, total

    def _read_rates(self) -> dict[str, float]:
        try:
            rates = json.loads(read_regular(self.dir / RATES, RATES_BYTES))
        except (OSError, ValueError, RecursionError, DiskEntryError):
            return {}
        if not isinstance(rates, dict):
            return {}
        return {k: float(v) for k, v in rates.items() if isinstance(k, str) and isinstance(v, (int, float)) and v > 0}

    def note_prefill_rate(self, fingerprint: dict, tok_s: float) -> None:
        """This model's prefill rate as just measured, kept (written on the writer's thread) for later runs."""
        self._rates[fingerprint_digest(fingerprint)] = float(tok_s)
        self._put(("rates",))

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
                meta = metadata(read_header(entry.path))
                fingerprint = json.loads(meta["fingerprint"])
                if not isinstance(fingerprint, dict):
                    raise DiskEntryError("its fingerprint is not a record")
                self._fingerprints[digest] = fingerprint
            except Exception as e:  # any way a planted file fails: refused and removed, never raised to a request
                key = next((k for k, v in self.index.get(digest, {}).items() if v is entry), None)
                if key is not None:
                    self._forget(digest, key, f"{entry.path.name} was refused and removed ({said(e)})")
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
                data = read_regular(entry.path, block_bytes(bufs, self.block) + 8 + HEADER_BYTES)
                tensors = check_block(data, ids[pos : pos + self.block], pos, digest, bufs,
                                      getattr(cache, "optional_buffers", ()))  # fmt: skip
            except Exception as e:  # any way a planted or damaged file fails: refused and removed, with the reason
                why = f"a disk block at position {pos} was refused and removed ({said(e)})"
                self._forget(digest, keys[k], why)
                break
            lo, hi = max(start, pos), min(end, pos + self.block)
            cache.give(lo, hi, tuple(None if t is None else t[:, :, :, lo - pos : hi - pos] for t in tensors))
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
            n = len(read_regular(entry.path, entry.nbytes))
        except (OSError, DiskEntryError):
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
        queued = 0
        with self._lock:
            have = self.index.get(digest, {})
            waiting = sum(self._queued.values())
        for k, key in enumerate(block_keys(ids[:upto], self.block)):
            if key in have or (digest, key) in self._queued:
                continue
            s = k * self.block
            tensors = tuple(None if t is None else t.to("cpu").contiguous() for t in cache.take(s, s + self.block))
            n = sum(t.numel() * t.element_size() for t in tensors if t is not None)  # copies already
            if waiting + queued + n > QUEUE_BYTES or n > self.budget:
                break
            with self._lock:
                self._queued[(digest, key)] = n
            self._put((digest, key, s, tuple(ids[s : s + self.block]), tensors, fingerprint))
            queued += n
        return queued

    def _put(self, job) -> None:
        with self._lock:
            self._jobs += 1
            if self._writer is None or not self._writer.is_alive():
                self._writer = threading.Thread(target=self._write_loop, name="kvchat-disk-writer", daemon=True)
                self._writer.start()
        self._queue.put(job)

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:  # close(): every job before it is done
                return
            try:
                if job[0] == "rates":
                    with contextlib.suppress(OSError):
                        tmp = self.dir / f"{RATES}.tmp{os.getpid()}"
                        tmp.write_text(json.dumps(dict(self._rates)))
                        os.replace(tmp, self.dir / RATES)
                else:
                    self._write(*job)
            except OSError as e:  # a full or read-only disk: the block stays in memory's tiers only
                self.refused = [*self.refused[-9:], f"a block could not be written: {e}"]
            finally:
                with self._lock:
                    if job[0] != "rates":
                        self._queued.pop((job[0], job[1]), None)
                    self._jobs -= 1
                    if not self._jobs:
                        self._idle.notify_all()

    def close(self, timeout: float = 30.0) -> bool:
        """Write what is queued and end the writer (at exit: a thread killed mid-write aborts the process)."""
        done = self.flush(timeout)
        writer = self._writer
        if writer is not None and writer.is_alive():
            self._queue.put(None)
            writer.join(timeout if done else 1.0)
        return done

    def _write(self, digest, key, start, ids, tensors, fingerprint) -> None:
        meta = {"format": FORMAT, "fingerprint": json.dumps(fingerprint, sort_keys=True), "ids": json.dumps(ids),
                "start": str(start)}  # fmt: skip
        data = save_tensors({f"t{i}": t for i, t in enumerate(tensors) if t is not None}, metadata=meta)
        with folder_lock(self.dir / LOCK):  # one writer at a time among the processes sharing the folder
            self._write_locked(digest, key, start, data, fingerprint)

    def _folder_stamp(self) -> int | None:
        """The folder's modification time (ns): it changes when any process adds or removes a file there."""
        try:
            return os.stat(self.dir).st_mtime_ns
        except OSError:
            return None

    def _write_locked(self, digest, key, start, data: bytes, fingerprint) -> None:
        stamp = self._folder_stamp()
        coarse = stamp is None or stamp % 1_000_000_000 == 0  # a filesystem of whole seconds cannot tell: count
        if coarse or stamp != self._stamp:  # another process wrote or evicted since our last write: count again
            index, total = self._listing()  # off the request thread's lock: a folder of thousands of blocks
            with self._lock:
                self.index, self.bytes = index, total
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
        self._stamp = self._folder_stamp()  # still under the folder's lock: this write and its evictions included

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
        """Wait until every queued block (and the rates file) is written; False when `timeout` ran out first."""
        end = time.monotonic() + timeout
        with self._lock:
            while self._jobs:
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


def _close_at_exit(ref) -> None:
    store = ref()
    if store is not None:
        store.close(10.0)
