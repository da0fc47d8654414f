"""Builds kvchat's CPU kernels (the C library in csrc/, its ABI in csrc/kernels.h) for this CPU and wraps them
for torch tensors.

Batch-1 decode streams every weight once per token, so it runs at the speed of a memory stream;
these plain row dot products reach it where torch's one-row products do not (engine/BENCHMARKS.md,
"What makes the CPU path fast").
The library is compiled on first use with the system's C compiler into the user cache directory,
keyed by source, compiler, flags and CPU, and every function is checked against torch before use.
Where anything is missing (no compiler, no OpenMP, KVCHAT_KERNELS=0) the engine runs torch's
kernels instead; `status()` says which and why.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

from ..devices import BF16_FLAGS, VARIANT_ENV, WITHOUT_BF16, bf16_hardware, cpu_flags  # noqa: F401 (the tests' names)
from ..model import RMSNorm, swap_halves
from ..quant import (
    ACTIVATION_BLOCK,
    INT5_GROUP,
    QMAX,
    check_activations,
    dequantize,
    integer_product,
    pack_int4,
    pack_int5,
    quantize,
    storage_bytes,
    tile,
)
from ..user_cache import user_cache

SOURCES = Path(__file__).with_name("csrc")  # kernels.h (the ABI), simd.h, and one .c file per area
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
# The instruction-set variants an x86 build can be forced to (KVCHAT_KERNELS_VARIANT, the tests): the flags
# that take a part away from -march=native. "native" is the default: the best this CPU runs.
X86_VARIANTS = {
    "native": (),
    "avx512-no-vnni": ("-mno-avx512vnni",),  # AVX-512 without VNNI: the 256-bit integer products
    "avx512-no-vbmi": ("-mno-avx512vbmi",),  # the int4 tiles' nibbles by shifts only
    "avx2": ("-mno-avx512f",),
    "avx2-no-vnni": ("-mno-avx512f", "-mno-avxvnni"),  # AVX2's integer products on vpmaddubsw
    "generic": ("-mno-avx512f", "-mno-avx2", "-mno-fma"),  # plain C
}
ARM_VARIANTS = {"native": (), "generic": ("-DKV_GENERIC",)}  # aarch64: NEON (and what -mcpu adds), or plain C
X86 = platform.machine() in ("x86_64", "AMD64")  # where the variants are builds of their own
ARM = platform.machine().lower() in ("aarch64", "arm64")
VARIANTS = X86_VARIANTS if X86 else ARM_VARIANTS if ARM else {"native": ()}
LIBRARY_SUFFIX = {"Windows": ".dll", "Darwin": ".dylib"}.get(platform.system(), ".so")


def target_flags(flags: tuple[str, ...], machine: str | None = None) -> tuple[str, ...]:
    """The build's flags for this machine: ARM compilers name the host CPU with -mcpu (clang refuses
    -march=native there), x86 ones with -march."""
    machine = (machine or platform.machine()).lower()
    if machine in ("aarch64", "arm64"):
        return tuple("-mcpu=native" if f == "-march=native" else f for f in flags)
    return flags


QUANT_FUNCS = {"int8": "kv_matvec_q8", "int4": "kv_matvec_q4", "int5": "kv_matvec_q5"}
INTEGER_FUNCS = {mode: name + "x" for mode, name in QUANT_FUNCS.items()}  # int8 activations
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# kv_gguf_rows' kinds (csrc/kernels.h): GGUF type -> (kind, block bytes, values a block, values per scale)
GGUF_ROWS = {"Q4_0": (0, 18, 32, 32), "Q4_1": (1, 20, 32, 32), "Q8_0": (2, 34, 32, 32), "Q4_K": (3, 144, 256, 32)}
GGUF_ROWS |= {"Q6_K": (4, 210, 256, 16), "Q5_K": (5, 176, 256, 32)}


def cache_dir() -> Path:
    """KVCHAT_CACHE_DIR when set, else the platform's user cache directory."""
    return user_cache("kernels")


