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


SCAN_CHUNK = 64  # positions a scanning layer's chunk takes at most: its [t, t] products stay small


class ScanLayer(nn.Module):
    """What a scanning state layer in attention's place shares (Granite 4.0-H's Mamba-2 mixer, Qwen3-Next's gated
    DeltaNet): no window, no rotation, no sinks; its two projections the ones a backend may swap (the convolution's
    and the scan's few weights stay); a batch's rows each run over a state of its own; its depthwise causal
    convolution (`conv`, C channels) + silu over the state the cache holds before the new positions, then the
    layer's own `scan` in chunks that end where the cache wants a state, so no position's state is computed twice.

    Shapes: C the convolution's channels, K its width, t the positions run (the new ones, and those since the base
    the cache gave)."""

    window, rope_kind, causal_only, sinks = None, None, True, None  # as Attention's, for Block and the masks

    def linears(self) -> list[str]:
        return ["in_proj", "out_proj"]

    def _mix(self, xs: torch.Tensor, steps: torch.Tensor, cache, layer: int, start: int) -> torch.Tensor:
        """xs [B, T, C] the convolution's raw input, steps [B, T, ·] the layer's other per-position inputs, at
        positions start.. -> the scan's output for those positions, over the state before them (a base's before
        that, with the inputs since run again: HybridCache.scan_state)."""
        base, conv0, s0, since = start, None, None, None
        if cache is not None and start > 0:
            base, conv0, s0, since = cache.scan_state(layer, start)
        xs = xs.transpose(1, 2)  # [B, C, T]
        if since is not None:  # the positions from the base to start, again
            xs = torch.cat((since[0].to(xs.dtype), xs), dim=-1)
            steps = torch.cat((since[1].to(steps.dtype), steps), dim=1)
        if conv0 is None:
            conv0 = xs.new_zeros(xs.shape[0], xs.shape[1], self.conv.kernel_size[0] - 1)
        full = torch.cat((conv0.to(xs.dtype), xs), dim=-1)  # [B, C, K − 1 + t]
        u = F.silu(F.conv1d(full, self.conv.weight, self.conv.bias, groups=xs.shape[1])).transpose(1, 2).float()
        t = u.shape[1]  # u [B, t, C]
        ends = cache.state_points(base, base + t) if cache is not None else [base + t]
        y, states = self.scan(u, steps, s0, [e - base for e in ends])
        if cache is not None:
            cache.keep_scan_state(layer, base, full, steps, {base + e: s for e, s in states.items()})
        return y[:, start - base :]

    def scan(self, u: torch.Tensor, steps: torch.Tensor, s0, ends: list[int]):
        """u [B, t, C] (the convolution's output, float32), steps [B, t, ·], s0 the state before them or None (zeros)
        -> (y [B, t, ...], {e: the state after e positions} for each e in `ends`): the layer's own."""
        raise NotImplementedError

    @staticmethod
    def chunked(one, s, t: int, ends: list[int]):
        """`one(s, a, b)` -> (y [B, b − a, ...], the state after b) over chunks of t positions from the state s, each
        ending at one of `ends` or at most SCAN_CHUNK long -> (y [B, t, ...], {e: the state after e} for `ends`)."""
        cuts = sorted({*ends, *range(SCAN_CHUNK, t, SCAN_CHUNK)} - {0})
        wanted, states, ys, a = set(ends), {}, [], 0
        for b in cuts:
            y, s = one(s, a, b)
            ys.append(y)
            if b in wanted:
                states[b] = s  # each chunk makes a new state: nothing writes into this one
            a = b
        return (torch.cat(ys, dim=1) if len(ys) > 1 else ys[0]), states

    def rows(self, inputs: tuple[torch.Tensor, ...], cache, layer: int, start):
        """`_mix(*inputs, cache, layer, start)` over the batch: each row over its own cache where `cache` is a list
        (one a row, `start` likewise), else all rows at once."""
        if isinstance(cache, list):
            return torch.cat([self._mix(*(t[r : r + 1] for t in inputs), cache[r], layer, start[r])
                              for r in range(len(cache))])  # fmt: skip
        return self._mix(*inputs, cache, layer, start)
