"""The hand-written CPU kernels for decode (cpu_kernels.c): built once for this CPU, loaded with ctypes.

Batch-1 decode streams every weight once per token; torch's one-row CPU products stream them at
roughly half of what the memory system gives (README, Performance) and each costs tens of
microseconds of fixed work. The kernels here are plain row dot products that reach the memory's
speed. They are compiled on first use with the system's C compiler (`cc -O3 -march=native
-fopenmp`) into the user cache directory, keyed by source, compiler, flags and CPU, and each is
checked against torch before use. Where anything is missing (no compiler, no OpenMP, another CPU
kind, KVCHAT_KERNELS=0) the engine runs torch's kernels instead; `status()` says which and why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
QUANT_FUNCS = {"int8": "kv_matvec_q8", "int4": "kv_matvec_q4"}
FLOAT_FUNCS = {torch.float32: "kv_matvec_f32", torch.bfloat16: "kv_matvec_bf16", torch.float16: "kv_matvec_f16"}


def cache_dir() -> Path:
    """KVCHAT_CACHE_DIR when set, else the platform's user cache directory."""
    env = os.environ.get("KVCHAT_CACHE_DIR")
    if env:
        return Path(env).expanduser() / "kernels"
    import platformdirs
    return Path(platformdirs.user_cache_dir("kvchat", appauthor=False)) / "kernels"


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags (a cache may be shared)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return platform.processor() + platform.machine()


def build(cc: str | None = None, extra_flags: tuple[str, ...] = (), out_dir: Path | None = None) -> Path:
    """Compile cpu_kernels.c (once per source, compiler, flags and CPU) and return the library's path."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    flags = FLAGS + tuple(extra_flags)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, version, *flags, _cpu_signature()]).encode())
    out_dir = out_dir or cache_dir()
    target = out_dir / f"cpu_kernels-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # build aside, then rename: atomic for other processes
        partial = Path(tmp) / target.name
        done = subprocess.run([cc, *flags, str(SOURCE), "-o", str(partial)], capture_output=True, text=True,
                              timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-600:]}")
        os.replace(partial, target)
    return target


def _openmp_runtimes() -> set[str]:
    """The OpenMP runtime files mapped into this process (more than one would fight over the cores)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    return {ln.split()[-1] for ln in maps if ("libgomp" in ln or "libomp" in ln or "libiomp" in ln) and "/" in ln}


class Kernels:
    """The loaded library: one-row products for float weights and for group-wise int8/int4 codes."""

    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.lib.kv_isa.restype = ctypes.c_char_p
        self.isa = self.lib.kv_isa().decode()
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._float = {}
        for dtype, name in FLOAT_FUNCS.items():
            fn = getattr(self.lib, name, None)
            if fn is not None:  # float16 needs the compiler's _Float16
                fn.argtypes, fn.restype = [p, p, p, i64, i64, ctypes.c_int], None
                self._float[dtype] = fn
        self._quant = {}
        for mode, name in QUANT_FUNCS.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = [p, p, p, p, i64, i64, i64, ctypes.c_int], None
            self._quant[mode] = fn
        self.dtypes = frozenset(d for d in self._float if self._agrees(d))
        self.modes = frozenset(m for m in self._quant if self._quant_agrees(m))

    def matvec(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """weight [out, in] (contiguous, CPU), x [in] of its dtype -> y [out] of its dtype."""
        out, n = weight.shape
        x = x.contiguous()
        y = torch.empty(out, dtype=weight.dtype)
        self._float[weight.dtype](weight.data_ptr(), x.data_ptr(), y.data_ptr(), out, n, torch.get_num_threads())
        return y

    def qmatvec(self, mode: str, codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, group: int) -> torch.Tensor:
        """codes [out, in] int8 or [out, in/2] uint8 (int4, two a byte), scales [out, in/g] float32, x [in]
        float32 -> y [out] float32."""
        out, n = scales.shape[0], x.numel()
        x = x.contiguous()
        y = torch.empty(out, dtype=torch.float32)
        self._quant[mode](codes.data_ptr(), scales.data_ptr(), x.data_ptr(), y.data_ptr(), out, n, group,
                          torch.get_num_threads())
        return y

    def _agrees(self, dtype: torch.dtype) -> bool:
        """The kernel against F.linear on awkward sizes (a vector tail, one thread and two)."""
        g = torch.Generator().manual_seed(0)
        for out, n in ((7, 64), (33, 131), (96, 576)):
            w = torch.randn(out, n, generator=g).to(dtype)
            x = torch.randn(n, generator=g).to(dtype)
            want = (w.float() @ x.float())
            got = self.matvec(w, x).float()
            if not torch.allclose(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max())):
                return False
        return True

    def _quant_agrees(self, mode: str) -> bool:
        from .quant import dequantize, pack_int4, quantize
        g = torch.Generator().manual_seed(0)
        for out, n, group in ((5, 64, 64), (19, 192, 32), (40, 576, 64), (8, 96, 48)):
            codes, scales = quantize(torch.randn(out, n, generator=g), mode, group)
            x = torch.randn(n, generator=g)
            want = dequantize(codes, scales) @ x
            got = self.qmatvec(mode, pack_int4(codes) if mode == "int4" else codes, scales, x, group)
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
                return False
        return True


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
    if platform.system() != "Linux":
        raise RuntimeError(f"built and tested on Linux only, not {platform.system()}")
    before = _openmp_runtimes()
    k = Kernels(build())
    after = _openmp_runtimes()
    if len(after) > max(1, len(before)):  # ours brought its own OpenMP: two thread pools on the same cores
        raise RuntimeError(f"the kernels would run a second OpenMP runtime ({', '.join(sorted(after))})")
    if not k.dtypes:
        raise RuntimeError("the kernels disagree with torch on this CPU")
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
    return f"kvchat kernels ({k.isa}; {types})"
