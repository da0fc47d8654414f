"""Quantization with the reference's numbers, packing, storage, and the quantized model and cache."""

import pytest
import torch

from engine.backends import kernels
from engine.backends.quantized import QuantLinear
from engine.backends.quantized_model import weight_bytes
from engine.kv_cache import KVCache, QuantKVCache
from engine.quant import dequantize, pack_int4, quantize, quantize_with_scale, storage_bytes, unpack_int4
from engine.sampling import SamplingParams, choose
from engine.session import Request, Session
from engine.weights.loading import load_model


def test_table_30_2():
    x = torch.tensor([-1.2, -0.2, 0.7, 1.8])
    q = quantize_with_scale(x, 0.5, 7)
    assert q.tolist() == [-2, 0, 1, 4]
    x_hat = dequantize(q, torch.tensor([0.5]))
    assert x_hat.tolist() == [-1.0, 0.0, 0.5, 2.0]
    assert torch.allclose(x_hat - x, torch.tensor([0.2, 0.2, -0.2, 0.2]), atol=1e-6)
    assert ((x_hat - x).abs() <= 0.25 + 1e-6).all()


def test_outlier_clips():
    q = quantize_with_scale(torch.tensor([8.0]), 0.5, 7)  # 8 / 0.5 = 16 -> clipped to 7
    assert q.tolist() == [7]
    x_hat = dequantize(q, torch.tensor([0.5]))
    assert x_hat.tolist() == [3.5] and (x_hat - 8.0).item() == -4.5  # far beyond s/2: clipping, not rounding


def test_exercise_4_half_way_cases_round_to_even():
    q = quantize_with_scale(torch.tensor([0.75, -0.75, 5.0]), 0.5, 7)  # 1.5, -1.5, 10
    assert q.tolist() == [2, -2, 7]
    assert dequantize(q, torch.tensor([0.5])).tolist() == [1.0, -1.0, 3.5]
    assert quantize_with_scale(torch.tensor([0.25, 1.25]), 0.5, 7).tolist() == [0, 2]  # 0.5 -> 0, 2.5 -> 2


def test_four_int4_values_and_one_float32_scale_take_6_bytes():
    assert storage_bytes(4, "int4", 1) == 6
    assert storage_bytes(4, "int8", 1) == 8
    codes, scales = quantize(torch.tensor([[-1.2, -0.2, 0.7, 1.8]]), "int4", 4)
    packed = pack_int4(codes)
    assert packed.numel() * packed.element_size() + scales.numel() * scales.element_size() == 6


def test_paris_lyon_near_tie_flips_to_the_lower_index():
    logits = torch.tensor([0.6, 0.7])  # Paris, Lyon
    assert choose(logits, SamplingParams()) == 1  # Lyon
    q = dequantize(quantize_with_scale(logits, 0.5, 7), torch.tensor([0.5]))
    assert q.tolist() == [0.5, 0.5]
    assert choose(q, SamplingParams()) == 0  # the tie goes to Paris


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_error_is_at_most_half_a_step_inside_the_range_and_not_outside(mode):
    g = torch.Generator().manual_seed(0)
    qmax = {"int4": 7, "int8": 127}[mode]
    for _ in range(200):
        s = float(torch.rand(1, generator=g)) * 2 + 0.01
        inside = (torch.rand(64, generator=g) * 2 - 1) * qmax * s
        err = (dequantize(quantize_with_scale(inside, s, qmax), torch.tensor([s])) - inside).abs()
        assert (err <= s / 2 + 1e-5 * s * qmax).all()
    outside = torch.tensor([qmax * 1.0 + 3.0])  # s = 1: beyond Q·s
    err = (dequantize(quantize_with_scale(outside, 1.0, qmax), torch.tensor([1.0])) - outside).abs()
    assert err.item() == 3.0 > 0.5


def test_pack_unpack_round_trip():
    codes = torch.arange(-7, 8, dtype=torch.int8).repeat(4)[:60].view(2, 30)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 15)
    assert torch.equal(unpack_int4(packed), codes)


