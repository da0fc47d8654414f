"""Rotary position embeddings: inverse frequencies (default, linear, llama3) and the rotation."""

from __future__ import annotations

import math

import torch

from .config import RopeConfig


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[d/2] float32, the same arithmetic as transformers so logits match bit for bit in float32."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
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
    return inv


def cos_sin_table(rope: RopeConfig, head_dim: int, length: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin: [length, d] in `dtype`, computed in float32 then cast (as transformers does).

    The sin table carries the sign of the rotation, [-sin | +sin], so that with the two halves of x
    swapped (`swap_halves`) the rotation is x·cos + swap(x)·sin_signed: the same products as
    transformers' x·cos + rotate_half(x)·sin, in fewer kernels.
    """
    inv = inv_frequencies(rope, head_dim)
    freqs = torch.arange(length, dtype=torch.float32)[:, None] * inv[None, :]  # [T, d/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
    sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
    return emb.cos().to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [x2 | x1]: one kernel."""
    return x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x: [B, T, heads, d]; cos/sin_signed: [T, 1, d]. Half-split rotation (the Hugging Face layout)."""
    return x * cos + swap_halves(x) * sin_signed
