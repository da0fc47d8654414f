"""The Hugging Face checkpoint's names for every family kvchat runs: every tensor it must hold with its shape,
which of them each of kvchat's modules is read from (several, stacked along rows, where kvchat fuses q/k/v and
gate/up), and the way back (`hf_state_dict`)."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..errors import ModelLoadError
from .delta_rows import delta_state, part_name
from .stacked_experts import (
    expert_shapes,
    granite_name,
    granite_state,
    resolve,
    stacked,
    stacked_sources,
    stacked_state,
)

NORMS = {  # placement -> kvchat's norm -> the checkpoint's name
    "pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
    "sandwich": {
        "attn_norm": "input_layernorm",
        "attn_post_norm": "post_attention_layernorm",
        "mlp_norm": "pre_feedforward_layernorm",
        "mlp_post_norm": "post_feedforward_layernorm",
    },
    "post": {"attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"},
}


# a mixture's checkpoint names: the MLP module, its router, and each expert's gate, up and down projections
EXPERT_NAMES = {
    "qwen3_moe": ("mlp", "gate", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "gate", "w1", "w3", "w2"),
}


LFM2_NORMS = {"attn_norm": "operator_norm", "mlp_norm": "ffn_norm"}


def final_norm(cfg: ModelConfig) -> str:
    """The checkpoint's name for the norm before the head (LFM2 calls it the embedding norm)."""
    return "model.embedding_norm.weight" if cfg.family == "lfm2" else "model.norm.weight"


