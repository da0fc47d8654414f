"""What a cache of T positions takes for the families kvchat runs, from their published configs (no weights): the
table in engine/MODELS.md, "What a position costs, family by family". A sliding-window model's rings, a latent
attention's compressed rows and a hybrid's states with their snapshots are counted as kvchat allocates them; beside
MLA and a hybrid, what plain attention (over the same heads, on every layer) would take.

    python -m engine.tools.cache_table [--positions 4096 32768]
"""

from __future__ import annotations

import argparse

import torch

from ..config import config_from_dict
from ..kv_cache import make_cache


def _yarn(factor: float, original: int, theta: float, **more) -> dict:
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "rope_theta": theta, "beta_fast": 32.0, "beta_slow": 1.0, **more}  # fmt: skip


# the published config.json fields each family's cache is sized from (the rest: what config_from_dict requires)
CONFIGS = {
    "Llama 3.1 8B": dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=131072,
    ),  # fmt: skip
    "Qwen3 8B": dict(
        architectures=["Qwen3ForCausalLM"],
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
    ),  # fmt: skip
    "Gemma 3 4B (text)": dict(
        architectures=["Gemma3ForCausalLM"],
        hidden_size=2560,
        intermediate_size=10240,
        num_hidden_layers=34,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        sliding_window=1024,
        sliding_window_pattern=6,
        query_pre_attn_scalar=256,
        vocab_size=262208,
        max_position_embeddings=131072,
        hidden_activation="gelu_pytorch_tanh",
    ),  # fmt: skip
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"],
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        sliding_window=128,
        num_local_experts=32,
        num_experts_per_tok=4,
        vocab_size=201088,
        max_position_embeddings=131072,
        rope_scaling=_yarn(32.0, 4096, 150000.0, truncate=False),
    ),  # fmt: skip
    "LFM2-1.2B (hybrid)": dict(
        architectures=["Lfm2ForCausalLM"],
        hidden_size=2048,
        intermediate_size=12288,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=65536,
        max_position_embeddings=128000,
        layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
        conv_L_cache=3,
    ),  # fmt: skip
    "Granite 4.0-H-Tiny (hybrid)": dict(
        architectures=["GraniteMoeHybridForCausalLM"],
        hidden_size=1536,
        intermediate_size=512,
        num_hidden_layers=40,
        num_attention_heads=12,
        num_key_value_heads=4,
        layer_types=["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
        mamba_n_heads=48,
        mamba_d_head=64,
        mamba_d_state=128,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        num_local_experts=64,
        num_experts_per_tok=6,
        shared_intermediate_size=1024,
        position_embedding_type="nope",
        vocab_size=100352,
        max_position_embeddings=131072,
    ),  # fmt: skip
    "Qwen3-Next-80B-A3B (hybrid)": dict(
        architectures=["Qwen3NextForCausalLM"],
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        partial_rotary_factor=0.25,
        vocab_size=151936,
        max_position_embeddings=262144,
    ),  # fmt: skip
    "DeepSeek-V2-Lite": dict(
        architectures=["DeepseekV2ForCausalLM"],
        hidden_size=2048,
        intermediate_size=10944,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        moe_intermediate_size=1408,
        first_k_dense_replace=1,
        vocab_size=102400,
        max_position_embeddings=163840,
        rope_scaling=_yarn(40.0, 4096, 10000.0, mscale=0.707, mscale_all_dim=0.707),
    ),  # fmt: skip
    "DeepSeek-V3 (671B)": dict(
        architectures=["DeepseekV3ForCausalLM"],
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        moe_intermediate_size=2048,
        first_k_dense_replace=3,
        routed_scaling_factor=2.5,
        vocab_size=129280,
        max_position_embeddings=163840,
        rope_scaling=_yarn(40.0, 4096, 10000.0, mscale=1.0, mscale_all_dim=1.0),
    ),  # fmt: skip
}


def rows(positions: list[int], dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Per family: its bytes per position (every layer holding it), and at each count of positions what kvchat's cache
    of that capacity allocates and what plain attention would (the same for all but MLA)."""
    out = []
    size = torch.empty((), dtype=dtype).element_size()
    for name, raw in CONFIGS.items():
        cfg = config_from_dict(raw)
        row = {"model": name, "per_position": make_cache(cfg, 16, dtype, "meta").bytes_per_position, "at": {}}
        for t in positions:
            kept = make_cache(cfg, t, dtype, "meta").allocated_bytes
            plain = cfg.plain_attention_bytes(t, size) if cfg.mla or any(cfg.state_layers) else kept
            row["at"][t] = (kept, plain)
        out.append(row)
    return out


def table(positions: list[int]) -> str:
    """The rows as engine/MODELS.md shows them (bfloat16 K/V, MiB)."""

    def mib(b: int) -> str:
        return f"{b / 2**20:,.0f}"

    head = "| model | bytes a position | " + " | ".join(f"{t:,} positions" for t in positions) + " |"
    lines = [head, "|---|---|" + "---|" * len(positions)]
    for r in rows(positions):
        cells = []
        for t in positions:
            kept, plain = r["at"][t]
            cells.append(f"{mib(kept)} MiB" + ("" if plain == kept else f" (plain attention {mib(plain)} MiB)"))
        lines.append(f"| {r['model']} | {r['per_position']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m engine.tools.cache_table", description=__doc__.split("\n\n")[0])
    p.add_argument("--positions", type=int, nargs="+", default=[4096, 32768])
    print(table(p.parse_args(argv).positions))


if __name__ == "__main__":
    main()
