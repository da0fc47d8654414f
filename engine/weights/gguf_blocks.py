"""GGUF block types decoded into kvchat's codes: each native type's codes, scales and offsets as numpy arrays
(Q8_0 and Q6_K as int8, Q4_0/Q4_1/Q4_K as int4, Q5_0/Q5_1/Q5_K as int5 in their own block layout), so
those tensors compute from the file's own values."""

from __future__ import annotations

import numpy as np
import torch

from ..backends import kernel_verdicts
from ..backends import kernels as kernel_library
from ..quant import mxfp4_scales, pack_int4, pack_int5, storage_bytes, tile, unpack_mxfp4, untile
from .gguf_header import GGUF_ROWS


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 values from their bytes [..., 2k] -> float32 [..., k]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., m] bytes -> [..., 2m] values 0..15: the low nibbles first, then the high ones (ggml's order
    within a block: value i in byte i's low nibble, value m + i in its high one)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(qh: np.ndarray, n: int) -> np.ndarray:
    """[..., n/8] bytes -> [..., n] bits, bit i of the little-endian word being value i's."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")[..., :n]


def _recentred(d: np.ndarray, m: np.ndarray, centre: int) -> np.ndarray:
    """The offset that keeps x = d · q + m when codes q are stored as q − centre (the kernels' int4 nibbles
    are −8..7, int5 codes −16..15): m + centre · d per group, rounded once from float64 to float32."""
    return (m.astype(np.float64) + centre * d.astype(np.float64)).astype(np.float32)


def _centred(codes: np.ndarray, d: np.ndarray, m: np.ndarray, centre: int) -> tuple:
    """Unsigned codes q with x = d · q + m (d, m per group) as signed codes q − centre, and their offsets."""
    return (codes.astype(np.int16) - centre).astype(np.int8), _recentred(d, m, centre)


# Each block type -> (rows [N, bytes] -> codes int8 [N, K], scales float32 [N, K/g], offsets float32 [N, K/g] or
# None), with x = s · q (+ m) exactly as llama.cpp's dequantization defines each type (gguf.quants is the test's
# reference). Block layouts are ggml's (ggml-common.h).
def _q8_0(raw):
    b = raw.reshape(raw.shape[0], -1, 34)  # d, 32 int8
    return b[..., 2:].copy().view(np.int8).reshape(len(raw), -1), _f16(b[..., :2]).reshape(len(raw), -1), None


def _q4_0(raw):
    b = raw.reshape(raw.shape[0], -1, 18)  # d, 16 bytes of nibbles: x = d · (q − 8)
    codes = _nibbles(b[..., 2:]).astype(np.int8) - 8
    return codes.reshape(len(raw), -1), _f16(b[..., :2]).reshape(len(raw), -1), None


def _q4_1(raw):
    b = raw.reshape(raw.shape[0], -1, 20)  # d, m, 16 bytes of nibbles: x = d · q + m
    d, m = _f16(b[..., 0:2])[..., 0], _f16(b[..., 2:4])[..., 0]
    codes, mins = _centred(_nibbles(b[..., 4:]), d, m, 8)
    return codes.reshape(len(raw), -1), d, mins


def _q5_0(raw):
    b = raw.reshape(raw.shape[0], -1, 22)  # d, 4 bytes of fifth bits, 16 bytes of nibbles: x = d · (q − 16)
    q = _nibbles(b[..., 6:]) | (_bits(b[..., 2:6], 32) << 4)
    return (q.astype(np.int8) - 16).reshape(len(raw), -1), _f16(b[..., :2]).reshape(len(raw), -1), None


def _q5_1(raw):
    b = raw.reshape(raw.shape[0], -1, 24)  # d, m, 4 bytes of fifth bits, 16 bytes of nibbles: x = d · q + m
    q = _nibbles(b[..., 8:]) | (_bits(b[..., 4:8], 32) << 4)
    return q.astype(np.int8).reshape(len(raw), -1), _f16(b[..., 0:2])[..., 0], _f16(b[..., 2:4])[..., 0]


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of a Q4_K/Q5_K super-block -> its 8 six-bit scales and 8 six-bit mins."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_groups(b: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K/Q5_K super-block's header -> each group of 32's scale d · sc and offset −dmin · mn."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [N, nb, 1]
    sc, mn = _k_scales(b[..., 4:16])
    return (d * sc).reshape(n, -1), (-(dmin * mn)).reshape(n, -1)


def _q4_k(raw):
    n = raw.shape[0]
    b = raw.reshape(n, -1, 144)  # d, dmin, 12 bytes of scales, 128 bytes: 4 × 32 bytes = 8 groups of 32 nibbles
    scales, mins = _k_groups(b, n)
    qs = b[..., 16:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    codes, mins = _centred((qs & 0x0F).reshape(n, -1), scales, mins, 8)
    return codes, scales, mins


def _q5_k(raw):
    n = raw.shape[0]
    b = raw.reshape(n, -1, 176)  # d, dmin, 12 bytes of scales, 32 bytes of fifth bits, 128 bytes of nibbles
    scales, mins = _k_groups(b, n)
    ql = (b[..., 48:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    qh = (b[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 0x01
    q = ql.reshape(n, -1, 8, 32) | (qh << 4)
    return q.astype(np.int8).reshape(n, -1), scales, mins


def _q6_k(raw):
    n = raw.shape[0]
    b = raw.reshape(n, -1, 210)  # 128 bytes low nibbles, 64 bytes of high pairs, 16 int8 scales, d
    ql = (b[..., :128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    qh = (b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    q = ql.reshape(n, -1, 8, 32) | (qh.reshape(n, -1, 8, 32) << 4)
    scales = _f16(b[..., 208:210]) * b[..., 192:208].copy().view(np.int8).astype(np.float32)  # [N, nb, 16]
    return (q.astype(np.int8) - 32).reshape(n, -1), scales.reshape(n, -1), None


def _q5_blocks(raw, size: int):
    """Q5_0 (`size` 22) / Q5_1 (24) blocks as the kernels' int5 layout (each block without its float16
    scale and minimum: 4 bytes of fifth bits, 16 of nibbles, code q meaning q − 16), scales d and offsets:
    x = d · (q − 16) for Q5_0; x = d · q + m = d · (q − 16) + (m + 16 · d) for Q5_1."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, size)
    d = _f16(b[..., 0:2])[..., 0]
    if size == 22:
        return np.ascontiguousarray(b[..., 2:]).reshape(n, -1), d, None
    return np.ascontiguousarray(b[..., 4:]).reshape(n, -1), d, _recentred(d, _f16(b[..., 2:4])[..., 0], 16)