def compiler() -> list[str] | None:
    """The C compiler's command: CC, else the system's cc, gcc or clang, else `zig cc` where the ziglang
    package is installed (a compiler from PyPI, for machines that have none); None without any."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if found:
        return [found]
    if importlib.util.find_spec("ziglang") is not None:
        return [sys.executable, "-m", "ziglang", "cc"]
    return None


def compiler_name(cc: list[str]) -> str:
    """A compiler's command as a person reads it: `/usr/bin/gcc`, `zig cc`."""
    return "zig cc" if "ziglang" in cc else " ".join(cc)


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags (a cache may be shared)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return platform.processor() + platform.machine()


def sources() -> list[Path]:
    """The library's files: every header and C file in csrc/, in a fixed order."""
    return sorted(p for p in SOURCES.iterdir() if p.suffix in (".c", ".h"))


def variants() -> list[str]:
    """The distinct builds this CPU can execute, best first: on x86 each variant that takes away a part this CPU
    has (one that takes away nothing would be the native build again), then plain C; elsewhere the native build."""
    if not X86:
        return list(VARIANTS)
    have = cpu_flags()
    out = ["native"]
    if "avx512f" in have:
        out += ["avx512-no-vnni"] * ("avx512_vnni" in have) + ["avx512-no-vbmi"] * ("avx512vbmi" in have) + ["avx2"]
    if "avx_vnni" in have:  # AVX-VNNI: AVX2's integer products have a path of their own without it
        out.append("avx2-no-vnni")
    return out + ["generic"]


def variant() -> str:
    """The variant asked for (KVCHAT_KERNELS_VARIANT), "native" when none; an unknown name is an error."""
    name = os.environ.get(VARIANT_ENV, "").strip() or "native"
    if name not in VARIANTS:
        raise RuntimeError(f"{VARIANT_ENV}={name!r} is not a variant here (variants: {', '.join(variants())})")
    return name


