"""Several positions through the model in one pass, beside Transformer.forward's one sequence of new positions:
B sequences' next positions as rows (`rows`: torch's products over all of them, where kvchat's kernels do not run
decode) and one sequence's next n positions (`span`: a speculative verify). The architecture stays in
engine.model; this is how the engine feeds it more than one sequence's step at a time."""

from __future__ import annotations

import torch

from .model import Transformer, attention_dtype
from .rotary import rope_offset


def span(model: Transformer, tokens: list[int], cache) -> torch.Tensor:
    """`tokens` at positions cache.length.. of one sequence in one pass (a speculative verify): logits [n, V], row i
    the logits after token i. Where the backend's one-call step takes them, each position is a row of its batched
    step — the weights read once for all, each row bit for bit the decode step there alone (a row's attention sees
    the rows before it: they wrote their K/V first); elsewhere a forward of the n positions, as prefill computes
    them."""
    if len(tokens) > 1:
        out = model.forward_spans([(tokens, cache)], every=True)
        if out is not None:
            return out[0][0]  # [1, n, V] -> [n, V]
    ids = torch.tensor([tokens], device=model.norm.weight.device)  # [1, n]
    return model(ids, cache)[0]  # [1, n, V] -> [n, V]


def rows(model: Transformer, tokens: list[int], caches: list) -> torch.Tensor:
    """B sequences' next positions (a token each, each cache at its own length) in one pass through the blocks:
    every product takes the B rows at once, so torch reads each weight once for all of them (a GPU; a CPU without
    kvchat's kernels), and attention is each sequence's own, over its own cache and window. Logits [B, 1, V]; each
    row as `forward` computes it alone, up to the products' order of summation."""
    device = model.norm.weight.device
    starts = [c.length for c in caches]
    for c, s in zip(caches, starts):
        if s + 1 > c.capacity:
            raise ValueError(f"{s + 1} positions exceed the cache capacity of {c.capacity}")
        c.reserve(s, s + 1)
    turns = [s + rope_offset(c) for s, c in zip(starts, caches)]  # each row's rotary position
    at = torch.tensor(turns, device=device)  # [B]
    ropes = [  # each row's own position: [B, 1, 1, r]
        (cos.index_select(0, at)[:, None, None], sin.index_select(0, at)[:, None, None])
        for cos, sin in model.rope_tables(max(turns) + 1)
    ]
    x = model.embed_ids(torch.tensor([[t] for t in tokens], device=device))  # [B, 1, D]
    dtype = attention_dtype(x.dtype, x.device, model.widen_bf16)
    per_row = [model.masks(s, 1, dtype, device, c) for s, c in zip(starts, caches)]
    masks = {w: [m[w] for m in per_row] for w in per_row[0]}  # each window's mask of each row
    for i, layer in enumerate(model.layers):
        x = layer(x, ropes, masks, caches, i, starts)
    for c, s in zip(caches, starts):
        c.length = s + 1
    return model.logits(x)  # [B, 1, V]
