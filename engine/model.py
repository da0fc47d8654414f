"""The decoder: Llama, Mistral, Qwen2 and Qwen3 in one module, written for KV-cached inference.

Plain PyTorch and nothing else from the engine: the architecture as the checkpoints define it.
How its weights are stored and multiplied on a given device (CPU layouts, quantized codes, the
one-call decode step) is engine.backends' business, which swaps modules in after loading.

Shapes: B batch, T new positions, S attended positions (cached + new), D hidden, H query heads,
H_kv key/value heads, G = H / H_kv, d head width, F MLP width, V vocabulary.
q/k/v and gate/up are fused into one matmul each; the checkpoint's separate tensors are
concatenated at load and split again by `hf_state_dict`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from .config import ModelConfig, RopeConfig


# --- rotary position embeddings -----------------------------------------------------------------
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
    if rope.factors:  # a GGUF's rope_freqs: each frequency divided by its factor (llama.cpp's rule)
        inv = inv / torch.tensor(rope.factors, dtype=torch.float32)
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


# --- masks ----------------------------------------------------------------------------------------
def attention_mask(start: int, t: int, window: int | None, device) -> torch.Tensor | None:
    """[T, S] bool, True where query start+i may attend key j: causal, within the sliding window.

    None when every new query may see every key (one new position, no window in reach).
    """
    s = start + t
    if t == 1 and (window is None or s <= window):
        return None
    return visible(torch.arange(start, s, device=device), s, window)


def attention_dtype(dtype: torch.dtype, device: torch.device, widen_bf16: bool = False) -> torch.dtype:
    """The dtype attention computes in: the activations', float32 for float16 on the CPU (its fp16 kernel is slow)
    and, with `widen_bf16` (the loader's, on a CPU without bf16 instructions, where SDPA falls back to its slow
    reference path), for bfloat16 there too."""
    if device.type == "cpu" and (dtype == torch.float16 or (dtype == torch.bfloat16 and widen_bf16)):
        return torch.float32
    return dtype


def additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean [T, S] mask as SDPA adds it, 0 where visible and -inf elsewhere: converted once per
    forward, where SDPA would convert a boolean one in every layer's call."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def visible(q_pos: torch.Tensor, keys: int, window: int | None) -> torch.Tensor:
    """[T, keys] bool for queries at positions q_pos [T] (a tensor, so a CUDA graph can move them):
    key j is visible when it is not ahead of the query and within the sliding window."""
    q_pos = q_pos[:, None]
    k_pos = torch.arange(keys, device=q_pos.device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= (q_pos - k_pos) < window
    return allowed


# --- blocks ---------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, scale in the model dtype (as transformers does, so bf16 matches).
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused kernel
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.h_kv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.g = self.h // self.h_kv
        self.qkv = nn.Linear(cfg.hidden_size, (self.h + 2 * self.h_kv) * self.d, bias=cfg.qkv_bias)  # D -> (H+2H_kv)d
        self.o = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)  # Hd -> D
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.causal_only = cfg.sliding_window is None
        self.window = cfg.sliding_window
        self.widen_bf16 = False  # bfloat16 attention in float32 (Transformer.widen_bf16_attention)

    def forward(self, x, cos, sin, mask, cache, layer: int, start):
        """x [B, T, D] at positions start.. (an int, or a device tensor [1] for a static-shape step);
        the new K/V go into `cache` (any object with write/write_at) -> [B, T, D]."""
        B, T, _ = x.shape
        h, h_kv = self.h, self.h_kv
        qkv = self.qkv(x).view(B, T, h + 2 * h_kv, self.d)  # [B, T, H + 2H_kv, d]
        if self.q_norm is None:  # rotate q and k together: one pass over H + H_kv heads
            qk = apply_rotary(qkv[:, :, : h + h_kv], cos, sin)
            q, k = qk[:, :, :h], qk[:, :, h:]
        else:
            q = apply_rotary(self.q_norm(qkv[:, :, :h]), cos, sin)
            k = apply_rotary(self.k_norm(qkv[:, :, h : h + h_kv]), cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), qkv[:, :, h + h_kv :].transpose(1, 2)  # [B, heads, T, d]
        if cache is not None and isinstance(start, torch.Tensor):  # static shapes (CUDA graphs)
            k, v = cache.write_at(layer, start, k, v)  # [B, H_kv, C, d], masked beyond the position
        elif cache is not None:
            k, v = cache.write(layer, start, k, v)  # [B, H_kv, S, d]
        dtype = q.dtype
        # widened copies are made dense: SDPA's flash kernel needs unit-stride rows
        if attention_dtype(dtype, q.device, self.widen_bf16) != dtype:
            q, k, v = (t.to(torch.float32, memory_format=torch.contiguous_format) for t in (q, k, v))
        if T > 1:  # many positions: SDPA's native GQA (its flash kernels), causal without a mask on a fresh prompt
            causal = isinstance(start, int) and start == 0 and self.causal_only
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if causal else mask, is_causal=causal, enable_gqa=self.g > 1
            )  # [B, H, T, d]
            return self.o(y.to(dtype).transpose(1, 2).reshape(B, T, h * self.d))
        # One position: the G query heads that share a KV head as rows, no copy of K/V per query head.
        q = q.reshape(B, h_kv, self.g, self.d)  # [B, H_kv, G, d]
        if mask is not None and self.g > 1:
            mask = mask.repeat(self.g, 1)  # [1, S] -> [G, S]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H_kv, G, d]
        return self.o(y.to(dtype).reshape(B, T, h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.f = cfg.intermediate_size
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * self.f, bias=False)  # D -> 2F
        self.down = nn.Linear(self.f, cfg.hidden_size, bias=False)  # F -> D

    def forward(self, x):
        gate, up = self.gate_up(x).split(self.f, dim=-1)  # [B, T, F] each
        return self.down(F.silu(gate).mul_(up))  # the product into silu's fresh buffer: one [B, T, F] less


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, layer, start):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache, layer, start)
        return x + self.mlp(self.mlp_norm(x))


def block_linears(blocks):
    """(parent, name, module) for every linear inside the given blocks: what a module swap replaces."""
    for block in blocks:
        for parent in (block.attn, block.mlp):
            for name in ("qkv", "o") if parent is block.attn else ("gate_up", "down"):
                yield parent, name, getattr(parent, name)


# --- the model ------------------------------------------------------------------------------------
class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope_length: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.dequantized_bytes = 0  # a file's codes dequantized once for torch (no kernels), what they take
        # [V, D]; its own storage given, so no random init runs (on the meta device that init imports torch._dynamo,
        # which a first load then waits for: engine/BENCHMARKS.md, "Opening a model file")
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # D -> V, always a module
        if cfg.tie_word_embeddings:
            self.tie()
        self.rope_length = rope_length or 0  # positions the rotary tables cover at least
        self.decode_step = None  # a backend's decode of one position through every block in one call
        self.decode_step_refused: str | None = None  # why a backend's step failed its load-time check, if it did
        self.activations = "float32"  # what quantized layers' one-row products multiply: float32 | int8 (the loader's)
        self.widen_bf16 = False  # bfloat16 attention computed in float32 (widen_bf16_attention)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def tie(self) -> None:
        """A tied model's head multiplies by the embedding's own matrix: the same Parameter, not a copy."""
        self.lm_head.weight = self.embed.weight

    def widen_bf16_attention(self, on: bool = True) -> None:
        """bfloat16 attention (and its mask) computed in float32 on the CPU: the loader's call where the CPU has
        no bf16 instructions, as the model cannot tell."""
        self.widen_bf16 = on
        for block in self.layers:
            block.attn.widen_bf16 = on

    def rope_tables(self, length: int):
        """cos, sin [≥ length, d], built once per dtype/device and doubled when a longer context comes:
        sized by the context in use, not by max_position_embeddings."""
        w = self.norm.weight
        if (
            self._rope is None
            or self._rope[0].shape[0] < length
            or self._rope[0].dtype != w.dtype
            or self._rope[0].device != w.device
        ):
            n = max(self.rope_length, 1 << max(10, (length - 1).bit_length()))  # a power of two, ≥ 1024
            self._rope = cos_sin_table(self.cfg.rope, self.cfg.head_dim, n, w.dtype, w.device)
        return self._rope

    def forward(self, ids: torch.Tensor, cache=None, last_only: bool = False) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, V] ([B, 1, V] with last_only). With a cache, the T new positions
        start at cache.length and are appended to it; without one, they start at 0 (a full recompute)."""
        B, T = ids.shape
        start = cache.length if cache is not None else 0
        if cache is not None and start + T > cache.capacity:
            raise ValueError(f"{start + T} positions exceed the cache capacity of {cache.capacity}")
        cos, sin = self.rope_tables(start + T)
        cos, sin = cos[start : start + T, None], sin[start : start + T, None]  # [T, 1, d]
        x = self.embed(ids)  # [B, T, D]
        if B * T == 1 and self.decode_step is not None and self.decode_step.usable(cache):
            x = x.reshape(-1)  # [D], a fresh row: the blocks update it in place
            self.decode_step.run(x, cache, start, cos.reshape(-1), sin.reshape(-1))
            cache.length = start + 1
            return self.lm_head(self.norm(x.view(B, T, -1)))
        mask = attention_mask(start, T, self.cfg.sliding_window, ids.device)
        mask = additive(mask, attention_dtype(x.dtype, x.device, self.widen_bf16))
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i, start)
        if cache is not None:
            cache.length = start + T
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))  # [B, T, V]

    def forward_static(self, ids: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
        """One decode step with static shapes, for CUDA graphs: ids [B, 1], pos [1] (a device tensor, the
        position being written) -> logits [B, 1, V]. Attention runs over the whole capacity with a mask,
        so no shape depends on the position. The caller advances cache.length."""
        cos, sin = self.rope_tables(cache.capacity)
        cos, sin = cos.index_select(0, pos)[:, None], sin.index_select(0, pos)[:, None]  # [1, 1, d]
        mask = visible(pos, cache.capacity, self.cfg.sliding_window)  # [1, C]
        x = self.embed(ids)  # [B, 1, D]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i, pos)
        return self.lm_head(self.norm(x))

    def parameter_count(self) -> int:
        """The model's values: its parameters, and the weights quantized layers hold as codes (a tied
        head and embedding once)."""
        coded = sum(getattr(m, "coded_values", 0) for m in self.modules())  # modules(): each module once
        return coded + sum(p.numel() for p in self.parameters())

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under the Hugging Face names, q/k/v and gate/up split apart again."""
        c = self.cfg
        out = {"model.embed_tokens.weight": self.embed.weight, "model.norm.weight": self.norm.weight}
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head.weight
        for i, b in enumerate(self.layers):
            p = f"model.layers.{i}."
            sizes = [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
            for name, w in zip("qkv", b.attn.qkv.weight.split(sizes)):
                out[p + f"self_attn.{name}_proj.weight"] = w
            if b.attn.qkv.bias is not None:
                for name, w in zip("qkv", b.attn.qkv.bias.split(sizes)):
                    out[p + f"self_attn.{name}_proj.bias"] = w
            out[p + "self_attn.o_proj.weight"] = b.attn.o.weight
            if b.attn.o.bias is not None:
                out[p + "self_attn.o_proj.bias"] = b.attn.o.bias
            if b.attn.q_norm is not None:
                out[p + "self_attn.q_norm.weight"] = b.attn.q_norm.weight
                out[p + "self_attn.k_norm.weight"] = b.attn.k_norm.weight
            gate, up = b.mlp.gate_up.weight.split(c.intermediate_size)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
            out[p + "mlp.down_proj.weight"] = b.mlp.down.weight
            out[p + "input_layernorm.weight"] = b.attn_norm.weight
            out[p + "post_attention_layernorm.weight"] = b.mlp_norm.weight
        return {k: v.detach().contiguous() for k, v in out.items()}
