"""Symmetric group-wise quantization, exactly as the reference defines it.

    q = clip(round_half_even(x / s), -Q, Q),   x̂ = s · q,   Q = 7 (int4) or 127 (int8)

one scale per group of `group_size` consecutive values, s = max|x| / Q over the group. Int4
codes are packed two per byte. Storage = packed codes + scales, counted exactly. The rounding
error is at most s/2 only inside the unclipped range [-Q·s, Q·s]; with s = max|x|/Q nothing in
the group is clipped, but an explicit smaller scale (as in the reference's outlier) clips.
"""

from __future__ import annotations

import dataclasses
import math

import torch

QMAX = {"int8": 127, "int4": 7}
BITS = {"int8": 8, "int5": 5, "int4": 4, "mxfp4": 4}
FILE_MODES = ("int5", "mxfp4")  # codes only a model file brings (a GGUF's Q5_0/Q5_1 blocks, MXFP4), never made here
# MXFP4 (gpt-oss's experts): a 4-bit e2m1 code per value, two a byte as int4's; as int8 codes, the e2m1 values
# doubled (whole numbers), with the block's scale 2^(e − 127) halved: s · q is then the value, exactly
MXFP4_GROUP = 32
MXFP4_CODES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
INT5_GROUP, INT5_BYTES = 32, 20  # int5 codes: 32 values in 20 bytes (4 of fifth bits, 16 of nibbles)
SCALE_DTYPE = torch.float32  # one float32 scale per group: 4 bytes
PRECISIONS = ("none", *QMAX)  # "none": the model dtype, unquantized
DEFAULT_GROUP_SIZE = 64  # values per scale unless a person chooses otherwise (0: one per output channel)


def check_mode(mode: str) -> None:
    if mode not in QMAX:
        raise ValueError(f"quantization {mode!r} is not supported (supported: none, {', '.join(QMAX)})")


def quantize_with_scale(x: torch.Tensor, scale, qmax: int) -> torch.Tensor:
    """Codes for x at a given scale: clip(round_half_even(x / s), -Q, Q). torch.round rounds half to even."""
    return torch.clamp(torch.round(x / scale), -qmax, qmax).to(torch.int8)


