"""How each family departs from the Llama shape in its config.json: the ModelConfig fields of Gemma's sandwich and
windows, SmolLM3's unrotated layers, Granite's scales, OLMo 2's post-norms, the mixtures' dense layers, gpt-oss's
sinks, alternating windows and clamped, biased experts, DeepSeek's latent attention and routers, and the hybrids'
state layers (engine/MODELS.md, "Model families")."""

from __future__ import annotations

from .errors import ModelLoadError
from .rope_config import rope_params
from .rotary import yarn_mscale


def layer_types(raw: dict, layers: int, default) -> tuple[str, ...]:
    """Per layer, "sliding" or "full": config.json's layer_types, else `default(i)` (a family's own pattern)."""
    given = raw.get("layer_types")
    if given is None:
        return tuple("sliding" if default(i) else "full" for i in range(layers))
    if not isinstance(given, list) or len(given) != layers:
        raise ModelLoadError(f"config.json's layer_types must name each of the {layers} layers")
    kinds = {"sliding_attention": "sliding", "full_attention": "full"}
    if any(t not in kinds for t in given):
        raise ModelLoadError(f"config.json's layer_types holds a kind kvchat does not run: {sorted(set(given))}")
    return tuple(kinds[t] for t in given)


def family_fields(family: str, raw: dict, layers: int, hidden: int, window) -> dict:
    """The ModelConfig fields by which `family` departs from the Llama shape, from its config.json."""
    out: dict = {}
    if family in ("gemma2", "gemma3"):
        out.update(
            norm_offset=1.0,
            norm_placement="sandwich",
            embed_scale=hidden**0.5,
            attention_scale=float(raw.get("query_pre_attn_scalar") or 256) ** -0.5,
            attn_softcap=raw.get("attn_logit_softcapping"),
            final_softcap=raw.get("final_logit_softcapping"),
        )
        pattern = int(raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6)
        slides = (lambda i: (i + 1) % 2) if family == "gemma2" else (lambda i: (i + 1) % pattern)
        out["layer_types"] = layer_types(raw, layers, slides) if window else ()
        if family == "gemma3":
            params = raw.get("rope_parameters")
            if isinstance(params, dict) and "sliding_attention" in params:
                local = params["sliding_attention"]
            else:  # transformers 4.x: the local layers' own theta, no scaling
                local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
            out["rope_local"] = local  # its parameters: engine.config makes them a RopeConfig
    elif family == "smollm3":
        given = raw.get("no_rope_layers")
        interval = int(raw.get("no_rope_layer_interval") or 4)
        rotates = [bool(v) for v in given] if given is not None else [(i + 1) % interval != 0 for i in range(layers)]
        if len(rotates) != layers:
            raise ModelLoadError(f"config.json's no_rope_layers must name each of the {layers} layers")
        out["rope_layers"] = tuple(rotates)
        if window:
            out["layer_types"] = layer_types(raw, layers, lambda i: not rotates[i])
    elif family == "granite":
        out.update(
            embed_scale=float(raw.get("embedding_multiplier", 1.0)),
            residual_scale=float(raw.get("residual_multiplier", 1.0)),
            attention_scale=float(raw.get("attention_multiplier", 1.0)),
            logits_scale=float(raw.get("logits_scaling", 1.0)),
        )
    elif family == "olmo2":
        out.update(norm_placement="post", qk_norm_span="all")
    elif family == "qwen3_moe":
        out["moe_layers"] = _sparse_layers(raw, layers)
    elif family == "gpt_oss":
        out.update(
            layer_types=layer_types(raw, layers, lambda i: (i + 1) % 2) if window else (),  # sliding, full, ...
            sinks=True,
            router_bias=True,
            router_topk_first=True,
            expert_bias=True,
            swiglu_limit=_positive(raw, "swiglu_limit", 7.0),
            swiglu_alpha=_positive(raw, "swiglu_alpha", 1.702),
        )
    elif family in ("deepseek_v2", "deepseek_v3"):
        out.update(_deepseek(family, raw, layers))
    elif family == "lfm2":
        out.update(_lfm2(raw, layers))
    elif family == "granitemoehybrid":
        out.update(_granite_hybrid(raw, layers, hidden))
    elif family == "qwen3_next":
        out.update(_qwen3_next(raw, layers))
    elif window and raw.get("layer_types") is not None:
        out["layer_types"] = layer_types(raw, layers, lambda i: True)
    for key in ("attn_softcap", "final_softcap"):
        if out.get(key) is not None:
            out[key] = float(out[key])
    return out


