"""A GGUF file's tensor names against the Hugging Face names kvchat's model uses: the global tensors, each block's
(with an architecture's departures and a mixture's stacked experts, "#j" for expert j's rows), both ways."""

from __future__ import annotations

import functools
import re

# Hugging Face tensor names -> GGUF names ("{i}": the block)
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "model.embedding_norm.weight": "token_embd_norm.weight",  # LFM2's norm before the head
    "lm_head.weight": "output.weight",
}
BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # a mixture: the router, and each expert's rows of the experts' stacked tensors ("#j": expert j)
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.{j}.gate_proj.weight": "ffn_gate_exps.weight#{j}",
    "mlp.experts.{j}.up_proj.weight": "ffn_up_exps.weight#{j}",
    "mlp.experts.{j}.down_proj.weight": "ffn_down_exps.weight#{j}",
    "block_sparse_moe.experts.{j}.w1.weight": "ffn_gate_exps.weight#{j}",
    "block_sparse_moe.experts.{j}.w3.weight": "ffn_up_exps.weight#{j}",
    "block_sparse_moe.experts.{j}.w2.weight": "ffn_down_exps.weight#{j}",
    # gpt-oss: the router's bias, the experts' biases (rows of [E, rows] tensors), the sinks
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.experts.{j}.gate_proj.bias": "ffn_gate_exps.bias#{j}",
    "mlp.experts.{j}.up_proj.bias": "ffn_up_exps.bias#{j}",
    "mlp.experts.{j}.down_proj.bias": "ffn_down_exps.bias#{j}",
    "self_attn.sinks": "attn_sinks.weight",
}
ARCH_BLOCK_NAMES = {  # where an architecture's names depart from BLOCK_NAMES
    "gemma2": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    },
    "olmo2": {
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    },
    "gpt-oss": {"post_attention_layernorm.weight": "post_attention_norm.weight"},
    "phi3": {"self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "lfm2": {  # its block's names, and the short convolution's (its kernel [D, K] in the file, [D, 1, K] here)
        "operator_norm.weight": "attn_norm.weight",
        "ffn_norm.weight": "ffn_norm.weight",
        "feed_forward.w1.weight": "ffn_gate.weight",
        "feed_forward.w3.weight": "ffn_up.weight",
        "feed_forward.w2.weight": "ffn_down.weight",
        "self_attn.q_layernorm.weight": "attn_q_norm.weight",
        "self_attn.k_layernorm.weight": "attn_k_norm.weight",
        "self_attn.out_proj.weight": "attn_output.weight",
        "conv.conv.weight": "shortconv.conv.weight",
        "conv.in_proj.weight": "shortconv.in_proj.weight",
        "conv.out_proj.weight": "shortconv.out_proj.weight",
    },
    "deepseek2": {  # latent attention; kv_b as two tensors (k_b transposed, v_b), read joined: GGUFModel.kv_b
        "self_attn.q_a_proj.weight": "attn_q_a.weight",
        "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
        "self_attn.q_b_proj.weight": "attn_q_b.weight",
        "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
        "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
        "self_attn.kv_b_proj.weight": "attn_k_b.weight",
        "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
        "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    },
    "granitehybrid": {  # Mamba-2 mixers as llama.cpp's converter names them (A as −exp(A_log), A and D [H, 1], the
        # norm [G, I/G], the kernel [C, K]); the MLP's parts ("a|b": the shared MLP's with experts, or alone)
        "mamba.in_proj.weight": "ssm_in.weight",
        "mamba.conv1d.weight": "ssm_conv1d.weight",
        "mamba.conv1d.bias": "ssm_conv1d.bias",
        "mamba.dt_bias": "ssm_dt.bias",
        "mamba.A_log": "ssm_a",
        "mamba.D": "ssm_d",
        "mamba.norm.weight": "ssm_norm.weight",
        "mamba.out_proj.weight": "ssm_out.weight",
        "shared_mlp.gate_proj.weight": "ffn_gate_shexp.weight|ffn_gate.weight",
        "shared_mlp.up_proj.weight": "ffn_up_shexp.weight|ffn_up.weight",
        "shared_mlp.output_linear.weight": "ffn_down_shexp.weight|ffn_down.weight",
        "block_sparse_moe.router.layer.weight": "ffn_gate_inp.weight",
        "block_sparse_moe.experts.{j}.gate_proj.weight": "ffn_gate_exps.weight#{j}",
        "block_sparse_moe.experts.{j}.up_proj.weight": "ffn_up_exps.weight#{j}",
        "block_sparse_moe.experts.{j}.down_proj.weight": "ffn_down_exps.weight#{j}",
    },
    "qwen3next": {  # the gated DeltaNet as llama.cpp's converter names it (q/k/v and z apart, b and a in one
        # tensor per key head: read by rows, engine.weights.gguf_file; A as −exp(A_log), the kernel [C, K]), its
        # norms but the DeltaNet's as 1 + w, the shared expert and its gate
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
        "linear_attn.in_proj_z.weight": "attn_gate.weight",
        "linear_attn.in_proj_b.weight": "ssm_ba.weight",
        "linear_attn.in_proj_a.weight": "ssm_ba.weight",
        "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
        "linear_attn.conv1d.weight": "ssm_conv1d.weight",
        "linear_attn.dt_bias": "ssm_dt.bias",
        "linear_attn.A_log": "ssm_a",
        "linear_attn.norm.weight": "ssm_norm.weight",
        "linear_attn.out_proj.weight": "ssm_out.weight",
        "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
        "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
        "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
        "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    },
}
ARCH_BLOCK_NAMES["gemma3"] = ARCH_BLOCK_NAMES["gemma2"]
EXPERT = re.compile(r"^(mlp|block_sparse_moe)\.experts\.(\d+)\.(.+)$")


@functools.cache
def _block_names(arch: str) -> dict[str, str]:
    """BLOCK_NAMES with an architecture's own (built once: gguf_name runs for every tensor of a file)."""
    return {**BLOCK_NAMES, **ARCH_BLOCK_NAMES.get(arch, {})}


def gguf_name(arch: str, hf: str) -> str | None:
    """The GGUF name of a Hugging Face tensor name in a file of `arch` (an expert's: its rows of the stacked
    tensor, "…#j"; "a|b" where it depends on the model: `pick_name`); None for a name no GGUF file holds."""
    if hf in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf]
    if not hf.startswith("model.layers."):
        return None
    i, rest = hf[len("model.layers.") :].split(".", 1)
    expert = EXPERT.match(rest)
    if expert:
        rest = f"{expert[1]}.experts.{{j}}.{expert[3]}"
    names = _block_names(arch)
    if rest not in names:
        return None
    return "|".join(f"blk.{i}.{n}" for n in names[rest].split("|")).replace("{j}", expert[2] if expert else "")


def pick_name(name: str, experts: bool) -> str:
    """Of a name's "with experts|without" forms, the model's (Granite 4.0-H's shared MLP)."""
    return name.split("|")[0 if experts else 1] if "|" in name else name
