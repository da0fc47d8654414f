"""Qwen3-Next's gated DeltaNet, the linear attention on three of every four of its layers. What it carries from one
position to the next is not K/V that grow with T but a state of fixed size — its convolution's last K_δ − 1 inputs
and a matrix S [H_v, d_k, d_v] per sequence — which engine.state_cache.HybridCache keeps, with snapshots, so an
edit can go back.

Per position t and value head (its query/key head shared with H_v / H_k − 1 others): q and k L2-normalised (q also
by 1/√d_k), the decay α = exp(g), g = −exp(A_log) · softplus(a + dt_bias), the write strength β = σ(b); then
S ← α · S, u = β · (v − Sᵀk), S ← S + k ⊗ u, o = Sᵀq: the delta rule writes into S only what it did not already
predict for k. The output is normalised per head, gated by silu(z), and projected back. Many positions run as the
chunked form of the same recurrence (within a chunk, the writes solve one triangular system, as the WY form of
DeltaNet has them; across chunks, S carries on); the chunks end where the cache wants a state, so no position's
state is computed twice.

Shapes: B batch, T new positions, D hidden, H_k and H_v the query/key and value heads, d_k and d_v their widths,
C_δ = 2 · H_k · d_k + H_v · d_v the convolution's channels (q, k, v), K_δ its width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .block_parts import ScanLayer

if TYPE_CHECKING:
    from .config import ModelConfig


class HeadNorm(nn.Module):
    """RMSNorm over each value head's d_v outputs (weight w, not 1 + w), then × silu(z), in float32."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))  # [d_v]
        self.eps = eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y [B, T, H_v, d_v] (float32), z [B, T, H_v · d_v] -> [B, T, H_v · d_v] in z's dtype."""
        n = F.rms_norm(y, self.weight.shape, self.weight.float(), self.eps)
        return (n.flatten(-2) * F.silu(z.float())).to(z.dtype)


