"""The RMS norm every family's blocks use (Gemma's with its 1 + w), apart from engine.model so the attention kinds
beside it (engine.latent_attention) build on it without importing the decoder."""

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
