"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): a position caches one latent c (d_c values, shared by every
head) and one rotated key k_r (d_r values, shared too) instead of K and V per head; each head's unrotated key and its
value are the latent times that head's rows of `kv_b`. So a cached position takes L·(d_c + d_r)·b bytes where plain
attention over the same heads would take L·H·(d_n + d_r + d_v)·b.

Two ways to attend, the same numbers up to rounding: a prompt expands the cached latents into every head's K and V
(`expanded`: one product over the S positions, then attention as usual); a decode step (and any few positions)
absorbs `kv_b` into the query and the output instead (`absorbed`: q_n·W_uk is a d_c-wide query over the latents
themselves, and the weighted latents times W_uv are each head's value), so no position is expanded.
The cache holds [c | k_r] of each position as its K and V halves (engine.config.ModelConfig.cache_width): one
head of (d_c + d_r) / 2 values in each, read in place.

Shapes: B batch, T new positions, S attended positions, D hidden, H heads, d_n / d_r / d_v a head's unrotated key,
rotated key and value widths, d_c the latent, w = (d_c + d_r) / 2 the cache's half.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .block_parts import RMSNorm, attention_dtype
from .rotary import apply_rotary, deinterleave

if TYPE_CHECKING:
    from .config import ModelConfig

LORA_EPS = 1e-6  # the latent's and the query's own RMSNorms (DeepSeek's modules default to it, whatever the config)


class LatentAttention(nn.Module):
    """Attention over cached latents: projections q (or q_a, its norm, q_b), kv_a (D -> d_c + d_r), the latent's
    norm, kv_b (d_c -> H·(d_n + d_v), kept in the model dtype: decode reads it as the absorbed query and value
    maps) and o (H·d_v -> D)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.h, self.dn, self.dr, self.dv, self.dc = (
            cfg.num_heads, cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        )  # fmt: skip
        self.w = cfg.cache_width  # (d_c + d_r) / 2: each cache half's values
        D, qd = cfg.hidden_size, cfg.num_heads * (cfg.qk_nope_head_dim + cfg.head_dim)
        if cfg.q_lora_rank:
            self.q, self.q_a = None, nn.Linear(D, cfg.q_lora_rank, bias=cfg.qkv_bias)  # D -> q_lora
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LORA_EPS)
            self.q_b = nn.Linear(cfg.q_lora_rank, qd, bias=False)  # q_lora -> H(d_n + d_r)
        else:
            self.q = nn.Linear(D, qd, bias=False)  # D -> H(d_n + d_r)
            self.q_a = self.q_a_norm = self.q_b = None
        self.kv_a = nn.Linear(D, self.dc + self.dr, bias=cfg.qkv_bias)  # D -> d_c + d_r
        self.kv_a_norm = RMSNorm(self.dc, LORA_EPS)
        self.kv_b = nn.Linear(self.dc, self.h * (self.dn + self.dv), bias=False)  # d_c -> H(d_n + d_v)
        self.o = nn.Linear(self.h * self.dv, D, bias=cfg.o_bias)  # H d_v -> D
        self.scale = cfg.attention_scale
        self.interleaved = cfg.rope_interleave
        self.window, self.rope_kind, self.causal_only = None, 0, True  # as Attention's, for Block and the masks
        self.sinks = self.softcap = None
        self.absorb_below = max(2, (self.dn + self.dv) // 2)  # T where expanding S latents costs what absorbing does
        self.widen_bf16 = False

    def linears(self) -> list[str]:
        """The projections a backend may swap (quantize, lay out): all but kv_b, which decode reads as weights."""
        return (["q"] if self.q is not None else ["q_a", "q_b"]) + ["kv_a", "o"]

    def rotate(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """x [B, T, heads, d_r] rotated (its pairs first put in the half-split layout where DeepSeek interleaves)."""
        return apply_rotary(deinterleave(x) if self.interleaved else x, cos, sin)

    def project(self, x, cos, sin):
        """x [B, T, D] -> q_n [B, T, H, d_n], q_r [B, T, H, d_r] rotated, and each position's cache row
        [B, 1, T, d_c + d_r]: the normalised latent, then the rotated shared key."""
        B, T, _ = x.shape
        q = self.q(x) if self.q is not None else self.q_b(self.q_a_norm(self.q_a(x)))  # [B, T, H(d_n + d_r)]
        q_n, q_r = q.view(B, T, self.h, self.dn + self.dr).split([self.dn, self.dr], dim=-1)
        c, k_r = self.kv_a(x).split([self.dc, self.dr], dim=-1)  # [B, T, d_c], [B, T, d_r]
        k_r = self.rotate(k_r.unsqueeze(2), cos, sin)[:, :, 0]  # [B, T, d_r]
        row = torch.cat((self.kv_a_norm(c), k_r), dim=-1).unsqueeze(1)  # [B, 1, T, d_c + d_r]
        return q_n, self.rotate(q_r, cos, sin), row

    def forward(self, x, cos, sin, mask, cache, layer: int, start, causal: bool = True):
        """As engine.model.Attention.forward: x [B, T, D] at positions start.. -> [B, T, D], the new positions'
        rows written into `cache` (a list of caches, one row each, for B sequences' next positions)."""
        q_n, q_r, row = self.project(x, cos, sin)
        w = self.w
        if isinstance(cache, list):  # one row a sequence, each over its own positions
            rows = []
            for b in range(x.shape[0]):
                k, v = cache[b].write(layer, start[b], *_halves(row[b : b + 1], w))
                rows.append(self.attend(q_n[b : b + 1], q_r[b : b + 1], k, v, mask[b], start[b]))
            return self.o(torch.cat(rows))
        if cache is None:
            k, v = _halves(row, w)
        elif isinstance(start, torch.Tensor):  # static shapes (CUDA graphs): every slot, masked beyond the position
            k, v = cache.write_at(layer, start, *_halves(row, w))
        else:
            k, v = cache.write(layer, start, *_halves(row, w))  # [B, 1, S, w] each
        return self.o(self.attend(q_n, q_r, k, v, mask, start, causal))

    def attend(self, q_n, q_r, k, v, mask, start, causal: bool = True) -> torch.Tensor:
        """q_n [B, T, H, d_n], q_r [B, T, H, d_r] over the cache's halves k, v [B, 1, S, w] -> [B, T, H d_v]."""
        dtype = q_n.dtype
        if attention_dtype(dtype, q_n.device, self.widen_bf16) != dtype:
            q_n, q_r, k, v = (t.float() for t in (q_n, q_r, k, v))
        if q_n.shape[1] < self.absorb_below:
            y = self.absorbed(q_n, q_r, k, v, mask)
        else:
            y = self.expanded(q_n, q_r, k, v, mask, causal and isinstance(start, int) and start == 0)
        return y.to(dtype)

    def absorbed(self, q_n, q_r, k, v, mask) -> torch.Tensor:
        """Attention in the latent's space: the query's unrotated part times W_uk is a d_c-wide query over the
        cached latents, the rotated part one over the shared keys; the weighted latents times W_uv each head's
        output. The heads are rows of one product over the cache, which is read in place."""
        B, T, H, _ = q_n.shape
        S, w, dc = k.shape[2], self.w, self.dc
        maps = self.kv_b.weight.to(q_n.dtype).view(H, self.dn + self.dv, dc)  # [H, d_n + d_v, d_c]
        q_lat = torch.einsum("bthn,hnc->bhtc", q_n, maps[:, : self.dn])  # [B, H, T, d_c]
        q = torch.cat((q_lat, q_r.transpose(1, 2)), dim=-1).reshape(B, 1, H * T, dc + self.dr)  # heads as rows
        scores = (q[..., :w] @ k.transpose(-1, -2) + q[..., w:] @ v.transpose(-1, -2)) * self.scale  # [B, 1, HT, S]
        scores = scores.view(B, H, T, S)
        if mask is not None:  # an additive [T, S] mask, or a boolean one (a static-shape step's)
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).view(B, 1, H * T, S)
        lat = torch.cat((probs @ k, probs @ v[..., : dc - w]), dim=-1).view(B, H, T, dc)  # [B, H, T, d_c]
        y = torch.einsum("bhtc,hvc->bthv", lat, maps[:, self.dn :])  # [B, T, H, d_v]
        return y.reshape(B, T, H * self.dv)

    def expanded(self, q_n, q_r, k, v, mask, fresh: bool) -> torch.Tensor:
        """Attention as plain attention: every attended latent expanded into each head's unrotated key and value
        (one product over the S positions), the shared rotated key beside each head's. `fresh`: a prompt from
        position 0 with no mask to add, SDPA's causal path."""
        B, T, H, _ = q_n.shape
        S, w, dc = k.shape[2], self.w, self.dc
        latents = torch.cat((k, v[..., : dc - w]), dim=-1)[:, 0]  # [B, S, d_c]
        k_r = v[:, 0, :, dc - w :]  # [B, S, d_r]
        kv = self.kv_b(latents.to(self.kv_b.weight.dtype)).to(q_n.dtype).view(B, S, H, self.dn + self.dv)
        keys = torch.cat((kv[..., : self.dn], k_r[:, :, None].expand(B, S, H, self.dr)), dim=-1).transpose(1, 2)
        values = kv[..., self.dn :].transpose(1, 2)  # [B, H, S, d_v]
        q = torch.cat((q_n, q_r), dim=-1).transpose(1, 2)  # [B, H, T, d_n + d_r]
        y = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=None if fresh else mask, is_causal=fresh, scale=self.scale
        )  # [B, H, T, d_v]
        return y.transpose(1, 2).reshape(B, T, H * self.dv)


def _halves(row: torch.Tensor, w: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache row [B, 1, T, 2w] as the cache's K and V halves [B, 1, T, w] each."""
    return row[..., :w], row[..., w:]
