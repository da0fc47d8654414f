"""The decoder: Llama, Mistral, Qwen2 and Qwen3 in one module, written for KV-cached inference.

Shapes: B batch, T new positions, S attended positions (cached + new), D hidden, H query heads,
H_kv key/value heads, G = H / H_kv, d head width, F MLP width, V vocabulary.
q/k/v and gate/up are fused into one matmul each; the checkpoint's separate tensors are
concatenated at load (see loader.py) and split again on save (see `hf_state_dict`).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kv_cache import KVCache
from .rope import apply_rotary, cos_sin_table


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernels = None  # kernels.Kernels: one row (decode) on the CPU in one call (see use_kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.numel() == x.shape[-1]:
            return self.kernels.rms_norm(x, self.weight, self.eps)
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
        self.flash_prefill = False  # set on CUDA by the loader: prefill through SDPA's native GQA / flash path
        self.causal_only = cfg.sliding_window is None
        self.window = cfg.sliding_window
        self.kernels = None  # kernels.Kernels: a decode position's rotation, cache write and attention in one call

    def forward(self, x, cos, sin, mask, cache: KVCache | None, layer: int, start):
        B, T, _ = x.shape
        h, h_kv = self.h, self.h_kv
        qkv = self.qkv(x)  # [B, T, (H + 2H_kv)d]
        if self.kernels is not None and B * T == 1 and type(cache) is KVCache and isinstance(start, int) \
                and cache.k.dtype == qkv.dtype:  # decode on the CPU
            qn, kn = (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
            y = self.kernels.attend(qkv.view(-1), cos.view(-1), sin.view(-1), qn, kn, getattr(self.q_norm, "eps", 0.0),
                                    cache.k[layer, 0], cache.v[layer, 0], start, self.window, h)  # [H d]
            return self.o(y.view(B, T, h * self.d))
        qkv = qkv.view(B, T, h + 2 * h_kv, self.d)  # [B, T, H + 2H_kv, d]
        if self.q_norm is None:  # rotate q and k together: one pass over H + H_kv heads
            qk = apply_rotary(qkv[:, :, :h + h_kv], cos, sin)
            q, k = qk[:, :, :h], qk[:, :, h:]
        else:
            q = apply_rotary(self.q_norm(qkv[:, :, :h]), cos, sin)
            k = apply_rotary(self.k_norm(qkv[:, :, h:h + h_kv]), cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), qkv[:, :, h + h_kv:].transpose(1, 2)  # [B, heads, T, d]
        if cache is not None and isinstance(start, torch.Tensor):  # static shapes (CUDA graphs)
            k, v = cache.write_at(layer, start, k, v)  # [B, H_kv, C, d], masked beyond the position
        elif cache is not None:
            k, v = cache.write(layer, start, k, v)  # [B, H_kv, S, d]
        if T > 1 and self.flash_prefill:  # native GQA: SDPA may pick its flash kernel
            causal = start == 0 and self.causal_only  # a fresh prompt: the plain causal mask, no tensor needed
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if causal else mask, is_causal=causal,
                                               enable_gqa=self.g > 1)  # [B, H, T, d]
            return self.o(y.transpose(1, 2).reshape(B, T, h * self.d))
        # Group the G query heads that share a KV head into rows: no copy of K/V per query head.
        q = q.reshape(B, h_kv, self.g * T, self.d)  # [B, H_kv, G·T, d]
        if mask is not None and self.g > 1:
            mask = mask.repeat(self.g, 1)  # [T, S] -> [G·T, S]
        if q.dtype == torch.float16 and q.device.type == "cpu":  # the CPU's fp16 attention kernel is slow
            y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask).to(q.dtype)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H_kv, G·T, d]
        y = y.view(B, h, T, self.d).transpose(1, 2).reshape(B, T, h * self.d)
        return self.o(y)


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


class LinearT(nn.Module):
    """A Linear whose weight is stored transposed, [in, out]: on the CPU a one-row float32 product
    `x @ w_t` streams the weight faster than F.linear on the [out, in] layout (see README, Performance)."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = weight_t.shape
        self.weight_t = nn.Parameter(weight_t, requires_grad=False)  # [in, out]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "LinearT":
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(linear.weight.detach().t().contiguous(), bias)

    @property
    def weight(self) -> torch.Tensor:  # [out, in], a view: for export and quantization
        return self.weight_t.t()

    def forward(self, x):
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


