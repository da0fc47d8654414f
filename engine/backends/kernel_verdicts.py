"""The kernels' verdict cache: what a library's checks found, kept beside it as JSON (keyed by the library, whose
name holds the digest of sources, compiler, flags and CPU, and by torch's version), so that a later process
takes it instead of checking again (engine/BENCHMARKS.md, "Opening a model file")."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .kernel_binding import Kernels


def verdict_path(library: Path) -> Path:
    return library.with_name(library.name + ".checked.json")


def checked(library: Path) -> Kernels:
    """The library, its functions checked against torch: by this process, or by an earlier one with the same
    library (its name holds the digest of sources, compiler, flags and CPU) and torch, whose verdict is kept
    beside it (engine/BENCHMARKS.md, "Opening a model file"). A verdict that is unreadable, or from another
    torch, is checked again."""
    path = verdict_path(library)
    try:
        kept = json.loads(path.read_text(encoding="utf-8"))
        if kept.get("torch") == torch.__version__:
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
        tmp.write_text(json.dumps(k.checks()), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # only the next process's start is at stake
