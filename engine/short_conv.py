"""LFM2's short convolution, the layer a hybrid keeps in place of attention on most of its blocks: the input gated
and convolved over the last K positions, channel by channel. What it carries from one position to the next is not
K/V that grow with T but a state of fixed size, the last K − 1 gated inputs of every channel
(engine.state_cache.HybridCache keeps it, and snapshots of it every 16 positions, so an edit can go back).

Shapes: B batch, T new positions, D hidden, K the kernel's width (LFM2's conv_L_cache, 3).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from .config import ModelConfig


class ShortConv(nn.Module):
    """out(C · conv(B · x)) with B, C, x = in_proj(x) in thirds: a depthwise causal convolution of width K over the
    gated input, gated again. Takes Attention's place in a block (the same call), with no window and no rotation."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        D, self.k = cfg.hidden_size, cfg.conv_kernel
        self.in_proj = nn.Linear(D, 3 * D, bias=cfg.conv_bias)  # D -> 3D
        self.conv = nn.Conv1d(D, D, self.k, groups=D, bias=cfg.conv_bias)  # weight [D, 1, K]
        self.out_proj = nn.Linear(D, D, bias=cfg.conv_bias)  # D -> D
        self.window, self.rope_kind, self.causal_only = None, None, True  # as Attention's, for Block and the masks
        self.sinks = None

    def linears(self) -> list[str]:
        """The projections a backend may swap (quantize, lay out); the convolution's few weights stay."""
        return ["in_proj", "out_proj"]

    def forward(self, x, cos, sin, mask, cache, layer: int, start, causal: bool = True):
        """x [B, T, D] at positions start.. -> [B, T, D]; the state before them read from `cache` (zeros from position
        0, or without a cache), the state after them written back (a list of caches: one a row)."""
        B, T, D = x.shape
        gate_in, gate_out, h = self.in_proj(x).chunk(3, dim=-1)  # [B, T, D] each
        u = (gate_in * h).transpose(1, 2)  # [B, D, T]
        if isinstance(cache, list):  # one row a sequence, each with its own state
            y = torch.cat([self._convolve(u[b : b + 1], cache[b], layer, start[b]) for b in range(B)])
        else:
            y = self._convolve(u, cache, layer, start)
        return self.out_proj(gate_out * y.transpose(1, 2))  # [B, T, D]

    def _convolve(self, u: torch.Tensor, cache, layer: int, start: int) -> torch.Tensor:
        """u [B, D, T] -> [B, D, T] over the state [B, D, K − 1] of the positions before `start`, then kept."""
        prev = None if cache is None or start == 0 else cache.conv_state(layer, start)
        if prev is None:
            prev = u.new_zeros(u.shape[0], u.shape[1], self.k - 1)
        full = torch.cat((prev.to(u.dtype), u), dim=-1)  # [B, D, K − 1 + T]
        if cache is not None:
            cache.keep_conv_state(layer, start, full)
        return F.conv1d(full, self.conv.weight, self.conv.bias, groups=u.shape[1])  # [B, D, T]
