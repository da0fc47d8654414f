"""What the attention kinds and the decoder's blocks share: the RMS norm (Gemma's with its 1 + w), the dtype
attention computes in, and what the scanning layers in attention's place share (ScanLayer). Apart from engine.model
so the layers beside it (engine.latent_attention, engine.mamba_mixer, engine.delta_net) build on them without
importing the decoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """x / rms(x) · w, or · (1 + w) with `offset` (Gemma, which also scales in float32 before the cast)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            return (F.rms_norm(x.float(), self.weight.shape, None, self.eps) * (self.weight.float() + self.offset)).to(
                x.dtype
            )
        # Normalise in float32, scale in the model dtype (as transformers does, so bf16 matches).
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused kernel
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


def attention_dtype(dtype: torch.dtype, device: torch.device, widen_bf16: bool = False) -> torch.dtype:
    """The dtype attention computes in: the activations', float32 for float16 on the CPU (its fp16 kernel is slow)
    and, with `widen_bf16` (the loader's, on a CPU without bf16 instructions, where SDPA falls back to its slow
    reference path), for bfloat16 there too."""
    if device.type == "cpu" and (dtype == torch.float16 or (dtype == torch.bfloat16 and widen_bf16)):
        return torch.float32
    return dtype


class ScanLayer(nn.Module):
    """What a scanning state layer in attention's place shares (Granite 4.0-H's Mamba-2 mixer, Qwen3-Next's gated
    DeltaNet): no window, no rotation, no sinks; its two projections the ones a backend may swap (the convolution's
    and the scan's few weights stay); a batch's rows each run over a state of its own."""

    window, rope_kind, causal_only, sinks = None, None, True, None  # as Attention's, for Block and the masks

    def linears(self) -> list[str]:
        return ["in_proj", "out_proj"]

    def rows(self, inputs: tuple[torch.Tensor, ...], cache, layer: int, start):
        """`_mix(*inputs, cache, layer, start)` over the batch: each row over its own cache where `cache` is a list
        (one a row, `start` likewise), else all rows at once."""
        if isinstance(cache, list):
            return torch.cat([self._mix(*(t[r : r + 1] for t in inputs), cache[r], layer, start[r])
                              for r in range(len(cache))])  # fmt: skip
        return self._mix(*inputs, cache, layer, start)
