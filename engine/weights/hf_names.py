"""The Hugging Face checkpoint's names for a Llama-family model: every tensor it must hold with its shape,
and which of them each of kvchat's fused modules (q/k/v, gate/up) is read from."""

from __future__ import annotations

from ..config import ModelConfig


def expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape, under Hugging Face names."""
    D, F, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qd, kvd = cfg.num_heads * d, cfg.num_kv_heads * d
    out = {"model.embed_tokens.weight": (cfg.vocab_size, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, D)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": (qd, D),
                p + "self_attn.k_proj.weight": (kvd, D),
                p + "self_attn.v_proj.weight": (kvd, D),
                p + "self_attn.o_proj.weight": (D, qd),
                p + "mlp.gate_proj.weight": (F, D),
                p + "mlp.up_proj.weight": (F, D),
                p + "mlp.down_proj.weight": (D, F),
                p + "input_layernorm.weight": (D,),
                p + "post_attention_layernorm.weight": (D,),
            }
        )
        if cfg.qkv_bias:
            out.update(
                {
                    p + "self_attn.q_proj.bias": (qd,),
                    p + "self_attn.k_proj.bias": (kvd,),
                    p + "self_attn.v_proj.bias": (kvd,),
                }
            )
        if cfg.o_bias:
            out[p + "self_attn.o_proj.bias"] = (D,)
        if cfg.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return out


LINEARS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")  # a block's linears, by module path


def block_sources(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """One block's tensors under the module's names -> the checkpoint tensors each is read from
    (several: stacked along rows, as q/k/v and gate/up are fused)."""
    p = f"model.layers.{i}."
    a = p + "self_attn."
    out = {
        "attn.qkv.weight": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
        "attn.o.weight": [a + "o_proj.weight"],
        "mlp.gate_up.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
        "mlp.down.weight": [p + "mlp.down_proj.weight"],
        "attn_norm.weight": [p + "input_layernorm.weight"],
        "mlp_norm.weight": [p + "post_attention_layernorm.weight"],
    }
    if cfg.qkv_bias:
        out["attn.qkv.bias"] = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
    if cfg.o_bias:
        out["attn.o.bias"] = [a + "o_proj.bias"]
    if cfg.qk_norm:
        out["attn.q_norm.weight"], out["attn.k_norm.weight"] = [a + "q_norm.weight"], [a + "k_norm.weight"]
    return out
