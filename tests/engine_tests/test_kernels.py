"""kvchat's CPU decode kernels (engine/backends/csrc/): built here, checked against torch at model
shapes for every type and every instruction-set variant this CPU can run, and a model decoding
through them gives the logits and tokens of the same model on torch's kernels."""

import ctypes
import importlib.util
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from checkpoints import FAMILY_CASES, make_checkpoint
from engine import devices
from engine.backends import kernel_build, kernel_checks, kernel_verdicts, kernels, quantized, quantized_model
from engine.backends.cpu_layouts import KernelHead, KernelLinear, PackedLinear
from engine.backends.decode_step import KernelAttention, KernelRMSNorm
from engine.backends.quantized import QuantLinear
from engine.errors import ModelLoadError
from engine.kv_cache import KVCache
from engine.model import Attention, RMSNorm
from engine.quant import PreQuantized, dequantize, integer_product, pack_int4, pack_int5, quantize
from engine.weights.loading import load_model

K = kernels.load()
needs_kernels = pytest.mark.skipif(K is None, reason=f"no kernels here: {kernels.status()}")
X86 = kernel_build.X86


@pytest.fixture
def no_kernels(monkeypatch):
    """The engine as it runs where the kernels cannot be built: torch's kernels only."""
    monkeypatch.setattr(kernels, "load", lambda: None)


def close(got, want, tol):
    got, want = got.detach().float(), want.detach().float()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


