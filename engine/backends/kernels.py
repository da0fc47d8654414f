"""kvchat's CPU kernels for this process: built (engine.backends.kernel_build), bound (kernel_binding) and checked
against torch (kernel_checks, with the verdict kept by kernel_verdicts) on first use, or None with the reason.

Batch-1 decode streams every weight once per token, so it runs at the speed of a memory stream;
these plain row dot products reach it where torch's one-row products do not (engine/BENCHMARKS.md,
"What makes the CPU path fast"). Where anything is missing (no compiler, no OpenMP, KVCHAT_KERNELS=0) the
engine runs torch's kernels instead; `status()` says which and why.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import torch

from .kernel_binding import Kernels
from .kernel_build import (
    VARIANTS,
    build,
    compiler,
    compiler_name,
    openmp_runtimes,
    report,
    report_words,
    variant,
    zig_cc,
)
from .kernel_verdicts import checked

_lock = threading.Lock()
_loaded: Kernels | None = None
_reason: str | None = None  # why there are no kernels; None while not tried


def load() -> Kernels | None:
    """The kernels for this process (built and checked on first call), or None; status() says why."""
    global _loaded, _reason
    with _lock:
        if _loaded is None and _reason is None:
            try:
                _loaded, _reason = _load(), ""
            except Exception as e:  # any failure: torch's kernels run instead
                _loaded, _reason = None, f"{type(e).__name__}: {e}"
        return _loaded


def _load() -> Kernels:
    if os.environ.get("KVCHAT_KERNELS", "1").strip().lower() in ("0", "off", "no", "false"):
        raise RuntimeError("turned off by KVCHAT_KERNELS")
    forced = variant()
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or pip install ziglang for zig cc)")
    flags = VARIANTS[forced]
    try:
        k = _built(cc, flags)
    except (RuntimeError, OSError) as e:  # the system's compiler failed outright: the next one, where there is one
        zig = zig_cc()
        if zig is None or "ziglang" in cc or os.environ.get("CC"):  # CC names the one compiler to use
            raise
        k = _built(zig, flags)
        k.fell_through = f"{compiler_name(cc)} failed ({e}), so zig cc built them"
    k.variant = forced  # a second OpenMP runtime never runs: _built opened the library first and went to one thread
    if not k.dtypes:
        raise RuntimeError("the kernels disagree with torch on this CPU")
    return k


def _built(cc: list[str], flags: tuple[str, ...]) -> Kernels:
    """The library `cc` builds and checks: with OpenMP, else on one thread — where the compiler refuses OpenMP or
    cannot link it, or where its OpenMP runtime is not the one torch runs (clang's libomp beside torch's libgomp:
    two thread pools would fight over the cores; the library is opened, nothing in it run, before it is used)."""
    first = k = one_thread = None
    if "ziglang" not in cc:  # zig's clang takes -fopenmp but ships no OpenMP runtime to link: one thread there
        try:
            before = openmp_runtimes()
            path = build(cc, flags)
            ctypes.CDLL(str(path))  # maps the OpenMP runtime it needs; runs nothing of it
            after = openmp_runtimes()
            if len(after) > max(1, len(before)):
                theirs = ", ".join(sorted(Path(p).name for p in after - before))
                ours = ", ".join(sorted(Path(p).name for p in before)) or "none"
                one_thread = f"one thread: {compiler_name(cc)}'s OpenMP runtime ({theirs}) is not torch's ({ours})"
            else:
                k = checked(path)
        except (RuntimeError, OSError) as e:  # no OpenMP (refused, or not linked): one thread; else this error
            first = e
    if k is None:
        try:
            k = checked(build(cc, flags, openmp=False))
        except (RuntimeError, OSError):
            if first is None:
                raise
            raise first from None
        one_thread = one_thread or f"one thread: {compiler_name(cc)} has no OpenMP"
    k.one_thread, k.compiler, k.build = one_thread, compiler_name(cc), report(k.path)
    return k


def for_dtype(dtype: torch.dtype) -> Kernels | None:
    """The kernels when they serve float weights of `dtype`."""
    k = load()
    return k if k is not None and dtype in k.dtypes else None


def for_mode(mode: str) -> Kernels | None:
    """The kernels when they serve int8/int4 codes."""
    k = load()
    return k if k is not None and mode in k.modes else None


def status() -> str:
    """One line for the CLI, the benchmark and the app: what runs one-row products and why."""
    k = load()
    if k is None:
        return f"torch (no kvchat kernels: {_reason})"
    types = ", ".join(sorted(str(d).removeprefix("torch.") for d in k.dtypes) + sorted(k.modes))
    integer = f"; int8 activations: {k.int_isa}" if k.integer_modes else ""
    forced = f"; forced variant {k.variant}" if k.variant != "native" else ""
    threads = f"; {k.one_thread}" if k.one_thread else ""
    return f"kvchat kernels ({k.isa}; {types}{integer}{forced}{threads}; {built(k)})"


def built(k: Kernels) -> str:
    """What built the kernels, in words: the compiler and its version, each file that fell back a level with the
    compiler's first error there, and a system compiler that failed outright."""
    through = f"; {k.fell_through}" if k.fell_through else ""
    return f"built by {k.compiler}{report_words(k.build)}{through}"
