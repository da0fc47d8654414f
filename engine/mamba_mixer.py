"""Granite 4.0-H's Mamba-2 mixer, the layer that takes attention's place on most of its blocks: a gated, selective
state-space scan. What it carries from one position to the next is not K/V that grow with T but a state of fixed
size — its convolution's last K_m − 1 inputs and the scan's state h [H_m, P, N] — which
engine.state_cache.HybridCache keeps, with snapshots, so an edit can go back.

Per position t and head: Δ = clamp(softplus(dt + dt_bias)), h ← exp(Δ·A) · h + Δ · x ⊗ B, y = h · C + D · x, then
out(norm(y · silu(z))). Many positions run as the chunked form of the same recurrence (state-space duality: within a
chunk, y is a masked product like attention's; across chunks, the state carries on); the chunks end where the cache
wants a state (a snapshot's position, the last), so no position's state is computed twice.

Shapes: B batch, T new positions, D hidden, I = H_m · P the inner width, H_m heads, P a head's channels, N the
state's width, G_m the groups B and C are shared by, C_m = I + 2 · G_m · N the convolution's channels, K_m its width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .block_parts import ScanLayer

if TYPE_CHECKING:
    from .config import ModelConfig


class GatedNorm(nn.Module):
    """RMSNorm of y · silu(z) over each of the G_m groups of the inner width, in float32."""

    def __init__(self, width: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))  # [I]
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y [B, T, I] (float32), z [B, T, I] -> [B, T, I] in z's dtype."""
        g = (y * F.silu(z.float())).unflatten(-1, (self.groups, -1))  # [B, T, G_m, I / G_m]
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * g.flatten(-2)).to(z.dtype)


class MambaMixer(ScanLayer):
    """in_proj splits into the gate z [I], the convolution's input xBC [C_m] and the step dt [H_m]; xBC is convolved
    (depthwise, causal, width K_m) and passed through silu, then split into x [I], B and C [G_m · N] for the scan.
    Takes Attention's place in a block (the same call), with no window and no rotation."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        D = cfg.hidden_size
        self.h, self.p, self.n, self.g = cfg.mamba_heads, cfg.mamba_head_dim, cfg.mamba_state, cfg.mamba_groups
        self.i, self.c, self.k = cfg.mamba_inner, cfg.mamba_conv_width, cfg.mamba_kernel
        self.in_proj = nn.Linear(D, self.i + self.c + self.h, bias=cfg.mamba_proj_bias)  # D -> I + C_m + H_m
        self.conv = nn.Conv1d(self.c, self.c, self.k, groups=self.c, bias=cfg.mamba_conv_bias)  # weight [C_m, 1, K_m]
        self.dt_bias = nn.Parameter(torch.zeros(self.h))  # [H_m]
        self.A_log = nn.Parameter(torch.zeros(self.h))  # [H_m]: A = −exp(A_log)
        self.D = nn.Parameter(torch.ones(self.h))  # [H_m]: the skip, y += D · x
        self.norm = GatedNorm(self.i, self.g, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.i, D, bias=cfg.mamba_proj_bias)  # I -> D
        self.low, self.high = cfg.dt_limit

    def forward(self, x, cos, sin, mask, cache, layer: int, start, causal: bool = True):
        """x [B, T, D] at positions start.. -> [B, T, D]; the state before them read from `cache` (zeros from position
        0, or without a cache), the state after them written back (a list of caches: one a row)."""
        z, xbc, dt = self.in_proj(x).split([self.i, self.c, self.h], dim=-1)  # [B, T, I], [B, T, C_m], [B, T, H_m]
        return self.out_proj(self.norm(self.rows((xbc, dt), cache, layer, start), z))  # [B, T, D]

    def scan(self, u, dt, h0, ends: list[int]):
        """u [B, t, C_m] (x, B, C after the convolution, float32), dt [B, t, H_m] the raw steps, h0 [B, H_m, P, N] or
        None (zeros) -> (y [B, t, I] with the skip, {e: the state after e positions} for each e in `ends`)."""
        xs, Bm, Cm = u.split([self.i, self.g * self.n, self.g * self.n], dim=-1)
        x = xs.unflatten(-1, (self.h, self.p))  # [B, t, H_m, P]
        delta = F.softplus(dt.float() + self.dt_bias.float()).clamp(self.low, self.high)  # [B, t, H_m]
        A = -torch.exp(self.A_log.float())  # [H_m]
        rep = self.h // self.g  # heads per group
        Bh = Bm.unflatten(-1, (self.g, self.n)).repeat_interleave(rep, dim=2)  # [B, t, H_m, N]
        Ch = Cm.unflatten(-1, (self.g, self.n)).repeat_interleave(rep, dim=2)
        h = h0.float() if h0 is not None else x.new_zeros(x.shape[0], self.h, self.p, self.n)
        y, states = self.chunked(lambda h, a, b: _chunk(h, x[:, a:b], delta[:, a:b], A, Bh[:, a:b], Ch[:, a:b]),
                                 h, x.shape[1], ends)  # fmt: skip
        return (y + x * self.D.float()[:, None]).flatten(-2), states


def _chunk(h, x, dt, A, Bh, Ch):
    """One chunk of the scan in its dual form: h [B, H_m, P, N] the state before it, x [B, t, H_m, P], dt [B, t, H_m],
    A [H_m], Bh and Ch [B, t, H_m, N] -> (y [B, t, H_m, P] without the skip, the state after it)."""
    a = dt * A  # [B, t, H_m]: log of each position's decay
    cum = a.cumsum(dim=1)  # [B, t, H_m]
    xdt = x * dt[..., None]  # [B, t, H_m, P]
    if x.shape[1] == 1:  # one position: the recurrence itself
        decay = torch.exp(a[:, 0])[..., None, None]  # [B, H_m, 1, 1]
        h = h * decay + xdt[:, 0, :, :, None] * Bh[:, 0, :, None, :]  # [B, H_m, P, N]
        return torch.einsum("bhpn,bhn->bhp", h, Ch[:, 0])[:, None], h
    t = x.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()  # [t(i), t(j)]
    seg = (cum[:, :, None, :] - cum[:, None, :, :]).masked_fill(~causal[None, :, :, None], float("-inf"))
    scores = torch.einsum("bihn,bjhn->bijh", Ch, Bh) * torch.exp(seg)  # [B, t, t, H_m]
    y = torch.einsum("bijh,bjhp->bihp", scores, xdt)  # [B, t, H_m, P]: within the chunk
    y = y + torch.einsum("bihn,bhpn->bihp", Ch, h) * torch.exp(cum)[..., None]  # the state before it, decayed
    last = cum[:, -1]  # [B, H_m]
    carry = torch.exp(last[:, None] - cum)[..., None] * Bh  # [B, t, H_m, N]
    h = h * torch.exp(last)[..., None, None] + torch.einsum("bjhn,bjhp->bhpn", carry, xdt)
    return y, h
