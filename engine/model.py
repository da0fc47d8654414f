"""The decoder: Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, SmolLM3, Granite, OLMo 2, the mixtures of experts
(Qwen3-MoE, Mixtral, gpt-oss), DeepSeek-V2/V3 (their latent attention: engine.latent_attention) and the hybrids, LFM2
(its short convolutions: engine.short_conv), Granite 4.0-H (its Mamba-2 mixers: engine.mamba_mixer) and Qwen3-Next
(its gated DeltaNets: engine.delta_net), in one module, written for KV-cached inference.

Plain PyTorch and nothing else from the engine but its feed-forward halves (engine.feedforward), its rotations,
the latent attention, the short convolution, the Mamba-2 mixer, the gated DeltaNet and the parts they share: the
architecture as the checkpoints define it.
How its weights are stored and multiplied on a given device (CPU layouts, quantized codes, the
one-call decode step) is engine.backends' business, which swaps modules in after loading.

Shapes: B batch, T new positions, S attended positions (cached + new), D hidden, H query heads,
H_kv key/value heads, G = H / H_kv, d head width, r rotating width (d, or less with a partial rotary), F MLP
width, E experts, k experts per position, N = B·T positions, V vocabulary.
q/k/v and gate/up are fused into one matmul each; the checkpoint's separate tensors are
concatenated at load and split again by `hf_state_dict`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .block_parts import RMSNorm, attention_dtype
from .delta_net import GatedDeltaNet
from .feedforward import MLP, MoE
from .latent_attention import LatentAttention
from .mamba_mixer import MambaMixer
from .rotary import apply_rotary, cos_sin_table, rope_offset, section_columns
from .short_conv import ShortConv

if TYPE_CHECKING:
    from .config import ModelConfig


# --- masks ----------------------------------------------------------------------------------------
BLOCKS = "blocks"  # a masks dict's mark: some of its positions see later ones (Transformer.masks' `blocks`)
FEW_POSITIONS = 8  # new positions of one sequence a forward runs as rows of the batched decode step, at most


def attention_mask(start: int, t: int, window: int | None, device) -> torch.Tensor | None:
    """[T, S] bool, True where query start+i may attend key j: causal, within the sliding window.

    None when every new query may see every key (one new position, no window in reach).
    """
    s = start + t
    if t == 1 and (window is None or s <= window):
        return None
    return visible(torch.arange(start, s, device=device), s, window)


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
class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.h, self.h_kv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.g = self.h // self.h_kv
        self.gated = cfg.attn_output_gate  # Qwen3-Next: each query head's rows followed by its output gate's
        q_rows = (2 if self.gated else 1) * self.h
        self.qkv = nn.Linear(cfg.hidden_size, (q_rows + 2 * self.h_kv) * self.d, bias=cfg.qkv_bias)  # D -> (H+2H_kv)d
        self.o = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.o_bias)  # Hd -> D
        self.qk_norm_all = cfg.qk_norm_span == "all"  # OLMo 2 normalises all of q (and of k) at once
        q_span, k_span = (self.h * self.d, self.h_kv * self.d) if self.qk_norm_all else (self.d, self.d)
        self.q_norm = RMSNorm(q_span, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_span, cfg.rms_norm_eps, cfg.norm_offset) if cfg.qk_norm else None
        self.window = cfg.window(layer)
        self.causal_only = self.window is None
        self.rope_kind = cfg.rope_kind(layer)  # which of the model's rotary tables, None: no rotation
        self.scale = cfg.attention_scale  # None: SDPA's 1/√d
        self.softcap = cfg.attn_softcap
        # [H] a learned logit per query head that joins every softmax's denominator (gpt-oss's attention sinks)
        self.sinks = nn.Parameter(torch.zeros(self.h)) if cfg.sinks else None
        self.widen_bf16 = False  # bfloat16 attention in float32 (Transformer.widen_bf16_attention)

    def linears(self) -> list[str]:
        """The projections a backend may swap (quantize, lay out)."""
        return ["qkv", "o"]

    def project(self, x, cos, sin):
        """x [B, T, D] -> q [B, T, H, d], k and v [B, T, H_kv, d], q and k normalised (if the family does) and
        rotated, and the output gate's logits [B, T, H d] (None where the family has none)."""
        B, T, _ = x.shape
        h, h_kv, d = self.h, self.h_kv, self.d
        qkv = self.qkv(x)  # [B, T, (H + 2H_kv)d], or [B, T, (2H + 2H_kv)d] with each query head's gate after it
        if self.gated:
            qg = qkv[..., : 2 * h * d].unflatten(-1, (h, 2, d))  # [B, T, H, 2, d]
            q, gate = qg[..., 0, :], qg[..., 1, :].flatten(-2)  # [B, T, H, d], [B, T, H d]
            k = self.k_norm(qkv[..., 2 * h * d : (2 * h + h_kv) * d].unflatten(-1, (h_kv, d)))
            v = qkv[..., (2 * h + h_kv) * d :].unflatten(-1, (h_kv, d))
            return apply_rotary(self.q_norm(q), cos, sin), apply_rotary(k, cos, sin), v, gate
        if self.qk_norm_all:
            q = self.q_norm(qkv[..., : h * d]).view(B, T, h, d)
            k = self.k_norm(qkv[..., h * d : (h + h_kv) * d]).view(B, T, h_kv, d)
            v = qkv[..., (h + h_kv) * d :].view(B, T, h_kv, d)
            return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, None
        qkv = qkv.view(B, T, h + 2 * h_kv, d)  # [B, T, H + 2H_kv, d]
        if self.q_norm is None:  # rotate q and k together: one pass over H + H_kv heads
            qk = apply_rotary(qkv[:, :, : h + h_kv], cos, sin)
            q, k = qk[:, :, :h], qk[:, :, h:]
        else:
            q = apply_rotary(self.q_norm(qkv[:, :, :h]), cos, sin)
            k = apply_rotary(self.k_norm(qkv[:, :, h : h + h_kv]), cos, sin)
        return q, k, qkv[:, :, h + h_kv :], None

    def forward(self, x, cos, sin, mask, cache, layer: int, start, causal: bool = True):
        """x [B, T, D] at positions start.. (an int, or a device tensor [1] for a static-shape step); cos/sin the
        rotary rows of those positions (None: this layer does not rotate); mask the additive [T, S] mask of this
        layer's window; the new K/V go into `cache` (any object with write/write_at) -> [B, T, D]. B sequences'
        next positions (T = 1) each over a cache of its own: `cache` and `start` lists, `mask` a list (rows). `causal`:
        False where the mask lets some positions see later ones (an image's, Gemma 3)."""
        B = x.shape[0]
        *qkv, gate = self.project(x, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in qkv)  # [B, heads, T, d]
        if isinstance(cache, list):  # one row a sequence, each attending over its own positions
            rows = [self.attend(q[b : b + 1], *cache[b].write(layer, start[b], k[b : b + 1], v[b : b + 1]), mask[b],
                                start[b]) for b in range(B)]  # fmt: skip
            return self.o(self.gate(torch.cat(rows), gate))  # [B, 1, H d] -> [B, 1, D]
        if cache is not None and isinstance(start, torch.Tensor):  # static shapes (CUDA graphs)
            k, v = cache.write_at(layer, start, k, v)  # [B, H_kv, C, d], masked beyond the position
        elif cache is not None:
            k, v = cache.write(layer, start, k, v)  # [B, H_kv, S, d]
        return self.o(self.gate(self.attend(q, k, v, mask, start, causal), gate))

    @staticmethod
    def gate(y: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """y [B, T, H d] × σ(gate) where the family gates attention's output (Qwen3-Next)."""
        return y if gate is None else y * torch.sigmoid(gate)

    def attend(self, q, k, v, mask, start, causal: bool = True):
        """q [B, H, T, d] at positions start.. over k, v [B, H_kv, S, d] (mask the additive [T, S], or None) ->
        [B, T, H d] in q's dtype."""
        B, h, T, _ = q.shape
        dtype = q.dtype
        # widened copies are made dense: SDPA's flash kernel needs unit-stride rows
        if attention_dtype(dtype, q.device, self.widen_bf16) != dtype:
            q, k, v = (t.to(torch.float32, memory_format=torch.contiguous_format) for t in (q, k, v))
        if self.softcap is not None or self.sinks is not None:  # capped scores, sinks: no SDPA kernel has them
            y = self.attend_scored(q, k, v, mask)  # [B, H, T, d]
            return y.to(dtype).transpose(1, 2).reshape(B, T, h * self.d)
        if T > 1:  # many positions: SDPA's native GQA (its flash kernels), causal without a mask on a fresh prompt
            causal = causal and isinstance(start, int) and start == 0 and self.causal_only
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if causal else mask, is_causal=causal, enable_gqa=self.g > 1, scale=self.scale
            )  # [B, H, T, d]
            return y.to(dtype).transpose(1, 2).reshape(B, T, h * self.d)
        # One position: the G query heads that share a KV head as rows, no copy of K/V per query head.
        q = q.reshape(B, self.h_kv, self.g, self.d)  # [B, H_kv, G, d]
        if mask is not None and self.g > 1:
            mask = mask.repeat(self.g, 1)  # [1, S] -> [G, S]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # [B, H_kv, G, d]
        return y.to(dtype).reshape(B, T, h * self.d)

    def attend_scored(self, q, k, v, mask):
        """q [B, H, T, d], k/v [B, H_kv, S, d] -> [B, H, T, d] with the scores in hand: soft-capped (c·tanh(s/c),
        Gemma 2) before the mask, and with each head's sink logit beside them in the softmax, its share then
        dropped (gpt-oss), as the families were trained."""
        B, H, T, d = q.shape
        S = k.shape[2]
        q = q.reshape(B, self.h_kv, self.g * T, d)  # the G heads sharing a KV head as rows: no copy of K/V
        scores = q @ k.transpose(-1, -2) * (self.scale if self.scale is not None else d**-0.5)  # [B, H_kv, GT, S]
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = (scores.view(B, self.h_kv, self.g, T, S) + mask).view(B, self.h_kv, self.g * T, S)
        if self.sinks is not None:
            sink = self.sinks.to(scores.dtype).view(1, self.h_kv, self.g, 1).expand(B, -1, -1, T)  # [B, H_kv, G, T]
            scores = torch.cat((scores, sink.reshape(B, self.h_kv, self.g * T, 1)), dim=-1)  # [B, H_kv, GT, S+1]
            scores = scores - scores.amax(dim=-1, keepdim=True)
            probs = torch.softmax(scores, dim=-1, dtype=scores.dtype)[..., :S]
        else:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        y = probs.to(q.dtype) @ v  # [B, H_kv, GT, d]
        return y.view(B, H, T, d)