@needs_kernels
def test_kernels_build_and_serve_every_type():
    assert K.dtypes == {torch.float32, torch.bfloat16, torch.float16} and K.modes == {"int8", "int4", "int5", "mxfp4"}
    assert K.integer_modes == K.modes and f"int8 activations: {K.int_isa}" in kernels.status()
    assert kernels.status().startswith("kvchat kernels (")
    assert K.int4_tile_rows == (16 if K.isa in ("avx512", "avx2") else 0)  # AVX-512's and AVX2's tiles pass their check
    assert K.int4_integer_tiles == (K.isa == "avx512" and K.int_isa == "avx512-vnni")
    assert K.int8_integer_tiles == K.int4_integer_tiles  # int8 codes in the same tiles, by the same VNNI
    assert len(kernel_build.openmp_runtimes()) == 1  # torch's OpenMP pool, shared


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out,n", [(960, 576), (576, 1536), (49152, 576), (5, 3)])
def test_matvec_equals_torch_at_model_shapes(dtype, out, n):
    g = torch.Generator().manual_seed(out + n)
    w, x = torch.randn(out, n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    got = K.matvec(w, x)
    assert got.dtype == dtype and got.shape == (out,)
    close(got, F.linear(x.float(), w.float()), 1e-5 if dtype == torch.float32 else 1e-2)


@needs_kernels
@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("group", [16, 32, 64, 576])
def test_quantized_matvec_equals_the_dequantized_product(mode, group):
    g = torch.Generator().manual_seed(group)
    codes, scales = quantize(torch.randn(300, 576, generator=g), mode, group)
    x = torch.randn(576, generator=g)
    got = K.qmatvec(mode, pack_int4(codes) if mode == "int4" else codes, scales, x, group)
    close(got, dequantize(codes, scales) @ x, 1e-5)


@needs_kernels
@pytest.mark.parametrize("mode", ["int8", "int4", "int5"])
@pytest.mark.parametrize("n,group", [(576, 32), (576, 64), (1536, 0), (96, 32), (160, 0), (96, 48)])
def test_integer_products_are_their_definition_not_the_float_product(mode, n, group, kernel_variant):
    """activations="int8": x quantized per 32 inputs, integer block sums (engine.quant.integer_product), with
    and without offsets, tails of half a vector step included, on every variant this CPU runs; a group that is
    not whole blocks of 32 (48) runs the float product instead."""
    g = torch.Generator().manual_seed(n + group)
    group = 32 if mode == "int5" else group or n
    if mode == "int5":
        codes = torch.randint(-16, 16, (70, n), generator=g, dtype=torch.int8)
        scales = torch.rand(70, n // group, generator=g) / 100
        stored = pack_int5(codes)
    else:
        codes, scales = quantize(torch.randn(70, n, generator=g), mode, group)
        stored = pack_int4(codes) if mode == "int4" else codes
    x = torch.randn(n, generator=g) * torch.linspace(0.01, 3, n)  # blocks of very different ranges
    for mins in (None, torch.randn(scales.shape, generator=g) / 10):
        got = kernel_variant.qmatvec(mode, stored, scales, x, group, mins, "int8")
        exact = dequantize(codes, scales, mins=mins) @ x
        if group % 32:
            close(got, exact, 1e-5)
            continue
        close(got, integer_product(codes, scales, x, mins).float(), 1e-5)
        assert not torch.allclose(got, exact, rtol=1e-5, atol=1e-5 * float(exact.abs().max()))  # x was quantized
        close(got, exact, 3e-2)  # ... and stays near the exact product


@needs_kernels
@pytest.mark.parametrize("mode", ["int8", "int4", "int5"])
@pytest.mark.parametrize("n,group", [(576, 32), (896, 0), (160, 32)])
def test_an_integer_products_row_is_the_same_bits_whatever_rows_run_beside_it(mode, n, group, kernel_variant):
    """A row's result under int8 activations does not depend on the rows computed with it (AVX2 takes rows two at
    a time, a last odd row alone): the rows of a 7-row product equal, bit for bit, those of the product of its last
    6 rows, of its rows one at a time, with and without offsets."""
    g = torch.Generator().manual_seed(n + group + len(mode))
    group = 32 if mode == "int5" else group or n
    if mode == "int5":
        codes, scales = torch.randint(-16, 16, (7, n), generator=g, dtype=torch.int8), torch.rand(7, n // 32) / 100
    else:
        codes, scales = quantize(torch.randn(7, n, generator=g), mode, group)
    x = torch.randn(n, generator=g) * torch.linspace(0.01, 3, n)
    pack = {"int4": pack_int4, "int5": pack_int5}.get(mode, torch.Tensor.contiguous)

    def product(rows, mins):
        return kernel_variant.qmatvec(mode, pack(codes[rows]), scales[rows].contiguous(), x, group,
                                      None if mins is None else mins[rows].contiguous(), "int8")  # fmt: skip

    for mins in (None, torch.randn(scales.shape, generator=g) / 10):
        whole = product(slice(0, 7), mins)
        assert torch.equal(product(slice(1, 7), mins), whole[1:])
        assert torch.equal(torch.cat([product(slice(r, r + 1), mins) for r in range(7)]), whole)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_rounds_as_the_module_does(dtype):
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.data = (torch.rand(576) + 0.5).to(dtype)
    x = torch.randn(1, 1, 576).to(dtype) * 3
    want = norm(x)
    norm.__class__, norm.kernels = KernelRMSNorm, K
    got = norm(x)
    assert got.shape == x.shape and got.dtype == dtype
    close(got, want, 1e-6 if dtype == torch.float32 else 1e-2)


@needs_kernels
@pytest.mark.parametrize("dtype,offset", [(torch.float32, 0.0), (torch.bfloat16, 0.0), (torch.float32, 1.0)])
def test_a_prompts_norms_and_swiglu_are_each_rows_decode_arithmetic(dtype, offset):
    """A prompt's rows through the kernel norm (an offset norm's 1 + w too) and the kernel SwiGLU: each row the same
    bits as that row alone (a decode step's), and within float rounding of torch's norm, SiLU and MLP."""
    from engine.backends.decode_step import KernelMLP
    from engine.config import config_from_dict
    from engine.feedforward import MLP

    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(576, 1e-5, offset).to(dtype)
    norm.weight.data = (torch.rand(576, generator=g) + 0.5 - offset).to(dtype)
    x = (torch.randn(1, 37, 576, generator=g) * 3).to(dtype)  # 37 positions
    want = norm(x)
    norm.__class__, norm.kernels = KernelRMSNorm, K
    got = norm(x)
    assert got.dtype == dtype and torch.equal(torch.cat([norm(x[:, t : t + 1]) for t in range(37)], 1), got)
    close(got, want, 1e-6 if dtype == torch.float32 else 1e-2)
    sizes = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=1, num_attention_heads=4, vocab_size=32)
    cfg = config_from_dict(dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", **sizes))
    mlp = MLP(cfg)
    h = torch.randn(1, 37, 64, generator=g) * 4
    with torch.no_grad():
        want = mlp(h)
        mlp.__class__, mlp.kernels = KernelMLP, K
        close(mlp(h), want, 1e-5)
        gate_up = mlp.gate_up(h)  # [1, 37, 2F]: silu(gate) · up a row, each row's bits alone
        rows = K.silu_mul(gate_up)
        assert torch.equal(torch.cat([K.silu_mul(gate_up[:, t : t + 1]) for t in range(37)], 1), rows)
        close(rows, F.silu(gate_up[..., :160]) * gate_up[..., 160:], 1e-6)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,extra", [("llama", {}), ("qwen3", {}), ("mistral", {"sliding_window": 8})])
def test_attention_step_equals_the_torch_step(tmp_path, dtype, family, extra):
    """Rotation (with Qwen3's q/k norms), the cache write and attention over the cache (and only the
    window) in one call give the torch path's output and cache."""
    cfg = load_model(make_checkpoint(tmp_path, family, **extra), dtype="float32").config
    attn = Attention(cfg).to(dtype)
    cos_t, sin_t = torch.rand(2, 40, 1, cfg.head_dim).to(dtype)
    caches = [KVCache(1, cfg.num_kv_heads, cfg.head_dim, 40, dtype, "cpu") for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        prompt = torch.randn(1, 20, cfg.hidden_size, generator=g).to(dtype)
        for c in caches:
            attn(prompt, cos_t[:20], sin_t[:20], None, c, 0, 0)
            c.length = 20
        for pos in range(20, 30):  # past the window of 8
            x = torch.randn(1, 1, cfg.hidden_size, generator=g).to(dtype)
            mask = None if cfg.sliding_window is None else torch.arange(pos + 1)[None] > pos - cfg.sliding_window
            attn.__class__ = Attention
            want = attn(x, cos_t[pos : pos + 1], sin_t[pos : pos + 1], mask, caches[0], 0, pos)
            attn.__class__, attn.kernels = KernelAttention, K
            got = attn(x, cos_t[pos : pos + 1], sin_t[pos : pos + 1], mask, caches[1], 0, pos)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            close(got, want, tol)
            close(caches[1].k[:, :, :, : pos + 1], caches[0].k[:, :, :, : pos + 1], tol)
            assert torch.equal(caches[1].v[:, :, :, : pos + 1], caches[0].v[:, :, :, : pos + 1])


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(
    "family,extra",
    [("llama", {}), ("qwen2", {"tie": True}), ("qwen3", {}), ("mistral", {"sliding_window": 8}),
     ("gpt_oss", {k: v for k, v in FAMILY_CASES["gpt_oss"].items() if k != "family"})],
)  # fmt: skip
def test_decoding_through_the_kernels_matches_torchs_kernels(
    tmp_path, monkeypatch, dtype, family, extra, kernel_variant
):
    path = make_checkpoint(tmp_path, family, **extra)
    fast = load_model(path, dtype=dtype)
    assert (
        isinstance(fast.model.layers[0].attn.qkv, KernelLinear) and fast.model.layers[0].attn.kernels is kernel_variant
    )
    assert fast.model.decode_step is not None  # the blocks of a decode step run in one C call
    monkeypatch.setattr(kernels, "load", lambda: None)
    plain = load_model(path, dtype=dtype)
    assert type(plain.model.layers[0].attn) is Attention and plain.kernels is None
    assert (
        isinstance(fast.model.lm_head, KernelHead)
        and fast.model.lm_head.kernels is kernel_variant
        and fast.kernels is kernel_variant
    )
    if fast.config.tie_word_embeddings:  # the head multiplies by the embedding's own matrix, not a copy
        assert fast.model.lm_head.weight is fast.model.embed.weight
    prompt = torch.randint(5, fast.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    cfg = fast.config
    caches = [KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, fast.dtype, "cpu") for _ in range(2)]
    tol = 1e-4 if dtype == "float32" else 3e-2
    with torch.inference_mode():
        token = prompt
        for _ in range(24):
            want = plain.model(token, caches[0], last_only=True)
            got = fast.model(token, caches[1], last_only=True)
            close(got, want, tol)
            token = want[:, -1].argmax(-1, keepdim=True)


def _decode(model, cache, prompt, steps):
    """Greedy logits of a prompt and `steps` decode steps: [steps + 1, V]."""
    out, token = [], prompt
    with torch.inference_mode():
        for _ in range(steps + 1):
            out.append(model(token, cache, last_only=True)[0, -1])
            token = out[-1].argmax().view(1, 1)
    return torch.stack(out)


@needs_kernels
@pytest.mark.parametrize(
    "weights,group,dtype,activations",
    [
        ("int8", 0, "float32", "float32"),
        ("int8", 64, "float32", "float32"),
        ("int4", 32, "float32", "float32"),
        ("int4", 32, "bfloat16", "float32"),
        ("int8", 0, "float32", "int8"),
        ("int4", 32, "float32", "int8"),
        ("int4", 32, "bfloat16", "int8"),
    ],
)
def test_quantized_layers_decode_through_the_kernels(llama_dir, weights, group, dtype, activations, kernel_variant):
    """The one-call C step and the module path compute the same products (int8 activations included)."""
    loaded = load_model(llama_dir, weights=weights, group_size=group, dtype=dtype, activations=activations)
    assert loaded.activations == activations and loaded.facts()["activations"] == activations
    ql = loaded.model.layers[0].mlp.gate_up
    assert isinstance(ql, QuantLinear) and ql.decoder is kernel_variant and ql.activations == activations
    x = torch.randn(1, 1, ql.in_features).to(loaded.dtype)
    if activations == "int8":
        want = integer_product(ql.weight_codes(), ql.scale_values(), x.reshape(-1).float()).float()
    else:
        want = F.linear(x.float(), ql.dequantized_weight(torch.float32))
    close(ql(x).reshape(-1), want.reshape(-1), 1e-5 if dtype == "float32" else 1e-2)
    tiled = kernel_variant.int4_tile_rows and (
        (weights == "int4" and (activations == "float32" or kernel_variant.int4_integer_tiles))
        or (weights == "int8" and activations == "int8" and kernel_variant.int8_integer_tiles)
    )
    assert ql.tiles == (kernel_variant.int4_tile_rows if tiled else 0)
    assert (f"{weights} in 16-row tiles" in loaded.decode_kernels) == bool(tiled)  # what the panel's row says
    cfg, model = loaded.config, loaded.model
    prompt = torch.arange(5, 17)[None]
    caches = [KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 40, loaded.dtype, "cpu") for _ in range(2)]
    assert model.decode_step is not None
    fast = _decode(model, caches[0], prompt, 12)  # every block of a step in one C call
    model.decode_step = None
    modules = _decode(model, caches[1], prompt, 12)  # module by module
    close(fast, modules, 1e-5 if dtype == "float32" else 2e-2)


@needs_kernels
@pytest.mark.parametrize(
    "weights,group,dtype,activations",
    [("none", 0, "float32", "float32"), ("none", 0, "bfloat16", "float32"), ("none", 0, "float16", "float32"),
     ("int8", 32, "float32", "float32"), ("int4", 32, "float32", "float32"),
     ("int4", 64, "bfloat16", "float32"), ("int8", 0, "bfloat16", "float32"), ("int8", 32, "float32", "int8"),
     ("int8", 64, "bfloat16", "int8"), ("int4", 32, "float32", "int8"), ("int4", 64, "bfloat16", "int8")],
)  # fmt: skip
def test_several_sequences_decode_in_one_call_each_as_it_would_alone(
    llama_dir, weights, group, dtype, activations, kernel_variant
):
    """Continuous batching's step (Transformer.forward_many: every block of B sequences' steps in one C call,
    the head once for all): each sequence's logits equal its own one-call step's bit for bit, whatever its
    batch-mates, their lengths and their number (past the integer products' pass of 8), with float32 or int8
    activations, float weights of 32 or 16 bits (their rows sharing each weight's load), on every instruction-set
    variant this CPU runs."""
    loaded = load_model(llama_dir, weights=weights, group_size=group, dtype=dtype, activations=activations)
    cfg, model = loaded.config, loaded.model
    assert model.decode_step is not None and model.decode_step.batches and kernel_variant.batch_rows
    assert loaded.activations == activations

    def caches():
        made = [KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 48, loaded.dtype, "cpu") for _ in range(10)]
        for i, c in enumerate(made):
            model(torch.arange(3, 8 + 3 * i)[None] % cfg.vocab_size, c)
        return made

    with torch.inference_mode():
        alone, together = caches(), caches()
        for step in range(3):
            for n in (5, 2, 3, 10):  # batch sizes change from step to step, as requests come and go
                tokens = [(11 * i + step + n) % cfg.vocab_size for i in range(n)]
                want = [model(torch.tensor([[t]]), c, last_only=True) for t, c in zip(tokens, alone[:n])]
                got = model.forward_many(tokens, together[:n])
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (step, n)
        assert [c.length for c in together] == [c.length for c in alone]
        for a, b in zip(alone, together):
            assert torch.equal(a.k[:, :, :, : a.length], b.k[:, :, :, : b.length])


def _two_layers(mode: str, n: int, k: int, group: int, offsets: bool, g: torch.Generator):
    """Random codes of `mode` (n rows of k), their scales and offsets (or None), and two layers holding them."""
    top = 8 if mode == "int4" else 128
    codes = torch.randint(1 - top if mode == "int8" else -top, top, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) + 0.1
    mins = torch.randn(n, k // group, generator=g) if offsets else None
    pre = PreQuantized(codes, scales, mode, group, torch.float32, mins)
    return codes, scales, mins, QuantLinear.from_codes(pre), QuantLinear.from_codes(pre)


@pytest.mark.parametrize("offsets", [False, True])
def test_a_prompts_products_read_int4_tiles_without_a_float32_copy(offsets, kernel_variant, monkeypatch):
    """Prefill's many rows by a layer in int4 tiles: on the 16-lane builds the kernels' own GEMM (each tile
    dequantized in blocks in the thread's cache, no float32 copy of the layer), on an odd number of tiles, inputs
    past a block of 128, rows past a pass of 12 and past what one pass over the weights takes; each output within
    float32 rounding of x times the dequantized weights. The other builds do not run it (None), and the layer
    takes torch's GEMM of the dequantized weights."""
    if not kernel_variant.int4_tile_rows:
        pytest.skip(f"no int4 tiles in the {kernel_variant.variant} build")
    g = torch.Generator().manual_seed(5)
    sixteen = kernel_variant.isa.startswith("avx512")
    assert kernel_variant.tile_gemm == sixteen
    calls = []
    gemm = kernel_variant.gemm_tiles
    monkeypatch.setattr(kernel_variant, "gemm_tiles", lambda *a: calls.append(a) or gemm(*a))
    for n, k, group, m in ((80, 288, 32, 38), (32, 8192, 64, 40)):  # 1 MiB of x holds 32 rows of 8,192
        codes, scales, mins, _, tiles = _two_layers("int4", n, k, group, offsets, g)
        tiles.use_tiles()
        assert tiles.decoder is kernel_variant
        x = torch.randn(2, m // 2, k, generator=g)
        want = x @ dequantize(codes, scales, mins=mins).t()  # [2, m/2, n]
        calls.clear()
        close(tiles(x), want, 1e-5)
        assert len(calls) == sixteen
        if not sixteen:
            assert gemm(tiles.codes, tiles.scales, x.reshape(m, k), group, tiles.mins) is None


@needs_kernels
@pytest.mark.skipif(not (K and K.int4_tile_rows), reason="int4 tiles need the AVX-512 or AVX2 kernels")
@pytest.mark.parametrize("offsets", [False, True])
def test_int4_tiles_hold_the_same_weight_as_rows(offsets):
    """A layer laid out in the kernels' tiles of 16 rows reads back the same codes and scales, dequantizes
    to the same weight for prefill (in chunks of whole tiles) and multiplies one row as the row layout does."""
    g = torch.Generator().manual_seed(3)
    n, k, group = 48, 160, 32
    codes, scales, mins, rows, tiles = _two_layers("int4", n, k, group, offsets, g)
    assert rows.tiles_fit()
    tiles.use_tiles()
    assert tiles.tiles == 16 and not tiles.tiles_fit() and tuple(tiles.codes.shape) == (n // 16, 16 * k // 2)
    assert not torch.equal(tiles.codes.view(-1), rows.codes.view(-1))  # the bytes did move
    assert torch.equal(tiles.weight_codes(), codes) and torch.equal(tiles.scale_values(), scales)
    assert tiles.storage_bytes == rows.storage_bytes
    want_w = dequantize(codes, scales, mins=mins)
    torch.testing.assert_close(tiles.dequantized_weight(torch.float32), want_w, rtol=2**-22, atol=2**-22)
    x = torch.randn(1, 1, k, generator=g)
    close(tiles(x).reshape(-1), (want_w @ x.reshape(-1)), 1e-5)
    many = torch.randn(1, 7, k, generator=g)
    torch.testing.assert_close(tiles(many), rows(many))  # prefill: the tiles' own GEMM or dequantized rows, one product
    switched = quantized_model.use_integer_activations(tiles)  # int8 activations: the tiles' integer products, or none
    if K.int4_integer_tiles:
        assert switched == 1 and tiles.activations == "int8"
        want = integer_product(codes, scales, x.reshape(-1), mins).float()
        close(tiles(x).reshape(-1), want, 1e-5)
        assert not torch.allclose(want, want_w @ x.reshape(-1), rtol=1e-6, atol=1e-6)  # not the float product
        if devices.bf16_hardware():  # prefill: bfloat16 products under the option, where the CPU has them
            assert tiles.halves_prefill() and not torch.equal(tiles(many), rows(many))
            close(tiles(many), rows(many), 2e-2)
        else:
            torch.testing.assert_close(tiles(many), rows(many))  # float products
    else:
        assert switched == 0 and tiles.activations == "float32"
        with pytest.raises(ValueError, match="float32 activations"):
            K.qmatvec("int4", tiles.codes, tiles.scales, x.reshape(-1), group, tiles.mins, "int8", tiled=True)
    quantized.SCRATCH_VALUES, kept = 20 * k, quantized.SCRATCH_VALUES  # 20 rows a chunk: rounded up to 32
    try:
        if tiles.halves_prefill():
            close(tiles(many), rows(many), 2e-2)
        else:
            torch.testing.assert_close(tiles(many), rows(many))
    finally:
        quantized.SCRATCH_VALUES = kept


@needs_kernels
@pytest.mark.parametrize("offsets", [False, True])
def test_int8_tiles_hold_the_same_weight_and_give_each_row_its_one_row_product(offsets, kernel_variant):
    """int8 codes under int8 activations laid out in the kernels' tiles (where 512-bit VNNI runs them): the same
    codes, scales and weight read back, an embedding's lookup gathered from the tiles equal to the rows', the one-row
    product the integer product's definition, and B rows at once (a batched decode step, the head of an int4 model)
    bit for bit each row's one-row product; elsewhere the layer stays in rows."""
    from engine.backends.quantized import QuantEmbedding

    g = torch.Generator().manual_seed(5)
    n, k, group = 48, 192, 64
    codes, scales, mins, rows, tiles = _two_layers("int8", n, k, group, offsets, g)
    assert tiles.decoder is kernel_variant and not tiles.tiles_fit()  # float32 activations: rows
    assert quantized_model.use_integer_activations(tiles) == 1 and quantized_model.use_integer_activations(rows) == 1
    if not kernel_variant.int8_integer_tiles:
        assert not tiles.tiles_fit() and quantized_model.use_tiles(tiles) == 0 and tiles.tiles == 0
        return
    assert tiles.tiles_fit() and quantized_model.use_tiles(tiles) == 1 and not tiles.tiles_fit()
    assert tiles.tiles == 16 and tuple(tiles.codes.shape) == (n // 16, 16 * k)
    assert not torch.equal(tiles.codes.view(-1), rows.codes.view(-1))  # the bytes did move
    assert torch.equal(tiles.weight_codes(), codes) and torch.equal(tiles.scale_values(), scales)
    assert tiles.storage_bytes == rows.storage_bytes
    want_w = dequantize(codes, scales, mins=mins)
    torch.testing.assert_close(tiles.dequantized_weight(torch.float32), want_w, rtol=2**-22, atol=2**-22)
    ids = torch.tensor([[0, 17, 47, 16], [15, 31, 32, 1]])
    torch.testing.assert_close(QuantEmbedding(tiles)(ids), QuantEmbedding(rows)(ids), rtol=0, atol=0)
    x = torch.randn(9, k, generator=g)
    one = torch.stack([tiles(r[None, None]).reshape(-1) for r in x])
    for r, y in zip(x, one):
        close(y, integer_product(codes, scales, r, mins).float(), 1e-5)
    for b in (2, 5, 8, 9):  # a pass of 8 rows, and past it
        assert torch.equal(kernel_variant.rows("int8", tiles.codes, x[:b], tiles.scales, group, tiles.mins,
                                               tiled=True, activations="int8"), one[:b])  # fmt: skip
    with pytest.raises(ValueError, match="tiles hold"):
        kernel_variant.qmatvec("int8", tiles.codes, tiles.scales, x[0], group, tiles.mins, "float32", tiled=True)


@needs_kernels
def test_an_int4_models_int8_head_is_tiled_and_its_embedding_reads_the_tiles(llama_dir, kernel_variant):
    """Under int8 activations an int4 model's int8 head — its embedding table too, where tied — lies in tiles
    where the kernels have int8 tiles: the lookups read the tiles, and the one-call step decodes as the modules."""
    from engine.backends.quantized import QuantEmbedding

    loaded = load_model(llama_dir, weights="int4", activations="int8")
    head, embed = loaded.model.lm_head, loaded.model.embed
    assert isinstance(head, QuantLinear) and head.mode == "int8"
    assert head.tiles == (16 if kernel_variant.int8_integer_tiles else 0)
    assert ("int8 in 16-row tiles" in loaded.decode_kernels) == bool(kernel_variant.int8_integer_tiles)
    assert isinstance(embed, QuantEmbedding) and embed.table.tiles == head.tiles
    ids = torch.arange(0, loaded.config.vocab_size, 7)[None]
    table = embed.table
    want = dequantize(table.weight_codes(), table.scale_values(), loaded.dtype)[ids]
    torch.testing.assert_close(embed(ids), want, rtol=0, atol=0)
    cfg, model = loaded.config, loaded.model
    prompt = torch.arange(5, 17)[None]
    caches = [KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 40, loaded.dtype, "cpu") for _ in range(2)]
    fast = _decode(model, caches[0], prompt, 12)
    model.decode_step = None
    close(fast, _decode(model, caches[1], prompt, 12), 1e-5)


@needs_kernels
def test_int8_activations_are_a_named_choice_kept_apart_from_the_exact_path(llama_dir, kernel_variant):
    """The option changes decode's logits (a little), says so in the facts, keys cached kernel_variant/V apart, and an
    unknown value is a clear load error."""
    exact = load_model(llama_dir, weights="int8", group_size=32)
    fast = load_model(llama_dir, weights="int8", group_size=32, activations="int8")
    assert fast.fingerprint != exact.fingerprint and fast.fingerprint["activations"] == "int8"
    assert f"int8 activations: {kernel_variant.int_isa}" in fast.decode_kernels
    cfg = exact.config
    caches = [KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 40, torch.float32, "cpu") for _ in range(2)]
    prompt = torch.arange(5, 17)[None]
    a, b = _decode(exact.model, caches[0], prompt, 6), _decode(fast.model, caches[1], prompt, 6)
    k0, k1 = caches[0].k[..., :12, :], caches[1].k[..., :12, :]
    if devices.bf16_hardware():  # the prompt's blocks (many rows): bfloat16 products under the option, float32 without
        assert not torch.equal(k0, k1)
        close(k1, k0, 0.02)
    else:
        torch.testing.assert_close(k0, k1, rtol=0, atol=0)
    assert not torch.allclose(a, b, rtol=1e-6, atol=1e-6)  # one-row products: int8 ones
    close(b, a, 0.1)
    assert load_model(llama_dir, activations="int8").activations == "float32"  # nothing quantized: nothing to do
    with pytest.raises(ModelLoadError, match="activations 'int16' are not supported"):
        load_model(llama_dir, weights="int8", activations="int16")


@needs_kernels
def test_the_one_call_step_follows_the_cache_it_is_given(llama_dir, kernel_variant):
    """A new cache (another capacity, maybe at the same address) is written where it lies."""
    loaded = load_model(llama_dir)
    cfg, model = loaded.config, loaded.model
    prompt = torch.arange(5, 15)[None]
    for capacity in (64, 24, 64, 33):
        cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, torch.float32, "cpu")
        fast = _decode(model, cache, prompt, 8)
        model.decode_step, keep = None, model.decode_step
        want_cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, torch.float32, "cpu")
        want = _decode(model, want_cache, prompt, 8)
        model.decode_step = keep
        close(fast, want, 1e-5)
        close(cache.k[:, :, :, : cache.length], want_cache.k[:, :, :, : cache.length], 1e-5)
        del cache


def test_without_kernels_the_engine_runs_torchs(no_kernels, llama_dir):
    loaded = load_model(llama_dir, dtype="float32")
    layer = loaded.model.layers[0]
    assert not isinstance(layer.attn.qkv, KernelLinear) and type(layer.attn) is Attention
    assert isinstance(layer.attn.qkv, PackedLinear) or not torch.backends.mkldnn.is_available()
    ql = load_model(llama_dir, weights="int8", group_size=0).model.layers[0].attn.qkv
    assert ql.decoder is None and ql.kernel == "int8pack"


def test_a_kernel_that_disagrees_with_torch_is_not_used(monkeypatch):
    if K is None:
        pytest.skip(kernels.status())
    real = kernels.Kernels.matvec
    monkeypatch.setattr(kernels.Kernels, "matvec", lambda self, w, x: real(self, w, x) * 1.05)
    assert kernels.Kernels(K.path).dtypes == frozenset()


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )


STATUS = "import torch; from engine.backends import kernels; print(kernels.status())"


@pytest.mark.parametrize(
    "env,says", [({"KVCHAT_KERNELS": "0"}, "turned off by KVCHAT_KERNELS"), ({"CC": "/bin/false"}, "/bin/false failed")]
)
def test_no_kernels_is_said_and_the_model_still_runs(tmp_path, llama_dir, env, says):
    code = STATUS + f"; from engine.weights.loading import load_model; print(load_model({str(llama_dir)!r}).kernels)"
    r = _run(code, KVCHAT_CACHE_DIR=str(tmp_path), **env)
    assert r.returncode == 0, r.stderr
    assert says in r.stdout and r.stdout.splitlines()[-1] == "None"


@needs_kernels
@pytest.mark.skipif(not shutil.which("gcc"), reason="the stand-in compiler calls gcc")
def test_a_compiler_without_openmp_builds_kernels_for_one_thread_and_says_so(tmp_path, llama_dir):
    """Apple's clang, or clang without libomp, refuses -fopenmp: the kernels are built without it (one
    thread: the pragmas are ignored), decode runs on them, and the Decode kernels row says why one thread."""
    cc = tmp_path / "cc-without-openmp"
    cc.write_text(
        '#!/bin/sh\nfor a in "$@"; do\n'
        '  [ "$a" = -fopenmp ] && { echo "unsupported option -fopenmp" >&2; exit 1; }\n'
        'done\nexec gcc "$@"\n'
    )
    cc.chmod(0o755)
    code = STATUS + f"; from engine.weights.loading import load_model; print(load_model({str(llama_dir)!r}).kernels)"
    r = _run(code, KVCHAT_CACHE_DIR=str(tmp_path / "cache"), CC=str(cc))
    assert r.returncode == 0, r.stderr
    status, loaded = r.stdout.splitlines()[-2:]
    assert status.startswith("kvchat kernels (") and f"one thread: {cc} has no OpenMP" in status
    assert loaded.startswith("<engine.backends.kernel_binding.Kernels")


@needs_kernels
def test_a_machine_without_a_c_compiler_builds_the_kernels_with_zig_cc_and_says_so(tmp_path, llama_dir):
    """No cc, gcc or clang on PATH (a Windows or macOS machine without developer tools): with the ziglang
    package installed the kernels are built by `zig cc` (no OpenMP there: one thread), checked as any
    build is, and the Decode kernels row names the compiler."""
    if importlib.util.find_spec("ziglang") is None:
        pytest.skip("ziglang is not installed (pip install -e '.[test]')")
    bare = tmp_path / "bin"  # a PATH with python alone: no C compiler on it
    bare.mkdir()
    (bare / "python").symlink_to(sys.executable)
    code = STATUS + f"; from engine.weights.loading import load_model; print(load_model({str(llama_dir)!r}).kernels)"
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=600,
        env={**env, "PATH": str(bare), "KVCHAT_CACHE_DIR": str(tmp_path / "cache")},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    status, loaded = r.stdout.splitlines()[-2:]
    assert status.startswith("kvchat kernels (") and "built by zig cc" in status, status
    assert "one thread: zig cc has no OpenMP" in status and loaded.startswith("<engine.backends.kernel_binding.Kernels")


@needs_kernels
@pytest.mark.skipif(not X86, reason="the variants are x86 builds")
def test_a_forced_variant_is_built_and_said_and_an_unknown_one_is_refused(tmp_path):
    """KVCHAT_KERNELS_VARIANT forces a build for less than this CPU has (the panel's Decode kernels row and
    `engine info` say so); a name that is not a variant here runs torch's kernels, with the reason."""
    r = _run(STATUS, KVCHAT_CACHE_DIR=str(tmp_path), KVCHAT_KERNELS_VARIANT="generic")
    assert r.returncode == 0 and "kvchat kernels (generic;" in r.stdout and "forced variant generic" in r.stdout
    r = _run(STATUS, KVCHAT_CACHE_DIR=str(tmp_path), KVCHAT_KERNELS_VARIANT="sse9")
    assert "no kvchat kernels" in r.stdout and "KVCHAT_KERNELS_VARIANT='sse9' is not a variant here" in r.stdout
    assert kernel_build.variants()[0] == "native" and kernel_build.variants()[-1] == "generic"


@pytest.mark.skipif(not (X86 and shutil.which("gcc")), reason="instruction-set variants are built with gcc on x86")
@pytest.mark.parametrize(
    "variant,isa",
    [
        ("native", None),
        ("avx512-no-vnni", None),  # AVX-512 without VNNI: the 256-bit integer products
        ("avx512-no-vbmi", None),  # AVX-512 without VBMI: int4 tiles' nibbles by shifts only
        ("avx2", "avx2"),
        ("avx2-no-vnni", "avx2"),  # AVX2 without any VNNI: vpmaddubsw
        ("generic", "generic"),
    ],
)
def test_each_instruction_set_variant_agrees_with_torch(tmp_path, variant, isa):
    """The AVX-512, AVX2 and plain-C paths, and each integer-product path, pass the self-check (each that
    this CPU can run)."""
    flags = kernel_build.X86_VARIANTS[variant]
    path = kernel_build.build("gcc", flags, tmp_path)
    assert kernel_build.build("gcc", flags, tmp_path) == path  # cached
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name, path.name + kernel_build.REPORT]
    k = kernels.Kernels(path)
    cpu = devices.cpu_flags()
    if isa == "avx2" and not {"avx2", "fma", "f16c"} <= cpu:
        isa = "generic"
    if isa is not None:
        assert k.isa == isa
    assert k.dtypes == {torch.float32, torch.bfloat16, torch.float16} and k.modes == {"int8", "int4", "int5", "mxfp4"}
    assert k.integer_modes == k.modes
    assert k.int4_tile_rows == (16 if k.isa in ("avx512", "avx2") else 0)
    assert kernel_checks.tiles_agree(
        k, 16
    )  # the tiled product's AVX-512, AVX2 and plain-C bodies (plain C: never chosen)
    assert k.int8_integer_tiles == k.int4_integer_tiles
    assert k.int4_integer_tiles == (k.isa == "avx512" and k.int_isa == "avx512-vnni")
    if "-mno-avxvnni" in flags or isa == "generic":
        assert k.int_isa == isa
    elif isa is None and "avx512_vnni" in cpu and "-mno-avx512vnni" not in flags:
        assert k.int_isa == "avx512-vnni"


