"""How each family departs from the Llama shape in its config.json: the ModelConfig fields of Gemma's sandwich and
windows, SmolLM3's unrotated layers, Granite's scales, OLMo 2's post-norms, the mixtures' dense layers, and gpt-oss's
sinks, alternating windows and clamped, biased experts (engine/MODELS.md, "Model families")."""

from __future__ import annotations

from .errors import ModelLoadError


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
        step = int(raw.get("decoder_sparse_step") or 1)
        dense = set(raw.get("mlp_only_layers") or [])
        out["moe_layers"] = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
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
