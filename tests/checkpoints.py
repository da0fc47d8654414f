"""Tiny random-weight checkpoints in the Hugging Face layout, written by transformers (the reference).

transformers is a test dependency only: it writes the checkpoints and computes the reference
logits; the engine loads them with its own code.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.tools.bench.shapes import TINY

SPECIAL_TOKENS = [
    "<s>",
    "</s>",
    "<unk>",
    "<|im_start|>",
    "<|im_end|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<|user|>",
    "<|assistant|>",
    "<|system|>",
]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
    " + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXT = [
    "I am planning a trip to Chengdu. My budget is 600 yuan. Actually, make it 750 yuan.",
    "The quick brown fox jumps over the lazy dog. Hello world! How are you today?",
    "Café, naïve, façade, résumé, Zürich, São Paulo, Kraków, Ελληνικά, Русский.",
    "成都的预算是六百元。我们去北京和上海旅行。日本語のテキストも少し。한국어 문장.",
    "Emoji: 😀 🎉 👍🏽 🇨🇳 ❤️ 🚄 and numbers 0123456789 with code: def f(x): return x * 2",
] * 20

# one tiny checkpoint per family beyond the Llama shape, its windows shorter than the tests' prompts
FAMILY_CASES = {
    "gemma2": dict(
        family="gemma2", tie=True, sliding_window=6, attn_logit_softcapping=50.0, final_logit_softcapping=30.0
    ),
    "gemma3": dict(
        family="gemma3",
        tie=True,
        num_hidden_layers=3,
        sliding_window=6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
    "phi3": dict(family="phi3", partial_rotary_factor=0.75),
    "smollm3": dict(family="smollm3", num_hidden_layers=4, tie=True),  # llama.cpp: every 4th layer unrotated
    "granite": dict(
        family="granite",
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078,
        logits_scaling=8.0,
    ),
    "olmo2": dict(family="olmo2"),
    "qwen3_moe": dict(
        family="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True
    ),
    "mixtral": dict(family="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(  # sinks, a window on every other layer, yarn, biased experts with the clamped SwiGLU
        family="gpt_oss",
        head_dim=16,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=6,
        rope={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 16,
            "rope_theta": 150000.0,
        },  # fmt: skip
    ),
    "lfm2": dict(  # a hybrid: short convolutions on most layers, attention on some (LFM2's shape in small)
        family="lfm2",
        tie=True,
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        norm_eps=1e-6,
        conv_L_cache=3,
    ),
    "granitemoehybrid": dict(  # Granite 4.0-H-Micro's shape in small: Mamba-2 on most layers, unrotated attention
        family="granitemoehybrid",
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        num_local_experts=0,
        shared_intermediate_size=96,
        mamba_n_heads=4,
        mamba_d_state=16,
        mamba_n_groups=2,
        mamba_d_conv=4,
        mamba_expand=2,
        position_embedding_type="nope",
        embedding_multiplier=6.0,
        residual_multiplier=0.5,
        attention_multiplier=0.1,
        logits_scaling=2.0,
    ),
    "qwen3_next": dict(  # Qwen3-Next's shape in small: DeltaNet on three of four layers, gated attention, experts
        family="qwen3_next",
        num_hidden_layers=4,
        head_dim=16,
        linear_num_key_heads=2,  # each query/key head serving two value heads
        linear_num_value_heads=4,
        linear_key_head_dim=12,  # equal, as llama.cpp's qwen3next wants them; a state small enough for a snapshot
        linear_value_head_dim=12,  # every 16 positions
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    "deepseek_v2": dict(  # DeepSeek-V2-Lite's shape in small: latent attention, one dense layer, shared experts
        family="deepseek_v2",
        num_hidden_layers=3,
        num_key_value_heads=4,  # MLA's heads are all the query's (transformers repeats K/V by H / H_kv)
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        n_shared_experts=2,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    ),
    "deepseek_v3": dict(  # V3's in small: the queries' low rank, sigmoid routing by groups with its correction bias
        family="deepseek_v3",
        num_hidden_layers=3,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        rope={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 16,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },  # fmt: skip
    ),
}

_TOKENIZER_CACHE: dict[int, str] = {}


def tokenizer_json(vocab_size: int = 384) -> str:
    """A byte-level BPE trained on a few mixed-script lines, with the special tokens of several chat formats."""
    if vocab_size not in _TOKENIZER_CACHE:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(TEXT, trainer)
        _TOKENIZER_CACHE[vocab_size] = tok.to_str()
    return _TOKENIZER_CACHE[vocab_size]


FAMILIES = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gemma2": "Gemma2Config",
    "gemma3": "Gemma3TextConfig",
    "phi3": "Phi3Config",
    "smollm3": "SmolLM3Config",
    "granite": "GraniteConfig",
    "olmo2": "Olmo2Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
    "gpt_oss": "GptOssConfig",
    "deepseek_v2": "DeepseekV2Config",
    "deepseek_v3": "DeepseekV3Config",
    "lfm2": "Lfm2Config",
    "granitemoehybrid": "GraniteMoeHybridConfig",
    "qwen3_next": "Qwen3NextConfig",
}


def make_checkpoint(
    out: Path,
    family: str = "llama",
    *,
    seed: int = 0,
    tie: bool = False,
    config_style: str = "native",
    chat_template: str = CHATML,
    shards: bool = False,
    generation_eos=None,
    **overrides,
) -> Path:
    """Write a tiny random `family` checkpoint to `out` (transformers' save_pretrained) and return it.

    config_style "v4" rewrites config.json in the transformers 4.x form (rope_theta, rope_scaling).
    """
    import torch
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok_str = tokenizer_json()
    (out / "tokenizer.json").write_text(tok_str)
    vocab = Tokenizer.from_str(tok_str).get_vocab_size()
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    kw = dict(
        vocab_size=vocab,
        **{k: TINY[k] for k in sizes},  # the tools' tiny shape (engine/tools/bench/shapes.py)
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=0,
        eos_token_id=1,
        rms_norm_eps=1e-6,
        pad_token_id=None,  # some families default to an id past the tiny vocabulary
    )
    if family in ("qwen3", "qwen3_moe"):
        kw["head_dim"] = 32  # Qwen3 sets head_dim apart from hidden / heads
    if family in ("gemma2", "gemma3"):
        kw.update(head_dim=16, query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh")
    rope = overrides.pop("rope", None)  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    kw.update(overrides)
    cfg = getattr(transformers, FAMILIES[family])(**kw)
    if rope is not None:
        params = {"rope_theta": kw.get("rope_theta", 10000.0), **rope}
        if hasattr(cfg, "rope_parameters"):
            cfg.rope_parameters = params
        else:
            cfg.rope_scaling = rope
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights so logits differ visibly between tokens
        for p in model.parameters():
            if p.dim() in (2, 3):  # 3: a mixture's experts, stacked
                p.normal_(0, 0.08)
            elif p.dim() == 1:
                p.uniform_(0.5, 1.5) if p.shape[0] in (kw["hidden_size"], kw.get("head_dim", 16)) else p.normal_(0, 0.1)
        if family == "qwen3_next":  # its norms scale by 1 + w, w near 0 as trained (its DeltaNet's own by w)
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5) if "linear_attn" in name else p.uniform_(-0.5, 0.5)
                elif name.endswith("A_log"):  # as transformers initialises it: A from 1 to 16, the step's bias 1
                    p.uniform_(1, 16).log_()
                elif name.endswith("dt_bias"):
                    p.fill_(1.0)
                elif name.endswith("conv1d.weight"):  # [C, 1, K]: as large as torch's own init for a width of K
                    p.normal_(0, 0.5)
        for name, b in model.named_buffers():  # DeepSeek-V3's router correction: a bias the choice must follow
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.3, 0.3)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="40KB" if shards else "5GB")
    raw = json.loads((out / "config.json").read_text())
    if config_style == "v4":
        params = raw.pop("rope_parameters", None) or {}
        raw["rope_theta"] = params.pop("rope_theta", 10000.0)
        params.pop("rope_type", None) if params.get("rope_type") == "default" else None
        raw["rope_scaling"] = params or None
        (out / "config.json").write_text(json.dumps(raw))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": chat_template,
            }
        )
    )
    if generation_eos is not None:
        (out / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    elif (out / "generation_config.json").exists():
        (out / "generation_config.json").unlink()
    return out