class Block(nn.Module):
    """Attention then MLP, each a residual branch: normalised before (Llama), before and after (Gemma's sandwich)
    or after (OLMo 2), scaled before the add (Granite)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()

        def norm(where: str):
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset) if where else None

        pre = "pre" if cfg.norm_placement in ("pre", "sandwich") else ""
        post = "post" if cfg.norm_placement in ("sandwich", "post") else ""
        self.attn_norm = norm(pre)
        if cfg.conv_layers and cfg.conv_layers[layer]:  # a hybrid's short convolution in attention's place (LFM2)
            self.attn = ShortConv(cfg, layer)
        elif cfg.mamba_layers and cfg.mamba_layers[layer]:  # Granite 4.0-H's Mamba-2 mixer in attention's place
            self.attn = MambaMixer(cfg, layer)
        elif cfg.delta_layers and cfg.delta_layers[layer]:  # Qwen3-Next's gated DeltaNet in attention's place
            self.attn = GatedDeltaNet(cfg, layer)
        else:
            self.attn = LatentAttention(cfg, layer) if cfg.mla else Attention(cfg, layer)
        self.attn_post_norm = norm(post)
        self.mlp_norm = norm(pre)
        self.mlp = MoE(cfg) if cfg.is_moe(layer) else MLP(cfg)
        self.mlp_post_norm = norm(post)
        self.residual_scale = cfg.residual_scale
        self.plain = cfg.norm_placement == "pre" and cfg.residual_scale == 1.0

    def forward(self, x, ropes, masks, cache, layer, start):
        """ropes: the model's rotary rows [(cos, sin) per kind]; masks: additive masks by window."""
        a = self.attn
        cos, sin = (None, None) if a.rope_kind is None else ropes[a.rope_kind]
        mask, causal = masks[a.window], BLOCKS not in masks
        if self.plain:
            x = x + a(self.attn_norm(x), cos, sin, mask, cache, layer, start, causal)
            return x + self.mlp(self.mlp_norm(x))
        x = x + self.branch(a(self.norm(self.attn_norm, x), cos, sin, mask, cache, layer, start, causal),
                            self.attn_post_norm)  # fmt: skip
        return x + self.branch(self.mlp(self.norm(self.mlp_norm, x)), self.mlp_post_norm)

    @staticmethod
    def norm(norm, x):
        return x if norm is None else norm(x)

    def branch(self, y, post_norm):
        """A branch's output as the residual adds it: normalised after (sandwich, post) and scaled (Granite)."""
        y = self.norm(post_norm, y)
        return y * self.residual_scale if self.residual_scale != 1.0 else y