def _positive(raw: dict, key: str, default: float) -> float:
    """A finite number above 0 from config.json (its default where absent)."""
    value = raw.get(key, default)
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < float("inf")
    if not ok:
        raise ModelLoadError(f"config.json's {key} is {value!r}: it must be a finite number above 0")
    return float(value)


def _deepseek(family: str, raw: dict, layers: int) -> dict:
    """DeepSeek-V2/V3's fields: the latent attention's widths (each checked: a cache is sized from them), its score
    scale (1/√(d_n + d_r), times YaRN's mscale² where the rotary scales), the dense first layers, the shared experts
    and the router (V2: softmax, greedy or best groups first; V3: sigmoid, a correction bias on the choice, groups)."""
    widths = {}
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = raw.get(key)
        if not whole(value, 1, 1 << 16):
            raise ModelLoadError(f"config.json's {key} is {value!r}: a width from 1 to 65,536")
        widths[key] = int(value)
    if (widths["kv_lora_rank"] + widths["qk_rope_head_dim"]) % 2 or widths["qk_rope_head_dim"] % 2:
        raise ModelLoadError("the latent and rotary widths must be even (kv_lora_rank + qk_rope_head_dim, and pairs)")
    if widths["kv_lora_rank"] < widths["qk_rope_head_dim"]:  # the cache's V half holds the latent's end, then k_r
        raise ModelLoadError("kv_lora_rank must be at least qk_rope_head_dim")
    q_rank = raw.get("q_lora_rank")
    if q_rank is not None and not whole(q_rank, 1, 1 << 16):
        raise ModelLoadError(f"config.json's q_lora_rank is {q_rank!r}: a width from 1 to 65,536, or null")
    scale = (widths["qk_nope_head_dim"] + widths["qk_rope_head_dim"]) ** -0.5
    params = rope_params(raw)
    if params.get("rope_type", params.get("type", "default")) not in ("default", None) and params.get("mscale_all_dim"):
        scale *= yarn_mscale(float(params.get("factor") or 1.0), float(params["mscale_all_dim"])) ** 2
    dense = raw.get("first_k_dense_replace") or 0
    if not whole(dense, 0, layers):
        raise ModelLoadError(f"config.json's first_k_dense_replace is {dense!r}: out of range (0 to {layers})")
    experts = int(raw.get("n_routed_experts") or 0)
    method = raw.get("topk_method") or ("noaux_tc" if family == "deepseek_v3" else "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ModelLoadError(f"config.json's topk_method {method!r} is not one kvchat routes by")
    groups, best = (raw.get("n_group") or 1, raw.get("topk_group") or 1) if method != "greedy" else (0, 0)
    if groups and (not whole(groups, 1, experts) or experts % groups or not whole(best, 1, groups)):
        raise ModelLoadError(f"config.json's n_group {groups!r}, topk_group {best!r}: not groups of {experts} experts")
    shared = raw.get("n_shared_experts") or 0
    if not whole(shared, 0, 64):
        raise ModelLoadError(f"config.json's n_shared_experts is {shared!r}: out of range (0 to 64)")
    return {
        "kv_lora_rank": widths["kv_lora_rank"],
        "q_lora_rank": int(q_rank or 0),
        "qk_nope_head_dim": widths["qk_nope_head_dim"],
        "v_head_dim": widths["v_head_dim"],
        "rope_interleave": bool(raw.get("rope_interleave", True)),  # V2's complex rotation: always interleaved
        "attention_scale": scale,
        "moe_layers": tuple(i >= int(dense) for i in range(layers)),
        "shared_experts": int(shared),
        "router_scoring": "sigmoid" if family == "deepseek_v3" else "softmax",
        "router_groups": int(groups),
        "router_topk_groups": int(best),
        "router_choice_bias": family == "deepseek_v3",
        "routed_scaling": _positive(raw, "routed_scaling_factor", 1.0),
    }


def _lfm2(raw: dict, layers: int) -> dict:
    """LFM2's hybrid: which layers are short convolutions (`layer_types` "conv", or every one not in
    full_attn_idxs), the convolution's width and bias."""
    kinds = raw.get("layer_types")
    if kinds is None:
        full = raw.get("full_attn_idxs")
        full = set(range(layers)) if full is None else set(full)
        kinds = ["full_attention" if i in full else "conv" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or any(k not in ("conv", "full_attention") for k in kinds):
        raise ModelLoadError(f"config.json's layer_types must name each of the {layers} layers conv or full_attention")
    width = raw.get("conv_L_cache", 3)
    if not whole(width, 2, 64):
        raise ModelLoadError(f"config.json's conv_L_cache is {width!r}: a convolution's width from 2 to 64")
    return {"conv_layers": tuple(k == "conv" for k in kinds), "conv_kernel": int(width),
            "conv_bias": bool(raw.get("conv_bias", False))}  # fmt: skip


MAMBA_KINDS = {"mamba": True, "linear_attention": True, "attention": False, "full_attention": False}


def _granite_hybrid(raw: dict, layers: int, hidden: int) -> dict:
    """Granite 4.0-H: Granite's scales, Mamba-2 mixers on the layers `layer_types` names mamba (attention on the
    others, unrotated unless position_embedding_type is rope), the mixer's widths (each checked: a state is sized
    from them), and the shared MLP beside the experts."""
    kinds = raw.get("layer_types") or raw.get("layers_block_type") or ["mamba"] * layers
    if not isinstance(kinds, list) or len(kinds) != layers or any(k not in MAMBA_KINDS for k in kinds):
        raise ModelLoadError(f"config.json's layer_types must name each of the {layers} layers mamba or attention")
    limits = (("mamba_n_heads", 128, 1 << 12), ("mamba_d_state", 256, 1 << 12), ("mamba_n_groups", 1, 1 << 12),
              ("mamba_d_conv", 4, 64), ("mamba_expand", 2, 64))  # fmt: skip
    sizes = _widths(raw, limits)
    inner = sizes["mamba_expand"] * hidden
    head = raw.get("mamba_d_head", "auto")
    head = inner // sizes["mamba_n_heads"] if head in ("auto", None) else head
    if not whole(head, 1, 1 << 16) or int(head) * sizes["mamba_n_heads"] != inner:
        raise ModelLoadError(f"the Mamba heads ({sizes['mamba_n_heads']} × {head!r}) do not make its width {inner}")
    if sizes["mamba_n_heads"] % sizes["mamba_n_groups"]:
        raise ModelLoadError("mamba_n_heads must be a multiple of mamba_n_groups")
    low, high = _limit(raw.get("time_step_limit"))
    shared = raw.get("shared_intermediate_size") or 0
    if not whole(shared, 0, 1 << 24):
        raise ModelLoadError(f"config.json's shared_intermediate_size is {shared!r}: out of range")
    rotates = raw.get("position_embedding_type") == "rope"
    return {
        "embed_scale": float(raw.get("embedding_multiplier", 1.0)),
        "residual_scale": float(raw.get("residual_multiplier", 1.0)),
        "attention_scale": float(raw.get("attention_multiplier", 1.0)),
        "logits_scale": float(raw.get("logits_scaling", 1.0)),
        "rope_layers": () if rotates else (False,) * layers,
        "router_topk_first": True,  # the k highest logits, then their softmax
        "shared_mlp": int(shared) if expert_count(raw) else 0,
        "mamba_layers": tuple(MAMBA_KINDS[k] for k in kinds),
        "mamba_heads": sizes["mamba_n_heads"],
        "mamba_head_dim": int(head),
        "mamba_state": sizes["mamba_d_state"],
        "mamba_groups": sizes["mamba_n_groups"],
        "mamba_kernel": sizes["mamba_d_conv"],
        "mamba_conv_bias": bool(raw.get("mamba_conv_bias", True)),
        "mamba_proj_bias": bool(raw.get("mamba_proj_bias", False)),
        "dt_limit": (low, high),
    }


def _widths(raw: dict, limits) -> dict[str, int]:
    """A state layer's widths from config.json, each (key, default, most) a whole number from 1 to its most (a
    convolution's width — mamba_d_conv, linear_conv_kernel_dim — from 2: it must see a position before): a state
    is sized from them, so one out of range is refused by name."""
    sizes = {}
    for key, default, high in limits:
        value = raw.get(key, default)
        if not whole(value, 2 if key.endswith(("_conv", "conv_kernel_dim")) else 1, high):
            raise ModelLoadError(f"config.json's {key} is {value!r}: out of range (1 to {high:,})")
        sizes[key] = int(value)
    return sizes


def _sparse_layers(raw: dict, layers: int) -> tuple[bool, ...]:
    """Qwen's mixtures: every decoder_sparse_step-th layer a mixture, but those mlp_only_layers names."""
    step = raw.get("decoder_sparse_step")
    step = 1 if step is None else step
    if not whole(step, 1, max(1, layers)):
        raise ModelLoadError(f"config.json's decoder_sparse_step is {step!r}: out of range (1 to {layers})")
    dense = set(raw.get("mlp_only_layers") or [])
    return tuple(i not in dense and (i + 1) % int(step) == 0 for i in range(layers))


DELTA_KINDS = {"linear_attention": True, "full_attention": False}


def _qwen3_next(raw: dict, layers: int) -> dict:
    """Qwen3-Next: gated DeltaNet layers where `layer_types` says linear_attention (else every
    full_attention_interval-th layer attention), their widths (each checked: a state is sized from them), gated
    attention, (1 + w) norms, and the shared expert beside the routed ones with its own sigmoid gate."""
    kinds = raw.get("layer_types")
    if kinds is None:
        every = raw.get("full_attention_interval", 4)
        if not whole(every, 1, max(1, layers)):
            raise ModelLoadError(f"config.json's full_attention_interval is {every!r}: out of range (1 to {layers})")
        kinds = ["linear_attention" if (i + 1) % int(every) else "full_attention" for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or any(k not in DELTA_KINDS for k in kinds):
        raise ModelLoadError(
            f"config.json's layer_types must name each of the {layers} layers linear_attention or full_attention"
        )
    limits = (("linear_num_key_heads", 16, 1 << 10), ("linear_num_value_heads", 32, 1 << 10),
              ("linear_key_head_dim", 128, 1 << 12), ("linear_value_head_dim", 128, 1 << 12),
              ("linear_conv_kernel_dim", 4, 64))  # fmt: skip
    sizes = _widths(raw, limits)
    if sizes["linear_num_value_heads"] % sizes["linear_num_key_heads"]:
        raise ModelLoadError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    shared = raw.get("shared_expert_intermediate_size") or 0
    if not whole(shared, 0, 1 << 24):
        raise ModelLoadError(f"config.json's shared_expert_intermediate_size is {shared!r}: out of range")
    experts = bool(expert_count(raw))
    return {
        "norm_offset": 1.0,  # every RMSNorm scales by (1 + w); the DeltaNet's own gated norm by w
        "attn_output_gate": True,
        "moe_layers": _sparse_layers(raw, layers) if experts else (),
        "shared_mlp": int(shared) if experts else 0,
        "shared_gate": bool(shared) and experts,
        "delta_layers": tuple(DELTA_KINDS[k] for k in kinds),
        "delta_k_heads": sizes["linear_num_key_heads"],
        "delta_v_heads": sizes["linear_num_value_heads"],
        "delta_k_dim": sizes["linear_key_head_dim"],
        "delta_v_dim": sizes["linear_value_head_dim"],
        "delta_kernel": sizes["linear_conv_kernel_dim"],
    }


def expert_count(raw: dict):
    """The routed experts config.json names, under each family's key (0 where none), as given: checked by the caller."""
    return raw.get("num_experts") or raw.get("num_local_experts") or raw.get("n_routed_experts") or 0


def _limit(value) -> tuple[float, float]:
    """time_step_limit: [low, high] (high may be written Infinity, or as transformers 5 writes it), or null."""
    if value is None:
        return 0.0, float("inf")
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ModelLoadError(f"config.json's time_step_limit is {value!r}: a pair [low, high]")
    out = []
    for v in value:
        if isinstance(v, dict) and v.get("__float__") in ("Infinity", "inf"):
            v = float("inf")
        if isinstance(v, str) and v in ("Infinity", "inf"):
            v = float("inf")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v < 0:
            raise ModelLoadError(f"config.json's time_step_limit is {value!r}: two numbers from 0 up")
        out.append(float(v))
    if out[0] > out[1]:
        raise ModelLoadError(f"config.json's time_step_limit is {value!r}: its low end above its high end")
    return out[0], out[1]


def lfm2_width(raw: dict) -> int:
    """LFM2's MLP width: its intermediate_size (block_ff_dim) taken 2/3, times block_ffn_dim_multiplier, rounded up
    to block_multiple_of, where block_auto_adjust_ff_dim says (as transformers' Lfm2MLP sizes it)."""
    width = int(raw.get("block_ff_dim") or raw["intermediate_size"])
    if raw.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            step = int(raw.get("block_multiple_of") or 256)
            width = int(float(multiplier) * width)
            width = step * ((width + step - 1) // step)
    return width


def whole(value, low: int, high: int) -> bool:
    """A whole number from low to high (a float only when it is whole: never NaN or inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (not isinstance(value, float) or value.is_integer()) and low <= value <= high
