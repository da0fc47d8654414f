"""Which device and dtype a model runs in, and how many threads torch's CPU kernels use."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from .errors import ModelLoadError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VARIANT_ENV = "KVCHAT_KERNELS_VARIANT"  # the kernels' instruction-set variant forced (engine.backends.kernels)
BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86's AVX-512 BF16 and AMX-BF16, ARM's BF16 extension
WITHOUT_BF16 = {"avx2", "avx2-no-vnni", "generic"}  # forced variants that stand for a CPU without them


def free_memory() -> int | None:
    """Bytes of memory free now, where the OS says (Linux, macOS); None elsewhere."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def free_on(device) -> int | None:
    """Bytes free now where `device`'s tensors live: the GPU's memory on CUDA, else the machine's (free_memory)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return free_memory()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them ("flags" on x86, "Features" on ARM; empty where
    there is no such file)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    return frozenset(
        f for ln in lines if ln.partition(":")[0].strip() in ("flags", "Features") for f in ln.partition(":")[2].split()
    )


def bf16_hardware() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (a forced AVX2 or plain-C kernel variant stands for a CPU
    that does not): where it does not, a bfloat16 model's prefill and attention compute in float32."""
    return bool(cpu_flags() & BF16_FLAGS) and os.environ.get(VARIANT_ENV, "").strip() not in WITHOUT_BF16


def resolve_device(name: str | None = None) -> torch.device:
    """cuda, then mps, then cpu when `name` is None or "auto"."""
    if name in (None, "", "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device cuda was asked for, but torch sees no CUDA GPU")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError("device mps was asked for, but it is not available")
    return device


def default_threads() -> int:
    """Threads for torch's kernels: KVCHAT_THREADS, else one per physical core (hyperthreads share a
    core's memory bandwidth and only add contention to a memory-bound decode)."""
    env = os.environ.get("KVCHAT_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    n = os.cpu_count() or 1
    try:
        smt = Path("/sys/devices/system/cpu/smt/active").read_text().strip() == "1"
    except OSError:
        smt = False
    return max(1, n // 2) if smt else n


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """bfloat16 on a GPU, float32 on the CPU, unless asked otherwise."""
    if name in (None, "", "auto"):
        return torch.bfloat16 if device.type in ("cuda", "mps") else torch.float32
    if name not in DTYPES:
        raise ModelLoadError(f"dtype {name!r} is not supported (supported: {', '.join(DTYPES)})")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