def test_the_prefill_weight_buffer_is_reused_in_and_out_of_inference_mode():
    from engine.backends.cpu_layouts import weight_scratch

    with torch.inference_mode():
        a = weight_scratch((4, 8))
        a.fill_(2)
    b = weight_scratch((2, 8))  # outside inference mode: still writable (a normal tensor)
    b.copy_(torch.ones(2, 8))
    assert b.data_ptr() == a.data_ptr() and weight_scratch((64, 64)).numel() == 4096


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_prefill_computes_in_float32_a_chunk_of_rows_at_a_time(monkeypatch, dtype):
    """A 16-bit weight's many-row product in float32, widened a few rows at a time (here 3 chunks and a
    remainder): F.linear's float32 numbers rounded once (a chunk's GEMM may add in another order: at most one
    unit in the last place of the 16-bit result apart), with and without a bias; bfloat16 takes that path
    where the CPU has no bf16 instructions (a forced AVX2 variant stands for one), float16 always."""
    from engine.backends import cpu_layouts

    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(200, 96, generator=g).to(dtype), torch.randn(200, generator=g).to(dtype)
    x = torch.randn(2, 5, 96, generator=g).to(dtype)
    monkeypatch.setattr(cpu_layouts, "WIDEN_CHUNK_BYTES", 64 * 96 * 4)  # 64 rows a chunk: 3 chunks and 8 rows
    for bias in (None, b):
        exact = F.linear(x.float(), w.float(), None if bias is None else bias.float())
        got, want = cpu_layouts.widened_linear(x, w, bias), exact.to(dtype)
        assert got.dtype == dtype and got.shape == want.shape
        ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
        assert bool(((got.float() - want.float()).abs() <= ulp).all())  # within one rounding of float32's
        assert float((got.float() - exact).abs().max()) < 2 * float(ulp.max())
        assert (got == want).float().mean() > 0.95  # nearly every value exactly as F.linear's rounded once
    calls = []
    monkeypatch.setattr(cpu_layouts, "widened_linear", lambda *a: calls.append(1) or F.linear(*a))
    for variant in ("avx2", "native") if kernel_build.X86 else ("native",):
        monkeypatch.setenv(devices.VARIANT_ENV, variant)
        assert devices.bf16_hardware() == (variant == "native" and bool(devices.cpu_flags() & devices.BF16_FLAGS))
        calls.clear()
        cpu_layouts.many_rows_linear(x, w, b)
        assert calls == [1] * (dtype == torch.float16 or not devices.bf16_hardware()), (variant, dtype)