def quantize(x: torch.Tensor, mode: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> codes int8 [..., K], scales float32 [..., K / group_size]."""
    check_mode(mode)
    qmax = QMAX[mode]
    k = x.shape[-1]
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group size {group_size} does not divide the row length {k}")
    xg = x.float().reshape(*x.shape[:-1], k // group_size, group_size)  # [..., G, g]
    scale = xg.abs().amax(-1, keepdim=True) / qmax  # [..., G, 1]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero group: any scale works
    codes = quantize_with_scale(xg, scale, qmax)
    return codes.reshape(x.shape), scale.squeeze(-1).to(SCALE_DTYPE)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype=torch.float32, mins=None) -> torch.Tensor:
    """codes [..., K] int8, scales [..., G] (and offsets `mins` [..., G]) -> x̂ = s · q (+ m), [..., K] in dtype."""
    k, groups = codes.shape[-1], scales.shape[-1]
    q = codes.reshape(*codes.shape[:-1], groups, k // groups).to(dtype)
    x = q * scales.to(dtype).unsqueeze(-1)
    if mins is not None:
        x = x + mins.to(dtype).unsqueeze(-1)
    return x.reshape(codes.shape)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7], [..., K] (K even) -> uint8 [..., K/2]: low nibble first."""
    c = codes.to(torch.uint8) & 0x0F
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> int8 [..., K], sign-extended from 4 bits."""
    lo = (packed & 0x0F).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    out = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return torch.where(out > 7, out - 16, out)


def tile(rows: torch.Tensor | None, tile_rows: int, unit: int) -> torch.Tensor | None:
    """[N, C] -> [N/tile_rows, tile_rows·C]: each tile holds its rows side by side, `unit` values of one
    row, then the same of the next (int4 codes: unit 4 bytes, 8 inputs; scales: unit 1). The decode
    kernels' layout for one-row products of int4 codes, where a vector lane is a row."""
    if rows is None:
        return None
    if rows.dtype in (torch.uint8, torch.int8) and unit == 4 and rows.is_contiguous():  # 4 bytes as one int32
        return tile(rows.view(torch.int32), tile_rows, 1).view(rows.dtype)  # 3x faster than byte by byte
    n, c = rows.shape
    return rows.view(n // tile_rows, tile_rows, c // unit, unit).transpose(1, 2).reshape(n // tile_rows, -1)


def untile(tiles: torch.Tensor | None, tile_rows: int, unit: int) -> torch.Tensor | None:
    """tile's inverse: [N/tile_rows, tile_rows·C] -> [N, C]."""
    if tiles is None:
        return None
    t, c = tiles.shape[0], tiles.shape[1] // tile_rows
    return tiles.view(t, c // unit, tile_rows, unit).transpose(1, 2).reshape(t * tile_rows, c)


def unpack_int5(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/32·20] in the int5 layout (per 32 values: 4 bytes whose bit i is value i's fifth bit,
    then 16 bytes whose low nibbles are values 0-15 and high nibbles 16-31; code q means q − 16) ->
    int8 [..., K] in −16..15."""
    b = packed.reshape(*packed.shape[:-1], -1, INT5_BYTES).to(torch.int64)  # [..., G, 20]
    qh = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)  # [..., G]
    fifth = (qh.unsqueeze(-1) >> torch.arange(INT5_GROUP, device=packed.device)) & 1  # [..., G, 32]
    nibbles = torch.cat([b[..., 4:] & 0x0F, b[..., 4:] >> 4], dim=-1)  # [..., G, 32]
    return ((nibbles | (fifth << 4)) - 16).to(torch.int8).reshape(*packed.shape[:-1], -1)


def mxfp4_scales(e: torch.Tensor) -> torch.Tensor:
    """e8m0 scale bytes (uint8, as an MXFP4 file holds them: 2^(e − 127)) -> the float32 scales of MXFP4_CODES, halved:
    2^(e − 128)."""
    return torch.ldexp(torch.ones(e.shape, device=e.device), e.to(torch.int32) - 128)


def unpack_mxfp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] MXFP4 codes, two a byte (value 2k in byte k's low nibble) -> int8 [..., K], each the e2m1
    value doubled (MXFP4_CODES), as the scales halved make exact."""
    table = torch.tensor(MXFP4_CODES, dtype=torch.int8, device=packed.device)
    b = packed.to(torch.int64)
    return torch.stack((table[b & 15], table[b >> 4]), dim=-1).flatten(-2)


def pack_int5(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in −16..15, [..., K] (K a multiple of 32) -> the int5 layout of unpack_int5."""
    q = (codes.to(torch.int64) + 16).reshape(*codes.shape[:-1], -1, INT5_GROUP)  # [..., G, 32] in 0..31
    qh = ((q >> 4) << torch.arange(INT5_GROUP, device=codes.device)).sum(-1)  # [..., G]
    head = torch.stack([(qh >> (8 * i)) & 0xFF for i in range(4)], dim=-1)  # [..., G, 4]
    nibbles = (q[..., :16] & 0x0F) | ((q[..., 16:] & 0x0F) << 4)  # [..., G, 16]
    return torch.cat([head, nibbles], dim=-1).to(torch.uint8).reshape(*codes.shape[:-1], -1)


ACTIVATIONS = ("float32", "int8")  # what a quantized layer's one-row product multiplies its codes by
ACTIVATION_BLOCK = 32  # inputs per activation scale under int8 activations


def check_activations(activations: str) -> None:
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations {activations!r} are not supported (supported: {', '.join(ACTIVATIONS)})")


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [K] (K a multiple of 32) -> codes int8 [K], scales float32 [K / 32]: the int8 activations of an
    integer product, per block of 32 inputs as the weights' own rule (s = max|x| / 127, round half to even)."""
    return quantize(x, "int8", ACTIVATION_BLOCK)


def integer_product(codes, scales, x, mins=None) -> torch.Tensor:
    """The definition of a one-row product under int8 activations: codes [N, K] (int values), scales
    [N, K/g] (g a multiple of 32), x [K] -> y [N] float64 = sum over blocks b of s · d_b · (q . c)_b, the
    block dot products exact integers, plus the offsets' share from x itself (sum_j m_j · sum of x over group j)."""
    n, k = codes.shape
    c, d = quantize_activations(x.float())
    dots = (codes.to(torch.int64).view(n, -1, ACTIVATION_BLOCK) * c.to(torch.int64).view(-1, ACTIVATION_BLOCK)).sum(-1)
    s = scales.double().repeat_interleave(k // scales.shape[1] // ACTIVATION_BLOCK, dim=1)  # [N, K/32]
    y = (s * d.double() * dots.double()).sum(-1)
    if mins is not None:
        y = y + mins.double() @ x.double().view(mins.shape[1], -1).sum(-1)
    return y


def storage_bytes(num_values: int, mode: str, num_scales: int, scale_bytes: int = 4) -> int:
    """Packed codes plus scales: four int4 values and one float32 scale take 2 + 4 = 6 bytes."""
    return math.ceil(num_values * BITS[mode] / 8) + num_scales * scale_bytes


def group_for(in_features: int, group_size: int) -> int:
    """The group size a matrix with rows of `in_features` takes: `group_size` where it divides the
    row, else one scale per output channel (the whole row)."""
    return group_size if 0 < group_size and in_features % group_size == 0 else in_features


def describe(mode: str, group_size: int, in_features: int | None = None) -> str:
    """How a precision is named in the facts, the panel and the fingerprint: "int8/g64", "int4/per-channel"."""
    per_channel = group_size <= 0 or (in_features is not None and group_size == in_features)
    return f"{mode}/per-channel" if per_channel else f"{mode}/g{group_size}"


@dataclasses.dataclass(frozen=True)
class PreQuantized:
    """Codes a model file already holds, as a quantized layer stores them: codes [N, K] int8 (int4 values
    in −8..7, unpacked, or with `packed` two a byte [N, K/2] uint8 as pack_int4 lays them; int5 packed as
    unpack_int5 reads them), scales [N, K/g] float32, and for formats with a minimum per group (GGUF's Q4_1,
    Q5_1, K-quants) offsets `mins` [N, K/g] float32: x̂ = s · q + m; `dtype` is the activations'."""

    codes: torch.Tensor
    scales: torch.Tensor
    mode: str
    group_size: int
    dtype: torch.dtype
    mins: torch.Tensor | None = None
    packed: bool = False  # int4 codes two a byte
    tiles: int = 0  # packed int4 codes, scales and offsets already in the kernels' tiles of this many rows (tile)

    @property
    def shape(self) -> tuple[int, int]:
        """[N, K]: the matrix the codes stand for (int5 codes are stored packed, 20 bytes a 32 values)."""
        n, k = self.codes.shape
        if self.tiles:
            n, k = n * self.tiles, k // self.tiles
        if self.mode == "int5":
            return n, k // INT5_BYTES * INT5_GROUP
        return (n, 2 * k) if self.packed else (n, k)

    @property
    def device(self) -> torch.device:
        return self.codes.device