def _q5_k_int5(raw):
    """Q5_K super-blocks in the int5 layout: each group of 32's codes q (0..31) repacked as Q5_0 packs a
    block, with x = s · q + m = s · (q − 16) + (m + 16 · s)."""
    codes, scales, mins = _q5_k(raw)  # codes 0..31 [N, K], scale and offset per 32
    packed = pack_int5(torch.from_numpy(codes.astype(np.int8) - 16)).numpy()
    return packed, scales, _recentred(scales, mins, 16)


def _kvchat_nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's nibbles -> kvchat's int4 rows, without unpacking: a chunk of h bytes [..., h] holds values 0..h-1
    in its low nibbles and h..2h-1 in its high ones (Q4_0/Q4_1: h = 16, Q4_K: h = 32); kvchat's byte k holds
    values 2k and 2k+1 (low nibble first) as 4-bit two's complement codes q − 8, which is q XOR 8."""
    even, odd = qs[..., 0::2], qs[..., 1::2]
    return np.concatenate([(even & 0x0F) | (odd << 4), (even >> 4) | (odd & 0xF0)], axis=-1) ^ np.uint8(0x88)


def fast_rows():
    """kvchat's kernels for writing a file's rows straight into a product's buffers (kv_gguf_rows), when they load
    and give this module's numbers bit for bit (checked once per kernel build, the verdict kept with the
    kernels'); else None: numpy decodes."""
    k = kernel_library.load()
    if k is None:
        return None
    if k.gguf_rows_agree is None:
        k.gguf_rows_agree = _rows_agree(k)
        kernel_verdicts.keep_verdict(k)
    return k if k.gguf_rows_agree else None