# --- The ABI: csrc/kernels.h is what Python calls ------------------------------------------------------------
HEADER = kernel_build.SOURCES / "kernels.h"
C_TYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}


def header_functions() -> dict[str, tuple[str, list[str]]]:
    """name -> (return type, parameter types) of every prototype in kernels.h (comments removed)."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    out = {}
    for ret, name, params in re.findall(r"^((?:const )?\w+ \*?)(kv_\w+)\(([^)]*)\);", text, flags=re.M):
        kinds = [p.rsplit(None, 1)[0] + ("*" if "*" in p else "") for p in (s.strip() for s in params.split(",")) if p]
        out[name] = (ret.strip(), [] if kinds == ["void"] else kinds)
    return out


def header_struct(name: str) -> list[tuple[str, str]]:
    """(field, C type) of `typedef struct {...} name;` in kernels.h, in order."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    body = re.search(r"typedef struct \{([^}]*)\} " + name + ";", text).group(1)
    fields = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        kind, names = re.match(r"((?:const )?\w+)\s*(.*)", decl).groups()
        for n in names.split(","):
            n = n.strip()
            fields.append((n.lstrip("*"), kind + ("*" if n.startswith("*") else "")))
    return fields


def as_ctype(kind: str):
    return ctypes.c_void_p if kind.endswith("*") else C_TYPES.get(kind.removeprefix("const "), kind)


