"""The text model's config inside a multimodal checkpoint's config.json (Gemma 3 4B+, SmolVLM / Idefics3,
Qwen2.5-VL): its text_config (or, in Qwen2.5-VL's 4.x files, the fields at the root) with the outer ids, as the
config of a text model of its family (engine.config reads it)."""

from __future__ import annotations

from pathlib import Path

from .errors import ModelLoadError

# Gemma3TextConfig's defaults: a Gemma 3 4B+ config.json's text_config gives only what departs from them
GEMMA3_TEXT = {
    "vocab_size": 262208,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
}


def text_config_of(raw: dict, arch: str | None, path: Path | None = None) -> dict:
    """config.json as its text model's config: unchanged for a text-only architecture."""
    if arch == "Gemma3ForConditionalGeneration":  # the text model's config, under text_config
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ModelLoadError("config.json lacks the text model's text_config", path)
        ids = {k: raw[k] for k in ("bos_token_id", "eos_token_id") if k in raw}
        raw = {**GEMMA3_TEXT, **ids, **text, "architectures": [arch]}
    elif arch == "Qwen2_5_VLForConditionalGeneration":  # transformers 5's text_config, or 4.x's fields at the root
        text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
        raw = {**{k: raw[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in raw}, **text,
               "architectures": [arch]}  # fmt: skip
    elif arch in ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"):
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ModelLoadError("config.json lacks the text model's text_config", path)
        outer = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in raw}
        raw = {**outer, **text, "architectures": [arch]}
    return raw