def build(
    cc: str | list[str] | None = None,
    extra_flags: tuple[str, ...] = (),
    out_dir: Path | None = None,
    openmp: bool = True,
) -> Path:
    """Compile the kernels (once per source, compiler, flags and CPU) in one compiler call and return the
    library's path. `openmp=False`: without -fopenmp (the pragmas are ignored: one thread), for a compiler
    that has no OpenMP (Apple's clang, clang without libomp)."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or pip install ziglang for zig cc)")
    cc = [cc] if isinstance(cc, str) else list(cc)
    flags = target_flags(tuple(f for f in FLAGS if openmp or f != "-fopenmp")) + tuple(extra_flags)
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    files = sources()
    texts = [f"{p.name}\n{p.read_text()}" for p in files]
    key = hashlib.sha256("\0".join([*texts, *cc, version, *flags, _cpu_signature()]).encode())
    out_dir = out_dir or cache_dir()
    target = out_dir / f"cpu_kernels-{key.hexdigest()[:16]}{LIBRARY_SUFFIX}"
    if target.is_file():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:  # build aside, then rename: atomic for other processes
        partial = Path(tmp) / target.name
        done = subprocess.run(
            [*cc, *flags, f"-I{SOURCES}", *(str(p) for p in files if p.suffix == ".c"), "-o", str(partial)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler_name(cc)} failed: {done.stderr.strip()[-600:]}")
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
    """The loaded library: one-row products for float weights and for group-wise int8/int4/int5 codes (with
    float32 activations, or int8 ones: `integer_modes`, run by `int_isa`)."""

    def __init__(self, path: Path, verdict: dict | None = None):
        """`verdict`: what the checks found for this very library on this CPU and torch before (checks());
        without it every function is checked against torch now."""
        self.path = path
        self.variant = "native"  # or the variant the build was forced to (X86_VARIANTS)
        self.gguf_rows_agree: bool | None = None  # kv_gguf_rows against numpy: engine.weights.gguf_blocks checks it
        self.one_thread: str | None = None  # why the build runs on one thread (no OpenMP), or None
        self.compiler = "cc"  # what built it, as a person reads it (compiler_name)
        self.lib = ctypes.CDLL(str(path))
        self.lib.kv_isa.restype = self.lib.kv_int_isa.restype = ctypes.c_char_p
        self.isa = self.lib.kv_isa().decode()
        self.int_isa = self.lib.kv_int_isa().decode()  # what runs the integer products
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._float, self._norm, self._attend = {}, {}, {}
        for dtype, suffix in SUFFIX.items():
            if not hasattr(self.lib, "kv_matvec_" + suffix):  # float16 needs the compiler's _Float16
                continue
            self._float[dtype] = self._declare("kv_matvec_" + suffix, [p, p, p, i64, i64, i32])
            self._norm[dtype] = self._declare("kv_rmsnorm_" + suffix, [p, p, p, i64, f32])
            self._attend[dtype] = self._declare(
                "kv_attend_" + suffix, [p] * 5 + [f32, p, p] + [i64] * 6 + [f32, p, i32]
            )
        self._decode = {
            dtype: self._declare(
                "kv_decode_layers_" + SUFFIX[dtype], [p, i64, p, p, p, f32, f32] + [i64] * 8 + [p] * 8 + [i32]
            )
            for dtype in self._float
        }
        self._quant = {
            mode: self._declare(name, [p, p, p, p, p, i64, i64, i64, i32]) for mode, name in QUANT_FUNCS.items()
        }
        self._integer = {
            mode: self._declare(name, [p, p, p, p, p, i64, i64, i64, i32]) for mode, name in INTEGER_FUNCS.items()
        }
        self._quantize = self._declare("kv_quantize", [p, p, p, p, i64, i64, i64, i32, i32])
        self._dequant = {
            mode: self._declare(name.replace("matvec", "dequant"), [p, p, p, p, i64, i64, i64, i32])
            for mode, name in QUANT_FUNCS.items()
        }
        self._tiled = self._declare("kv_matvec_q4t", [p, p, p, p, p, i64, i64, i64, i32])
        self._tiled_integer = self._declare("kv_matvec_q4tx", [p, p, p, p, p, i64, i64, i64, i32])
        self._tiled_dequant = self._declare("kv_dequant_q4t", [p, p, p, p, i64, i64, i64, i32])
        self._silu = self._declare("kv_silu_f32", [p, p, i64])
        self._gguf_rows = self._declare("kv_gguf_rows", [p, i64, i64, i64, p, i64, i64, i64, i64, p, p, p, i32])
        self._read_stream = self._declare("kv_read_stream", [p, i64, i32])
        self._read_stream.restype = ctypes.c_float
        self.lib.kv_int4_tile_rows.restype = self.lib.kv_int4_integer_tiles.restype = ctypes.c_int
        if verdict is not None:
            self._take(verdict)
            return
        with torch.inference_mode():
            self.dtypes = frozenset(d for d in self._float if self._agrees(d)) if self._silu_agrees() else frozenset()
            self.modes = frozenset(m for m in self._quant if self._quant_agrees(m))
            self.integer_modes = frozenset(m for m in self.modes if self._quant_agrees(m, "int8"))
            rows = self.lib.kv_int4_tile_rows()  # 0 where rows are as fast (no 16-lane vectors)
            self.int4_tile_rows = rows if rows and "int4" in self.modes and self._tiles_agree(rows) else 0
            self.int4_integer_tiles = bool(  # the tiles' integer products with int8 activations (512-bit VNNI)
                self.int4_tile_rows
                and self.lib.kv_int4_integer_tiles()
                and "int4" in self.integer_modes
                and self._tiles_agree(rows, "int8")
            )

    def checks(self) -> dict:
        """What the load-time checks found, as kept beside the library (_load): the same build on the same CPU
        and torch finds the same, so a later process takes it instead of checking again."""
        return {
            "torch": torch.__version__,
            "dtypes": sorted(str(d).removeprefix("torch.") for d in self.dtypes),
            "modes": sorted(self.modes),
            "integer_modes": sorted(self.integer_modes),
            "int4_tile_rows": self.int4_tile_rows,
            "int4_integer_tiles": self.int4_integer_tiles,
            "gguf_rows_agree": self.gguf_rows_agree,
        }

    def _take(self, v: dict) -> None:
        self.dtypes = frozenset(d for d in self._float if str(d).removeprefix("torch.") in v["dtypes"])
        self.modes = frozenset(m for m in self._quant if m in v["modes"])
        self.integer_modes = frozenset(m for m in self.modes if m in v["integer_modes"])
        self.int4_tile_rows = int(v["int4_tile_rows"]) if "int4" in self.modes else 0
        self.int4_integer_tiles = bool(v["int4_integer_tiles"]) and bool(self.int4_tile_rows)
        self.gguf_rows_agree = None if v.get("gguf_rows_agree") is None else bool(v["gguf_rows_agree"])

    @staticmethod
    def _memory(*tensors: torch.Tensor | None) -> list[int | None]:
        """Raw addresses for C, after the checks that keep it in bounds: CPU memory, dense rows."""
        for t in tensors:
            if t is not None and not (t.is_cpu and t.is_contiguous()):
                raise ValueError("kvchat's kernels take contiguous CPU tensors")
        return [None if t is None else t.data_ptr() for t in tensors]

    def _declare(self, name: str, argtypes):
        fn = getattr(self.lib, name)
        fn.argtypes, fn.restype = argtypes, None
        return fn

    def gguf_rows(self, raw, kind: str, mode: str, order, r0: int, tile: int, group: int, codes, scales, mins) -> None:
        """A GGUF tensor's rows of `kind` (GGUF_ROWS), raw [n, nb · block bytes] uint8 (numpy, a view of the mapped
        file), into rows r0 .. r0 + n of a product's codes in `mode` (int4: two a byte, uint8, in tiles of `tile`
        rows, 1: rows; int8; int5: the int5 layout, uint8), scales and offsets (or None) with one per `group`
        values (torch, CPU, contiguous), output row r0 + r from source row order[r] (csrc/quant_products.c,
        kv_gguf_rows)."""
        import numpy as np

        code, block, values, source_group = GGUF_ROWS[kind]
        form = {"int4": 0, "int8": 1, "int5": 2}[mode]
        n, nb = raw.shape[0], raw.shape[1] // block
        per = storage_bytes(values, mode, 0)  # code bytes a block
        tile = max(1, tile)
        rows = codes.numel() // (nb * per)  # the product's rows
        groups = nb * values // group
        fits = {"int4": code in (0, 1, 3), "int8": True, "int5": code == 5}[mode]
        if (
            not fits
            or raw.dtype != np.uint8
            or not raw.flags.c_contiguous
            or raw.shape[1] != nb * block
            or codes.dtype != (torch.int8 if mode == "int8" else torch.uint8)
            or group not in (16, 32)
            or group > source_group
            or (mode == "int5" and group != 32)
            or codes.numel() != rows * nb * per
            or scales.numel() != rows * groups
            or r0 < 0
            or r0 + n > rows
            or rows % tile
            or (tile > 1 and mode != "int4")
            or (mins is not None and mins.numel() != rows * groups)
            or scales.dtype != torch.float32
            or (mins is not None and mins.dtype != torch.float32)
        ):
            raise ValueError("gguf_rows: the blocks do not fit the product's buffers")
        if order is not None:
            order = np.ascontiguousarray(order, dtype=np.int64)
            if order.shape != (n,) or (n and (order.min() < 0 or order.max() >= n)):
                raise ValueError("gguf_rows: the row order is not an order of the tensor's rows")
        c, s, m = self._memory(codes, scales, mins)
        self._gguf_rows(
            raw.ctypes.data, code, n, nb, None if order is None else order.ctypes.data, r0, tile, form, group,
            c, s, m, torch.get_num_threads(),
        )  # fmt: skip

    def read_stream(self, x: torch.Tensor) -> float:
        """The sum of a float32 tensor's values, read once on torch's threads (the bench's read roofline)."""
        if x.dtype != torch.float32:
            raise ValueError("read_stream reads float32 values")
        return float(self._read_stream(*self._memory(x), x.numel(), torch.get_num_threads()))

    def matvec(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """weight [out, in] (contiguous, CPU), x [in] of its dtype -> y [out] of its dtype."""
        out, n = weight.shape
        y = torch.empty(out, dtype=weight.dtype)
        self._float[weight.dtype](*self._memory(weight, x.contiguous(), y), out, n, torch.get_num_threads())
        return y

    def qmatvec(
        self,
        mode: str,
        codes: torch.Tensor,
        scales: torch.Tensor,
        x: torch.Tensor,
        group: int,
        mins: torch.Tensor | None = None,
        activations: str = "float32",
        tiled: bool = False,
    ) -> torch.Tensor:
        """codes [out, in] int8 or [out, in/2] uint8 (int4, two a byte), scales [out, in/g] float32 (and
        offsets `mins` [out, in/g] float32: weights s · q + m), x [in] float32 -> y [out] float32.
        `activations="int8"`: x quantized per block of 32 and integer dot products (engine.quant.integer_product)
        where in and g are whole blocks; the float32 product otherwise. `tiled`: int4 codes, scales and
        offsets in tiles of `int4_tile_rows` rows (engine.quant.tile); int8 activations where `int4_integer_tiles`."""
        check_activations(activations)
        if tiled and (mode != "int4" or not (activations == "float32" or self.int4_integer_tiles)):
            raise ValueError("these kernels' tiles hold int4 codes multiplied by float32 activations")
        return self._product(mode, codes, scales, x, group, mins, activations, tiled)

    def _product(self, mode, codes, scales, x, group, mins, activations, tiled) -> torch.Tensor:
        """qmatvec past its checks: the self-checks call it on the paths they are deciding."""
        n = x.numel()
        out = scales.numel() * group // n
        y = torch.empty(out, dtype=torch.float32)
        if tiled:
            fn = self._tiled if activations == "float32" else self._tiled_integer
        else:
            fn = self._quant[mode] if activations == "float32" else self._integer[mode]
        fn(*self._memory(codes, scales, mins, x.contiguous(), y), out, n, group, torch.get_num_threads())
        return y

    def quantize(
        self,
        mode: str,
        weight: torch.Tensor,
        group: int,
        codes: torch.Tensor | None = None,
        scales: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """engine.quant.quantize in one pass: weight [out, in] -> codes as stored (int8 [out, in], or int4
        two a byte [out, in/2] uint8) and scales [out, in/g] float32 (into `codes` and `scales` when
        given: rows of a larger matrix's buffers, filled a chunk at a time)."""
        w = weight.detach().float().contiguous()
        out, n = w.shape
        if codes is None:
            codes, scales = self.code_buffers(mode, out, n, group)
        if n % group or (mode == "int4" and group % 2):
            raise ValueError(f"group size {group} must be even and divide the row length {n}")
        w_, codes_, scales_ = self._memory(w, codes, scales)
        args = (codes_, None) if mode == "int8" else (None, codes_)
        self._quantize(w_, *args, scales_, out, n, group, QMAX[mode], torch.get_num_threads())
        return codes, scales

    @staticmethod
    def code_buffers(mode: str, out: int, n: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Empty codes in the layout the kernels read (int8 [out, n], or int4 two a byte [out, n/2] uint8)
        and float32 scales [out, n/g]."""
        codes = torch.empty(out, n, dtype=torch.int8) if mode == "int8" else torch.empty(out, n // 2, dtype=torch.uint8)
        return codes, torch.empty(out, n // group, dtype=torch.float32)

    def dequantize(
        self,
        mode: str,
        codes: torch.Tensor,
        scales: torch.Tensor,
        in_features: int,
        group: int,
        into: torch.Tensor | None = None,
        mins: torch.Tensor | None = None,
        tiled: bool = False,
    ) -> torch.Tensor:
        """The float32 weight [out, in] = s · q (+ m) of int8 codes or int4 codes two a byte, in one pass
        (into `into` when given: a float32 [out, in] buffer); `tiled`: int4 in tiles of rows, as qmatvec."""
        out = scales.numel() * group // in_features
        w = torch.empty(out, in_features, dtype=torch.float32) if into is None else into
        fn = self._tiled_dequant if tiled else self._dequant[mode]
        fn(*self._memory(codes, scales, mins, w), out, in_features, group, torch.get_num_threads())
        return w

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """One row x [..., n] -> RMSNorm(x) · weight, rounded as engine.model.RMSNorm rounds."""
        x = x.contiguous()
        y = torch.empty_like(x)
        self._norm[x.dtype](*self._memory(x, weight, y), x.numel(), eps)
        return y

    def attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q_norm,
        k_norm,
        eps: float,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pos: int,
        window: int | None,
        heads: int,
    ) -> torch.Tensor:
        """Attention of one new position, batch 1: qkv [(H + 2 H_kv) d] packed q|k|v; cos, sin [d] (the
        signed-sin table's row for `pos`); q_norm/k_norm [d] weights or None; k_cache, v_cache
        [H_kv, C, d] (contiguous), into which the rotated k and v are written at `pos` -> y [H d]."""
        h_kv, cap, d = k_cache.shape
        lo = 0 if window is None else max(0, pos - window + 1)
        if not 0 <= pos < cap:
            raise ValueError(f"position {pos} is outside the cache's {cap}")
        y = torch.empty(heads * d, dtype=qkv.dtype)
        qkv, cos, sin, qn, kn, kc, vc, out = self._memory(qkv, cos, sin, q_norm, k_norm, k_cache, v_cache, y)
        self._attend[y.dtype](
            qkv, cos, sin, qn, kn, eps, kc, vc, cap, pos, lo, heads, h_kv, d, d**-0.5, out, torch.get_num_threads()
        )
        return y

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu of float32 values x [n] -> [n], as every decode step's MLP gate computes it."""
        x = x.contiguous()
        y = torch.empty_like(x)
        self._silu(*self._memory(x, y), x.numel())
        return y

    def _silu_agrees(self) -> bool:
        """The decode step's silu against torch's over every magnitude a gate can take: its e^x overflows past
        x = 88.7 and underflows below -87.3, where a vector exponent built by hand goes wrong first."""
        edges = torch.tensor([-1e30, -200.0, -100.0, -88.8, -88.72, -88.5, -88.0, -87.4, -87.2, -20.0, 0.0, 1e-3])
        x = torch.cat([edges, -edges, torch.linspace(-120, 120, 997)])  # vector bodies and a scalar tail
        got, want = self.silu(x), F.silu(x)
        return bool(torch.allclose(got, want, rtol=1e-5, atol=1e-30) and torch.isfinite(got).all())

    def _agrees(self, dtype: torch.dtype) -> bool:
        """Each kernel of `dtype` against torch on awkward sizes (vector tails, GQA, a window, q/k norms)."""
        g = torch.Generator().manual_seed(0)

        def close(got, want, tol):
            return torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.float().abs().max()))

        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for out, n in ((7, 64), (33, 131), (96, 576)):
            w = torch.randn(out, n, generator=g).to(dtype)
            x = torch.randn(n, generator=g).to(dtype)
            if not close(self.matvec(w, x), w.float() @ x.float(), tol):
                return False
            norm = RMSNorm(n, 1e-6).to(dtype)
            norm.weight.data = torch.rand(n, generator=g).to(dtype) + 0.5
            if not close(self.rms_norm(x, norm.weight, 1e-6), norm(x), tol):
                return False
        for heads, h_kv, d, pos, window, qk_norm in ((4, 2, 64, 9, None, False), (6, 3, 40, 20, 8, True)):
            qkv = torch.randn((heads + 2 * h_kv) * d, generator=g).to(dtype)
            cos, sin = torch.rand(d, generator=g).to(dtype), torch.rand(d, generator=g).to(dtype)
            qn = kn = None
            if qk_norm:
                qn, kn = torch.rand(d, generator=g).to(dtype) + 0.5, torch.rand(d, generator=g).to(dtype) + 0.5
            kc, vc = torch.randn(2, h_kv, pos + 3, d, generator=g).to(dtype)
            got = self.attend(qkv, cos, sin, qn, kn, 1e-6, kc, vc, pos, window, heads)

            def rotate(x, w, d=d, cos=cos, sin=sin):  # x [heads, d] -> [heads, d]
                if w is not None:
                    x = w * F.rms_norm(x.float(), (d,), None, 1e-6).to(dtype)
                return x * cos + swap_halves(x) * sin

            q = rotate(qkv[: heads * d].view(heads, d), qn)
            k = rotate(qkv[heads * d : (heads + h_kv) * d].view(h_kv, d), kn)
            if not (close(kc[:, pos], k, tol) and torch.equal(vc[:, pos], qkv[(heads + h_kv) * d :].view(h_kv, d))):
                return False
            lo = 0 if window is None else max(0, pos - window + 1)
            keys = kc[:, lo : pos + 1].float().repeat_interleave(heads // h_kv, 0)  # [H, S, d]
            values = vc[:, lo : pos + 1].float().repeat_interleave(heads // h_kv, 0)
            want = F.scaled_dot_product_attention(q.float()[:, None], keys, values)  # [H, 1, d]
            if not close(got, want.reshape(-1), tol):
                return False
        return True

    def _quant_agrees(self, mode: str, activations: str = "float32") -> bool:
        """The products of `mode`'s codes (and their quantization and dequantization) against the definition,
        at the given activations, on awkward shapes (vector tails, groups that are not whole 32s)."""
        g = torch.Generator().manual_seed(0)
        if mode == "int5":  # a file's codes only: random ones in its layout
            return self._int5_agrees(g, activations)
        for out, n, group in (
            (5, 64, 64),
            (19, 192, 32),
            (40, 576, 64),
            (8, 96, 48),
            (6, 128, 16),
            (7, 160, 160),
            (3, 96, 32),
        ):
            w = torch.randn(out, n, generator=g)
            w[0, :group] = 0  # an all-zero group
            w[1, :8] = torch.tensor([QMAX[mode], 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5])  # s = 1: exact halves, to even
            codes, scales = quantize(w, mode, group)
            x = torch.randn(n, generator=g)
            stored = pack_int4(codes) if mode == "int4" else codes
            if activations == "float32":  # the quantizer once: the integer pass reuses what it checked
                mine = self.quantize(mode, w, group)
                if not (torch.equal(mine[0], stored) and torch.equal(mine[1], scales)):
                    return False
            mins = torch.randn(scales.shape, generator=g)  # offsets: weights s · q + m
            if not all(self._codes_agree(mode, stored, codes, scales, x, group, m, activations) for m in (None, mins)):
                return False
        return True

    def _tiles_agree(self, rows: int, activations: str = "float32") -> bool:
        """The tiled int4 product (at `activations`) and dequantization against the row layout's definition."""
        g = torch.Generator().manual_seed(1)
        for out, n, group in ((rows, 64, 32), (3 * rows, 576, 64), (2 * rows, 96, 8), (rows, 160, 160)):
            w, x = torch.randn(out, n, generator=g), torch.randn(n, generator=g)
            codes, scales = quantize(w, "int4", group)
            mins = torch.randn(scales.shape, generator=g)
            stored = tile(pack_int4(codes), rows, 4)
            for m in (None, mins):
                if not self._codes_agree("int4", stored, codes, scales, x, group, m, activations, rows):
                    return False
        return True

    def _int5_agrees(self, g: torch.Generator, activations: str) -> bool:
        """The int5 products and dequantization against the definition, with and without offsets."""
        for out, n in ((5, 64), (19, 576), (8, 896), (3, 96)):
            codes = torch.randint(-16, 16, (out, n), generator=g, dtype=torch.int8)
            codes[0, :INT5_GROUP] = torch.arange(-16, 16)  # every code once
            scales, mins = torch.rand(out, n // INT5_GROUP, generator=g), torch.randn(out, n // INT5_GROUP, generator=g)
            x, stored = torch.randn(n, generator=g), pack_int5(codes)
            for m in (None, mins):
                if not self._codes_agree("int5", stored, codes, scales, x, INT5_GROUP, m, activations):
                    return False
        return True

    def _codes_agree(self, mode, stored, codes, scales, x, group, mins, activations="float32", tiles=0) -> bool:
        """The one-row product and the dequantization of `stored` codes against the definition, s · q (+ m):
        s · q is exact in float32 (equal), s · q + m is one rounding in C (FMA) against torch's two. Under int8
        activations, the product against engine.quant.integer_product where the shape is whole blocks. `tiles`:
        `stored` is int4 in tiles of that many rows, and scales and offsets are tiled to go with it."""
        want_w = dequantize(codes, scales, mins=mins)
        want = want_w @ x
        if activations != "float32" and x.numel() % ACTIVATION_BLOCK == 0 and group % ACTIVATION_BLOCK == 0:
            want = integer_product(codes, scales, x, mins).float()
        kept_scales, kept_mins = (tile(scales, tiles, 1), tile(mins, tiles, 1)) if tiles else (scales, mins)
        got = self._product(mode, stored, kept_scales, x, group, kept_mins, activations, bool(tiles))
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
            return False
        if activations != "float32":
            return True  # the dequantization is the float path's, checked there
        mine = self.dequantize(mode, stored, kept_scales, x.numel(), group, None, kept_mins, bool(tiles))
        return torch.equal(mine, want_w) if mins is None else torch.allclose(mine, want_w, rtol=2**-22, atol=2**-22)


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
    before = _openmp_runtimes()
    forced = variant()
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or pip install ziglang for zig cc)")
    flags, first = VARIANTS[forced], None
    k = one_thread = None
    if "ziglang" not in cc:  # zig's clang takes -fopenmp but ships no OpenMP runtime to link: one thread there
        try:
            k = _checked(build(cc, flags))
        except (RuntimeError, OSError) as e:  # no OpenMP (refused, or not linked): one thread; else this error
            first = e
    if k is None:
        try:
            k = _checked(build(cc, flags, openmp=False))
        except (RuntimeError, OSError):
            if first is None:
                raise
            raise first from None
        one_thread = f"one thread: {compiler_name(cc)} has no OpenMP"
    k.variant, k.one_thread, k.compiler = forced, one_thread, compiler_name(cc)
    after = _openmp_runtimes()
    if len(after) > max(1, len(before)):  # ours brought its own OpenMP: two thread pools on the same cores
        raise RuntimeError(f"the kernels would run a second OpenMP runtime ({', '.join(sorted(after))})")
    if not k.dtypes:
        raise RuntimeError("the kernels disagree with torch on this CPU")
    return k


def _verdict_path(library: Path) -> Path:
    return library.with_name(library.name + ".checked.json")


def _checked(library: Path) -> Kernels:
    """The library, its functions checked against torch: by this process, or by an earlier one with the same
    library (its name holds the digest of sources, compiler, flags and CPU) and torch, whose verdict is kept
    beside it (engine/BENCHMARKS.md, "Opening a model file"). A verdict that is unreadable, or from another
    torch, is checked again."""
    path = _verdict_path(library)
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
    path = _verdict_path(k.path)
    try:
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(k.checks()), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass  # only the next process's start is at stake


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
    return f"kvchat kernels ({k.isa}; {types}{integer}{forced}{threads}; built by {k.compiler})"