def test_the_header_parser_reads_prototypes_and_structs():
    """What the ABI checks below rest on."""
    fns = header_functions()
    assert fns["kv_isa"] == ("const char *", [])
    assert fns["kv_matvec_f32"] == ("void", ["const float*", "const float*", "float*", "int64_t", "int64_t", "int"])
    assert header_struct("kv_linear")[:5] == [
        ("w", "const void*"),
        ("scales", "const float*"),
        ("mins", "const float*"),
        ("bias", "const void*"),
        ("out", "int64_t"),
    ]


@needs_kernels
def test_every_exported_function_is_declared_in_the_header_and_called_as_declared():
    """ctypes' declarations of every kernel (engine/backends/kernels.py) against csrc/kernels.h: the same
    parameters in the same order, the same return type; and the library exports nothing the header does not
    declare."""
    fns = header_functions()
    exported = subprocess.run(["nm", "-D", "--defined-only", str(K.path)], capture_output=True, text=True).stdout
    exported = {line.split()[-1] for line in exported.splitlines() if line.split()[-1].startswith(("kv_", "int_"))}
    assert exported == {n for n in fns if hasattr(K.lib, n)}, "exported but not in kernels.h (or the reverse)"
    for name, (ret, params) in fns.items():
        if not hasattr(K.lib, name):  # float16 ones where the compiler has no _Float16
            assert "f16" in name, name
            continue
        fn = getattr(K.lib, name)
        want_ret = {"void": None, "const char *": ctypes.c_char_p, "int": ctypes.c_int, "float": ctypes.c_float}[ret]
        assert fn.restype == want_ret, name
        if params:
            assert list(fn.argtypes) == [as_ctype(p) for p in params], name


