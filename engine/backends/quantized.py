"""Weights stored as group-wise int8/int4 codes and their scales (engine.quant defines the codes).

"Quantize, then swap the module": QuantLinear replaces a Linear and QuantEmbedding an embedding.
On the CPU, one-row products (decode) run kvchat's kernels straight on the codes and float32
scales with float32 activations, the quantization's own definition; prefill dequantizes into a
reused buffer and multiplies in float32 (int4 tiles on the 16-lane builds: the kernels' own GEMM reads
them, csrc/tile_prefill.c). Where the kernels are missing, torch's packed kernels
serve the layouts they support, and a file's codes no torch kernel reads are dequantized once
(engine.backends.quantized_model.dequantize_for_torch; on the fly only where they would not fit in memory).
Passes over a whole model's quantized layers live in engine.backends.quantized_model.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from ..devices import bf16_hardware
from ..quant import (
    ACTIVATION_BLOCK,
    BITS,
    FILE_MODES,
    PreQuantized,
    check_mode,
    dequantize,
    mxfp4_scales,
    pack_int4,
    quantize,
    storage_bytes,
    tile,
    unpack_int4,
    unpack_int5,
    unpack_mxfp4,
    untile,
)
from . import kernels as kernel_library
from .cpu_layouts import FEW_INTEGER_ROWS, FEW_ROWS, many_rows_linear, weight_scratch

SCRATCH_VALUES = 4 * 2**20  # weight values a many-row product dequantizes at once (16 MiB in float32)
KERNEL_DTYPE = torch.bfloat16  # activations and kernel scales of torch's packed CPU kernels
_INT4_CHECKED: dict[tuple[int, int, int], bool] = {}  # (N, K, group) -> the int4 kernel agrees here


def _int4pack(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in [-7, 7] -> the layout of torch's CPU int4 kernel (unsigned, offset 8)."""
    return torch._convert_weight_to_int4pack_for_cpu((codes.to(torch.int32) + 8).contiguous(), 2)


def _int4pack_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor):
    return torch._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)