def block_linears(blocks):
    """(parent, name, module) for every linear inside the given blocks, each expert's own: what a module swap
    replaces (a router stays in the model dtype)."""
    for block in blocks:
        for name in block.attn.linears():
            yield block.attn, name, getattr(block.attn, name)
        for mlp in block.mlp.mlps() if isinstance(block.mlp, MoE) else (block.mlp,):
            yield mlp, "gate_up", mlp.gate_up
            yield mlp, "down", mlp.down


# --- the model ------------------------------------------------------------------------------------
class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope_length: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.dequantized_bytes = 0  # a file's codes dequantized once for torch (no kernels), what they take
        self.huge_page_bytes = 0  # the weights moved onto 2 MB pages (engine.huge_pages)
        # [V, D]; its own storage given, so no random init runs (on the meta device that init imports torch._dynamo,
        # which a first load then waits for: engine/BENCHMARKS.md, "Opening a model file")
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)  # D -> V, always a module
        if cfg.tie_word_embeddings:
            self.tie()
        self.rope_length = rope_length or 0  # positions the rotary tables cover at least
        self.decode_step = None  # a backend's decode of one position through every block in one call
        self.decode_step_refused: str | None = None  # why a backend's step failed its load-time check, if it did
        self.activations = "float32"  # what quantized layers' one-row products multiply: float32 | int8 (the loader's)
        self.widen_bf16 = False  # bfloat16 attention computed in float32 (widen_bf16_attention)
        self._rope: tuple | None = None  # (key, [(cos, sin) per rotary kind])

    def tie(self) -> None:
        """A tied model's head multiplies by the embedding's own matrix: the same Parameter, not a copy."""
        self.lm_head.weight = self.embed.weight

    def widen_bf16_attention(self, on: bool = True) -> None:
        """bfloat16 attention (and its mask) computed in float32 on the CPU: the loader's call where the CPU has
        no bf16 instructions, as the model cannot tell."""
        self.widen_bf16 = on
        for block in self.layers:
            block.attn.widen_bf16 = on

    def rope_tables(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[(cos, sin) [≥ length, r]] per rotary kind (the global one, then the sliding layers' own), built once per
        dtype/device and doubled when a longer context comes: sized by the context in use, not by
        max_position_embeddings. A longrope model's tables change kind past its original context, as
        transformers' do."""
        w, rope = self.norm.weight, self.cfg.rope
        long = rope.type == "longrope" and length > rope.original_max_position_embeddings
        if self._rope is None or self._rope[0][0] < length or self._rope[0][1:] != (w.dtype, w.device, long):
            n = max(self.rope_length, 1 << max(10, (length - 1).bit_length()))  # a power of two, ≥ 1024
            kinds = [rope] + ([self.cfg.rope_local] if self.cfg.rope_local is not None else [])
            tables = [cos_sin_table(r, self.cfg.head_dim, n, w.dtype, w.device, length) for r in kinds]
            self._rope = ((n, w.dtype, w.device, long), tables)
        return self._rope[1]

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] -> [B, T, D], scaled where the family scales its embedding (Gemma, Granite)."""
        x = self.embed(ids)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        return x

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The last hidden states [..., D] -> logits [..., V]: final norm, head, and the family's scale or cap."""
        return self.scaled(self.lm_head(self.norm(x)))

    def scaled(self, out: torch.Tensor) -> torch.Tensor:
        """The head's output [..., V] as logits: the family's scale or cap applied."""
        if self.cfg.logits_scale != 1.0:
            out = out / self.cfg.logits_scale
        if self.cfg.final_softcap is not None:
            cap = self.cfg.final_softcap
            out = torch.tanh(out / cap) * cap
        return out

    def masks(self, start: int, t: int, dtype, device, cache=None, blocks=()) -> dict:
        """The additive mask of each window among the layers (None: full attention) for T new positions; a sliding
        layer's over its cache's ring of slots where the cache keeps one (WindowedKVCache). `blocks`: runs [a, b)
        of the new positions that see each other whole (an image's, in Gemma 3), not only what came before."""
        ringed = cache is not None and cache.windowed
        windows = set(self.cfg.windows) - ({cache.window} if ringed else set())  # the ring's mask is its own
        out = {w: additive(attention_mask(start, t, w, device), dtype) for w in windows}
        if ringed:
            out[cache.window] = additive(cache.ring_mask(start, t, device), dtype)
        for w, m in out.items():
            for a, b in blocks if m is not None else ():
                keys = torch.arange(start + a, start + b, device=device)  # a ring keeps position p in slot p mod S
                m[a:b].index_fill_(1, keys % cache.slots if ringed and w == cache.window else keys, 0.0)
        if blocks:
            out[BLOCKS] = True  # not causal alone: no layer may take SDPA's causal shortcut for these positions
        return out

    def forward(self, ids: torch.Tensor, cache=None, last_only: bool = False, images=None) -> torch.Tensor:
        """ids [B, T] -> logits [B, T, V] ([B, 1, V] with last_only). With a cache, the T new positions
        start at cache.length and are appended to it; without one, they start at 0 (a full recompute).
        `images`: the rows of image positions among them (engine.image_prompt.ImageRows), their embedding rows replaced
        by the vision encoder's."""
        B, T = ids.shape
        start = cache.length if cache is not None else 0
        if cache is not None and start + T > cache.capacity:
            raise ValueError(f"{start + T} positions exceed the cache capacity of {cache.capacity}")
        step = getattr(cache, "max_chunk", T)  # a sliding layer's ring takes at most this many positions a step
        if T > step:
            if images is not None:  # PromptImages.piece (engine.image_prompt) keeps a step within the ring's reach
                raise ValueError(f"{T} positions with an image's in one step: a sliding ring takes {step} at most")
            parts = [self.forward(ids[:, a : a + step], cache, last_only) for a in range(0, T, step)]
            return parts[-1] if last_only else torch.cat(parts, dim=1)
        if B == 1 and 1 < T <= FEW_POSITIONS and images is None and self.rows_ready(cache):
            # a few positions (a short new message, a forward no scheduler took as rows): the rows of one batched
            # step, each its decode step, the weights read once for all of them
            out = self.forward_spans([(ids[0].tolist(), cache)], every=not last_only)
            if out is not None:
                return out[0]
        if cache is not None:
            cache.reserve(start, start + T)  # a pool's blocks for the new positions, none shared (copy on write)
        if images is not None and images.positions is not None:  # mrope: each position's own t, h, w
            ropes = self.mrope_rows(images.positions)
        else:
            p = start + rope_offset(cache)
            ropes = [(cos[p : p + T, None], sin[p : p + T, None]) for cos, sin in self.rope_tables(p + T)]
        x = self.embed_ids(ids)  # [B, T, D]
        if images is not None and images.rows.numel():
            x[0, images.rows] = images.values.to(x.dtype)  # [n, D]: the image positions' rows
        if B * T == 1 and self.decode_step is not None and self.decode_step.usable(cache):
            x = x.reshape(-1)  # [D], a fresh row: the blocks update it in place
            cos, sin = ropes[0]
            self.decode_step.run(x, cache, start, cos.reshape(-1), sin.reshape(-1))
            cache.length = start + 1
            return self.logits(x.view(B, T, -1))
        blocks = images.blocks if images is not None else ()
        masks = self.masks(start, T, attention_dtype(x.dtype, x.device, self.widen_bf16), ids.device, cache, blocks)
        for i, layer in enumerate(self.layers):
            x = layer(x, ropes, masks, cache, i, start)
        if cache is not None:
            cache.length = start + T
        if last_only:
            x = x[:, -1:]
        return self.logits(x)  # [B, T, V]

    def rows_ready(self, cache) -> bool:
        """Whether new positions on `cache` may run as rows of the backend's batched step (kvchat's kernels, a cache
        they read; not longrope, whose tables depend on the length)."""
        step = self.decode_step
        ready = step is not None and getattr(step, "batches", False) and self.cfg.rope.type != "longrope"
        return ready and cache is not None and step.usable(cache)

    def mrope_rows(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """positions [3, T] (t, h, w of each new position) -> [(cos, sin) [T, 1, r]]: each column's rotation taken
        from the part of the position its section names (Qwen2.5-VL's multimodal rotary; a text position's three
        parts are equal, so its row is the plain table's)."""
        cos, sin = self.rope_tables(int(positions.max()) + 1)[0]  # [L, r]
        which = section_columns(self.cfg.rope.sections, cos.shape[-1], cos.device)  # [r]
        pick = which.view(1, 1, -1).expand(1, positions.shape[1], -1)  # [1, T, r]
        rows = [t[positions].gather(0, pick)[0][:, None] for t in (cos, sin)]  # [3, T, r] -> [T, 1, r]
        return [(rows[0], rows[1])]

    def forward_many(self, tokens: list[int], caches: list) -> list[torch.Tensor] | None:
        """B sequences' next positions (a token each, each cache at its own length) in one call of the backend's
        step, every weight read once for all: the logits [1, 1, V] of each, as `forward` computes it alone. None
        where that step cannot take them (a cache it cannot read; longrope, whose tables depend on the length)."""
        return self.forward_spans([([t], c) for t, c in zip(tokens, caches)])

    def forward_spans(self, spans: list[tuple[list[int], object]], every: bool = False) -> list[torch.Tensor] | None:
        """Several sequences' next positions in one call of the backend's batched step: each span's tokens at its
        cache's length on (a decode step's one token, a few prompt positions riding beside other sequences' steps,
        a speculative verify), every weight read once for all rows, each row its own decode step (a span's rows see
        the rows before them: they wrote their K/V first). Each span's logits after its last token [1, 1, V] (after
        each of its tokens [1, n, V] with `every`); None where the step cannot take them (rows_ready)."""
        step = self.decode_step
        caches = [c for _, c in spans]
        if not self.rows_ready(caches[0]) or not step.takes(caches):
            return None
        if any(c.length + len(t) > c.capacity for t, c in spans):
            return None
        rows, positions, ids, turns, wanted = [], [], [], [], []
        for tokens, c in spans:
            c.reserve(c.length, c.length + len(tokens))
            offset = rope_offset(c)  # mrope after an image: the rotation runs ahead of the index
            first = len(ids)
            for j, t in enumerate(tokens):
                rows.append(c), positions.append(c.length + j), ids.append(t), turns.append(c.length + j + offset)
            wanted.append(range(first if every else len(ids) - 1, len(ids)))  # the rows whose logits it gives
        device = self.norm.weight.device
        x = self.embed_ids(torch.tensor([[t] for t in ids], device=device))  # [R, 1, D]
        x = x.reshape(len(ids), -1).contiguous()  # [R, D], updated in place
        cos, sin = self.rope_tables(max(turns) + 1)[0]
        at = torch.tensor(turns, device=device)
        step.run_batch(x, rows, cos.index_select(0, at).contiguous(), sin.index_select(0, at).contiguous(), positions)
        for tokens, c in spans:  # each len(tokens) positions longer
            c.length += len(tokens)
        picked = [r for span in wanted for r in span]
        normed = torch.cat([self.norm(x[r].view(1, -1)) for r in picked])  # [P, D], a row as alone
        head = step.head_rows(normed) if hasattr(step, "head_rows") else None
        if head is not None:
            out = self.scaled(head)  # [P, V]
        else:
            out = torch.cat([self.logits(x[r].view(1, 1, -1))[0] for r in picked])
        return [part[None] for part in out.split([len(span) for span in wanted])]  # each span's [1, n, V]

    def forward_static(self, ids: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
        """One decode step with static shapes, for CUDA graphs: ids [B, 1], pos [1] (a device tensor, the
        position being written) -> logits [B, 1, V]. Attention runs over the whole capacity with a mask,
        so no shape depends on the position. The caller advances cache.length."""
        ropes = [
            (cos.index_select(0, pos)[:, None], sin.index_select(0, pos)[:, None])  # [1, 1, r]
            for cos, sin in self.rope_tables(cache.capacity)
        ]
        masks = {w: visible(pos, cache.capacity, w) for w in set(self.cfg.windows)}  # [1, C] each
        x = self.embed_ids(ids)  # [B, 1, D]
        for i, layer in enumerate(self.layers):
            x = layer(x, ropes, masks, cache, i, pos)
        return self.logits(x)

    def parameter_count(self) -> int:
        """The model's values: its parameters, and the weights quantized layers hold as codes (a tied
        head and embedding once)."""
        coded = sum(getattr(m, "coded_values", 0) for m in self.modules())  # modules(): each module once
        return coded + sum(p.numel() for p in self.parameters())

    def active_parameter_count(self) -> int:
        """The values one position computes with: all of them for a dense model; for a mixture, the experts'
        only k of E per layer (the embedding row read, not the table, is not subtracted: the head reads it all)."""
        return self.parameter_count() - sum(b.mlp.unread(_values) for b in self.layers if isinstance(b.mlp, MoE))


def _values(module: nn.Module) -> int:
    """The values a module holds: its parameters and its quantized layers' codes."""
    coded = sum(getattr(m, "coded_values", 0) for m in module.modules())
    return coded + sum(p.numel() for p in module.parameters())