def test_the_decode_steps_structs_are_the_headers():
    from engine.backends.decode_step import _Layer, _Linear

    for struct, name in ((_Linear, "kv_linear"), (_Layer, "kv_layer")):
        want = header_struct(name)
        got = [(n.rstrip("_"), t) for n, t in struct._fields_]
        assert [n for n, _ in got] == [n for n, _ in want], name
        for (field, t), (_, kind) in zip(got, want):
            assert t == (_Linear if kind == "kv_linear" else as_ctype(kind)), (name, field)


# Targets the kernels must compile and link for, with zig's clang (`pip install ziglang`, the test extra): the
# other operating systems and ARM, where nothing here can run them, and x86 with AVX-512 under clang (gcc
# accepts what clang refuses: a rounding mode that is a variable, not a constant expression).
CROSS_TARGETS = {
    "x86_64-windows-gnu": ("-mavx2", "-mfma", "-mf16c"),
    "x86_64-macos": ("-mavx2", "-mfma", "-mf16c"),
    "aarch64-macos": (),
    "aarch64-linux-gnu": (),
    "x86_64-linux-gnu": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mavx512vbmi",
                         "-mavx2", "-mfma", "-mf16c"),
}  # fmt: skip


@pytest.mark.parametrize("target", sorted(CROSS_TARGETS))
def test_the_kernels_compile_and_link_for_other_targets(tmp_path, target):
    """A compile-and-link check (no run) of the whole library, every file in one compiler call as on a user's
    machine, without OpenMP (zig ships none: the pragmas leave one thread)."""
    if importlib.util.find_spec("ziglang") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("ziglang (the test extra) is missing: CI must cross-compile the kernels")
        pytest.skip("ziglang is not installed (pip install -e '.[test]')")
    sources = [str(p) for p in kernel_build.sources() if p.suffix == ".c"]
    out = tmp_path / "kernels.bin"
    cmd = [sys.executable, "-m", "ziglang", "cc", "-target", target, "-O3", *CROSS_TARGETS[target]]
    cmd += ["-shared", "-fPIC", "-std=gnu11", "-Werror", f"-I{kernel_build.SOURCES}", *sources, "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.stat().st_size > 10_000
    if "windows" in target:  # a DLL exports only what its linker chose: every kernel Python calls must be there
        assert set(header_functions()) <= pe_exports(out.read_bytes()), set(header_functions()) - pe_exports(
            out.read_bytes()
        )


def pe_exports(b: bytes) -> set[str]:
    """The names a Windows DLL exports (its PE export directory), read without Windows."""
    import struct

    pe = struct.unpack_from("<I", b, 0x3C)[0]
    assert b[pe : pe + 4] == b"PE\0\0"
    sections, optional = struct.unpack_from("<H", b, pe + 6)[0], struct.unpack_from("<H", b, pe + 20)[0]
    opt = pe + 24
    directories = opt + (112 if struct.unpack_from("<H", b, opt)[0] == 0x20B else 96)  # PE32+ or PE32
    table = [struct.unpack_from("<8sIIII", b, opt + optional + 40 * i) for i in range(sections)]

    def at(rva: int) -> int:  # a virtual address as a file offset
        return next(rva - va + raw for _, size, va, rsize, raw in table if va <= rva < va + max(size, rsize))

    export = struct.unpack_from("<I", b, directories)[0]
    if not export:
        return set()
    e = at(export)
    count, names = struct.unpack_from("<I", b, e + 24)[0], struct.unpack_from("<I", b, e + 32)[0]
    found = set()
    for i in range(count):
        p = at(struct.unpack_from("<I", b, at(names) + 4 * i)[0])
        found.add(b[p : b.index(b"\0", p)].decode())
    return found


def test_the_build_names_the_host_cpu_as_each_architecture_s_compilers_expect():
    """-march=native on x86; -mcpu=native on ARM (Apple's clang and zig refuse -march=native there); the
    library's file named as each system loads it; ARM's variants are NEON and plain C."""
    assert "-march=native" in kernel_build.target_flags(kernel_build.FLAGS, "x86_64")
    arm = kernel_build.target_flags(kernel_build.FLAGS, "arm64")
    assert "-mcpu=native" in arm and "-march=native" not in arm
    assert kernel_build.target_flags(kernel_build.FLAGS, "aarch64") == arm
    assert kernel_build.ARM_VARIANTS == {"native": (), "generic": ("-DKV_GENERIC",)}
    assert kernel_build.LIBRARY_SUFFIX == {"Linux": ".so", "Darwin": ".dylib", "Windows": ".dll"}[platform.system()]


def test_the_loader_no_longer_refuses_a_system_that_is_not_linux(monkeypatch, tmp_path):
    """macOS and Windows build and check the kernels as Linux does (the check decides, not the name of the
    system): with the system reported as Darwin, the kernels here still build, load and pass."""
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))
    k = kernels._load()
    assert k.dtypes and k.isa in ("avx512", "avx2", "neon", "generic")


