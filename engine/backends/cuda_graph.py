"""Decode steps replayed from a CUDA graph: one launch per token instead of hundreds of kernels.

At batch 1 a small model's decode step on a GPU is bound by kernel launches: the step is captured
once (static shapes: `Transformer.forward_static`, the token and its position in device tensors)
and replayed for every token. The first replay is checked against the same step
run eagerly; any failure or mismatch leaves the session on the eager path, with the reason kept. Over the KV
pool the step reads each position's slot from the cache's slot map (a device tensor updated in place when a
block is added), and a pool that grew has moved its buffers: the graph is captured again.
"""

from __future__ import annotations

import os
import weakref

import torch

from ..feedforward import MoE
from ..state_cache import HybridCache


def graphs_wanted(device: torch.device, cache) -> bool:
    """On CUDA, over a cache in the model dtype, unless KVCHAT_CUDA_GRAPHS=0."""
    return device.type == "cuda" and not cache.quantized and os.environ.get("KVCHAT_CUDA_GRAPHS", "1") != "0"


class GraphDecoder:
    def __init__(self, model, cache):
        if any(isinstance(b.mlp, MoE) and b.mlp.stacked is None for b in model.layers):
            raise ValueError("a mixture's experts are not stacked (quantized): its step picks them on the host")
        if cache.windowed:
            raise ValueError("a sliding layer's ring is not captured: its step runs eagerly")
        if isinstance(cache, HybridCache):
            raise ValueError("a hybrid's states are not captured: its step runs eagerly")
        dev = cache.k.device
        self.model, self.cache = model, cache
        self.at = self._addresses()  # the buffers the graph reads and writes (a pool's growth moves them)
        self.ids = torch.zeros((1, 1), dtype=torch.long, device=dev)  # [B, 1], the token being consumed
        self.pos = torch.full((1,), cache.length, dtype=torch.long, device=dev)  # its position
        model.rope_tables(cache.capacity)  # built before capture: no allocation inside the graph
        cache.reserve(cache.length, cache.length + 1)  # the warm-up's slot (a pool's block, before capture)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up writes the slot at `length`, which the first real step overwrites
                model.forward_static(self.ids, self.pos, cache)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = model.forward_static(self.ids, self.pos, cache)  # [1, 1, V], rewritten by each replay
        self.checked = False

    def _addresses(self) -> tuple[weakref.ref, ...]:
        return tuple(weakref.ref(b) for b in self.cache.buffers())

    @property
    def moved(self) -> bool:
        """Whether the cache's buffers are no longer those the graph was captured on (a KV pool grew)."""
        return any(ref() is not b for ref, b in zip(self.at, self.cache.buffers()))

    def step(self, token: int) -> torch.Tensor:
        """Consume `token` at position cache.length; returns the logits for the next one."""
        cache = self.cache
        cache.reserve(cache.length, cache.length + 1)  # its block (a copy of a shared one) before the replay
        if self.moved:
            raise RuntimeError("the KV pool's buffers moved after the graph was captured")
        self.ids.fill_(token)
        self.pos.fill_(cache.length)
        self.graph.replay()
        if not self.checked:  # the first replay against the eager step (same inputs, same slot)
            eager = self.model.forward_static(self.ids, self.pos, cache)
            if not torch.allclose(self.logits.float(), eager.float(), rtol=1e-2, atol=1e-2):
                raise RuntimeError("CUDA graph replay differs from the eager step")
            self.checked = True
        cache.length += 1
        return self.logits