class EmbeddingT(nn.Module):
    """A tied embedding stored once, transposed [D, V]: rows are gathered for the lookup, and the
    output head is `x @ weight_t`, the fast layout (no second copy of the matrix)."""

    def __init__(self, weight_t: torch.Tensor):
        super().__init__()
        self.weight_t = nn.Parameter(weight_t, requires_grad=False)  # [D, V]

    @property
    def weight(self) -> torch.Tensor:  # [V, D], a view
        return self.weight_t.t()

    def forward(self, ids):
        return self.weight[ids]  # [B, T, D]


def block_linears(blocks):
    """(parent, name, nn.Linear) for every plain Linear inside the given blocks: what a module swap replaces."""
    for block in blocks:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    yield parent, name, child


class PackedLinear(nn.Module):
    """A Linear whose weight oneDNN has reordered into its blocked layout, for float32 and bfloat16 on
    the CPU: one-row products stream it faster than either plain layout, and prefill uses the same
    kernel (bfloat16 there runs on the CPU's bf16 units). The plain weight is not kept: `weight`
    unpacks it on demand (export, quantization)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.packed = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w, 1), requires_grad=False)  # [out, in] blocked
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:  # [out, in], unpacked (a copy)
        return self.packed.to_dense()

    def forward(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class KernelLinear(nn.Linear):
    """A Linear on the CPU whose one-row products (decode) run kvchat's kernel (kernels.py) on the
    checkpoint's [out, in] layout, at memory speed; many rows (prefill) run torch's (many_rows_linear)."""

    kernels = None  # the loaded kernels.Kernels, set by from_linear

    def forward(self, x):
        if x.numel() == self.in_features:  # one row: decode
            return kernel_linear(self.kernels, x, self.weight, self.bias)
        return many_rows_linear(x, self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernels) -> "KernelLinear":
        linear.__class__ = cls  # same parameters, another forward
        linear.kernels = kernels
        return linear


def use_kernels(model: "Transformer", kernels) -> None:
    """Route the CPU decode step through kvchat's kernels: all the blocks in one call where every linear
    has a kernel layout (kernels.DecodeLayers), and the norms, attention and output head module by module."""
    from .kernels import DecodeLayers
    model.head_kernels = kernels
    for m in model.modules():
        if isinstance(m, (RMSNorm, Attention)):
            m.kernels = kernels
    try:
        model.decode_layers = DecodeLayers(kernels, model)
    except ValueError:  # a layer the C step cannot read: the module path serves it
        model.decode_layers = None


def kernel_linear(kernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for one row x [..., in] through the kernels: -> [..., out]."""
    y = kernels.matvec(weight, x.reshape(-1)).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