class QuantLinear(nn.Module):
    """A Linear whose weight is stored as group-wise int8/int4 codes and their scales.

    Without kvchat's kernels, two layouts run torch's packed kernels with bfloat16 activations: int8
    with one scale per output channel (`_weight_int8pack_mm`), and int4 group-wise
    (`_weight_int4pack_mm_for_cpu`, its own nibble layout and bfloat16 scales: a scale is rounded to
    8 significant bits, ≤ 0.4% of s); every other case dequantizes the weight for each call. With
    kvchat's kernels, a one-row product (decode) multiplies the codes by float32 activations, or by
    int8 ones where `activations` is "int8" (use_integer_activations).
    """

    activations = "float32"
    tiles = 0  # rows in a tile of the kernels' decode layout (use_tiles); 0: codes in rows

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mode: str, group_size: int):
        """weight [N, K]; or a row source with `shape`, `dtype`, `device` and `row_chunks()` yielding
        (first row, [n, K] rows), for a matrix quantized a few thousand rows at a time as it is read
        (an embedding or output head: its float copy never exists whole); or the codes a file holds
        (PreQuantized: a GGUF's blocks as int8/int4/int5 codes, scales and offsets), kept as they are."""
        super().__init__()
        if mode == "mxfp4" and (weight.codes.device.type != "cpu" or kernel_library.for_mode(mode) is None):
            weight, mode = mxfp4_as_int8(weight), "int8"  # no kernel reads MXFP4 here: its exact int8 codes
        if not (isinstance(weight, PreQuantized) and mode in FILE_MODES):
            check_mode(mode)
        self.mode, self.out_features, self.in_features = mode, weight.shape[0], weight.shape[1]
        self.group_size = group_size if group_size > 0 else weight.shape[1]  # <= 0: per output channel
        self.compute_dtype = weight.dtype
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.decoder = kernel_library.for_mode(mode) if weight.device.type == "cpu" else None  # one-row products
        mins = None  # offsets [N, K/g] float32 of a file's format with a minimum per group: weights s · q + m
        if isinstance(weight, PreQuantized):
            codes, scales = weight.codes, weight.scales.contiguous()
            scales = scales if mode == "mxfp4" else scales.float()  # MXFP4: its e8m0 bytes, as the kernels read them
            mins = None if weight.mins is None else weight.mins.float().contiguous()
            if weight.tiles and self.decoder is not None and self.decoder.int4_tile_rows == weight.tiles:
                self.tiles = weight.tiles  # written in the kernels' tiles as the file was read
            elif weight.tiles:
                codes, scales = untile(codes, weight.tiles, 4), untile(scales, weight.tiles, 1)
                mins = untile(mins, weight.tiles, 1)
            if mode == "int4" and (self.decoder is not None) != weight.packed:  # the kernels' layout: two a byte
                codes = pack_int4(codes) if self.decoder is not None else unpack_int4(codes)
        else:
            chunks = weight.row_chunks() if hasattr(weight, "row_chunks") else [(0, weight)]
            codes, scales = self._quantize_rows(chunks)
        if self.decoder is not None:  # quantized straight into the layout the kernels read
            stored = codes  # [N, K] int8 | [N, K/2] uint8
            self.kernel = None  # prefill: dequantized into a reused buffer, then float32
        else:
            self.kernel = None if mins is not None else self._choose_kernel(weight.device, codes, scales)
            stored = pack_int4(codes) if mode == "int4" else codes
        if self.kernel == "int4pack":
            self.register_buffer("codes", _int4pack(codes))  # kernel layout, K/2 bytes a row
            sz = torch.zeros(scales.shape[1], scales.shape[0], 2, dtype=KERNEL_DTYPE, device=weight.device)
            sz[..., 0] = scales.t().to(KERNEL_DTYPE)  # [K/g, N, (scale, zero = 0)]
            self.register_buffer("scales_and_zeros", sz)
        else:
            self.register_buffer("codes", stored)
            self.register_buffer("scales", scales)
            if self.kernel == "int8pack":
                self.register_buffer("kernel_scales", scales.view(-1).to(KERNEL_DTYPE))  # [N]
        self.register_buffer("mins", mins)

    @classmethod
    def from_codes(cls, pre: PreQuantized, bias: torch.Tensor | None = None) -> QuantLinear:
        """The codes a file holds, at their own mode and group size."""
        return cls(pre, bias, pre.mode, pre.group_size)

    def _quantize_rows(self, chunks) -> tuple[torch.Tensor, torch.Tensor]:
        """(first row, [n, K] weight rows) chunks -> codes [N, K] int8 (the kernels' layout where they
        serve: int4 two a byte, [N, K/2] uint8) and scales [N, K/g] float32."""
        n, k, g = self.out_features, self.in_features, self.group_size
        codes = scales = None
        for a, w in chunks:
            if self.decoder is not None:  # in one pass in C, straight into the rows of the final buffers
                if codes is None:
                    codes, scales = self.decoder.code_buffers(self.mode, n, k, g)
                b = a + len(w)
                self.decoder.quantize(self.mode, w, g, codes[a:b], scales[a:b])
                continue
            c, s = quantize(w.detach(), self.mode, g)
            if a == 0 and len(c) == n:  # the whole matrix at once
                return c, s
            if codes is None:
                codes, scales = c.new_empty((n, *c.shape[1:])), s.new_empty((n, *s.shape[1:]))
            codes[a : a + len(c)], scales[a : a + len(s)] = c, s
        return codes, scales

    def _choose_kernel(self, device, codes, scales) -> str | None:
        if device.type != "cpu":
            return None
        if self.mode == "int8" and self.group_size == self.in_features:
            return "int8pack"
        if self.mode == "int4" and self.group_size % 32 == 0 and self.in_features % self.group_size == 0:
            key = (self.out_features, self.in_features, self.group_size)
            if key not in _INT4_CHECKED:
                _INT4_CHECKED[key] = self._int4_kernel_agrees(codes, scales)
            return "int4pack" if _INT4_CHECKED[key] else None
        return None

    def _int4_kernel_agrees(self, codes, scales) -> bool:
        """The kernel on this build and shape against the definition (once per shape and group size)."""
        try:
            x = torch.randn(2, self.in_features).to(KERNEL_DTYPE)
            sz = torch.stack([scales.t(), torch.zeros_like(scales.t())], -1).to(KERNEL_DTYPE)
            got = _int4pack_mm(x, _int4pack(codes), self.group_size, sz).float()
            want = F.linear(x.float(), dequantize(codes, sz[..., 0].t().float(), torch.float32))
            return bool(torch.allclose(got, want, rtol=3e-2, atol=3e-2 * float(want.abs().max())))
        except (RuntimeError, AttributeError):
            return False

    def kernel_operands(self, kernels):
        """(codes, scales, mins, bias, group, bits, tiles) as the one-call decode step reads them, when it can."""
        if kernels is not self.decoder:
            return None
        mode = KV_MXFP4 if self.mode == "mxfp4" else BITS[self.mode]  # (the mode numbers of csrc/kernels.h)
        return self.codes, self.scales, self.mins, self.bias, self.group_size, mode, self.tiles

    def tiles_fit(self) -> bool:
        """Whether the kernels have a tiled layout for this layer, whole tiles of rows: int4 codes with float32
        activations (or int8 ones where the kernels have the tiles' integer products), groups of whole 8-input
        steps; int8 codes with int8 activations where the kernels have their tiles, rows and groups of whole blocks."""
        rows = 0 if self.decoder is None else self.decoder.int4_tile_rows
        if not rows or self.tiles or self.out_features % rows:
            return False
        if self.mode == "int8":
            fits = self.in_features % ACTIVATION_BLOCK == 0 and self.group_size % ACTIVATION_BLOCK == 0
            return self.activations == "int8" and self.decoder.int8_integer_tiles and fits
        return (
            self.mode == "int4"
            and (self.activations == "float32" or self.decoder.int4_integer_tiles)
            and self.group_size % 8 == 0
        )

    def use_tiles(self) -> None:
        """Hold codes, scales and offsets in the kernels' tiles of rows (engine.quant.tile): a one-row product
        then multiplies a row per vector lane. Everything that reads them back sees rows (_in_rows, _row_of)."""
        rows = self.decoder.int4_tile_rows
        self.codes = tile(self.codes, rows, 4)  # [N/16, 16·K/2] int4 (8 inputs a row in turn), [N/16, 16·K] int8 (4)
        self.scales, self.mins = tile(self.scales, rows, 1), tile(self.mins, rows, 1)  # [N/16, 16·K/g]
        self.tiles = rows

    def _row_of(self, t: torch.Tensor, rows: torch.Tensor, unit: int) -> torch.Tensor:
        """Rows `rows` [...] of a stored tensor [N or N/16, ...] as [..., C]: gathered from the tiles without
        reading the others back (an embedding's lookup in an int8 head's tiles)."""
        if not self.tiles:
            return t[rows]
        n = self.tiles
        per = t.view(t.shape[0], -1, n, unit)  # [N/16, C/unit, 16, unit]
        return per[rows // n, :, rows % n].reshape(*rows.shape, -1)

    def _in_rows(self, t: torch.Tensor | None, unit: int) -> torch.Tensor | None:
        """A stored tensor in rows, [N, ...] (untiled when tiles hold it)."""
        return untile(t, self.tiles, unit) if self.tiles else t

    def scale_values(self) -> torch.Tensor:
        """[N, K/g] float32, the scales the layer computes with."""
        if self.kernel == "int4pack":
            return self.scales_and_zeros[..., 0].t().float()
        if self.mode == "mxfp4":
            return mxfp4_scales(self.scales)
        return self._in_rows(self.scales, 1)

    @property
    def coded_values(self) -> int:
        """The weight's values (held as codes, not parameters): what the model's parameter count adds."""
        return self.out_features * self.in_features

    @property
    def storage_bytes(self) -> int:
        groups = self.out_features * self.in_features // self.group_size
        offsets = 0 if self.mins is None else self.mins.numel() * self.mins.element_size()  # tiled or not
        scale_bytes = self.scales.element_size() if self.kernel is None else 4  # (MXFP4's e8m0: a byte)
        return storage_bytes(self.out_features * self.in_features, self.mode, groups, scale_bytes) + offsets

    def weight_codes(self) -> torch.Tensor:
        """[N, K] int8 codes."""
        if self.kernel == "int4pack":  # read the kernel's layout back through the kernel: x = I, s = 1
            eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE, device=self.codes.device)
            ones = torch.zeros_like(self.scales_and_zeros)
            ones[..., 0] = 1
            return _int4pack_mm(eye, self.codes, self.group_size, ones).t().round().to(torch.int8)
        return self._unpacked(self._in_rows(self.codes, 4))

    def row_codes(self, rows: torch.Tensor) -> torch.Tensor:
        """[..., K] int8 codes of the rows `rows` [...] (an embedding's lookup: only those rows unpacked)."""
        if self.kernel == "int4pack" or (self.tiles and self.mode != "int8"):
            return self.weight_codes()[rows]
        return self._unpacked(self._row_of(self.codes, rows, 4))

    def row_scales(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[..., K/g] float32 scales and offsets (None without) of the rows `rows` [...]."""
        if self.kernel == "int4pack" or self.mode == "mxfp4":
            return self.scale_values()[rows], None if self.mins is None else self._in_rows(self.mins, 1)[rows]
        mins = None if self.mins is None else self._row_of(self.mins, rows, 1)
        return self._row_of(self.scales, rows, 1), mins

    def _unpacked(self, stored: torch.Tensor) -> torch.Tensor:
        """Stored codes (int4 two a byte, int5 in its blocks, int8 as they are) as int8 values."""
        if self.mode == "int4":
            return unpack_int4(stored)
        if self.mode == "mxfp4":
            return unpack_mxfp4(stored)
        return unpack_int5(stored) if self.mode == "int5" else stored

    def _kernel_weight(self, into: torch.Tensor | None = None, a: int = 0, b: int | None = None) -> torch.Tensor:
        """Rows a:b (all by default) as float32 s · q, [b - a, K], in one pass in C (into `into` when
        given): what prefill multiplies by. Tiled, a and b are whole tiles (or b the last row)."""
        t = self.tiles or 1
        a, b = a // t, None if b is None else -(-b // t)  # rows -> tiles
        codes, scales = self.codes[a:b], self.scales[a:b]
        mins = None if self.mins is None else self.mins[a:b]
        return self.decoder.dequantize(
            self.mode, codes, scales, self.in_features, self.group_size, into, mins, tiled=bool(self.tiles)
        )

    def dequantized_weight(self, dtype=None) -> torch.Tensor:
        dtype = dtype or self.compute_dtype
        if self.decoder is not None:
            return self._kernel_weight().to(dtype)
        return dequantize(self.weight_codes(), self.scale_values(), dtype, self.mins)  # [N, K]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.decoder is not None and x.numel() == self.in_features:  # one row: decode
            y = self.decoder.qmatvec(
                self.mode,
                self.codes,
                self.scales,
                x.reshape(-1).float(),
                self.group_size,
                self.mins,
                self.activations,
                tiled=bool(self.tiles),
            )
            y = y.view(*x.shape[:-1], self.out_features).to(x.dtype)
            return y if self.bias is None else y + self.bias
        rows = x.numel() // self.in_features
        few = FEW_INTEGER_ROWS if self.activations == "int8" else FEW_ROWS
        if 1 < rows <= few and self._rows_at_once():  # a few positions (a prefill forward between decode
            y = (
                self.decoder.rows(  # turns): each row as decode computes it, the codes read once for all
                    self.mode,
                    self.codes,
                    x.reshape(rows, -1).float(),
                    self.scales,
                    self.group_size,
                    self.mins,
                    tiled=bool(self.tiles),
                    activations=self.activations,
                )
                .view(*x.shape[:-1], self.out_features)
                .to(x.dtype)
            )
            return y if self.bias is None else y + self.bias
        if self.kernel is not None:
            shape = x.shape
            xk = x.reshape(-1, shape[-1]).to(KERNEL_DTYPE)  # [B·T, K]
            if self.kernel == "int8pack":
                y = torch._weight_int8pack_mm(xk, self.codes, self.kernel_scales)
            else:
                y = _int4pack_mm(xk, self.codes, self.group_size, self.scales_and_zeros)
            y = y.reshape(*shape[:-1], self.out_features).to(x.dtype)
            return y if self.bias is None else y + self.bias
        if self._gemm_tiles(x):  # int4 tiles by float32 rows: dequantized in the kernel's own blocks
            y = self.decoder.gemm_tiles(self.codes, self.scales, x.reshape(rows, -1), self.group_size, self.mins)
            if y is not None:
                y = y.view(*x.shape[:-1], self.out_features)
                return y if self.bias is None else y + self.bias
        t = self.tiles or 1
        rows = -(-max(1, SCRATCH_VALUES // self.in_features) // t) * t  # weight rows dequantized at a time
        if self.halves_prefill():  # approximate activations: bfloat16 products (see halves_prefill)
            return self._half_rows(x, rows)
        if rows >= self.out_features:
            return many_rows_linear(x, self._float_rows(0, self.out_features, x.dtype), self.bias)
        y = x.new_empty(*x.shape[:-1], self.out_features)  # [..., N], filled a slice of outputs at a time
        for a in range(0, self.out_features, rows):
            b = min(a + rows, self.out_features)
            y[..., a:b] = many_rows_linear(
                x, self._float_rows(a, b, x.dtype), None if self.bias is None else self.bias[a:b]
            )
        return y

    def _half_rows(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """x [..., K] -> [..., N]: the weights `rows` at a time as bfloat16 (from their codes, rounded once), times
        x in bfloat16, each slice's products widened into x's dtype before the bias."""
        xh = x.to(torch.bfloat16)
        y = x.new_empty(*x.shape[:-1], self.out_features)  # [..., N]
        for a in range(0, self.out_features, rows):
            b = min(a + rows, self.out_features)
            y[..., a:b] = F.linear(xh, self._float_rows(a, b, torch.bfloat16))
        return y if self.bias is None else y.add_(self.bias)

    def halves_prefill(self) -> bool:
        """Whether prefill's many-row products take bfloat16 weights and activations: with int8 activations (the
        named approximation decode already makes) on a CPU that multiplies bfloat16 in hardware, where they run
        at about twice float32's speed — as llama.cpp multiplies its quantized types' prefill in int8."""
        return self.activations == "int8" and self.decoder is not None and bf16_hardware()

    def _gemm_tiles(self, x: torch.Tensor) -> bool:
        """Whether prefill's product takes the kernels' GEMM of int4 tiles (engine/BENCHMARKS.md, "Prefill's
        products from int4 tiles"): float32 rows by int4 tiles where the library runs it (checked), not the
        bfloat16 products of int8 activations."""
        d = self.decoder
        return (
            d is not None
            and d.tile_gemm
            and self.mode == "int4"
            and bool(self.tiles)
            and x.dtype == torch.float32
            and not self.halves_prefill()
        )

    def _rows_at_once(self) -> bool:
        """Whether the kernels' products of several rows serve this layer (int8 codes in rows or int4 in tiles,
        with float32 activations or the int8 ones its decode takes; checked to give each row's one-row product)."""
        d = self.decoder
        if d is None or not d.batch_rows:
            return False
        if self.activations != "float32" and self.mode not in d.integer_modes:
            return False
        return self.mode == "int8" or (self.mode == "int4" and bool(self.tiles))  # (int8 tiles: int8 activations)

    def _float_rows(self, a: int, b: int, dtype) -> torch.Tensor:
        """Weight rows a:b as s · q in dtype, [b - a, K]: with the kernels, dequantized in one pass into
        a reused buffer (float32, cast if the activations are not)."""
        if self.decoder is not None:
            w = self._kernel_weight(weight_scratch((b - a, self.in_features)), a, b)  # whole tiles: see forward
            if dtype == torch.float32:
                return w
            return weight_scratch(w.shape, dtype).copy_(w)  # rounded once into a reused buffer of its own
        codes = self._unpacked(self.codes[a:b])
        return dequantize(codes, self.scales[a:b], dtype, None if self.mins is None else self.mins[a:b])


class QuantEmbedding(nn.Module):
    """An embedding stored as a QuantLinear's codes and scales (`table`, [V, D]): a lookup dequantizes
    only the rows it gathers, and a tied output head is the same table, so the matrix exists once."""

    def __init__(self, table: QuantLinear):
        super().__init__()
        self.table = table

    @property
    def weight(self) -> torch.Tensor:  # [V, D] = s · q, dequantized whole (export, inspection)
        return self.table.dequantized_weight()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., D] = s · q of the gathered rows, in the model's dtype."""
        t = self.table
        codes, (scales, mins) = t.row_codes(ids), t.row_scales(ids)  # [..., D] int8, [..., D/g] each
        rows = codes.view(*ids.shape, scales.shape[-1], -1).float() * scales.unsqueeze(-1)  # [..., D/g, g]
        if mins is not None:
            rows = rows + mins.unsqueeze(-1)
        return rows.view(*ids.shape, t.in_features).to(t.compute_dtype)


KV_MXFP4 = 3  # csrc/kernels.h's mode for MXFP4 codes (the others' modes are their bits)


def mxfp4_as_int8(pre: PreQuantized) -> PreQuantized:
    """MXFP4 codes as int8 ones, exactly (engine.quant.MXFP4_CODES): where no kernel reads MXFP4 (a GPU, a CPU
    without kvchat's kernels), at a byte a value."""
    return dataclasses.replace(pre, codes=unpack_mxfp4(pre.codes), scales=mxfp4_scales(pre.scales), mode="int8",
                               packed=False)  # fmt: skip
