"""The disk tier's files, read as what they are: files in a folder anyone may write to. Only a regular file
(never a link, a FIFO or a device) is opened, its size checked before a byte is read, a header's length
bounded by HEADER_BYTES and by the file, and a block's tensors checked against the prompt, the fingerprint
and the working cache's layout, finite, before any is used (engine/disk_store.py keeps the tier)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import stat
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors

from .errors import cut

FORMAT = "kvchat-kv/1"
HEADER_BYTES = 1 << 20  # a block's safetensors header (its ids and fingerprint): a longer one is refused


def fingerprint_digest(fingerprint: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


class DiskEntryError(Exception):
    """A file that cannot be used: damaged, truncated, or not what its name says."""


@contextlib.contextmanager
def folder_lock(path: Path):
    """An exclusive lock on `path` between processes (POSIX flock; where there is none, this process only)."""
    try:
        import fcntl
    except ImportError:  # Windows: the tier is shared by one process at a time there
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def said(e: Exception) -> str:
    """An exception's words for a refusal's reason, cut to 200 characters."""
    return cut(str(e) or type(e).__name__, 200)


def block_bytes(bufs, block: int) -> int:
    """A block's K/V payload in the working cache's layout: the most a block's file holds besides its header.
    Each buffer is [L, B, H_kv, C, d]: a block is its [L, B, H_kv, block, d]."""
    return sum(b.element_size() * math.prod(b.shape[:3]) * block * b.shape[4] for b in bufs)


def _open_regular(path: Path) -> tuple[int, int]:
    """(a descriptor, the size) of `path` when it is a regular file; a link, a FIFO or a device is refused."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise DiskEntryError(f"it cannot be opened as a plain file ({e.strerror or e})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise DiskEntryError("it is not a regular file")
    return fd, st.st_size


def _read(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        piece = os.read(fd, min(n - len(out), 16 << 20))
        if not piece:
            break
        out += piece
    return bytes(out)


def read_regular(path: Path, most: int) -> bytes:
    """The bytes of `path`, a regular file of at most `most` bytes (checked before a byte is read)."""
    fd, size = _open_regular(path)
    try:
        if size > most:
            raise DiskEntryError(f"{size:,} bytes, more than the {most:,} it may hold")
        return _read(fd, size)
    finally:
        os.close(fd)


def read_header(path: Path) -> bytes:
    """A safetensors file's length field and header, without its tensors (what `metadata` reads): the length
    bounded by HEADER_BYTES and by the file before it is read."""
    fd, size = _open_regular(path)
    try:
        head = _read(fd, 8)
        if len(head) < 8:
            return head
        n = int.from_bytes(head, "little")
        if n > min(HEADER_BYTES, size - 8):
            raise DiskEntryError(f"a header of {n:,} bytes in a file of {size:,}")
        return head + _read(fd, n)
    finally:
        os.close(fd)


def metadata(data: bytes) -> dict:
    """A safetensors file's metadata, from its header alone."""
    if len(data) < 8:
        raise DiskEntryError("shorter than a header")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, HEADER_BYTES):
        raise DiskEntryError("the header runs past the file's end, or past a header's size")
    try:
        head = json.loads(data[8 : 8 + n])
    except (ValueError, RecursionError) as e:
        raise DiskEntryError(f"a damaged header: {said(e)}") from None
    meta = head.get("__metadata__") if isinstance(head, dict) else None
    return meta if isinstance(meta, dict) else {}


def check_block(data: bytes, ids, start: int, digest: str, bufs, optional=()) -> tuple[torch.Tensor | None, ...]:
    """The block's tensors, once the file is whole and says it holds these ids at this position, under this
    fingerprint, in the working cache's layout; None for a buffer among `optional` the block does not carry (a
    hybrid's snapshots, which only some blocks hold)."""
    meta = metadata(data)
    if meta.get("format") != FORMAT:
        raise DiskEntryError(f"not a {FORMAT} file")
    try:
        fingerprint = json.loads(meta["fingerprint"])
        held_ids, held_start = json.loads(meta["ids"]), int(meta["start"])
    except (KeyError, ValueError, TypeError, RecursionError) as e:
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
        if t is None and i in optional:
            out.append(None)
            continue
        want = (*buf.shape[:3], len(ids), buf.shape[4])
        if t is None or tuple(t.shape) != want or t.dtype != buf.dtype:
            raise DiskEntryError(f"tensor {i} is not the cache's layout {want} {buf.dtype}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise DiskEntryError(f"tensor {i} holds NaN or infinite values")
        out.append(t)
    if len(tensors) != sum(t is not None for t in out):
        raise DiskEntryError("it holds more tensors than the cache has")
    return tuple(out)