class HalfLinear(nn.Linear):
    """float16 on the CPU: torch's one-row float16 kernel streams the weight fastest of all layouts, but
    its many-row product is slow, so prefill computes in float32 (exact for float16 inputs) instead."""

    def forward(self, x):
        if x.numel() == x.shape[-1]:  # one row: decode
            return F.linear(x, self.weight, self.bias)
        return many_rows_linear(x, self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "HalfLinear":
        linear.__class__ = cls  # same parameters, another forward
        return linear


_ONEDNN: dict[tuple[torch.dtype, bool], bool] = {}


def onednn_works(dtype: torch.dtype, packed: bool = True) -> bool:
    """Whether this torch build and CPU run oneDNN's inner product for `dtype` (on a weight it packed,
    or on the plain [out, in] weight) and get F.linear's numbers."""
    key = (dtype, packed)
    if key not in _ONEDNN:
        ok = False
        if dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available():
            try:
                g = torch.Generator().manual_seed(0)
                lin = nn.Linear(64, 48, dtype=dtype)
                x = torch.randn(3, 64, generator=g).to(dtype)
                want = F.linear(x, lin.weight, lin.bias).float()
                got = (PackedLinear(lin)(x) if packed else plain_onednn_linear(x, lin.weight, lin.bias)).float()
                ok = bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2))
            except (RuntimeError, AttributeError):
                pass  # no oneDNN on this build or CPU
        _ONEDNN[key] = ok
    return _ONEDNN[key]


def plain_onednn_linear(x, weight, bias=None):
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


_scratch = threading.local()


def weight_scratch(shape, dtype=torch.float32) -> torch.Tensor:
    """A reusable CPU buffer for a weight-sized temporary of prefill (a dequantized or widened weight),
    one per thread: fresh memory for each call costs a page fault per 4 KiB of the matrix (a quarter of
    a quantized prefill on Qwen2.5-0.5B, measured)."""
    n = math.prod(shape)
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        with torch.inference_mode(False):  # a normal tensor: writable inside and outside inference mode
            buf = _scratch.buf = torch.empty(n, dtype=dtype)
    return buf[:n].view(shape)


