"""A GGUF file's metadata in config.json's terms: the sizes, the rotary scaling, and each architecture's own keys
(Gemma's windows and caps, Phi-3's longrope factors, Granite's scales, the mixtures' experts, DeepSeek's latent
attention and router, the hybrids' state layers), as llama.cpp's converter writes them; engine.config then checks
and reads them as it reads a folder's."""

from __future__ import annotations

import numpy as np

from ..errors import ModelLoadError

ARCHITECTURES = {  # a GGUF's general.architecture -> config.json's (a "llama" file with experts is a Mixtral)
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2vl": "Qwen2_5_VLForConditionalGeneration",  # Qwen2.5-VL's text model: Qwen2 with multimodal rotary positions
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",  # V3 where its router is a sigmoid (config_dict)
    "lfm2": "Lfm2ForCausalLM",
    "granitehybrid": "GraniteMoeHybridForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}


def config_dict(model) -> dict:
    """The model's config in config.json's terms, from the metadata (sizes checked by engine.config)."""
    heads = model.arch_value("attention.head_count")
    hidden = model.arch_value("embedding_length")
    tokens = model.meta("tokenizer.ggml.tokens")
    vocab = model.arch_value("vocab_size") or (len(tokens) if tokens is not None else None)
    head_dim = model.arch_value("attention.key_length") or (hidden // heads if hidden and heads else None)
    experts = model.arch_value("expert_count", 0)
    arch = "MixtralForCausalLM" if model.arch == "llama" and experts else ARCHITECTURES[model.arch]
    raw = {
        "architectures": [arch],
        "model_type": model.arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": model.arch_value("feed_forward_length"),
        "num_hidden_layers": model.arch_value("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _kv_heads(model, heads),
        "head_dim": head_dim,
        "max_position_embeddings": model.arch_value("context_length", 4096),
        "rms_norm_eps": model.arch_value("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": model.arch_value("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "attention_bias": "blk.0.attn_q.bias" in model.tensors and model.arch not in ("qwen2", "qwen2vl"),
        "bos_token_id": model.meta("tokenizer.ggml.bos_token_id"),
        "eos_token_id": model.meta("tokenizer.ggml.eos_token_id"),
        "hidden_act": "silu",
    }
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if raw[key] is None:
            raise ModelLoadError(f"the GGUF metadata lacks {key} ({model.arch}.*)", model.path)
    scaling = model.arch_value("rope.scaling.type")
    if scaling == "linear":
        raw["rope_scaling"] = {"type": "linear", "factor": model.arch_value("rope.scaling.factor", 1.0)}
    elif scaling == "yarn":  # the ramp's ends as the model was trained: gpt-oss's untruncated
        raw["rope_scaling"] = {
            "type": "yarn",
            "factor": model.arch_value("rope.scaling.factor", 1.0),
            "original_max_position_embeddings": model.arch_value("rope.scaling.original_context_length"),
            "beta_fast": model.arch_value("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": model.arch_value("rope.scaling.yarn_beta_slow", 1.0),
            "truncate": model.arch != "gpt-oss",
        }
    elif scaling not in (None, "none"):
        raise ModelLoadError(f"rope scaling {scaling!r} is not supported (supported: none, linear, yarn)", model.path)
    rope_dims = model.arch_value("rope.dimension_count")
    # (Qwen3-Next's config rotates a quarter unless it says: the file's count is always said)
    if rope_dims is not None and model.arch != "deepseek2" and (rope_dims != head_dim or model.arch == "qwen3next"):
        if model.arch not in ("phi3", "qwen3next"):
            raise ModelLoadError(f"partial rotary embeddings ({rope_dims} of {head_dim}) are not supported", model.path)
        raw["partial_rotary_factor"] = rope_dims / head_dim
    raw.update(_family_dict(model, raw, experts))
    return raw


def _family_dict(model, raw: dict, experts: int) -> dict:
    """config.json's family fields, from the metadata llama.cpp's converter writes for each architecture (and
    llama.cpp's own rules where it writes none: Gemma's query scaling and window pattern, SmolLM3's unrotated
    layers)."""
    out: dict = {}
    layers = raw["num_hidden_layers"]
    window = model.arch_value("attention.sliding_window")
    if window:
        out["sliding_window"] = window
        out["use_sliding_window"] = True
    if model.arch in ("gemma2", "gemma3"):
        big = layers == (46 if model.arch == "gemma2" else 62)  # the 27B: scaled by the hidden size per head
        out.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=raw["hidden_size"] // raw["num_attention_heads"] if big else raw["head_dim"],
            attn_logit_softcapping=model.arch_value("attn_logit_softcapping"),
            final_logit_softcapping=model.arch_value("final_logit_softcapping"),
        )
        pattern = model.arch_value("attention.sliding_window_pattern")
        if isinstance(pattern, np.ndarray):  # one flag per layer
            out["layer_types"] = ["sliding_attention" if v else "full_attention" for v in pattern.tolist()]
        else:
            out["sliding_window_pattern"] = int(pattern or (2 if model.arch == "gemma2" else 6))
        if model.arch == "gemma3":
            out["rope_local_base_freq"] = 10000.0  # llama.cpp's, for the sliding layers
    elif model.arch == "phi3":
        short, long = model.tensors.get("rope_factors_short.weight"), model.tensors.get("rope_factors_long.weight")
        original = model.arch_value("rope.scaling.original_context_length")
        if short is not None and long is not None:
            out["rope_scaling"] = {
                "type": "longrope",
                "short_factor": model.float_rows(short).reshape(-1).tolist(),
                "long_factor": model.float_rows(long).reshape(-1).tolist(),
                "original_max_position_embeddings": original or raw["max_position_embeddings"],
                "attention_factor": model.arch_value("rope.scaling.attn_factor"),
            }
    elif model.arch == "granitehybrid":
        out.update(_granite_hybrid_dict(model, raw, experts))
    elif model.arch == "qwen3next":
        out.update(_qwen3_next_dict(model, raw, experts))
    elif model.arch == "granite":
        out.update(
            embedding_multiplier=model.arch_value("embedding_scale", 1.0),
            residual_multiplier=model.arch_value("residual_scale", 1.0),
            attention_multiplier=model.arch_value("attention.scale", 1.0),
            logits_scaling=model.arch_value("logit_scale", 1.0),
        )
    elif model.arch == "smollm3":
        out["no_rope_layer_interval"] = 4  # llama.cpp's: every 4th layer unrotated
    elif model.arch == "deepseek2":
        out.update(_deepseek_dict(model, raw, experts))
    elif model.arch == "lfm2":  # a layer of no K/V heads is a short convolution
        per = model.arch_value("attention.head_count_kv")
        per = [int(v) for v in per] if isinstance(per, np.ndarray) else [per] * raw["num_hidden_layers"]
        out.update(layer_types=["conv" if not v else "full_attention" for v in per],
                   conv_L_cache=model.arch_value("shortconv.l_cache", 3), block_auto_adjust_ff_dim=False)  # fmt: skip
    elif model.arch == "qwen2vl":  # the frequencies each of a position's t, h, w rotates (a 4th, unused, last)
        sections = model.arch_value("rope.dimension_sections")
        sections = [int(v) for v in sections][:3] if isinstance(sections, np.ndarray) else sections
        out["rope_scaling"] = {"type": "mrope", "mrope_section": sections, "rope_theta": raw["rope_theta"]}
    if experts:
        out.update(
            num_experts=experts,
            num_local_experts=experts,
            num_experts_per_tok=model.arch_value("expert_used_count"),
            moe_intermediate_size=model.arch_value("expert_feed_forward_length") or raw["intermediate_size"],
            norm_topk_prob=bool(model.arch_value("expert_weights_norm", True)),
        )
    return out


def _granite_hybrid_dict(model, raw: dict, experts: int) -> dict:
    """Granite 4.0-H from llama.cpp's granitehybrid keys: a layer of no K/V heads is a Mamba-2 mixer (its widths under
    ssm.*: the heads are the time-step rank, the inner width I = heads · head width), Granite's scales, the shared
    MLP's width, rotation only where the file says the model was trained with it."""
    per = model.arch_value("attention.head_count_kv")
    per = [int(v) for v in per] if isinstance(per, np.ndarray) else [per] * raw["num_hidden_layers"]
    heads, inner = model.arch_value("ssm.time_step_rank"), model.arch_value("ssm.inner_size")
    hidden = raw["hidden_size"]
    first = next((i for i, v in enumerate(per) if not v), 0)
    out = {
        "layer_types": ["attention" if v else "mamba" for v in per],
        "embedding_multiplier": model.arch_value("embedding_scale", 1.0),
        "residual_multiplier": model.arch_value("residual_scale", 1.0),
        "attention_multiplier": model.arch_value("attention.scale", 1.0),
        "logits_scaling": model.arch_value("logit_scale", 1.0),
        "position_embedding_type": "rope" if model.arch_value("rope.scaling.finetuned") else "nope",
        "mamba_n_heads": heads,
        "mamba_d_head": inner // heads if inner and heads else None,
        "mamba_expand": inner / hidden if inner and hidden else None,
        "mamba_d_state": model.arch_value("ssm.state_size"),
        "mamba_n_groups": model.arch_value("ssm.group_count", 1),
        "mamba_d_conv": model.arch_value("ssm.conv_kernel"),
        "mamba_conv_bias": f"blk.{first}.ssm_conv1d.bias" in model.tensors,
        "shared_intermediate_size": model.arch_value("expert_shared_feed_forward_length") or raw["intermediate_size"],
        "num_local_experts": experts,
    }
    if experts:
        out["intermediate_size"] = model.arch_value("expert_feed_forward_length") or raw["intermediate_size"]
    return out


def _qwen3_next_dict(model, raw: dict, experts: int) -> dict:
    """Qwen3-Next from llama.cpp's qwen3next keys: attention every full_attention_interval-th layer, the DeltaNet's
    widths under ssm.* (the key heads are the group count, the value heads the time-step rank, d_k the state size,
    the inner width H_v · d_v), the shared expert's width; a layer without a router is a dense MLP."""
    layers, every = raw["num_hidden_layers"], model.arch_value("full_attention_interval", 4)
    value_heads, inner = model.arch_value("ssm.time_step_rank"), model.arch_value("ssm.inner_size")
    out = {
        "full_attention_interval": every,
        "linear_num_key_heads": model.arch_value("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": model.arch_value("ssm.state_size"),
        "linear_value_head_dim": inner // value_heads if inner and value_heads else None,
        "linear_conv_kernel_dim": model.arch_value("ssm.conv_kernel"),
        "shared_expert_intermediate_size": model.arch_value("expert_shared_feed_forward_length", 0),
        "mlp_only_layers": [i for i in range(layers or 0) if f"blk.{i}.ffn_gate_inp.weight" not in model.tensors],
    }
    return out


def _deepseek_dict(model, raw: dict, experts: int) -> dict:
    """DeepSeek-V2/V3's latent attention and router from llama.cpp's deepseek2 keys: the key length is the
    latent's and the rotary key's (d_c + d_r), key_length_mla a head's (d_n + d_r); a sigmoid router is V3's.
    YaRN's mscale comes as 0.1 · mscale_all_dim (taken for both mscales: their ratio, the cos/sin factor, 1)."""
    rope = model.arch_value("rope.dimension_count")
    sigmoid = model.arch_value("expert_gating_func") == 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
    groups = model.arch_value("expert_group_count")
    out = {
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "kv_lora_rank": model.arch_value("attention.kv_lora_rank"),
        "q_lora_rank": model.arch_value("attention.q_lora_rank"),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": (model.arch_value("attention.key_length_mla") or 0) - (rope or 0),
        "v_head_dim": model.arch_value("attention.value_length_mla"),
        "n_routed_experts": experts,
        "n_shared_experts": model.arch_value("expert_shared_count", 0),
        "first_k_dense_replace": model.arch_value("leading_dense_block_count", 0),
        "routed_scaling_factor": model.arch_value("expert_weights_scale", 1.0),
        "norm_topk_prob": bool(model.arch_value("expert_weights_norm", False)),
        "rope_interleave": True,  # llama.cpp rotates its pairs adjacent (LLAMA_ROPE_TYPE_NORM)
    }
    if groups:
        out.update(n_group=groups, topk_group=model.arch_value("expert_group_used_count", groups))
        out["topk_method"] = "noaux_tc" if sigmoid else "group_limited_greedy"
    scaling = raw.get("rope_scaling")
    log_mul = model.arch_value("rope.scaling.yarn_log_multiplier")
    if isinstance(scaling, dict) and log_mul:
        scaling.update(mscale=log_mul / 0.1, mscale_all_dim=log_mul / 0.1)
    return out


def _kv_heads(model, heads):
    """The K/V heads: one count, or the most of a count per layer (LFM2: 0 on its convolution layers)."""
    per = model.arch_value("attention.head_count_kv", heads)
    return int(per.max()) if isinstance(per, np.ndarray) and per.size else per
