"""What the machine is and can do, measured in the same run: the CPU and the instruction sets the kernels
use, memory bandwidth, reading the files, and a process's resident and peak memory."""

from __future__ import annotations

import platform
from pathlib import Path

CPU_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_bf16",
    "avx512_fp16",
    "avx512_vnni",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "sve",
    "neon",
)


def _status_bytes(key: str) -> int | None:
    """A size line of /proc/self/status (VmRSS, VmHWM) in bytes; None where there is no such file."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss_now() -> int:
    return _status_bytes("VmRSS") or 0


def reset_peak_rss() -> None:
    """Start VmHWM again from the current resident size (Linux: clear_refs 5)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss() -> int:
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_mem(device) -> int:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _peak_rss()


def device_sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device=None, megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second a large copy moves (read + write), best of `repeats`: reported beside the read roofline."""
    import torch

    from ... import huge_pages
    from ...trace import now

    device = torch.device(device or "cpu")
    n = megabytes * 2**20
    if device.type == "cpu":  # on the pages the weights are on, as the read roofline
        src, dst = huge_pages.empty(n, torch.uint8).fill_(1), huge_pages.empty(n, torch.uint8)
    else:
        src = torch.ones(n, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        device_sync(device)
        t0 = now()
        dst.copy_(src)
        device_sync(device)
        best = min(best, now() - t0)
    return 2 * n / best


def last_level_cache_bytes() -> int:
    """The largest CPU cache this machine reports (Linux sysfs), 0 where it says nothing."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) * {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1))
        except (OSError, ValueError):
            pass
    return max(sizes, default=0)


def measure_read_bandwidth(device=None, repeats: int = 5) -> float:
    """Bytes per second a read-only stream moves, best of `repeats`, with the run's thread count, over a buffer
    four times the last-level cache (at least 1 GiB, at most 4 GiB) so that it streams from memory: what a
    batch-1 decode step does, which reads its weights and writes almost nothing. The roofline (a copy's read +
    write figure is reported beside it). On the CPU the stream is the kernels' own sum (eight chains of vector
    adds and their prefetch: torch's sum read less than the decode kernels do, engine/BENCHMARKS.md, "How it
    is measured"), torch's sum where there are no kernels or on a GPU."""
    import torch

    from ... import huge_pages
    from ...backends import kernels
    from ...trace import now

    device = torch.device(device or "cpu")
    n = min(max(4 * last_level_cache_bytes(), 2**30), 2**32) if device.type == "cpu" else 2**30
    if device.type == "cpu":  # on the pages the weights are on (engine.huge_pages: 2 MB where it moves them)
        x = huge_pages.empty(n // 4).fill_(1.0)
    else:
        x = torch.ones(n // 4, dtype=torch.float32, device=device)
    k = kernels.load() if device.type == "cpu" else None
    best = float("inf")
    for _ in range(repeats):
        device_sync(device)
        t0 = now()
        k.read_stream(x) if k is not None else x.sum()
        device_sync(device)
        best = min(best, now() - t0)
    return n / best


def file_read_seconds(model_dir) -> float:
    """Time to read the weight files into fresh memory, once: what a load is compared with."""
    from ...trace import now

    t0 = now()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        buf = bytearray(path.stat().st_size)
        with open(path, "rb", buffering=0) as f:
            f.readinto(buf)
        del buf
    return now() - t0


def cpu_info() -> dict:
    """The CPU the run measured: its model name, the instruction sets that matter to the kernels, and
    what kvchat's kernels were built for."""
    from ... import devices
    from ...backends import kernels

    name, flags = platform.processor() or platform.machine(), devices.cpu_flags()
    try:
        models = [ln.partition(":")[2].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.partition(":")[0].strip() == "model name"]  # fmt: skip
        name = next((n for n in models if n), name)
    except OSError:
        pass
    return {"model": name, "instruction_sets": [f for f in CPU_FLAGS if f in flags], "kernels": kernels.status()}


def served_facts(ns, loaded) -> dict:
    """What a serving benchmark ran on, the head of its report: the model, its weights, the device (and CPU),
    the threads and the request lengths."""
    import torch

    return {
        "model": str(ns.model or ns.shape),
        "weights": ns.weights,
        "activations": getattr(ns, "activations", "float32"),
        "device": str(loaded.device),
        "cpu": cpu_info() if loaded.device.type == "cpu" else None,
        "threads": torch.get_num_threads(),
        "prompt_tokens": ns.prompt_tokens,
        "new_tokens": ns.new_tokens,
    }