class GatedDeltaNet(ScanLayer):
    """in_proj gives q, k, v (the convolution's input, C_δ), the gate z [H_v · d_v] and b, a [H_v] each (the rows in
    that order: engine.weights.hf_names reads them out of the checkpoint's per-head interleaving). Takes
    Attention's place in a block (the same call), with no window and no rotation."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        D = cfg.hidden_size
        self.hk, self.hv, self.dk, self.dv = cfg.delta_k_heads, cfg.delta_v_heads, cfg.delta_k_dim, cfg.delta_v_dim
        self.c, self.k = cfg.delta_conv_width, cfg.delta_kernel
        self.vw = self.hv * self.dv
        self.in_proj = nn.Linear(D, self.c + self.vw + 2 * self.hv, bias=False)  # D -> C_δ + H_v·d_v + 2·H_v
        self.conv = nn.Conv1d(self.c, self.c, self.k, groups=self.c, bias=False)  # weight [C_δ, 1, K_δ]
        self.dt_bias = nn.Parameter(torch.ones(self.hv))  # [H_v]
        self.A_log = nn.Parameter(torch.zeros(self.hv))  # [H_v]: the decay's rate −exp(A_log)
        self.norm = HeadNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.vw, D, bias=False)  # H_v·d_v -> D

    def forward(self, x, cos, sin, mask, cache, layer: int, start, causal: bool = True):
        """x [B, T, D] at positions start.. -> [B, T, D]; the state before them read from `cache` (zeros from position
        0, or without a cache), the state after them written back (a list of caches: one a row)."""
        qkv, z, steps = self.in_proj(x).split([self.c, self.vw, 2 * self.hv], dim=-1)  # steps: b then a
        return self.out_proj(self.norm(self.rows((qkv, steps), cache, layer, start), z))  # [B, T, D]

    def scan(self, u, steps, s0, ends: list[int]):
        """u [B, t, C_δ] (q, k, v after the convolution, float32), steps [B, t, 2·H_v] (b, a), s0 [B, H_v, d_k, d_v]
        or None (zeros) -> (o [B, t, H_v, d_v], {e: the state after e positions} for each e in `ends`)."""
        q, k, v = u.split([self.hk * self.dk, self.hk * self.dk, self.vw], dim=-1)
        rep = self.hv // self.hk  # value heads a query/key head serves (consecutive ones)
        q = _unit(q.unflatten(-1, (self.hk, self.dk))).repeat_interleave(rep, dim=2) * self.dk**-0.5  # [B, t, H_v, d_k]
        k = _unit(k.unflatten(-1, (self.hk, self.dk))).repeat_interleave(rep, dim=2)
        v = v.unflatten(-1, (self.hv, self.dv))  # [B, t, H_v, d_v]
        b, a = steps.float().split([self.hv, self.hv], dim=-1)  # [B, t, H_v] each
        g = -torch.exp(self.A_log.float()) * F.softplus(a + self.dt_bias.float())  # log of each position's decay
        beta = torch.sigmoid(b)
        s = s0.float() if s0 is not None else v.new_zeros(v.shape[0], self.hv, self.dk, self.dv)
        return self.chunked(lambda s, a, b: _chunk(s, q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b]),
                            s, v.shape[1], ends)  # fmt: skip


def _unit(x: torch.Tensor) -> torch.Tensor:
    """Each head's vector [.., d] scaled to length 1 (1e-6 under the root, as the reference kernels have it)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def _chunk(s, q, k, v, g, beta):
    """One chunk of the rule: s [B, H_v, d_k, d_v] the state before it, q and k [B, t, H_v, d_k], v [B, t, H_v, d_v],
    g and beta [B, t, H_v] -> (o [B, t, H_v, d_v], the state after it).

    With γ_i the decay's log summed to i in the chunk, each write is u_i = β_i (v_i − e^{γ_i} s₀ᵀk_i −
    Σ_{j<i} e^{γ_i − γ_j} (k_i · k_j) u_j): lower-triangular in u, so (I + A) U = βV − diag(β e^γ) K s₀ with
    A_ij = β_i e^{γ_i − γ_j} k_i · k_j (j < i), solved once; then o_i = e^{γ_i} s₀ᵀq_i + Σ_{j≤i} e^{γ_i − γ_j}
    (q_i · k_j) u_j and s = e^{γ_t} s₀ + Σ_j e^{γ_t − γ_j} k_j ⊗ u_j. Every exponent is ≤ 0."""
    if v.shape[1] == 1:  # one position: the recurrence itself
        s = s * torch.exp(g[:, 0])[..., None, None]  # [B, H_v, d_k, d_v]
        k0 = k[:, 0]  # [B, H_v, d_k]
        u = (v[:, 0] - torch.einsum("bhkv,bhk->bhv", s, k0)) * beta[:, 0, :, None]  # [B, H_v, d_v]
        s = s + k0[..., None] * u[..., None, :]
        return torch.einsum("bhkv,bhk->bhv", s, q[:, 0])[:, None], s
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H_v, t, d]
    g, beta = g.transpose(1, 2), beta.transpose(1, 2)  # [B, H_v, t]
    t = g.shape[-1]
    cum = g.cumsum(dim=-1)  # γ [B, H_v, t]
    lower = torch.ones(t, t, dtype=torch.bool, device=g.device).tril()  # [t(i), t(j)], j ≤ i
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [B, H_v, t, t]
    kb = k * beta[..., None]  # [B, H_v, t, d_k]
    system = (kb @ k.transpose(-1, -2)) * decay  # I + A read off its strict lower part (unitriangular)
    u0 = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)  # [.., t, d_v]
    w = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)  # [.., d_k]
    u = u0 - w @ s  # [B, H_v, t, d_v]: the writes
    o = (q * cum.exp()[..., None]) @ s + ((q @ k.transpose(-1, -2)) * decay) @ u  # [B, H_v, t, d_v]
    last = cum[..., -1]  # [B, H_v]
    s = s * last.exp()[..., None, None] + (k * (last[..., None] - cum).exp()[..., None]).transpose(-1, -2) @ u
    return o.transpose(1, 2), s