def _rows_agree(k) -> bool:
    """kv_gguf_rows against this module's decoders on random blocks of each kind (finite and subnormal scales),
    the rows reversed, written from row 16 of 48, in every form it writes the kind in (row_forms)."""
    rng = np.random.default_rng(1)
    for kind, (_, block, _, _) in GGUF_ROWS.items():
        raw = _random_blocks(rng, kind, 32, 2 * block)
        order = np.arange(31, -1, -1)
        for mode, group, rows in row_forms(kind):
            got = written_rows(k, raw, kind, mode, order, 16, 48, rows, group)
            want = numpy_rows(raw[order], kind, mode, group)
            if not all(np.array_equal(g[16:].view(np.uint8), w.view(np.uint8)) for g, w in zip(got, want)):
                return False
    return True


def row_forms(kind: str) -> list[tuple[str, int, int]]:
    """The forms kv_gguf_rows writes a kind in, as (mode, values per scale, rows a tile; 1: rows): int8 at the
    kind's own group and, where that is 32, at 16; int4 in rows and in tiles of 16 for the 4-bit kinds; int5 for
    Q5_K."""
    group = GGUF_ROWS[kind][3]
    forms = [("int8", g, 1) for g in (group, 16) if g <= group]
    if kind in INT4_PACKED:
        forms += [("int4", 32, 1), ("int4", 32, 16)]
    if kind in INT5:
        forms += [("int5", 32, 1)]
    return forms


def numpy_rows(raw, kind: str, mode: str, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What kv_gguf_rows writes for rows `raw` of `kind` in `mode` at `group`, by this module's decoders: codes
    (int4 packed as pack_int4 lays them), scales and offsets (zeros for a kind without), as rows."""
    if mode == "int5":
        return INT5[kind](raw)
    codes, scales, mins = NATIVE[kind][2](raw)
    widen = NATIVE[kind][1] // group
    if mode == "int4":
        codes = pack_int4(torch.from_numpy(codes)).numpy()
    return codes, scales.repeat(widen, -1), (np.zeros_like(scales) if mins is None else mins).repeat(widen, -1)


def written_rows(k, raw, kind: str, mode: str, order, r0: int, total: int, rows: int, group: int) -> tuple:
    """kv_gguf_rows of `raw` into zeroed buffers of `total` rows from row r0 (int4 in tiles of `rows`), read back
    as rows: (codes, scales, offsets) numpy arrays."""
    _, block, values, _ = GGUF_ROWS[kind]
    width = raw.shape[1] // block * values  # values a row
    got = [
        torch.zeros((total, storage_bytes(width, mode, 0)), dtype=torch.int8 if mode == "int8" else torch.uint8),
        torch.zeros((total, width // group)),
        torch.zeros((total, width // group)),
    ]
    if rows > 1:
        got = [tile(t, rows, unit) for t, unit in zip(got, (4, 1, 1))]
    k.gguf_rows(raw, GGUF_ROWS[kind], mode, order, r0, rows, group, *got)
    if rows > 1:
        got = [untile(t, rows, unit) for t, unit in zip(got, (4, 1, 1))]
    return tuple(t.numpy() for t in got)


def _random_blocks(rng, kind: str, rows: int, width: int) -> np.ndarray:
    """Random blocks of `kind` with finite float16 fields (a subnormal among them) and random codes."""
    _, block, _, _ = GGUF_ROWS[kind]
    raw = rng.integers(0, 256, size=(rows, width // block, block), dtype=np.uint8)
    fields = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[kind]
    for at in fields:
        halves = (rng.standard_normal(raw.shape[:2]) * 1e-2).astype(np.float16)
        halves[0, 0] = np.float16(-3e-5)  # a subnormal
        raw[..., at : at + 2] = halves[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def _int4_blocks(raw, block: int, qs: int, h: int, nh: int):
    """Blocks of `block` bytes whose nibbles run from byte qs to the end in chunks of h -> (codes [N, K/2] in
    kvchat's packed rows, each block's first nh float16 fields [N, nb, nh] as float32)."""
    b = raw.reshape(raw.shape[0], -1, block)
    nib = b[..., qs:].reshape(*b.shape[:2], -1, h)  # [N, nb, chunks, h]
    return _kvchat_nibbles(nib).reshape(len(raw), -1), _f16(b[..., : 2 * nh])


def _q4_0_packed(raw):
    codes, d = _int4_blocks(raw, 18, 2, 16, 1)
    return codes, d[..., 0], None


def _q4_1_packed(raw):
    codes, dm = _int4_blocks(raw, 20, 4, 16, 2)
    d, m = dm[..., 0], dm[..., 1]
    return codes, d, _recentred(d, m, 8)


def _q4_k_packed(raw):
    n = raw.shape[0]
    scales, mins = _k_groups(raw.reshape(n, -1, 144), n)
    codes, _ = _int4_blocks(raw, 144, 16, 32, 0)
    return codes, scales, _recentred(scales, mins, 8)


def _mxfp4_packed(raw):
    """llama.cpp's MXFP4 blocks (17 bytes: an e8m0 scale, then 16 bytes holding value j in the low nibble and value
    j + 16 in the high one) -> (codes two a byte in order, as int4's [N, K/2], the e8m0 bytes [N, K/32], None):
    engine.quant.MXFP4_CODES, the doubled e2m1 values, by mxfp4_scales' halved scale."""
    b = raw.reshape(raw.shape[0], -1, 17)
    qs = b[..., 1:]
    codes = np.concatenate((qs & 15, qs >> 4), axis=-1)  # [N, nb, 32] in order
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8).reshape(len(raw), -1)
    return packed, np.ascontiguousarray(b[..., 0]), None


