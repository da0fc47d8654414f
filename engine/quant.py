"""Symmetric group-wise quantization, exactly as the reference defines it.

    q = clip(round_half_even(x / s), -Q, Q),   x̂ = s · q,   Q = 7 (int4) or 127 (int8)

one scale per group of `group_size` consecutive values, s = max|x| / Q over the group. Int4
codes are packed two per byte. Storage = packed codes + scales, counted exactly. The rounding
error is at most s/2 only inside the unclipped range [-Q·s, Q·s]; with s = max|x|/Q nothing in
the group is clipped, but an explicit smaller scale (as in the reference's outlier) clips.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

QMAX = {"int8": 127, "int4": 7}
BITS = {"int8": 8, "int4": 4}
SCALE_DTYPE = torch.float32  # one float32 scale per group: 4 bytes


def check_mode(mode: str) -> None:
    if mode not in QMAX:
        raise ValueError(f"quantization {mode!r} is not supported (supported: none, {', '.join(QMAX)})")


def quantize_with_scale(x: torch.Tensor, scale, qmax: int) -> torch.Tensor:
    """Codes for x at a given scale: clip(round_half_even(x / s), -Q, Q). torch.round rounds half to even."""
    return torch.clamp(torch.round(x / scale), -qmax, qmax).to(torch.int8)


def quantize(x: torch.Tensor, mode: str, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> codes int8 [..., K], scales float32 [..., K / group_size]."""
    check_mode(mode)
    qmax = QMAX[mode]
    k = x.shape[-1]
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group size {group_size} does not divide the row length {k}")
    xg = x.float().reshape(*x.shape[:-1], k // group_size, group_size)  # [..., G, g]
    scale = xg.abs().amax(-1, keepdim=True) / qmax  # [..., G, 1]
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero group: any scale works
    codes = quantize_with_scale(xg, scale, qmax)
    return codes.reshape(x.shape), scale.squeeze(-1).to(SCALE_DTYPE)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """codes [..., K] int8, scales [..., G] -> x̂ = s · q, [..., K] in dtype."""
    k, groups = codes.shape[-1], scales.shape[-1]
    q = codes.reshape(*codes.shape[:-1], groups, k // groups).to(dtype)
    return (q * scales.to(dtype).unsqueeze(-1)).reshape(codes.shape)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in [-7, 7], [..., K] (K even) -> uint8 [..., K/2]: low nibble first."""
    c = codes.to(torch.uint8) & 0x0F
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> int8 [..., K], sign-extended from 4 bits."""
    lo = (packed & 0x0F).to(torch.int8)
    hi = (packed >> 4).to(torch.int8)
    out = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    return torch.where(out > 7, out - 16, out)


def storage_bytes(num_values: int, mode: str, num_scales: int, scale_bytes: int = 4) -> int:
    """Packed codes plus scales: four int4 values and one float32 scale take 2 + 4 = 6 bytes."""
    return math.ceil(num_values * BITS[mode] / 8) + num_scales * scale_bytes


class QuantLinear(nn.Module):
    """A Linear whose weight is stored as group-wise int8/int4 codes and float32 scales.

    CPU: int8 with one group per row runs torch's packed int8 kernel (`_weight_int8pack_mm`);
    otherwise the weight is dequantized on the fly for each call (correct, not fast).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mode: str, group_size: int):
        super().__init__()
        check_mode(mode)
        self.mode, self.out_features, self.in_features = mode, weight.shape[0], weight.shape[1]
        self.group_size = group_size if group_size > 0 else weight.shape[1]  # <= 0: per output channel
        self.compute_dtype = weight.dtype
        codes, scales = quantize(weight.detach(), mode, self.group_size)  # [N, K], [N, K/g]
        self.register_buffer("codes", pack_int4(codes) if mode == "int4" else codes)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @property
    def storage_bytes(self) -> int:
        return storage_bytes(self.out_features * self.in_features, self.mode, self.scales.numel())

    def weight_codes(self) -> torch.Tensor:
        return unpack_int4(self.codes) if self.mode == "int4" else self.codes

    def dequantized_weight(self, dtype=None) -> torch.Tensor:
        return dequantize(self.weight_codes(), self.scales, dtype or self.compute_dtype)  # [N, K]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "int8" and self.group_size == self.in_features and x.device.type == "cpu":
            shape = x.shape
            y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.codes, self.scales.view(-1).to(x.dtype))
            y = y.reshape(*shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.dequantized_weight(x.dtype), self.bias)


def quantize_model(model: nn.Module, mode: str, group_size: int) -> int:
    """Quantize, then swap: every Linear inside the blocks (of a model, or of one block as the loader
    streams them) becomes a QuantLinear. Embeddings and the output head stay in the model dtype.
    Returns how many modules were swapped."""
    from .model import block_linears
    check_mode(mode)
    swapped = 0
    for parent, name, child in list(block_linears(getattr(model, "layers", [model]))):
        g = group_size if group_size > 0 and child.in_features % group_size == 0 else child.in_features
        setattr(parent, name, QuantLinear(child.weight, child.bias, mode, g))
        swapped += 1
    return swapped


def weight_bytes(model: nn.Module) -> int:
    """What the model's weights take: quantized layers by their packed storage, the rest by their tensors."""
    total = 0
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.storage_bytes + (m.bias.numel() * m.bias.element_size() if m.bias is not None else 0)
        else:
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total
