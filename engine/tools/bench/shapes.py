"""The shapes the benchmark measures (real models' configs, random weights) and the random-weight checkpoint it
writes for one, loaded through the normal path so load time is measured too."""

from __future__ import annotations

import json
from pathlib import Path

# The tiny shape every tool and test starts from (random weights, a few layers); `tiny(...)` varies it.
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def tiny(model_type: str = "llama", **over) -> dict:
    """The tiny shape as `model_type` (its architectures named), with `over` replacing keys."""
    return {**TINY, "model_type": model_type, "architectures": [ARCHITECTURES[model_type]], **over}


SHAPES = {
    "tiny": tiny(),  # for tests
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    # Qwen3-30B-A3B's kind scaled down to 2 cores and 24 GB: 64 experts, 4 routed per token (1/16 as there),
    # ~0.4 B parameters of which ~45 M active
    "qwen3-moe-small": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 768,
        "intermediate_size": 2048,
        "moe_intermediate_size": 256,
        "num_experts": 64,
        "num_experts_per_tok": 4,
        "norm_topk_prob": True,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    # a size people run: fixed costs (tokenizer, code, prefill buffers) are a small share of its memory
    "qwen2.5-1.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    },
    # the size a 24 GiB card is bought for: its memory plan (selftest --fake), no benchmark on 2 cores
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
    },
}


def write_random_checkpoint(out: Path, shape, seed: int = 0, std: float = 0.02) -> Path:
    """A checkpoint of `shape` (a name in SHAPES, or a config dict) with random weights and a
    word-level tokenizer covering its vocabulary."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    from ...config import config_from_dict
    from ...model import Transformer
    from ...weights.hf_names import hf_state_dict

    raw = dict(SHAPES[shape] if isinstance(shape, str) else shape, hidden_act="silu", torch_dtype="float32")
    cfg = config_from_dict(raw)
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = Transformer(cfg)
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=std)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model)
    tensors.pop("lm_head.weight", None) if cfg.tie_word_embeddings else None
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw))
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # "t5 t9" -> ids 5, 9
    tok.save(str(out / "tokenizer.json"))
    # a chat template, so the app can drive it too (python -m desktop.tools.seam_bench)
    template = "{% for m in messages %}t1 {{ m['content'] }} t2 {% endfor %}{% if add_generation_prompt %}t3{% endif %}"
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return out


def random_prompt(n: int, vocab: int) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(1234)
    return torch.randint(10, vocab, (n,), generator=g).tolist()
