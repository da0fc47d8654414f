"""GGUF export for the llama.cpp comparison: names, shapes, the q/k permutation, and (where
llama-cpp-python is installed) the same greedy tokens as kvchat on the demo model."""

import importlib.util

import pytest
import torch
from safetensors import safe_open

gguf = pytest.importorskip("gguf")

from engine.tools.gguf_export import _permute, write_gguf  # noqa: E402


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_permute_interleaves_rotary_halves():
    # one head of width 4: rows (x0, x1 | x2, x3) rotate as pairs (x0, x2), (x1, x3) in the HF layout
    w = torch.arange(4.0)[:, None]
    assert _permute(w, 1).view(-1).tolist() == [0.0, 2.0, 1.0, 3.0]
    x = torch.randn(12, 5)
    assert torch.equal(_unpermute(_permute(x, 3), 3), x)


def test_gguf_holds_every_tensor(llama_dir, tmp_path):
    out = write_gguf(llama_dir, tmp_path / "m.gguf")
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    with safe_open(str(llama_dir / "model.safetensors"), framework="pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        down = f.get_tensor("model.layers.1.mlp.down_proj.weight")
        n_layers = 1 + max(int(k.split(".")[2]) for k in f.keys() if k.startswith("model.layers."))
    assert "token_embd.weight" in tensors and "output_norm.weight" in tensors
    assert sum(name.startswith("blk.") for name in tensors) == 9 * n_layers
    got_down = torch.from_numpy(tensors["blk.1.ffn_down.weight"].data.copy()).view(down.shape)
    assert torch.equal(got_down, down.float())
    from engine.config import load_config

    n_heads = load_config(llama_dir).num_heads
    got_q = torch.from_numpy(tensors["blk.0.attn_q.weight"].data.copy()).view(q.shape)
    assert torch.equal(_unpermute(got_q, n_heads), q.float())


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python (the bench extra)")
def test_llama_cpp_runs_the_same_weights(demo_model_dir, tmp_path):
    from engine.session import Request, Session
    from engine.tools.llamacpp import LlamaCpp
    from engine.weights.loading import load_model

    loaded = load_model(demo_model_dir)
    session = Session(loaded, capacity=256)
    messages = ({"role": "user", "content": "My budget is 600 yuan for 3 nights in Kyoto. How much per night?"},)
    last = list(session.generate(Request(messages=messages, max_new_tokens=20)))[-1]
    prompt = loaded.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
    lc = LlamaCpp(write_gguf(demo_model_dir, tmp_path / "demo.gguf"), n_ctx=256, threads=1)
    ids, _, _ = lc.generate(prompt, len(last.token_ids))
    lc.close()
    assert ids == list(last.token_ids)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python (the bench extra)")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_cpp_greedy_tokens_equal_kvchat_per_family(tmp_path, family):
    from engine.session import Request, Session
    from engine.tools.bench.shapes import write_random_checkpoint
    from engine.tools.llamacpp import LlamaCpp
    from engine.tools.selftest import TINY
    from engine.weights.loading import load_model

    path = write_random_checkpoint(tmp_path / family, TINY[family], std=0.2)  # peaked logits: no near-ties
    loaded = load_model(path)
    loaded.tokenizer.stop_ids = frozenset()
    prompt = list(range(5, 45))
    last = list(Session(loaded, capacity=128).generate(Request(prompt_ids=tuple(prompt), max_new_tokens=24)))[-1]
    lc = LlamaCpp(write_gguf(path, tmp_path / f"{family}.gguf"), n_ctx=128, threads=1)
    ids, _, _ = lc.generate(prompt, 24)
    lc.close()
    assert ids == list(last.token_ids)


def test_the_c_headers_gguf_kinds_and_block_sizes_are_the_weights_sides():
    """GGUF block geometry is defined once (engine.weights.gguf_header.GGUF_ROWS, from GGML_TYPES): the C side's
    enum of kinds and its block sizes must be the same numbers, in the same order."""
    import re
    from pathlib import Path

    from engine.weights.gguf_header import GGUF_ROWS

    csrc = Path(__file__).resolve().parents[2] / "engine" / "backends" / "csrc"
    enum = re.search(r"enum \{ (KV_GGUF_[^}]*)\}", (csrc / "kernels.h").read_text()).group(1)
    names = [n.strip().removeprefix("KV_GGUF_") for n in enum.split(",") if n.strip()]
    assert names == sorted(GGUF_ROWS, key=lambda k: GGUF_ROWS[k][0])
    sizes = re.search(r"bytes\[\] = \{([^}]*)\}", (csrc / "gguf_rows.c").read_text()).group(1)
    assert [int(b) for b in sizes.split(",")] == [GGUF_ROWS[n][1] for n in names]
