"""The GPU paths, checked where they can be: the static-shape decode step behind CUDA graphs and
native-GQA prefill give the eager path's logits on the CPU; on a CUDA machine the session decodes
through a captured graph and still equals the uncached recompute."""

import pytest
import torch
from conftest import DEVICES

from checkpoints import make_checkpoint
from engine.kv_cache import KVCache
from engine.session import Request, Session
from engine.weights.loading import load_model

CASES = {
    "llama": dict(family="llama"),
    "qwen3": dict(family="qwen3"),
    "mistral-sliding-window": dict(family="mistral", sliding_window=8),
    "qwen2": dict(family="qwen2", tie=True),
}


def _model(tmp_path, name):
    opts = dict(CASES[name])
    loaded = load_model(make_checkpoint(tmp_path, opts.pop("family"), **opts), device="cpu", dtype="float32")
    return loaded.model, loaded.config


def _cache(cfg, capacity=48, device="cpu"):
    return KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, torch.float32, device)


@pytest.mark.parametrize("name", sorted(CASES))
def test_static_decode_step_equals_the_eager_step(tmp_path, name):
    model, cfg = _model(tmp_path, name)
    prompt = torch.randint(5, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))
    a, b = _cache(cfg), _cache(cfg)
    with torch.inference_mode():
        model(prompt, a)
        model(prompt, b)
        token = torch.tensor([[7]])
        for _ in range(20):  # past the sliding window of 8
            want = model(token, a)  # [1, 1, V]
            got = model.forward_static(token, torch.tensor([b.length]), b)
            b.length += 1
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            token = want[:, -1].argmax(-1, keepdim=True)
    torch.testing.assert_close(a.k[:, :, :, : a.length], b.k[:, :, :, : b.length], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_native_gqa_prefill_equals_one_position_at_a_time(tmp_path, name):
    """Prefill (SDPA's native GQA: causal on a fresh prompt, an additive mask for a later chunk or a
    sliding window) gives the logits of feeding the prompt one position at a time (the query heads
    grouped as rows over their shared K/V), whole or in chunks."""
    model, cfg = _model(tmp_path, name)
    model.decode_step = None  # the modules' one-position path, not the kernels' C step
    prompt = torch.randint(5, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        c = _cache(cfg)
        want = torch.cat([model(prompt[:, i : i + 1], c) for i in range(prompt.shape[1])], dim=1)
        got_one = model(prompt, _cache(cfg))
        c2 = _cache(cfg)
        got_chunks = torch.cat([model(prompt[:, :12], c2), model(prompt[:, 12:], c2)], dim=1)
    torch.testing.assert_close(got_one, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_chunks, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_session_decode_path(llama_dir, device):
    loaded = load_model(llama_dir, device=device, dtype="float32")
    session = Session(loaded, capacity=64)
    last = list(session.generate(Request(prompt_ids=tuple(range(5, 25)), max_new_tokens=12)))[-1]
    assert session.decode_path == ("cuda-graph" if device == "cuda" else "eager"), session.graph_error
    # the graph's tokens equal a full recompute at every step
    ids = torch.tensor([list(range(5, 25))], device=device)
    with torch.inference_mode():
        for tok in last.token_ids:
            assert int(loaded.model(ids, last_only=True)[0, -1].argmax()) == tok
            ids = torch.cat([ids, torch.tensor([[tok]], device=device)], dim=1)