@pytest.mark.parametrize("mode,group", [("int8", 16), ("int8", 0), ("int4", 16), ("int4", 32), ("int4", 64)])
def test_quant_linear(mode, group):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=True)
    ql = QuantLinear(lin.weight, lin.bias, mode, group)
    expected_kernel = {("int8", 0): "int8pack", ("int4", 32): "int4pack", ("int4", 64): "int4pack"}.get((mode, group))
    if ql.decoder or (expected_kernel == "int4pack" and not hasattr(torch, "_weight_int4pack_mm_for_cpu")):
        expected_kernel = None  # kvchat's kernels serve decode and prefill: torch's packed layouts are not kept
    assert ql.kernel == expected_kernel and ql.decoder is kernels.for_mode(mode)
    g = group or 64
    codes, scales = quantize(lin.weight.detach(), mode, g)
    assert torch.equal(ql.weight_codes(), codes)  # the kernel's layout reads back to the same codes
    # an int4 kernel keeps bf16 scales: within 8 significant bits of the float32 definition
    torch.testing.assert_close(ql.scale_values(), scales, rtol=2**-8, atol=0)
    x = torch.randn(3, 5, 64)
    want = torch.nn.functional.linear(x, ql.dequantized_weight(), lin.bias)
    tol = 1e-4 if ql.kernel is None else 2e-2  # the packed kernels take bfloat16 activations
    torch.testing.assert_close(ql(x), want, rtol=tol, atol=tol)
    one = x[:1, :1]  # one row: decode, through kvchat's kernels where they are built
    tol = 1e-4 if ql.decoder is not None or ql.kernel is None else 2e-2
    torch.testing.assert_close(ql(one), want[:1, :1], rtol=tol, atol=tol)
    assert ql.storage_bytes == 48 * 64 * (8 if mode == "int8" else 4) // 8 + 48 * (64 // g) * 4
    rel = (ql.dequantized_weight() - lin.weight).norm() / lin.weight.norm()
    assert rel < (0.01 if mode == "int8" else 0.15)


