"""Rotary position embeddings: the frequencies of each scaling kind (linear, llama3, longrope, a GGUF's factors),
the cos/sin tables the model slices by position, the half-split rotation, and Qwen2.5-VL's multimodal positions
(which frequencies a position's t, h and w parts rotate, and how far its positions run ahead of a cache's
indices). Shapes as engine.model's: T positions, d head width, r the rotating width.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .rope_config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int, length: int = 0) -> torch.Tensor:
    """[r/2] float32, the same arithmetic as transformers so logits match bit for bit in float32. `length`: the
    context the tables serve (longrope takes its long factors past the original context)."""
    dim = int(head_dim * rope.partial)
    base = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # [r/2] each pair's wavelength
    if rope.type == "longrope":
        long = length > rope.original_max_position_embeddings
        ext = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        return 1.0 / (ext * base)
    if rope.type == "yarn":
        return _yarn_frequencies(rope, dim, base)
    inv = 1.0 / base
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":
        old = rope.original_max_position_embeddings
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv = torch.where(medium, smoothed, scaled)
    if rope.factors:  # a GGUF's rope_freqs: each frequency divided by its factor (llama.cpp's rule)
        inv = inv / torch.tensor(rope.factors, dtype=torch.float32)
    return inv


def _yarn_frequencies(rope: RopeConfig, dim: int, base: torch.Tensor) -> torch.Tensor:
    """YaRN [r/2] from `base` (θ^(2i/r)): the fast-turning frequencies kept, the slow ones divided by the factor, a
    linear ramp between (from beta_fast turns over the original context to beta_slow), as transformers computes them."""
    kept, interpolated = 1.0 / base, 1.0 / (rope.factor * base)
    old = rope.original_max_position_embeddings

    def turns_dim(turns: float) -> float:  # the dimension whose frequency turns `turns` times over the context
        return (dim * math.log(old / (turns * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = turns_dim(rope.beta_fast), turns_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return interpolated * (1 - keep) + kept * keep


def yarn_mscale(factor: float, mscale: float = 1) -> float:
    """YaRN's attention factor for a scaling factor (its paper's Eq. 21, as transformers computes it)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def cos_sin_table(
    rope: RopeConfig, head_dim: int, length: int, dtype, device, context: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin: [length, r] in `dtype`, computed in float32 then cast (as transformers does); `context` the
    positions in use (longrope's choice of factors).

    The sin table carries the sign of the rotation, [-sin | +sin], so that with the two halves of x
    swapped (`swap_halves`) the rotation is x·cos + swap(x)·sin_signed: the same products as
    transformers' x·cos + rotate_half(x)·sin, in fewer kernels.
    """
    inv = inv_frequencies(rope, head_dim, context)
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]  # [T, r/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, r]
    cos, sin = emb.cos(), torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
    if rope.attention_factor != 1.0:  # longrope scales both
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [x2 | x1]: one kernel."""
    return x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., r] with rotary pairs adjacent ((x0, x1), (x2, x3): DeepSeek's layout) -> [x0, x2, … | x1, x3, …], the
    half-split layout apply_rotary turns: q and k both so, so their products are the interleaved rotation's."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor | None, sin_signed: torch.Tensor | None) -> torch.Tensor:
    """x: [B, T, heads, d]; cos/sin_signed: [T, 1, r] (None: a layer that does not rotate). Half-split rotation (the
    Hugging Face layout) of the first r values of each head; the rest pass through (a partial rotary)."""
    if cos is None:
        return x
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :r], cos, sin_signed), x[..., r:]), dim=-1)
    return x * cos + swap_halves(x) * sin_signed


def rope_offset(cache) -> int:
    """How far a cache's rotary positions run ahead of its indices (mrope after an image: engine.image_prompt)."""
    return getattr(cache, "rope_offset", 0) if cache is not None else 0


def section_columns(sections: tuple[int, ...], width: int, device) -> torch.Tensor:
    """[r] long: which of a position's t, h, w parts rotates each column of a head (mrope; both halves alike)."""
    half = torch.repeat_interleave(torch.arange(len(sections)), torch.tensor(sections))  # [r/2]
    return torch.cat((half, half))[:width].to(device)
