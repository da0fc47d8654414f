"""Logits parity with transformers (the reference) for every supported architecture and option."""

import pytest
import torch

from checkpoints import FAMILY_CASES, make_checkpoint
from engine.kv_cache import make_cache
from engine.weights.loading import load_model

transformers = pytest.importorskip("transformers")

CASES = {
    "llama": dict(family="llama"),
    "llama-tied": dict(family="llama", tie=True),
    "llama-v4-config": dict(family="llama", config_style="v4"),
    "llama3-rope": dict(
        family="llama",
        rope={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "llama3-rope-v4-config": dict(
        family="llama",
        config_style="v4",
        rope={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "linear-rope": dict(family="llama", rope={"rope_type": "linear", "factor": 2.0}),
    "yarn-rope": dict(
        family="llama", rope={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    ),
    "llama-attention-bias": dict(family="llama", attention_bias=True),
    "mistral": dict(family="mistral", sliding_window=None),
    "mistral-sliding-window": dict(family="mistral", sliding_window=8),
    "qwen2": dict(family="qwen2", tie=True),
    "qwen3": dict(family="qwen3"),
    "qwen3-untied-mha": dict(family="qwen3", num_key_value_heads=4),
    "sharded": dict(family="llama", shards=True),
    **FAMILY_CASES,  # the families beyond the Llama shape (engine/MODELS.md, "Model families")
    "phi4-mini-partial-longrope": dict(
        family="phi3",
        partial_rotary_factor=0.75,
        rope={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.1, 1.3, 1.5, 2.0, 3.0],
            "long_factor": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
            "original_max_position_embeddings": 64,
        },
    ),
    "smollm3-no-rope-every-2nd-layer": dict(family="smollm3", no_rope_layer_interval=2, tie=True),
    "qwen3-moe-dense-layer": dict(
        family="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        mlp_only_layers=[1],
    ),
    "qwen3-moe-unnormalised": dict(
        family="qwen3_moe", num_experts=4, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False
    ),
    "granite-4.0-h-moe": dict(  # Granite 4.0-H-Tiny's shape in small: experts beside the shared MLP, rotated attention
        family="granitemoehybrid",
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=32,
        shared_intermediate_size=48,
        mamba_n_heads=4,
        mamba_d_state=16,
        mamba_n_groups=1,
        position_embedding_type="rope",
        residual_multiplier=0.5,
    ),
    "qwen3-next-dense-layer": dict(FAMILY_CASES["qwen3_next"], mlp_only_layers=[2]),  # an MLP without experts
    "mixtral-sliding-window": dict(family="mixtral", num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_and_20_decode_steps_match_transformers(tmp_path, name, kernel_variant):
    opts = dict(CASES[name])
    path = make_checkpoint(tmp_path, opts.pop("family"), **opts)
    if name == "sharded":
        assert (path / "model.safetensors.index.json").is_file()
    ours = load_model(path, device="cpu", dtype="float32")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(5, ours.config.vocab_size, (1, 12), generator=g)
    cfg = ours.config
    cache = make_cache(cfg, 64, torch.float32, "cpu")
    with torch.no_grad():
        ids = prompt
        mine = ours.model(prompt, cache)  # [1, 12, V]
        want = ref(prompt).logits
        torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-4)
        for _ in range(20):
            nxt = want[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            mine = ours.model(nxt, cache)  # one new position against the cache
            want = ref(ids).logits
            torch.testing.assert_close(mine[:, -1], want[:, -1], rtol=1e-4, atol=1e-4)
    assert cache.length == 32


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_close_to_transformers(tmp_path, dtype):
    path = make_checkpoint(tmp_path, "qwen2")
    ours = load_model(path, device="cpu", dtype=dtype)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    ids = torch.arange(3, 19).view(1, -1)
    cfg = ours.config
    cache = make_cache(cfg, 32, getattr(torch, dtype), "cpu")
    with torch.no_grad():
        a, b = ours.model(ids[:, :-1], cache).float(), ref(ids).logits.float()  # prefill: many rows
        last = ours.model(ids[:, -1:], cache).float()  # decode: one row (another kernel)
    assert ours.model.embed.weight.dtype == getattr(torch, dtype)
    a = torch.cat([a, last], dim=1)
    assert (a - b).abs().max() < 0.1
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9