def test_a_quantized_load_swaps_block_linears_and_the_head_and_counts_bytes(llama_dir):
    loaded = load_model(llama_dir, weights="int4", group_size=16)
    m, cfg = loaded.model, loaded.config
    blocks = [q for q in m.layers.modules() if isinstance(q, QuantLinear)]
    assert len(blocks) == 4 * cfg.num_layers and {q.mode for q in blocks} == {"int4"}  # qkv, o, gate_up, down
    heads = [m.embed.table, m.lm_head]  # untied: the embedding and the output head, each int8
    assert all(isinstance(h, QuantLinear) and (h.mode, h.group_size) == ("int8", 16) for h in heads)
    full = load_model(llama_dir)
    assert weight_bytes(full.model) == sum(p.numel() * 4 for p in full.model.parameters())
    vd = cfg.vocab_size * cfg.hidden_size
    fp32 = sum(q.out_features * q.in_features * 4 for q in blocks) + 2 * vd * 4
    packed = sum(q.out_features * q.in_features // 2 + q.out_features * q.in_features // 16 * 4 for q in blocks)
    packed += 2 * (vd + vd // 16 * 4)  # int8 codes + a float32 scale per 16
    assert weight_bytes(loaded.model) == weight_bytes(full.model) - fp32 + packed
    assert loaded.parameter_count == full.parameter_count  # codes count as the values they stand for
    assert loaded.fingerprint["quantization"] == "int4/g16" and full.fingerprint["quantization"] == "none"
    assert loaded.head_quantization == "int8/g16" and full.head_quantization == "none"
    assert load_model(llama_dir, weights="int8", group_size=0).facts()["head_weights"] == "int8/per-channel"


@pytest.mark.parametrize("tie", [False, True])
def test_quantized_embedding_and_head_follow_the_definition(tmp_path, monkeypatch, tie):
    """Read a few rows at a time (the loader's row source), the codes are the definition's codes of the
    whole matrix; a lookup is s · q of its rows; the head's logits are x · (s · q)ᵀ; a tied matrix is
    stored once."""
    from checkpoints import make_checkpoint
    from engine.weights.safetensors import Reader

    monkeypatch.setattr(Reader, "ROWS_PER_CHUNK", 100)  # 384 rows: four chunks, the last one short
    d = make_checkpoint(tmp_path, "llama", tie=tie)
    full, q = load_model(d), load_model(d, weights="int8", group_size=32)
    table = q.model.embed.table
    codes, scales = quantize(full.model.embed.weight, "int8", 32)
    assert torch.equal(table.weight_codes(), codes) and torch.equal(table.scale_values(), scales)
    ids = torch.tensor([[3, 0, 383, 3]])
    torch.testing.assert_close(q.model.embed(ids), dequantize(codes, scales)[ids], rtol=0, atol=0)
    head = q.model.lm_head  # always a module: the embedding's own table when tied
    assert (head is table) == tie and head.mode == "int8"
    w = dequantize(*quantize(full.model.lm_head.weight, "int8", 32))  # [V, D]
    x = torch.randn(1, 1, 64)
    torch.testing.assert_close(
        q.model.lm_head(q.model.norm(x)), torch.nn.functional.linear(q.model.norm(x), w), rtol=1e-5, atol=1e-5
    )
    vd = full.config.vocab_size * 64
    heads_fp32, heads_int8 = (1 if tie else 2) * vd * 4, (1 if tie else 2) * (vd + vd // 32 * 4)
    blocks = [m for m in q.model.layers.modules() if isinstance(m, QuantLinear)]
    blocks_fp32 = sum(m.out_features * m.in_features * 4 for m in blocks)
    assert (
        weight_bytes(q.model)
        == weight_bytes(full.model) - blocks_fp32 - heads_fp32 + sum(m.storage_bytes for m in blocks) + heads_int8
    )


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_many_rows_dequantize_a_slice_of_the_weight_at_a_time(monkeypatch, mode):
    """Prefill through a large matrix (an output head) never dequantizes it whole: the outputs are
    filled a slice at a time, and equal the whole product."""
    import engine.backends.quantized as quant

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 200, bias=True)
    ql = QuantLinear(lin.weight, lin.bias, mode, 16)
    x = torch.randn(2, 7, 64)
    want = ql(x)
    monkeypatch.setattr(quant, "SCRATCH_VALUES", 64 * 30)  # 30 rows at a time: seven slices
    spans, rows = [], QuantLinear._float_rows
    monkeypatch.setattr(QuantLinear, "_float_rows", lambda self, a, b, dt: spans.append((a, b)) or rows(self, a, b, dt))
    torch.testing.assert_close(ql(x), want, rtol=1e-6, atol=1e-6)
    assert spans == [(a, min(a + 30, 200)) for a in range(0, 200, 30)]
    torch.testing.assert_close(
        want, torch.nn.functional.linear(x, ql.dequantized_weight(), lin.bias), rtol=1e-4, atol=1e-4
    )


def test_quantized_kv_cache_bytes_count_the_scales():
    c = QuantKVCache(2, 2, 4, 16, torch.float32, "cpu", "int4")
    k = torch.randn(1, 2, 8, 4)
    for layer in range(2):
        c.write(layer, 0, k, k)
    c.length = 8
    per_position = 2 * 2 * 2 * (4 * 4 // 8 + 4)  # K+V, layers, heads, (packed codes + float32 scale)
    assert c.bytes_per_position == per_position == 48
    assert c.payload_bytes == 8 * 48
    assert c.allocated_bytes == 16 * 48
    c8 = QuantKVCache(2, 2, 4, 16, torch.float32, "cpu", "int8")
    assert c8.bytes_per_position == 2 * 2 * 2 * (4 + 4)
    # the float16 cache of Table 30.1 for comparison: 64 bytes per position, no scales
    assert KVCache(2, 2, 4, 16, torch.float16, "cpu").bytes_per_position == 64


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_quantized_cache_chunked_equals_token_by_token(llama_dir, kv):
    loaded = load_model(llama_dir)
    prompt = tuple(range(5, 40))
    a = list(
        Session(loaded, capacity=128, prefill_chunk=5, kv=kv).generate(Request(prompt_ids=prompt, max_new_tokens=10))
    )[-1]
    b = list(
        Session(loaded, capacity=128, prefill_chunk=1, kv=kv).generate(Request(prompt_ids=prompt, max_new_tokens=10))
    )[-1]
    assert a.token_ids == b.token_ids and a.cache["positions"] == len(prompt) + 9
    cfg = loaded.config
    per = 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim * (8 if kv == "int8" else 4) // 8 + 4)
    assert a.cache["payload_bytes"] == a.cache["positions"] * per


def test_int8_kv_stays_close_to_full_precision(llama_dir):
    loaded = load_model(llama_dir)
    cfg = loaded.config
    ids = torch.arange(5, 30).view(1, -1)
    full = loaded.model(ids, KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, torch.float32, "cpu"))
    q = loaded.model(
        ids, QuantKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 64, torch.float32, "cpu", "int8")
    )
    assert (full - q).abs().max() < 0.05 * full.abs().max()


def test_precision_change_invalidates_the_cache_with_its_reason(llama_dir):
    loaded = load_model(llama_dir)
    s = Session(loaded, capacity=128)
    list(s.generate(Request(prompt_ids=tuple(range(5, 20)), max_new_tokens=3)))
    s.set_model(loaded, kv="int8")
    start = list(s.generate(Request(prompt_ids=tuple(range(5, 20)), max_new_tokens=3)))[0]
    assert start.reuse.reused == 0 and "KV cache precision changed (none → int8)" in start.reuse.reason
    s.set_model(load_model(llama_dir, weights="int8", group_size=16))
    start = list(s.generate(Request(prompt_ids=tuple(range(5, 20)), max_new_tokens=3)))[0]
    assert "weight precision changed (none → int8/g16)" in start.reuse.reason