def _mlp_sources(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """Layer i's MLP tensors under kvchat's names -> the checkpoint's: one gated MLP, or a router and E experts."""
    p = f"model.layers.{i}."
    if cfg.family == "lfm2":  # w1 the gate, w3 the up projection, w2 down
        f = p + "feed_forward."
        return {"mlp.gate_up.weight": [f + "w1.weight", f + "w3.weight"], "mlp.down.weight": [f + "w2.weight"]}
    if cfg.family == "granitemoehybrid":  # gate and up rows of fused tensors (engine.weights.stacked_experts)
        return _granite_sources(cfg, i)
    if not cfg.is_moe(i):
        if cfg.family == "phi3":  # gate and up already fused in the file
            return {
                "mlp.gate_up.weight": [p + "mlp.gate_up_proj.weight"],
                "mlp.down.weight": [p + "mlp.down_proj.weight"],
            }
        return {
            "mlp.gate_up.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
            "mlp.down.weight": [p + "mlp.down_proj.weight"],
        }
    if stacked(cfg):  # gpt-oss: every expert's parts rows of one tensor a layer
        return stacked_sources(cfg, i)
    mlp, router, gate, up, down = EXPERT_NAMES["mixtral" if cfg.family == "mixtral" else "qwen3_moe"]
    out = {"mlp.router.weight": [f"{p}{mlp}.{router}.weight"]}
    for j in range(cfg.num_experts):
        e = f"{p}{mlp}.experts.{j}."
        out[f"mlp.experts.{j}.gate_up.weight"] = [e + gate + ".weight", e + up + ".weight"]
        out[f"mlp.experts.{j}.down.weight"] = [e + down + ".weight"]
    if cfg.shared_experts or cfg.shared_gate:  # DeepSeek's experts every position goes through, one MLP; Qwen's
        e = f"{p}mlp.shared_experts." if cfg.shared_experts else f"{p}mlp.shared_expert."  # shared expert, gated
        out["mlp.shared.gate_up.weight"] = [e + "gate_proj.weight", e + "up_proj.weight"]
        out["mlp.shared.down.weight"] = [e + "down_proj.weight"]
    if cfg.shared_gate:
        out["mlp.shared_gate.weight"] = [f"{p}mlp.shared_expert_gate.weight"]
    if cfg.router_choice_bias:
        out["mlp.choice_bias"] = [f"{p}mlp.gate.e_score_correction_bias"]
    return out


def _granite_sources(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """Granite 4.0-H's MLP: the shared one (alone where there are no experts), the router and the experts."""
    p = f"model.layers.{i}."
    shared = {"gate_up.weight": [granite_name(i, "gate"), granite_name(i, "up")],
              "down.weight": [p + "shared_mlp.output_linear.weight"]}  # fmt: skip
    if not cfg.is_moe(i):
        return {f"mlp.{k}": v for k, v in shared.items()}
    out = {f"mlp.shared.{k}": v for k, v in shared.items()}
    out["mlp.router.weight"] = [p + "block_sparse_moe.router.layer.weight"]
    for j in range(cfg.num_experts):
        out[f"mlp.experts.{j}.gate_up.weight"] = [granite_name(i, "gate", j), granite_name(i, "up", j)]
        out[f"mlp.experts.{j}.down.weight"] = [granite_name(i, "down", j)]
    return out


def _conv_sources(cfg: ModelConfig, c: str) -> dict[str, list[str]]:
    """A short convolution's tensors (LFM2) under kvchat's names -> the checkpoint's, `c` its prefix."""
    out = {f"attn.{m}.weight": [f"{c}{m}.weight"] for m in ("in_proj", "conv", "out_proj")}
    if cfg.conv_bias:
        out.update({f"attn.{m}.bias": [f"{c}{m}.bias"] for m in ("in_proj", "conv", "out_proj")})
    return out


MAMBA_TENSORS = {  # a Mamba-2 mixer's tensors: kvchat's name -> the checkpoint's
    "in_proj.weight": "in_proj.weight", "conv.weight": "conv1d.weight", "dt_bias": "dt_bias", "A_log": "A_log",
    "D": "D", "norm.weight": "norm.weight", "out_proj.weight": "out_proj.weight",
}  # fmt: skip


def _mamba_sources(cfg: ModelConfig, m: str) -> dict[str, list[str]]:
    """A Mamba-2 mixer's tensors (Granite 4.0-H) under kvchat's names -> the checkpoint's, `m` its prefix."""
    out = {f"attn.{mine}": [m + theirs] for mine, theirs in MAMBA_TENSORS.items()}
    if cfg.mamba_conv_bias:
        out["attn.conv.bias"] = [m + "conv1d.bias"]
    if cfg.mamba_proj_bias:
        out.update({f"attn.{p}.bias": [f"{m}{p}.bias"] for p in ("in_proj", "out_proj")})
    return out


def _mamba_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A Mamba-2 mixer's tensors under kvchat's names -> their shapes."""
    D, inner, C, H = cfg.hidden_size, cfg.mamba_inner, cfg.mamba_conv_width, cfg.mamba_heads
    return {"attn.in_proj.weight": (inner + C + H, D), "attn.in_proj.bias": (inner + C + H,),
            "attn.conv.weight": (C, 1, cfg.mamba_kernel), "attn.conv.bias": (C,), "attn.dt_bias": (H,),
            "attn.A_log": (H,), "attn.D": (H,), "attn.norm.weight": (inner,), "attn.out_proj.weight": (D, inner),
            "attn.out_proj.bias": (D,)}  # fmt: skip


DELTA_TENSORS = {  # a gated DeltaNet's tensors other than its input projection: kvchat's name -> the checkpoint's
    "conv.weight": "conv1d.weight", "dt_bias": "dt_bias", "A_log": "A_log", "norm.weight": "norm.weight",
    "out_proj.weight": "out_proj.weight",
}  # fmt: skip


def _delta_sources(i: int, m: str) -> dict[str, list[str]]:
    """A gated DeltaNet's tensors (Qwen3-Next) under kvchat's names -> the checkpoint's, `m` its prefix: its input
    projection from its parts (engine.weights.delta_rows), q/k/v, z, b and a stacked along rows."""
    out = {f"attn.{mine}": [m + theirs] for mine, theirs in DELTA_TENSORS.items()}
    out["attn.in_proj.weight"] = [part_name(i, p) for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")]
    return out


def _latent_sources(cfg: ModelConfig, a: str) -> dict[str, list[str]]:
    """Multi-head latent attention's tensors (DeepSeek) under kvchat's names -> the checkpoint's, `a` its prefix."""
    if cfg.q_lora_rank:
        out = {
            "attn.q_a.weight": [a + "q_a_proj.weight"],
            "attn.q_a_norm.weight": [a + "q_a_layernorm.weight"],
            "attn.q_b.weight": [a + "q_b_proj.weight"],
        }
    else:
        out = {"attn.q.weight": [a + "q_proj.weight"]}
    out["attn.kv_a.weight"] = [a + "kv_a_proj_with_mqa.weight"]
    out["attn.kv_a_norm.weight"] = [a + "kv_a_layernorm.weight"]
    out["attn.kv_b.weight"] = [a + "kv_b_proj.weight"]
    if cfg.qkv_bias:
        out["attn.kv_a.bias"] = [a + "kv_a_proj_with_mqa.bias"]
        if cfg.q_lora_rank:
            out["attn.q_a.bias"] = [a + "q_a_proj.bias"]
    return out


def block_sources(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """One block's tensors under the module's names -> the checkpoint tensors each is read from
    (several: stacked along rows, as q/k/v and gate/up are fused)."""
    p = f"model.layers.{i}."
    a = p + "self_attn."
    if cfg.conv_layers and cfg.conv_layers[i]:  # LFM2's short convolution in attention's place
        out = _conv_sources(cfg, p + "conv.")
    elif cfg.mamba_layers and cfg.mamba_layers[i]:  # Granite 4.0-H's Mamba-2 mixer in attention's place
        out = _mamba_sources(cfg, p + "mamba.")
    elif cfg.delta_layers and cfg.delta_layers[i]:  # Qwen3-Next's gated DeltaNet in attention's place
        out = _delta_sources(i, p + "linear_attn.")
    elif cfg.family == "lfm2":
        out = {"attn.qkv.weight": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
               "attn.o.weight": [a + "out_proj.weight"], "attn.q_norm.weight": [a + "q_layernorm.weight"],
               "attn.k_norm.weight": [a + "k_layernorm.weight"]}  # fmt: skip
    elif cfg.mla:
        out = _latent_sources(cfg, a)
    elif cfg.family == "phi3":
        out = {"attn.qkv.weight": [a + "qkv_proj.weight"]}
    else:
        out = {"attn.qkv.weight": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]}
    state = bool(cfg.state_layers and cfg.state_layers[i])
    if cfg.family != "lfm2" and not state:
        out["attn.o.weight"] = [a + "o_proj.weight"]
    out.update(_mlp_sources(cfg, i))
    for mine, theirs in (LFM2_NORMS if cfg.family == "lfm2" else NORMS[cfg.norm_placement]).items():
        out[mine + ".weight"] = [p + theirs + ".weight"]
    if cfg.qkv_bias and not cfg.mla:
        out["attn.qkv.bias"] = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
    if cfg.o_bias:
        out["attn.o.bias"] = [a + "o_proj.bias"]
    if cfg.qk_norm and cfg.family != "lfm2" and not state:
        out["attn.q_norm.weight"], out["attn.k_norm.weight"] = [a + "q_norm.weight"], [a + "k_norm.weight"]
    if cfg.sinks:
        out["attn.sinks"] = [a + "sinks"]
    return out


def linears(cfg: ModelConfig, i: int) -> list[str]:
    """Block i's linears by module path (each expert's own): what quantization and a file's codes replace."""
    mlps = [f"mlp.experts.{j}" for j in range(cfg.num_experts)] if cfg.is_moe(i) else ["mlp"]
    if cfg.is_moe(i) and cfg.shared_width:
        mlps.append("mlp.shared")
    if cfg.state_layers and cfg.state_layers[i]:  # the convolution's and the scan's own weights stay float
        attn = ["attn.in_proj", "attn.out_proj"]
    elif cfg.mla:  # kv_b stays a float weight: decode reads it as the absorbed maps (engine.latent_attention)
        attn = (["attn.q_a", "attn.q_b"] if cfg.q_lora_rank else ["attn.q"]) + ["attn.kv_a", "attn.o"]
    else:
        attn = ["attn.qkv", "attn.o"]
    return attn + [f"{m}.{name}" for m in mlps for name in ("gate_up", "down")]


def _shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Block i's tensors under kvchat's names -> their shapes (fused ones whole)."""
    D, d = cfg.hidden_size, cfg.head_dim
    qd, kvd = cfg.num_heads * d, cfg.num_kv_heads * d
    qg = 2 * qd if cfg.attn_output_gate else qd  # the query rows, each head's gate after it where the family gates
    out = {"attn.qkv.weight": (qg + 2 * kvd, D), "attn.o.weight": (D, qd), "attn.qkv.bias": (qg + 2 * kvd,)}
    out["attn.o.bias"] = (D,)
    out["attn.q_norm.weight"], out["attn.k_norm.weight"] = (
        ((qd,), (kvd,)) if cfg.qk_norm_span == "all" else ((d,), (d,))
    )
    for mine in LFM2_NORMS if cfg.family == "lfm2" else NORMS[cfg.norm_placement]:
        out[mine + ".weight"] = (D,)
    out["attn.sinks"] = (cfg.num_heads,)
    if cfg.mla:
        out.update(_latent_shapes(cfg))
    if cfg.mamba_layers:
        out.update(_mamba_shapes(cfg))
    if cfg.delta_layers:
        out.update(_delta_shapes(cfg))
    if cfg.conv_layers:
        K = cfg.conv_kernel
        out.update({"attn.in_proj.weight": (3 * D, D), "attn.in_proj.bias": (3 * D,), "attn.conv.weight": (D, 1, K),
                    "attn.conv.bias": (D,), "attn.out_proj.weight": (D, D), "attn.out_proj.bias": (D,)})  # fmt: skip
    if stacked(cfg):
        out.update(expert_shapes(cfg, i))
    if cfg.is_moe(i):
        F = cfg.moe_intermediate_size
        out["mlp.router.weight"] = (cfg.num_experts, D)
        for j in range(cfg.num_experts):
            out[f"mlp.experts.{j}.gate_up.weight"], out[f"mlp.experts.{j}.down.weight"] = (2 * F, D), (D, F)
        shared = cfg.shared_width
        out["mlp.shared.gate_up.weight"], out["mlp.shared.down.weight"] = (2 * shared, D), (D, shared)
        out["mlp.choice_bias"] = (cfg.num_experts,)
        out["mlp.shared_gate.weight"] = (1, D)
    else:
        F = cfg.intermediate_size
        out["mlp.gate_up.weight"], out["mlp.down.weight"] = (2 * F, D), (D, F)
    return out


def _delta_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A gated DeltaNet's tensors under kvchat's names -> their shapes (its input projection's parts stacked)."""
    D, C, hv, vw = cfg.hidden_size, cfg.delta_conv_width, cfg.delta_v_heads, cfg.delta_v_heads * cfg.delta_v_dim
    return {"attn.in_proj.weight": (C + vw + 2 * hv, D), "attn.conv.weight": (C, 1, cfg.delta_kernel),
            "attn.dt_bias": (hv,), "attn.A_log": (hv,), "attn.norm.weight": (cfg.delta_v_dim,),
            "attn.out_proj.weight": (D, vw)}  # fmt: skip


def _latent_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Latent attention's tensors under kvchat's names -> their shapes."""
    D, H, dc, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.q_lora_rank
    qd = H * (cfg.qk_nope_head_dim + cfg.head_dim)
    return {
        "attn.q.weight": (qd, D),
        "attn.q_a.weight": (r, D),
        "attn.q_a.bias": (r,),
        "attn.q_a_norm.weight": (r,),
        "attn.q_b.weight": (qd, r),
        "attn.kv_a.weight": (dc + cfg.head_dim, D),
        "attn.kv_a.bias": (dc + cfg.head_dim,),
        "attn.kv_a_norm.weight": (dc,),
        "attn.kv_b.weight": (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), dc),
        "attn.o.weight": (D, H * cfg.v_head_dim),
    }


def expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape, under Hugging Face names."""
    D = cfg.hidden_size
    out = {"model.embed_tokens.weight": (cfg.vocab_size, D), final_norm(cfg): (D,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, D)
    for i in range(cfg.num_layers):
        shapes = _shapes(cfg, i)
        for mine, theirs in block_sources(cfg, i).items():
            whole = shapes[mine]
            if len(theirs) == 1:
                out[theirs[0]] = whole
            else:  # stacked along rows: q/k/v by head counts, gate/up in halves
                rows = _split_rows(cfg, mine, whole[0])
                out.update({name: (r, *whole[1:]) for name, r in zip(theirs, rows)})
    return out


def check_shapes(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], stored=lambda name: name, where=None) -> None:
    """Every tensor the config implies against the shapes the file's own header gives (each checked against the
    file's size as it was read), before anything is sized from the config: an expert count, an intermediate size,
    a head count the file does not bear out is an error when the model is listed, not at its first request.
    `stored` names a tensor as the file does (its GGUF name), for the message."""
    parts = resolve(cfg, dict.fromkeys(shapes), lambda name: shapes[name])  # stacked experts: their tensors checked
    for name, shape in expected(cfg).items():
        if name in parts:
            continue
        got = shapes.get(name)
        if got is None:
            raise ModelLoadError(f"tensor {stored(name)!r} is missing from the weights", where)
        if tuple(got) != shape:
            implied = f"the config implies {list(shape)}"
            raise ModelLoadError(f"tensor {stored(name)!r} has shape {list(got)}, {implied}", where)


def _split_rows(cfg: ModelConfig, mine: str, rows: int) -> list[int]:
    """How a fused tensor's rows divide among the checkpoint tensors stacked into it."""
    if mine.startswith("attn.qkv"):
        d = cfg.head_dim
        return [cfg.num_heads * d * (2 if cfg.attn_output_gate else 1), cfg.num_kv_heads * d, cfg.num_kv_heads * d]
    if mine == "attn.in_proj.weight" and cfg.delta_layers:  # q/k/v, z, b, a
        hv = cfg.delta_v_heads
        return [cfg.delta_conv_width, hv * cfg.delta_v_dim, hv, hv]
    return [rows // 2, rows // 2]


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """A model's weights under the Hugging Face names, fused tensors split apart again (the demo model's and the
    bench shapes' checkpoints are written so)."""
    cfg = model.cfg
    out = {"model.embed_tokens.weight": model.embed.weight, final_norm(cfg): model.norm.weight}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    if stacked(cfg):
        out.update(stacked_state(model))
    for i, block in enumerate(model.layers):
        mine = dict(block.named_parameters())
        for name, theirs in block_sources(cfg, i).items():
            if stacked(cfg) and name.startswith("mlp."):
                continue
            t = mine[name]
            parts = [t] if len(theirs) == 1 else t.split(_split_rows(cfg, name, t.shape[0]))
            out.update(zip(theirs, parts))
    if cfg.family == "granitemoehybrid":
        out = granite_state(cfg, out)
    if any(cfg.delta_layers):
        out = delta_state(cfg, out)
    return {k: v.detach().contiguous() for k, v in out.items()}
