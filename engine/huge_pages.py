"""A loaded model's CPU weights on 2 MB pages: one anonymous mapping, advised for transparent huge pages, holds
every large tensor of the model, so that a decode step's stream of weights walks a few hundred page-table entries
where 4 KB pages took ~100,000 a token. On Linux only (macOS and Windows keep the weights where they were read);
`KVCHAT_HUGE_PAGES=0` turns it off. What it gains: engine/BENCHMARKS.md, "Weights on 2 MB pages"."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

import torch

HUGE = 2 << 20  # bytes in a huge page (x86-64's and aarch64's 4 KB-granule PMD size)
MADV_HUGEPAGE = 14
ENV = "KVCHAT_HUGE_PAGES"  # "0": off
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SMALLEST = 1 << 16  # storages under this stay where they are: a few pages each at most
ALIGN = 64  # each moved storage starts on a cache line


def available() -> bool:
    """Whether this process puts weights on huge pages: Linux with transparent huge pages on for advised memory
    ("always" or "madvise"), and not turned off by KVCHAT_HUGE_PAGES=0."""
    if not sys.platform.startswith("linux") or os.environ.get(ENV, "1") == "0":
        return False
    try:
        mode = THP.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def _madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def arena(nbytes: int) -> torch.Tensor | None:
    """nbytes [nbytes] uint8 starting on a 2 MB boundary of a private anonymous mapping advised for huge pages
    (the mapping lives as long as a tensor on it does), or None where that cannot be had."""
    madvise = _madvise()
    if madvise is None or nbytes <= 0:
        return None
    size = -(-nbytes // HUGE) * HUGE
    try:
        region = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return None
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping: unmapped when the last tensor goes
    skip = -raw.data_ptr() % HUGE
    if madvise(raw.data_ptr() + skip, size, MADV_HUGEPAGE) != 0:
        return None
    return raw[skip : skip + nbytes]


def empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised [numel] tensor on huge pages where `available()`, else torch's own (the bench's read
    stream: the roofline read from the same pages the weights are on)."""
    held = arena(numel * dtype.itemsize) if available() else None
    return torch.empty(numel, dtype=dtype) if held is None else held.view(dtype)


def _tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every CPU tensor the model holds: parameters, buffers and tensors kept as plain attributes."""
    found: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for t in [*m._parameters.values(), *m._buffers.values(), *vars(m).values()]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided and _plain(t):
                found.setdefault(id(t), t)
    return list(found.values())


def _plain(t: torch.Tensor) -> bool:
    """Whether a tensor has a storage of its own bytes (oneDNN's packed weights have none to move)."""
    try:
        t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return False
    return True


def gather(model: torch.nn.Module) -> int:
    """Move the model's CPU storages of SMALLEST bytes or more into one arena, each once (tensors sharing a
    storage, tied weights, keep sharing it), the old storage freed as the next is copied; the bytes moved, 0
    where huge pages are not `available()`. Run before anything takes the tensors' addresses (use_kernels)."""
    if not available():
        return 0
    by_storage: dict[int, list[torch.Tensor]] = {}  # keyed by address: holding a storage would keep it alive
    for t in _tensors(model):
        s = t.untyped_storage()
        if s.nbytes() >= SMALLEST:
            by_storage.setdefault(s.data_ptr(), []).append(t)
    places, total = [], 0  # (the tensors of one storage, its bytes, where it goes in the arena)
    for ts in by_storage.values():
        n = ts[0].untyped_storage().nbytes()
        places.append((ts, n, total))
        total += -(-n // ALIGN) * ALIGN
    held = arena(total)
    if held is None:
        return 0
    storage, base = held.untyped_storage(), held.storage_offset()
    for ts, n, at in places:  # each old storage freed once its tensors are set on the arena
        held[at : at + n].copy_(torch.empty(0, dtype=torch.uint8).set_(ts[0].untyped_storage()))
        with torch.no_grad():
            for t in ts:  # the same tensor objects, so every module and view of them follows
                size = t.element_size()
                t.set_(storage, (base + at) // size + t.storage_offset(), t.shape, t.stride())
    return total
