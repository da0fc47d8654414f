"""A Llama-shaped Q4_K_M GGUF file of random blocks at a chosen size, for timing how long a large file takes to open
(engine/BENCHMARKS.md, "Opening a model file"): Q4_K for q, k, o, gate, up and the embedding, Q6_K for v, down and the
output head, as llama.cpp's Q4_K_M mostly has them, with finite scales; a byte-level vocabulary of single characters
and "t<i>" tokens. The numbers mean nothing; the layout, sizes and metadata are a real file's.

    python -m engine.tools.synthetic_gguf out.gguf --hidden 4096 --layers 32 --intermediate 11008 --vocab 32000
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

BLOCK = {"Q4_K": 144, "Q6_K": 210}  # bytes a super-block of 256 values
HALVES = {"Q4_K": (0, 2), "Q6_K": (208,)}  # where each super-block's float16 fields sit


def random_blocks(rng: np.random.Generator, kind: str, rows: int, cols: int) -> np.ndarray:
    """[rows, cols / 256 · block bytes] uint8: random codes and scales, float16 fields small and finite."""
    raw = np.frombuffer(rng.bytes(rows * (cols // 256) * BLOCK[kind]), np.uint8).reshape(rows, cols // 256, -1).copy()
    for at in HALVES[kind]:
        raw[..., at : at + 2] = (
            (rng.random(raw.shape[:2], np.float32) * 1e-3).astype(np.float16)[..., None].view(np.uint8)
        )
    return raw.reshape(rows, -1)


def write(out: Path, hidden: int, layers: int, intermediate: int, vocab: int, heads: int, kv_heads: int) -> Path:
    import gguf

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(out.stem)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    tokens = chars + [f"t{i}" for i in range(vocab - len(chars))]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_token_merges(["t 1"])
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    kv = hidden // heads * kv_heads
    shapes = {
        "attn_q": ("Q4_K", hidden, hidden),
        "attn_k": ("Q4_K", kv, hidden),
        "attn_v": ("Q6_K", kv, hidden),
        "attn_output": ("Q4_K", hidden, hidden),
        "ffn_gate": ("Q4_K", intermediate, hidden),
        "ffn_up": ("Q4_K", intermediate, hidden),
        "ffn_down": ("Q6_K", hidden, intermediate),
    }
    w.add_tensor(
        "token_embd.weight", random_blocks(rng, "Q4_K", vocab, hidden), raw_dtype=gguf.GGMLQuantizationType.Q4_K
    )
    for i in range(layers):
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(hidden, np.float32))
        for name, (kind, rows, cols) in shapes.items():
            raw = random_blocks(rng, kind, rows, cols)
            w.add_tensor(f"blk.{i}.{name}.weight", raw, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output.weight", random_blocks(rng, "Q6_K", vocab, hidden), raw_dtype=gguf.GGMLQuantizationType.Q6_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=11008)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=32)
    a = p.parse_args(argv)
    path = write(a.out, a.hidden, a.layers, a.intermediate, a.vocab, a.heads, a.kv_heads)
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
