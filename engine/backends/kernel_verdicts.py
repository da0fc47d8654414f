"""The kernels' verdict cache: what a library's checks found, kept beside it as JSON (keyed by the library, whose
name holds the digest of sources, compiler, flags and CPU, by torch's version and by the checks' own source), so
that a later process takes it instead of checking again (engine/BENCHMARKS.md, "Opening a model file")."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import torch

from . import kernel_checks
from .kernel_binding import Kernels


@functools.cache
def checks_digest() -> str:
    """What the checks are: their module's source (a verdict found by other checks is checked again)."""
    return hashlib.sha256(Path(kernel_checks.__file__).read_bytes()).hexdigest()[:16]


def verdict_path(library: Path) -> Path:
    return library.with_name(library.name + ".checked.json")


def checked(library: Path) -> Kernels:
    """The library, its functions checked against torch: by this process, or by an earlier one with the same
    library (its name holds the digest of sources, compiler, flags and CPU) and torch, whose verdict is kept
    beside it (engine/BENCHMARKS.md, "Opening a model file"). A verdict that is unreadable, or from another
    torch or other checks, is checked again."""
    path = verdict_path(library)
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
        if kept.get("torch") == torch.__version__ and kept.get("checks") == checks_digest():
            return Kernels(library, kept)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    k = Kernels(library)
    keep_verdict(k)
    return k


def keep_verdict(k: Kernels) -> None:
    """Write what k's checks found beside its library (aside, then renamed: never half a file)."""
    path = verdict_path(k.path)
    try:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**k.checks(), "checks": checks_digest()}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # only the next process's start is at stake