# The aarch64 builds the self-check compares: NEON (the baseline every aarch64 CPU has), NEON with the dot
# product instructions (a Cortex-A76's, an Apple M1's: sdot), and plain C on the same target (-DKV_GENERIC).
ARM_BUILDS = {"neon": (), "neon-dotprod": ("-mcpu=cortex_a76",), "generic": ("-DKV_GENERIC",)}
SELFCHECK = os.path.join(os.path.dirname(__file__), "kernel_selfcheck.c")


def selfcheck_lines(text: str) -> tuple[str, dict]:
    """The self-check's output: its "isa …" line, and each case's values."""
    lines = text.strip().splitlines()
    return lines[0], {f[0]: [float(v) for v in f[2:]] for f in (line.split() for line in lines[1:])}


def test_the_neon_kernels_agree_with_plain_c_under_qemu(tmp_path):
    """Every kernel built for aarch64 with NEON (and with its dot-product extension) runs under qemu-aarch64 on
    the self-check's inputs and gives plain C's outputs on the same target, within float32 rounding: the float,
    bf16 and f16 products, int8/int4/int5 codes with and without offsets (float32 and int8 activations),
    dequantization and quantization, RMSNorm, silu, attention (whole, windowed and over a block pool's table)
    and a two-layer decode step in float32 and in int4 codes. Speed on ARM cannot be measured here; correctness is."""
    if importlib.util.find_spec("ziglang") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("ziglang (the test extra) is missing: CI must cross-compile the kernels")
        pytest.skip("ziglang is not installed (pip install -e '.[test]')")
    qemu = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
    if qemu is None:
        pytest.skip("qemu-aarch64 is not installed (apt-get install qemu-user; .ci/run installs it)")
    sources = [str(p) for p in kernel_build.sources() if p.suffix == ".c"]
    outputs = {}
    for name, flags in ARM_BUILDS.items():
        exe = tmp_path / f"selfcheck-{name}"
        cmd = [sys.executable, "-m", "ziglang", "cc", "-target", "aarch64-linux-musl", "-O2", "-static", *flags]
        include = f"-I{kernel_build.SOURCES}"
        cmd += ["-std=gnu11", "-Wall", "-Werror", include, *sources, SELFCHECK, "-lm", "-o", str(exe)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        run = subprocess.run([qemu, "-cpu", "max", str(exe)], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        outputs[name] = selfcheck_lines(run.stdout)
    assert outputs["neon"][0] == "isa neon int neon" and outputs["neon-dotprod"][0] == "isa neon int neon-dotprod"
    assert outputs["generic"][0] == "isa generic int generic"
    ref = outputs["generic"][1]
    assert len(ref) >= 40 and sum(len(v) for v in ref.values()) > 9_000
    for name, (_, cases) in outputs.items():  # several rows at once give each row's own product, bit for bit
        differs = {case: v for case, v in cases.items() if "differ" in case}
        assert len(differs) == 4 and all(x == 0 for v in differs.values() for x in v), (name, differs)
    for name in ("neon", "neon-dotprod"):
        got = outputs[name][1]
        assert got.keys() == ref.keys()
        for case, want in ref.items():
            scale = max(abs(v) for v in want) or 1.0
            worst = max(abs(a - b) for a, b in zip(got[case], want)) / scale
            assert len(got[case]) == len(want) and worst < 1e-5, (name, case, worst)
    print("aarch64 self-check:", ", ".join(f"{k} ({len(v)})" for k, v in ref.items()))


@needs_kernels
def test_a_wrong_decode_step_is_caught_at_load_and_the_module_path_serves(llama_dir, monkeypatch, tmp_path):
    """The load-time check runs the whole one-call step on the model itself (its codes, its fused layers)
    against the module path: a step that writes other numbers is refused with the reason in the Decode
    kernels row, and the tokens come from the module path."""
    from engine.backends import decode_step

    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))  # a wrong build is another build: no pass kept for it
    real = decode_step.DecodeLayers.run

    def wrong(self, x, cache, pos, cos, sin):
        real(self, x, cache, pos, cos, sin)
        x.add_(x.roll(1))  # as a wrong kernel would: plausible numbers, other tokens

    monkeypatch.setattr(decode_step.DecodeLayers, "run", wrong)
    bad = load_model(llama_dir, device="cpu", dtype="float32")
    assert bad.model.decode_step is None and "layer by layer: the one-call decode step disagreed" in bad.decode_kernels
    monkeypatch.undo()
    good = load_model(llama_dir, device="cpu", dtype="float32")
    assert good.model.decode_step is not None and "layer by layer" not in good.decode_kernels
    ids = torch.tensor([[3, 5, 7]])
    cache = KVCache(good.config.num_layers, good.config.num_kv_heads, good.config.head_dim, 8, torch.float32, "cpu")
    good.model(ids[:, :2], cache)
    stepped = good.model(ids[:, 2:], cache)[0, -1]
    assert torch.allclose(stepped, bad.model(ids)[0, -1], rtol=1e-4, atol=1e-4)  # the refused one's tokens are right