def many_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for prefill on the CPU. float32 goes through oneDNN's inner product on the plain weight
    where that gives F.linear's numbers: 10-25% faster here than F.linear's GEMM (README, Performance);
    float16 computes in float32 (torch's many-row float16 product is slow; float32 is exact for its inputs)."""
    if weight.dtype == torch.float16 and x.device.type == "cpu":
        bias = None if bias is None else bias.float()
        return many_rows_linear(x.float(), weight_scratch(weight.shape).copy_(weight), bias).to(x.dtype)
    if weight.dtype == torch.float32 and x.device.type == "cpu" and onednn_works(torch.float32, packed=False):
        return plain_onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def fast_cpu_linears(blocks, dtype: torch.dtype) -> int:
    """Swap the plain block linears for the fastest CPU layout for `dtype`, one at a time (one extra
    matrix alive at most): kvchat's kernels on the [out, in] layout where they build (kernels.py);
    else oneDNN-packed where it works, transposed for float32, and for float16 the [out, in] weight
    (HalfLinear), whose one-row torch kernel is the fastest there (README, Performance)."""
    from . import kernels
    k = kernels.for_dtype(dtype)
    if k is not None:
        def make(linear):
            return KernelLinear.from_linear(linear, k)
    elif onednn_works(dtype):
        make = PackedLinear
    elif dtype == torch.float32:
        make = LinearT.from_linear
    elif dtype == torch.float16:
        make = HalfLinear.from_linear
    else:
        return 0
    n = 0
    for parent, name, child in list(block_linears(blocks)):
        setattr(parent, name, make(child))
        n += 1
    return n


def attention_mask(start: int, t: int, window: int | None, device) -> torch.Tensor | None:
    """[T, S] bool, True where query start+i may attend key j: causal, within the sliding window.

    None when every new query may see every key (one new position, no window in reach).
    """
    s = start + t
    if t == 1 and (window is None or s <= window):
        return None
    return visible(torch.arange(start, s, device=device), s, window)


def visible(q_pos: torch.Tensor, keys: int, window: int | None) -> torch.Tensor:
    """[T, keys] bool for queries at positions q_pos [T] (a tensor, so a CUDA graph can move them):
    key j is visible when it is not ahead of the query and within the sliding window."""
    q_pos = q_pos[:, None]
    k_pos = torch.arange(keys, device=q_pos.device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= (q_pos - k_pos) < window
    return allowed


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope_length: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # [V, D]
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope_length = rope_length or 0  # positions the rotary tables cover at least
        self.head_kernels = None  # kernels.Kernels for a one-row output head on the CPU (set by the loader)
        self.decode_layers = None  # kernels.DecodeLayers: a CPU decode step's blocks in one call (use_kernels)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def head_weight(self) -> torch.Tensor:  # [V, D]
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def rope_tables(self, length: int):
        """cos, sin [≥ length, d], built once per dtype/device and doubled when a longer context comes:
        sized by the context in use, not by max_position_embeddings (32,768 positions of Qwen2.5 take
        16 MiB of tables and twice that while they are built)."""
        w = self.norm.weight
        if self._rope is None or self._rope[0].shape[0] < length or self._rope[0].dtype != w.dtype \
                or self._rope[0].device != w.device:
            n = max(self.rope_length, 1 << max(10, (length - 1).bit_length()))  # a power of two, ≥ 1024
            self._rope = cos_sin_table(self.cfg.rope, self.cfg.head_dim, n, w.dtype, w.device)
        return self._rope

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, last_only: bool = False) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, V] ([B, 1, V] with last_only). With a cache, the T new positions
        start at cache.length and are appended to it; without one, they start at 0 (a full recompute)."""
        B, T = ids.shape
        start = cache.length if cache is not None else 0
        if cache is not None and start + T > cache.capacity:
            raise ValueError(f"{start + T} positions exceed the cache capacity of {cache.capacity}")
        cos, sin = self.rope_tables(start + T)
        cos, sin = cos[start:start + T, None], sin[start:start + T, None]  # [T, 1, d]
        x = self.embed(ids)  # [B, T, D]
        if B * T == 1 and self.decode_layers is not None and self.decode_layers.usable(cache):  # CPU decode
            x = x.reshape(-1)  # [D], a fresh row: the blocks update it in place
            self.decode_layers.run(x, cache, start, cos.reshape(-1), sin.reshape(-1))
            cache.length = start + 1
            return self._head(x.view(B, T, -1))
        mask = attention_mask(start, T, self.cfg.sliding_window, ids.device)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i, start)
        if cache is not None:
            cache.length = start + T
        if last_only:
            x = x[:, -1:]
        return self._head(x)

    def forward_static(self, ids: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """One decode step with static shapes, for CUDA graphs: ids [B, 1], pos [1] (a device tensor, the
        position being written) -> logits [B, 1, V]. Attention runs over the whole capacity with a mask,
        so no shape depends on the position. The caller advances cache.length."""
        cos, sin = self.rope_tables(cache.capacity)
        cos, sin = cos.index_select(0, pos)[:, None], sin.index_select(0, pos)[:, None]  # [1, 1, d]
        mask = visible(pos, cache.capacity, self.cfg.sliding_window)  # [1, C]
        x = self.embed(ids)  # [B, 1, D]
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i, pos)
        return self._head(x)

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and the output projection: [B, T, D] -> [B, T, V]."""
        if self.lm_head is None and hasattr(self.embed, "table"):  # tied and quantized: the embedding's table
            return self.embed.table(self.norm(x))
        if self.lm_head is not None and type(self.lm_head) is not nn.Linear:  # transposed or quantized
            return self.lm_head(self.norm(x))
        if self.head_kernels is not None and x.shape[0] * x.shape[1] == 1:  # decode on the CPU
            return kernel_linear(self.head_kernels, self.norm(x), self.head_weight)
        if isinstance(self.embed, EmbeddingT):
            return self.norm(x) @ self.embed.weight_t  # [B, T, V]
        return F.linear(self.norm(x), self.head_weight)  # [B, T, V]

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights under the Hugging Face names, q/k/v and gate/up split apart again."""
        c = self.cfg
        out = {"model.embed_tokens.weight": self.embed.weight, "model.norm.weight": self.norm.weight}
        if self.lm_head is not None:
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