def _mxfp4(raw):
    """_mxfp4_packed with a code a byte: int8 [N, K], the doubled e2m1 values."""
    packed, e, _ = _mxfp4_packed(raw)
    return unpack_mxfp4(torch.from_numpy(packed)).numpy(), mxfp4_scales(torch.from_numpy(e)).numpy(), None


# The int4 types straight into kvchat's packed rows (two codes a byte, engine.quant.pack_int4's layout): what a
# product of these alone holds, with no int8 code per value on the way (engine/BENCHMARKS.md, "Opening a model
# file"). type -> rows -> (packed codes [N, K/2] uint8, scales, offsets or None).
INT4_PACKED = {"Q4_0": _q4_0_packed, "Q4_1": _q4_1_packed, "Q4_K": _q4_k_packed}
MXFP4 = {"MXFP4": _mxfp4_packed}  # gpt-oss's experts: their own codes, two a byte
# Held as int5 codes (their own five bits) when a product is of these alone: type -> rows -> (codes in the
# int5 layout, scales, offsets or None).
INT5 = {"Q5_0": lambda raw: _q5_blocks(raw, 22), "Q5_1": lambda raw: _q5_blocks(raw, 24), "Q5_K": _q5_k_int5}
OFFSETS = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")  # the types whose decoders give an offset per group
# GGUF type -> (mode its codes are held in, values per scale, decoder): computed natively by the kernels.
NATIVE = {
    "Q8_0": ("int8", 32, _q8_0),
    "Q4_0": ("int4", 32, _q4_0),
    "Q4_1": ("int4", 32, _q4_1),
    "Q5_0": ("int8", 32, _q5_0),
    "Q5_1": ("int8", 32, _q5_1),
    "Q4_K": ("int4", 32, _q4_k),
    "Q5_K": ("int8", 32, _q5_k),
    "Q6_K": ("int8", 16, _q6_k),
    "MXFP4": ("int8", 32, _mxfp4),  # as int8 codes; a product of MXFP4 alone holds its own (MXFP4)
}
