"""The kernels' checks against torch and against the definitions in engine.quant: every function of a loaded
library on awkward shapes (vector tails, GQA, windows, groups that are not whole 32s) before the engine uses it,
and what they found, kept and taken back (verdict_of, take)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv_pool import BLOCK
from ..model import RMSNorm
from ..quant import (
    ACTIVATION_BLOCK,
    INT5_GROUP,
    MXFP4_GROUP,
    QMAX,
    dequantize,
    integer_product,
    mxfp4_scales,
    pack_int4,
    pack_int5,
    quantize,
    tile,
    unpack_mxfp4,
)
from ..rotary import swap_halves


def silu_agrees(k) -> bool:
    """The decode step's silu against torch's over every magnitude a gate can take: its e^x overflows past
    x = 88.7 and underflows below -87.3, where a vector exponent built by hand goes wrong first."""
    edges = torch.tensor([-1e30, -200.0, -100.0, -88.8, -88.72, -88.5, -88.0, -87.4, -87.2, -20.0, 0.0, 1e-3])
    x = torch.cat([edges, -edges, torch.linspace(-120, 120, 997)])  # vector bodies and a scalar tail
    got, want = k.silu(x), F.silu(x)
    return bool(torch.allclose(got, want, rtol=1e-5, atol=1e-30) and torch.isfinite(got).all())


def agrees(k, dtype: torch.dtype) -> bool:
    """Each kernel of `dtype` against torch on awkward sizes (vector tails, GQA, a window, q/k norms)."""
    g = torch.Generator().manual_seed(0)

    def close(got, want, tol):
        return torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * float(want.float().abs().max()))

    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for out, n in ((7, 64), (33, 131), (96, 576)):
        w = torch.randn(out, n, generator=g).to(dtype)
        x = torch.randn(n, generator=g).to(dtype)
        if not close(k.matvec(w, x), w.float() @ x.float(), tol):
            return False
        norm = RMSNorm(n, 1e-6).to(dtype)
        norm.weight.data = torch.rand(n, generator=g).to(dtype) + 0.5
        if not close(k.rms_norm(x, norm.weight, 1e-6), norm(x), tol):
            return False
    for heads, h_kv, d, pos, window, qk_norm in ((4, 2, 64, 9, None, False), (6, 3, 40, 20, 8, True)):
        qkv = torch.randn((heads + 2 * h_kv) * d, generator=g).to(dtype)
        cos, sin = torch.rand(d, generator=g).to(dtype), torch.rand(d, generator=g).to(dtype)
        qn = kn = None
        if qk_norm:
            qn, kn = torch.rand(d, generator=g).to(dtype) + 0.5, torch.rand(d, generator=g).to(dtype) + 0.5
        kc, vc = torch.randn(2, h_kv, pos + 3, d, generator=g).to(dtype)
        got = k.attend(qkv, cos, sin, qn, kn, 1e-6, kc, vc, pos, window, heads)

        def rotate(x, w, d=d, cos=cos, sin=sin):  # x [heads, d] -> [heads, d]
            if w is not None:
                x = w * F.rms_norm(x.float(), (d,), None, 1e-6).to(dtype)
            return x * cos + swap_halves(x) * sin

        q = rotate(qkv[: heads * d].view(heads, d), qn)
        key = rotate(qkv[heads * d : (heads + h_kv) * d].view(h_kv, d), kn)
        if not (close(kc[:, pos], key, tol) and torch.equal(vc[:, pos], qkv[(heads + h_kv) * d :].view(h_kv, d))):
            return False
        lo = 0 if window is None else max(0, pos - window + 1)
        keys = kc[:, lo : pos + 1].float().repeat_interleave(heads // h_kv, 0)  # [H, S, d]
        values = vc[:, lo : pos + 1].float().repeat_interleave(heads // h_kv, 0)
        want = F.scaled_dot_product_attention(q.float()[:, None], keys, values)  # [H, 1, d]
        if not close(got, want.reshape(-1), tol):
            return False
        if not torch.equal(paged_attend(k, qkv, cos, sin, qn, kn, kc, vc, pos, window, heads), got):
            return False
        sinks = torch.randn(heads, generator=g) * 2  # gpt-oss's: a logit a head beside the scores, its value 0
        got = k.attend(qkv, cos, sin, qn, kn, 1e-6, kc, vc, pos, window, heads, None, sinks)
        scores = (q.float()[:, None] @ keys.transpose(1, 2))[:, 0] * d**-0.5  # [H, S]
        probs = torch.softmax(torch.cat((scores, sinks[:, None]), dim=1), dim=1)[:, :-1]
        if not close(got, (probs[:, None] @ values).reshape(-1), tol):
            return False
    return True


def paged_attend(k, qkv, cos, sin, qn, kn, kc, vc, pos, window, heads):
    """The same attention over a block pool: the cache's positions ([H_kv, S, d]) laid out in blocks of
    BLOCK slots in reverse order (a table), the result to equal the cache's own, bit for bit."""
    h_kv, S, d = kc.shape
    n = -(-S // BLOCK)
    table = torch.arange(n - 1, -1, -1, dtype=torch.int32)  # block i of the sequence in slot block n-1-i
    slots = (table.long()[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1)[:S]  # [S]
    pk, pv = kc.new_zeros(h_kv, n * BLOCK, d), vc.new_zeros(h_kv, n * BLOCK, d)
    pk[:, slots], pv[:, slots] = kc, vc
    return k.attend(qkv, cos, sin, qn, kn, 1e-6, pk, pv, pos, window, heads, table)


def quant_agrees(k, mode: str, activations: str = "float32") -> bool:
    """The products of `mode`'s codes (and their quantization and dequantization) against the definition,
    at the given activations, on awkward shapes (vector tails, groups that are not whole 32s)."""
    g = torch.Generator().manual_seed(0)
    if activations != "float32" and mode not in k._integer:  # no integer product for these codes
        return False
    if mode == "int5":  # a file's codes only: random ones in its layout
        return int5_agrees(k, g, activations)
    if mode == "mxfp4":
        return mxfp4_agrees(k, g, activations)
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
            mine = k.quantize(mode, w, group)
            if not (torch.equal(mine[0], stored) and torch.equal(mine[1], scales)):
                return False
        mins = torch.randn(scales.shape, generator=g)  # offsets: weights s · q + m
        if not all(codes_agree(k, mode, stored, codes, scales, x, group, m, activations) for m in (None, mins)):
            return False
    return True


def tiles_agree(k, rows: int, activations: str = "float32") -> bool:
    """The tiled int4 product (at `activations`) and dequantization against the row layout's definition."""
    g = torch.Generator().manual_seed(1)
    for out, n, group in ((rows, 64, 32), (3 * rows, 576, 64), (2 * rows, 96, 8), (rows, 160, 160)):
        w, x = torch.randn(out, n, generator=g), torch.randn(n, generator=g)
        codes, scales = quantize(w, "int4", group)
        mins = torch.randn(scales.shape, generator=g)
        stored = tile(pack_int4(codes), rows, 4)
        for m in (None, mins):
            if not codes_agree(k, "int4", stored, codes, scales, x, group, m, activations, rows):
                return False
    return True


def tile_gemm_agrees(k, rows: int) -> bool:
    """Prefill's product of many rows from int4 tiles (gemm_tiles) against x times the definition's weights, on
    an odd number of tiles, rows of x past a pass's 12 and groups that are not 32s; False where it does not run
    here (gemm_tiles' None: torch's GEMM of the dequantized weights then)."""
    g = torch.Generator().manual_seed(4)
    for out, n, group, m_rows in ((2 * rows, 64, 32, 13), (3 * rows, 576, 64, 30), (rows, 160, 160, 1),
                                  (2 * rows, 96, 8, 25)):  # fmt: skip
        w = torch.randn(out, n, generator=g)
        x = torch.randn(m_rows, n, generator=g)
        codes, scales = quantize(w, "int4", group)
        stored = tile(pack_int4(codes), rows, 4)
        for m in (None, torch.randn(scales.shape, generator=g)):
            got = k.gemm_tiles(stored, tile(scales, rows, 1), x, group, None if m is None else tile(m, rows, 1))
            if got is None:
                return False
            want = x @ dequantize(codes, scales, mins=m).t()  # [M, out]
            if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
                return False
    return True


def int5_agrees(k, g: torch.Generator, activations: str) -> bool:
    """The int5 products and dequantization against the definition, with and without offsets."""
    for out, n in ((5, 64), (19, 576), (8, 896), (3, 96)):
        codes = torch.randint(-16, 16, (out, n), generator=g, dtype=torch.int8)
        codes[0, :INT5_GROUP] = torch.arange(-16, 16)  # every code once
        scales, mins = torch.rand(out, n // INT5_GROUP, generator=g), torch.randn(out, n // INT5_GROUP, generator=g)
        x, stored = torch.randn(n, generator=g), pack_int5(codes)
        for m in (None, mins):
            if not codes_agree(k, "int5", stored, codes, scales, x, INT5_GROUP, m, activations):
                return False
    return True


def mxfp4_agrees(k, g: torch.Generator, activations: str = "float32") -> bool:
    """The MXFP4 product and dequantization against the definition: random codes (every one in a block) and e8m0
    scale bytes from 2^-28 to 2^11 and the subnormal ones."""
    for out, n in ((5, 64), (19, 576), (8, 2880), (3, 96)):
        idx = torch.randint(0, 16, (out, n), generator=g, dtype=torch.uint8)
        idx[0, :16] = torch.arange(16, dtype=torch.uint8)  # every code once
        stored = (idx[:, 0::2] | (idx[:, 1::2] << 4)).contiguous()
        codes = unpack_mxfp4(stored)
        e = torch.randint(100, 140, (out, n // MXFP4_GROUP), generator=g, dtype=torch.uint8)
        e.view(-1)[:3] = torch.tensor([0, 1, 2], dtype=torch.uint8)  # the subnormal scales too
        want_w = dequantize(codes, mxfp4_scales(e))
        x = torch.randn(n, generator=g)
        want = want_w @ x if activations == "float32" else integer_product(codes, mxfp4_scales(e), x).float()
        got = k._product("mxfp4", stored, e, x, MXFP4_GROUP, None, activations, False)
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
            return False
        if activations == "float32" and not torch.equal(k.dequantize("mxfp4", stored, e, n, MXFP4_GROUP), want_w):
            return False
    return True


def int8_tiles_agree(k, rows: int) -> bool:
    """int8 codes in tiles by int8 activations against engine.quant.integer_product, and their dequantization
    (read back into rows) against the definition."""
    g = torch.Generator().manual_seed(3)
    for out, n, group in ((rows, 64, 32), (3 * rows, 576, 64), (2 * rows, 96, 32), (rows, 160, 160)):
        w, x = torch.randn(out, n, generator=g), torch.randn(n, generator=g)
        codes, scales = quantize(w, "int8", group)
        stored = tile(codes, rows, 4)
        for m in (None, torch.randn(scales.shape, generator=g)):
            if not codes_agree(k, "int8", stored, codes, scales, x, group, m, "int8", rows):
                return False
            mn = None if m is None else tile(m, rows, 1)
            mine = k.dequantize("int8", stored, tile(scales, rows, 1), n, group, None, mn, True)
            if not torch.allclose(mine, dequantize(codes, scales, mins=m), rtol=2**-22, atol=2**-22):
                return False
    return True


def codes_agree(k, mode, stored, codes, scales, x, group, mins, activations="float32", tiles=0) -> bool:
    """The one-row product and the dequantization of `stored` codes against the definition, s · q (+ m):
    s · q is exact in float32 (equal), s · q + m is one rounding in C (FMA) against torch's two. Under int8
    activations, the product against engine.quant.integer_product where the shape is whole blocks. `tiles`:
    `stored` is int4 in tiles of that many rows, and scales and offsets are tiled to go with it."""
    want_w = dequantize(codes, scales, mins=mins)
    want = want_w @ x
    if activations != "float32" and x.numel() % ACTIVATION_BLOCK == 0 and group % ACTIVATION_BLOCK == 0:
        want = integer_product(codes, scales, x, mins).float()
    kept_scales, kept_mins = (tile(scales, tiles, 1), tile(mins, tiles, 1)) if tiles else (scales, mins)
    got = k._product(mode, stored, kept_scales, x, group, kept_mins, activations, bool(tiles))
    if not torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())):
        return False
    if activations != "float32":
        return True  # the dequantization is the float path's, checked there
    mine = k.dequantize(mode, stored, kept_scales, x.numel(), group, None, kept_mins, bool(tiles))
    return torch.equal(mine, want_w) if mins is None else torch.allclose(mine, want_w, rtol=2**-22, atol=2**-22)


def rows_agree(k) -> bool:
    """The products of several rows at once (engine.batching's decode steps) against each row's one-row product,
    bit for bit (a request's tokens must not depend on its batch-mates): float weights (32- and 16-bit), int8
    codes (groups of 32, longer groups, offsets), int4 tiles, and int8 tiles where they run, with float32
    activations and with int8 ones where the library's integer products serve them, on awkward sizes and 1 to 9
    rows (past a pass of 8)."""
    g = torch.Generator().manual_seed(2)
    activations = ("float32", "int8") if "int8" in k.integer_modes else ("float32",)
    tile_activations = ("float32", "int8") if k.int4_integer_tiles else ("float32",)
    for B in (1, 2, 3, 4, 5, 7, 9):
        for out, n in ((7, 64), (33, 131), (96, 576)):
            w, x = torch.randn(out, n, generator=g), torch.randn(B, n, generator=g)
            if not torch.equal(k.rows("float32", w, x), torch.stack([k.matvec(w, r) for r in x])):
                return False
            for dtype in k.dtypes & {torch.bfloat16, torch.float16}:  # 16-bit weights, rows in their own type
                wh, xh = w.to(dtype), x.to(dtype)
                if not torch.equal(
                    k.rows(str(dtype).removeprefix("torch."), wh, xh), torch.stack([k.matvec(wh, r) for r in xh])
                ):
                    return False
        for out, n, group in ((19, 192, 32), (40, 576, 64), (6, 128, 16), (7, 160, 160)):
            w, x = torch.randn(out, n, generator=g), torch.randn(B, n, generator=g)
            codes, scales = quantize(w, "int8", group)
            for m in (None, torch.randn(scales.shape, generator=g)):
                for act in activations:
                    want = torch.stack([k._product("int8", codes, scales, r, group, m, act, False) for r in x])
                    if not torch.equal(k.rows("int8", codes, x, scales, group, m, activations=act), want):
                        return False
        rows = k.int4_tile_rows
        for out, n, group in ((rows, 64, 32), (3 * rows, 576, 64), (2 * rows, 96, 8)) if rows else ():
            w, x = torch.randn(out, n, generator=g), torch.randn(B, n, generator=g)
            codes, scales = quantize(w, "int4", group)
            stored = tile(pack_int4(codes), rows, 4)
            for m in (None, torch.randn(scales.shape, generator=g)):
                sc, mn = tile(scales, rows, 1), None if m is None else tile(m, rows, 1)
                for act in tile_activations:
                    want = torch.stack([k._product("int4", stored, sc, r, group, mn, act, True) for r in x])
                    if not torch.equal(k.rows("int4", stored, x, sc, group, mn, tiled=True, activations=act), want):
                        return False
        shapes = ((rows, 64, 32), (3 * rows, 576, 64), (2 * rows, 160, 160))
        for out, n, group in shapes if k.int8_integer_tiles else ():
            w, x = torch.randn(out, n, generator=g), torch.randn(B, n, generator=g)
            codes, scales = quantize(w, "int8", group)
            stored = tile(codes, rows, 4)
            for m in (None, torch.randn(scales.shape, generator=g)):
                sc, mn = tile(scales, rows, 1), None if m is None else tile(m, rows, 1)
                want = torch.stack([k._product("int8", stored, sc, r, group, mn, "int8", True) for r in x])
                if not torch.equal(k.rows("int8", stored, x, sc, group, mn, tiled=True, activations="int8"), want):
                    return False
    return True


def check_all(k) -> None:
    """Every function of the loaded library `k` against torch: which float dtypes, code modes, integer (int8
    activation) modes and int4 tile layouts it may serve; what fails is not used."""
    with torch.inference_mode():
        k.dtypes = frozenset(d for d in k.float_dtypes if agrees(k, d)) if silu_agrees(k) else frozenset()
        k.modes = frozenset(m for m in k.code_modes if quant_agrees(k, m))
        k.integer_modes = frozenset(m for m in k.modes if quant_agrees(k, m, "int8"))
        rows = k.lib.kv_int4_tile_rows()  # 0 where rows are as fast (no 16-lane vectors)
        k.int4_tile_rows = rows if rows and "int4" in k.modes and tiles_agree(k, rows) else 0
        k.int4_integer_tiles = bool(  # the tiles' integer products with int8 activations (512-bit VNNI)
            k.int4_tile_rows
            and k.lib.kv_int4_integer_tiles()
            and "int4" in k.integer_modes
            and tiles_agree(k, rows, "int8")
        )
        k.int8_integer_tiles = bool(  # int8 codes in the same tiles by int8 activations (512-bit VNNI)
            k.int4_tile_rows
            and k.lib.kv_int8_integer_tiles()
            and "int8" in k.integer_modes
            and int8_tiles_agree(k, rows)
        )
        k.batch_rows = batches_rows(k)
        k.tile_gemm = bool(k.int4_tile_rows) and tile_gemm_agrees(k, k.int4_tile_rows)


def batches_rows(k) -> bool:
    """Whether the library's products of several rows serve batched decode steps: the float32 and int8/int4
    products it serves at all, and each row's result its one-row product's (rows_agree)."""
    return torch.float32 in k.dtypes and {"int8", "int4"} <= k.modes and rows_agree(k)


def verdict_of(k) -> dict:
    """What the checks found, as kept beside the library (engine.backends.kernel_verdicts): the same build on the
    same CPU and torch finds the same, so a later process takes it instead of checking again."""
    return {
        "torch": torch.__version__,
        "dtypes": sorted(str(d).removeprefix("torch.") for d in k.dtypes),
        "modes": sorted(k.modes),
        "integer_modes": sorted(k.integer_modes),
        "int4_tile_rows": k.int4_tile_rows,
        "int4_integer_tiles": k.int4_integer_tiles,
        "int8_integer_tiles": k.int8_integer_tiles,
        "gguf_rows_agree": k.gguf_rows_agree,
        "batch_rows": k.batch_rows,
        "tile_gemm": k.tile_gemm,
    }


def take(k, v: dict) -> None:
    """What an earlier process's checks found (verdict_of), taken instead of checking again."""
    k.dtypes = frozenset(d for d in k.float_dtypes if str(d).removeprefix("torch.") in v["dtypes"])
    k.modes = frozenset(m for m in k.code_modes if m in v["modes"])
    k.integer_modes = frozenset(m for m in k.modes if m in v["integer_modes"])
    k.int4_tile_rows = int(v["int4_tile_rows"]) if "int4" in k.modes else 0
    k.int4_integer_tiles = bool(v["int4_integer_tiles"]) and bool(k.int4_tile_rows)
    k.int8_integer_tiles = bool(v.get("int8_integer_tiles")) and bool(k.int4_tile_rows) and "int8" in k.integer_modes
    k.gguf_rows_agree = None if v.get("gguf_rows_agree") is None else bool(v["gguf_rows_agree"])
    with torch.inference_mode():  # kept by a kvchat before a check existed: that check now
        k.batch_rows = bool(v["batch_rows"]) if "batch_rows" in v else batches_rows(k)
        k.tile_gemm = bool(k.int4_tile_rows) and (
            bool(v["tile_gemm"]) if "tile_gemm" in v else tile_gemm_agrees(k, k.int4_tile_rows)
        )