@needs_kernels
def test_a_passed_step_check_is_kept_for_the_same_weights_and_build_and_a_refusal_never(
    llama_dir, monkeypatch, tmp_path
):
    """The step's check runs once per weights, kernel build, torch and dtype: a later open of the same files takes
    the kept pass (the check does not run), other files or another dtype are checked, and a refusal is never
    kept (the next open checks again)."""

    from engine.backends import decode_step

    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path / "cache"))
    ran = []
    real = decode_step.step_disagreement
    monkeypatch.setattr(decode_step, "step_disagreement", lambda m: ran.append(1) or real(m))
    for _ in range(2):
        assert load_model(llama_dir, device="cpu", dtype="float32").model.decode_step is not None
    assert len(ran) == 1  # the second open took the kept pass
    copy = shutil.copytree(llama_dir, tmp_path / "copy")
    (copy / "model.safetensors").write_bytes((llama_dir / "model.safetensors").read_bytes())  # another time
    load_model(copy, device="cpu", dtype="float32")
    load_model(llama_dir, device="cpu", dtype="bfloat16")
    assert len(ran) == 3
    monkeypatch.setattr(decode_step, "step_disagreement", lambda m: ran.append(1) or "a refusal")
    for _ in range(2):
        assert load_model(llama_dir, device="cpu", dtype="float16").model.decode_step is None
    assert len(ran) == 5


@needs_kernels
def test_the_kernels_checks_are_kept_beside_the_library_and_checked_again_when_unreadable(tmp_path, monkeypatch):
    """A library's checks against torch run once: the verdict is kept beside it, a later process takes it (no
    check runs) and finds the same; a verdict from another torch, or one that is not JSON, is checked again."""
    import json

    library = tmp_path / K.path.name
    shutil.copy(K.path, library)
    first = kernel_verdicts.checked(library)
    kept = library.with_name(library.name + ".checked.json")
    assert json.loads(kept.read_text())["torch"] == torch.__version__
    checked = []
    real = kernel_checks.agrees
    monkeypatch.setattr(kernel_checks, "agrees", lambda k, d: checked.append(d) or real(k, d))
    again = kernel_verdicts.checked(library)
    assert not checked and again.checks() == first.checks() and again.dtypes == first.dtypes
    assert again.int4_tile_rows == first.int4_tile_rows and again.modes == first.modes
    for bad in ('{"torch": "0.0", "dtypes": []}', "not json"):
        kept.write_text(bad)
        checked.clear()
        assert kernel_verdicts.checked(library).dtypes == first.dtypes and checked


@needs_kernels
def test_the_read_stream_sums_every_value_once():
    """The bench's read roofline is a real read: the stream's sum over an awkward length equals the values' sum."""
    x = torch.rand(3 * 16384 + 77, generator=torch.Generator().manual_seed(8))
    assert abs(K.read_stream(x) - float(x.double().sum())) < 1e-4 * float(x.sum())
    with pytest.raises(ValueError):
        K.read_stream(x.double())


@needs_kernels
@pytest.mark.parametrize("mode,tiled", [("int8", False), ("int4", True)])
def test_a_few_prompt_positions_under_int8_activations_are_each_rows_decode_product(mode, tiled, kernel_variant):
    """A prefill forward of a few positions (a newcomer's between decode turns) under int8 activations takes the
    kernels' several-rows integer products: each position's output is its one-row decode product bit for bit, and
    not the bfloat16 prefill products (which dequantize every weight for a handful of rows)."""
    g = torch.Generator().manual_seed(5)
    n, k, group = 48, 128, 32
    w = torch.randn(n, k, generator=g)
    codes, scales = quantize(w, mode, group)
    layer = QuantLinear.from_codes(PreQuantized(codes, scales, mode, group, torch.float32, None))
    if tiled:
        if not kernel_variant.int4_tile_rows:
            pytest.skip("no int4 tiles in this variant")
        layer.use_tiles()
    if quantized_model.use_integer_activations(layer) == 0:
        pytest.skip(f"this variant has no integer {mode} products here")
    assert layer.activations == "int8" and layer._rows_at_once()
    x = torch.randn(1, 3, k, generator=g)
    want = torch.stack([layer(x[:, i : i + 1]).reshape(-1) for i in range(3)])  # one row each: decode's product
    assert torch.equal(layer(x).reshape(3, -1), want)
