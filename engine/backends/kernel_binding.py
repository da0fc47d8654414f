"""The kernels' library bound for torch tensors (ctypes): one-row products for float weights and for group-wise
int8/int4/int5 codes, quantization, norms, attention, silu, a GGUF tensor's rows into a product's buffers; every
pointer handed to C after the checks that keep it in bounds. Loaded and checked by engine.backends.kernels."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..kv_pool import BLOCK  # KV_BLOCK in csrc/kernels.h: positions a block of the KV pool holds
from ..quant import QMAX, check_activations, storage_bytes
from .kernel_checks import check_all, take, verdict_of

QUANT_FUNCS = {"int8": "kv_matvec_q8", "int4": "kv_matvec_q4", "int5": "kv_matvec_q5", "mxfp4": "kv_matvec_mx4"}
INTEGER_FUNCS = {mode: name + "x" for mode, name in QUANT_FUNCS.items()}  # int8 activations
SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def check_slots(pos: int, cap: int, table: torch.Tensor | None) -> None:
    """Before C writes position `pos` and reads 0..pos: every slot they map to lies inside the cache's `cap` —
    slot j itself without a table, else block table[j / BLOCK] (an int32 CPU row, one entry a block)."""
    if table is None:
        if not 0 <= pos < cap:
            raise ValueError(f"position {pos} is outside the cache's {cap}")
        return
    blocks = pos // BLOCK + 1
    if pos < 0 or table.dtype != torch.int32 or table.dim() != 1 or table.numel() < blocks:
        raise ValueError(f"position {pos} is outside the block table's {table.numel()} blocks")
    used = table[:blocks]
    if int(used.min()) < 0 or (int(used.max()) + 1) * BLOCK > cap:
        raise ValueError(f"a block of the table lies outside the pool's {cap} slots")


# kv_gguf_rows' kinds (csrc/kernels.h): GGUF type -> (kind, block bytes, values a block, values per scale)


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
        self.build: dict = {}  # its build's report (kernel_build.report): version, each file's level, fallbacks
        self.fell_through: str | None = None  # the system compiler failed outright and the next built it: why
        self.lib = ctypes.CDLL(str(path))
        self.lib.kv_isa.restype = self.lib.kv_int_isa.restype = ctypes.c_char_p
        self.isa = self.lib.kv_isa().decode()
        self.int_isa = self.lib.kv_int_isa().decode()  # what runs the integer products
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        self._float, self._norm, self._norm_rows, self._attend = {}, {}, {}, {}
        for dtype, suffix in SUFFIX.items():
            if not hasattr(self.lib, "kv_matvec_" + suffix):  # float16 needs the compiler's _Float16
                continue
            self._float[dtype] = self._declare("kv_matvec_" + suffix, [p, p, p, i64, i64, i32])
            self._norm[dtype] = self._declare("kv_rmsnorm_" + suffix, [p, p, p, i64, f32])
            self._norm_rows[dtype] = self._declare("kv_rmsnorm_rows_" + suffix, [p, p, p, i64, i64, f32, i32])
            self._attend[dtype] = self._declare(
                "kv_attend_" + suffix, [p] * 5 + [f32, p, p] + [i64] * 3 + [p] + [i64] * 3 + [f32, p, p, i32]
            )
        self._decode = {
            dtype: self._declare(
                "kv_decode_layers_" + SUFFIX[dtype],
                [p, i64, p, p, p, f32, f32] + [i64] * 3 + [p] + [i64] * 5 + [p] * 8 + [i32],
            )
            for dtype in self._float
        }
        self._decode_batch = {  # several sequences' steps in one call (engine.batching)
            dtype: self._declare(
                "kv_decode_batch_" + SUFFIX[dtype],
                [p, i64, i64, p, p, p, f32, f32, i64, p, p, p, p, p] + [i64] * 7 + [p] * 8 + [i32],
            )
            for dtype in self._float
        }
        self._f32_rows = self._declare("kv_matvec_f32_rows", [p, p, i64, p, i64, i64, i64, i64, i32])
        self._half_rows = {torch.bfloat16: self._declare("kv_matvec_bf16_rows", [p, p, i64, p, p, i64, i64, i64, i32])}
        if torch.float16 in self._float:
            self._half_rows[torch.float16] = self._declare("kv_matvec_f16_rows", [p, p, p, i64, i64, i64, i32])
        self._q8_rows = self._declare("kv_matvec_q8_rows", [p, p, p, p, p, i64, i64, i64, i64, i32])
        self._q4t_rows = self._declare("kv_matvec_q4t_rows", [p, p, p, p, p, i64, i64, i64, i64, i32])
        self._q8x_rows = self._declare("kv_matvec_q8x_rows", [p, p, p, p, p, i64, i64, i64, i64, i32])
        self._q4tx_rows = self._declare("kv_matvec_q4tx_rows", [p, p, p, p, p, i64, i64, i64, i64, i32])
        self._q8tx_rows = self._declare("kv_matvec_q8tx_rows", [p, p, p, p, p, i64, i64, i64, i64, i32])
        self.batch_rows = False  # whether the products of several rows give each row's one-row product (checked)
        self._linear_rows = {
            dtype: self._declare("kv_linear_rows_" + SUFFIX[dtype], [p, i64, p, p, p, p, i32]) for dtype in self._float
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
        self._tiled_q8x = self._declare("kv_matvec_q8tx", [p, p, p, p, p, i64, i64, i64, i32])
        self._tiled_dequant = self._declare("kv_dequant_q4t", [p, p, p, p, i64, i64, i64, i32])
        self._tile_gemm = self._declare("kv_gemm_q4t", [p, p, p, p, p, i64, i64, i64, i64, i32])
        self._tile_gemm.restype = ctypes.c_int
        self.tile_gemm = False  # whether prefill's products read int4 tiles directly (gemm_tiles; checked)
        self._tiled_q8_dequant = self._declare("kv_dequant_q8t", [p, p, p, p, i64, i64, i64, i32])
        self._silu = self._declare("kv_silu_f32", [p, p, i64])
        self._silu_mul = self._declare("kv_silu_mul_rows_f32", [p, p, i64, i64, i32])
        self._gguf_rows = self._declare("kv_gguf_rows", [p, i64, i64, i64, p, i64, i64, i64, i64, p, p, p, i32])
        self._read_stream = self._declare("kv_read_stream", [p, i64, i32])
        self._read_stream.restype = ctypes.c_float
        self.lib.kv_int4_tile_rows.restype = self.lib.kv_int4_integer_tiles.restype = ctypes.c_int
        self.lib.kv_int8_integer_tiles.restype = ctypes.c_int
        if verdict is not None:
            take(self, verdict)
        else:
            check_all(self)

    @property
    def float_dtypes(self) -> tuple:
        """The float dtypes this build has functions for (float16 needs the compiler's _Float16)."""
        return tuple(self._float)

    @property
    def code_modes(self) -> tuple:
        return tuple(self._quant)

    def checks(self) -> dict:
        return verdict_of(self)

    @staticmethod
    def memory(*tensors: torch.Tensor | None) -> list[int | None]:
        """Raw addresses for C, after the checks that keep it in bounds: CPU memory, dense rows."""
        for t in tensors:
            if t is not None and not (t.is_cpu and t.is_contiguous()):
                raise ValueError("kvchat's kernels take contiguous CPU tensors")
        return [None if t is None else t.data_ptr() for t in tensors]

    def _declare(self, name: str, argtypes):
        fn = getattr(self.lib, name)
        fn.argtypes, fn.restype = argtypes, None
        return fn

    def gguf_rows(
        self, raw, geometry: tuple, mode: str, order, r0: int, tile: int, group: int, codes, scales, mins
    ) -> None:
        """A GGUF tensor's rows of one kind (`geometry`: its entry in engine.weights.gguf_header.GGUF_ROWS), raw
        [n, nb · block bytes] uint8 (numpy, a view of the mapped file), into rows r0 .. r0 + n of a product's codes
        in `mode` (int4: two a byte, uint8, in tiles of `tile` rows, 1: rows; int8; int5: the int5 layout, uint8),
        scales and offsets (or None) with one per `group` values (torch, CPU, contiguous), output row r0 + r from
        source row order[r] (csrc/gguf_rows.c, kv_gguf_rows); n the tensor's rows, or as many as `order` picks."""
        import numpy as np

        code, block, values, source_group = geometry
        form = {"int4": 0, "int8": 1, "int5": 2}[mode]
        n, nb = raw.shape[0] if order is None else len(order), raw.shape[1] // block
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
            if order.shape != (n,) or (n and (order.min() < 0 or order.max() >= raw.shape[0])):
                raise ValueError("gguf_rows: the row order is not an order of the tensor's rows")
        c, s, m = self.memory(codes, scales, mins)
        self._gguf_rows(
            raw.ctypes.data, code, n, nb, None if order is None else order.ctypes.data, r0, tile, form, group,
            c, s, m, torch.get_num_threads(),
        )  # fmt: skip

    def read_stream(self, x: torch.Tensor) -> float:
        """The sum of a float32 tensor's values, read once on torch's threads (the bench's read roofline)."""
        if x.dtype != torch.float32:
            raise ValueError("read_stream reads float32 values")
        return float(self._read_stream(*self.memory(x), x.numel(), torch.get_num_threads()))

    def matvec(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """weight [out, in] (contiguous, CPU), x [in] of its dtype -> y [out] of its dtype."""
        out, n = weight.shape
        y = torch.empty(out, dtype=weight.dtype)
        self._float[weight.dtype](*self.memory(weight, x.contiguous(), y), out, n, torch.get_num_threads())
        return y

    def rows(
        self,
        mode: str,
        weight: torch.Tensor,
        x: torch.Tensor,
        scales=None,
        group: int = 0,
        mins=None,
        tiled: bool = False,
        activations: str = "float32",
    ) -> torch.Tensor:
        """Several rows' products at once, x [B, in] float32 -> y [B, out] float32: float32 weights [out, in]
        (`mode` "float32"), int8 codes (in rows, or in tiles with int8 activations), or int4 codes in tiles
        (`tiled`), each row as matvec / qmatvec (with the same `activations`) gives it; bfloat16 or float16
        weights (`mode` their dtype's name) take x and give y in their dtype, each row as matvec rounds it."""
        B, n = x.shape
        x = x.contiguous()
        if mode == "float32":
            out = weight.shape[0]
            y = torch.empty(B, out, dtype=torch.float32)
            self._f32_rows(*self.memory(weight, x), n, y.data_ptr(), out, out, n, B, torch.get_num_threads())
            return y
        if mode in ("bfloat16", "float16"):
            out, wide = weight.shape[0], x.float()  # [B, in] widened, as the one-row product widens its x
            y = torch.empty(B, out, dtype=torch.float32)
            rows, nt = self._half_rows[weight.dtype], torch.get_num_threads()
            if weight.dtype == torch.bfloat16:
                rows(*self.memory(weight, x), n, *self.memory(wide, y), out, n, B, nt)
            else:
                rows(*self.memory(weight, wide, y), out, n, B, nt)
            return y.to(weight.dtype)  # rounded to nearest even, as the kernels' one-row product rounds
        integer = activations != "float32"
        if not (mode == "int8" or (mode == "int4" and tiled)):
            raise ValueError("several rows at once: float32 weights, int8 codes or int4 tiles")
        self._check_tiles(mode, tiled, activations)
        out = scales.numel() * group // n
        y = torch.empty(B, out, dtype=torch.float32)
        fn = {"int8": (self._q8_rows, self._q8x_rows), "int4": (self._q4t_rows, self._q4tx_rows)}[mode][integer]
        fn = self._q8tx_rows if mode == "int8" and tiled else fn
        fn(*self.memory(weight, scales, mins, x, y), out, n, group, B, torch.get_num_threads())
        return y

    def gemm_tiles(self, codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, group: int,
                   mins: torch.Tensor | None = None) -> torch.Tensor | None:  # fmt: skip
        """Prefill's product of many rows with int4 codes in tiles: x [M, in] float32 -> y [M, out] float32, each
        output the float32 sum of x times the dequantized weights (s · q + m) in order of the inputs; None where
        the library does not run it (no 16-lane vectors, a group that splits an 8-input step, no memory)."""
        M, n = x.shape
        x = x.contiguous()
        out = scales.numel() * group // n
        if codes.numel() * 2 != out * n or (mins is not None and mins.numel() != scales.numel()):
            raise ValueError(f"int4 tiles of {codes.numel():,} bytes do not hold a [{out}, {n}] weight")
        y = torch.empty(M, out, dtype=torch.float32)
        done = self._tile_gemm(*self.memory(codes, scales, mins, x, y), out, n, group, M, torch.get_num_threads())
        return y if done else None

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
        offsets in tiles of `int4_tile_rows` rows (engine.quant.tile); int8 activations where `int4_integer_tiles`;
        int8 codes in those tiles with int8 activations where `int8_integer_tiles`."""
        check_activations(activations)
        self._check_tiles(mode, tiled, activations)
        return self._product(mode, codes, scales, x, group, mins, activations, tiled)

    def _check_tiles(self, mode: str, tiled: bool, activations: str) -> None:
        """What the tiles of this library hold: int4 codes (by float32 activations, or int8 ones where
        `int4_integer_tiles`), int8 codes by int8 activations where `int8_integer_tiles`."""
        if not tiled:
            return
        if mode == "int8" and activations == "int8" and self.int8_integer_tiles:
            return
        if mode != "int4" or not (activations == "float32" or self.int4_integer_tiles):
            raise ValueError("these kernels' tiles hold int4 codes, or int8 codes by int8 activations where they run")

    def _product(self, mode, codes, scales, x, group, mins, activations, tiled) -> torch.Tensor:
        """qmatvec past its checks: the self-checks call it on the paths they are deciding."""
        n = x.numel()
        out = scales.numel() * group // n
        y = torch.empty(out, dtype=torch.float32)
        if tiled and mode == "int8":
            fn = self._tiled_q8x
        elif tiled:
            fn = self._tiled if activations == "float32" else self._tiled_integer
        else:
            fn = self._quant[mode] if activations == "float32" else self._integer[mode]
        fn(*self.memory(codes, scales, mins, x.contiguous(), y), out, n, group, torch.get_num_threads())
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
        w_, codes_, scales_ = self.memory(w, codes, scales)
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
        (into `into` when given: a float32 [out, in] buffer); `tiled`: in tiles of rows, as qmatvec."""
        out = scales.numel() * group // in_features
        w = torch.empty(out, in_features, dtype=torch.float32) if into is None else into
        fn = (self._tiled_q8_dequant if mode == "int8" else self._tiled_dequant) if tiled else self._dequant[mode]
        fn(*self.memory(codes, scales, mins, w), out, in_features, group, torch.get_num_threads())
        return w

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., n] -> RMSNorm(x) · weight, rounded as engine.model.RMSNorm rounds, each row as the decode
        step's one-row norm gives it (a prompt's rows over the threads)."""
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.shape[-1]
        if x.numel() == n:  # a decode step's row: no parallel region to open
            self._norm[x.dtype](*self.memory(x, weight, y), n, eps)
        else:
            self._norm_rows[x.dtype](*self.memory(x, weight, y), x.numel() // n, n, eps, torch.get_num_threads())
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
        table: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of one new position, batch 1: qkv [(H + 2 H_kv) d] packed q|k|v; cos, sin [d] (the
        signed-sin table's row for `pos`); q_norm/k_norm [d] weights or None; k_cache, v_cache
        [H_kv, C, d] (contiguous), into which the rotated k and v are written at `pos` -> y [H d]. `table`: the
        block pool's table of this sequence (int32 [≥ pos/16 + 1], position j in slot table[j/16]·16 + j%16),
        None for a cache of its own (position j in slot j). `sinks`: float32 [H], each head's logit in its
        softmax's denominator (gpt-oss), or None."""
        h_kv, cap, d = k_cache.shape
        lo = 0 if window is None else max(0, pos - window + 1)
        check_slots(pos, cap, table)
        y = torch.empty(heads * d, dtype=qkv.dtype)
        if sinks is not None and (sinks.dtype != torch.float32 or sinks.numel() != heads):
            raise ValueError("sinks are float32, one a query head")
        qkv, cos, sin, qn, kn, kc, vc, out, tb, sk = self.memory(
            qkv, cos, sin, q_norm, k_norm, k_cache, v_cache, y, table, sinks
        )
        self._attend[y.dtype](
            qkv, cos, sin, qn, kn, eps, kc, vc, cap, pos, lo, tb, heads, h_kv, d, d**-0.5, sk, out,
            torch.get_num_threads(),
        )  # fmt: skip
        return y

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """float32 gate_up [..., 2F] (each row gate | up) -> silu(gate) · up [..., F]: a prompt's SwiGLU."""
        gate_up = gate_up.contiguous()
        f = gate_up.shape[-1] // 2
        y = torch.empty(*gate_up.shape[:-1], f, dtype=torch.float32)
        self._silu_mul(*self.memory(gate_up, y), gate_up.numel() // (2 * f), f, torch.get_num_threads())
        return y

    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu of float32 values x [n] -> [n], as every decode step's MLP gate computes it."""
        x = x.contiguous()
        y = torch.empty_like(x)
        self._silu(*self.memory(x, y), x.numel())
        return y
