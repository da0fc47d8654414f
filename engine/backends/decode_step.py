"""The CPU decode step on kvchat's kernels: norms, attention and a whole step's blocks in C.

Swapped in by `use_kernels` once a model is loaded: RMSNorm and Attention become their kernel
variants (same parameters, another forward) — the norm for a decode step's row and a prompt's rows, attention
for one row — and a SwiGLU MLP's prompt rows take silu(gate) · up in one kernel pass; where every block linear
has a kernel layout, a decode step's blocks run in one C call (`DecodeLayers`) with nothing crossing into Python
between layers.
"""

from __future__ import annotations

import contextlib
import ctypes

import torch

from ..feedforward import ACT, MLP, MoE
from ..model import Attention, RMSNorm
from .cpu_layouts import kernel_head
from .kernel_binding import check_slots


class KernelRMSNorm(RMSNorm):
    """RMSNorm on the kernel, rounded as RMSNorm rounds: a decode step's row, and a prompt's rows (in one pass a
    row, where torch's norm was six passes over them)."""

    kernels = None
    folded: torch.Tensor | None = None  # an offset norm's 1 + w in float32 (a GGUF file holds it so), or None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:  # (1 + w) · x / rms(x) in float32, as a GGUF file's folded weight gives it
            if x.dtype != torch.float32:
                return super().forward(x)
            if self.folded is None:
                self.folded = (self.weight.detach().float() + self.offset).contiguous()
            return self.kernels.rms_norm(x, self.folded, self.eps)
        if x.dtype in self.kernels.dtypes and self.weight.dtype == x.dtype:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


class KernelMLP(MLP):
    """A SwiGLU MLP whose rows in float32 take silu(gate) · up in one kernel pass a row, as the one-call decode step
    computes it: a prompt's rows, and a step or a verify on the module path, agree with that step's."""

    kernels = None

    def forward(self, x):
        if self.limit is None and x.dtype == torch.float32:
            return self.down(self.kernels.silu_mul(self.gate_up(x)))  # [..., 2F] -> [..., F] -> [..., D]
        return super().forward(x)


class KernelAttention(Attention):
    """Attention whose decode position (batch 1, a cache in the model dtype) is rotated, written into
    the cache and attended in one kernel call."""

    kernels = None
    sinks_f32: torch.Tensor | None = None  # the sinks as the kernel reads them (float32), or None

    def forward(self, x, cos, sin, mask, cache, layer: int, start, causal: bool = True):
        B, T, _ = x.shape
        if B * T == 1 and isinstance(start, int) and cache is not None and cache.readable_by_kernels(x.dtype):
            qkv = self.qkv(x)  # [1, 1, (H + 2H_kv)d]
            qn, kn = (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
            y = self.kernels.attend(
                qkv.view(-1),
                cos.view(-1),
                sin.view(-1),
                qn,
                kn,
                getattr(self.q_norm, "eps", 0.0),
                cache.k[layer, 0],
                cache.v[layer, 0],
                start,
                self.window,
                self.h,
                cache.kernel_table(),
                self.sinks_f32,
            )  # [H d]
            return self.o(y.view(B, T, self.h * self.d))
        return super().forward(x, cos, sin, mask, cache, layer, start, causal)


def kernel_attends(attn: Attention, cfg) -> bool:
    """Whether the attention kernel computes this layer's decode: rotated over the whole head, scores at 1/√d
    and uncapped (sinks allowed), QK norms (if any) per head without an offset."""
    return (
        attn.rope_kind is not None
        and cfg.rope.partial == 1.0
        and attn.scale is None
        and attn.softcap is None
        and not attn.qk_norm_all
        and cfg.norm_offset == 0.0
    )


def _swap(module, cls, kernels):
    module.__class__ = cls  # same parameters, another forward
    module.kernels = kernels
    return module


def use_kernels(model, kernels, identity: str | None = None) -> None:
    """Route the CPU decode step through kvchat's kernels: all the blocks in one call where every linear
    has a kernel layout (DecodeLayers), and the norms, attention and output head module by module.
    `identity`: what identifies the weights (their files' names, sizes, times and headers), under which an
    earlier process's passed check is taken (_passed)."""
    for m in list(model.modules()):
        if isinstance(m, RMSNorm):
            _swap(m, KernelRMSNorm, kernels)
        elif type(m) is MLP and m.act is ACT["silu"]:
            _swap(m, KernelMLP, kernels)
        elif isinstance(m, Attention) and kernel_attends(m, model.cfg):
            _swap(m, KernelAttention, kernels)
            m.sinks_f32 = None if m.sinks is None else m.sinks.detach().float().contiguous()
    kernel_head(model, kernels)
    try:
        model.decode_step = DecodeLayers(kernels, model)
    except ValueError:  # a layer the C step cannot read: the module path serves it
        model.decode_step = None
    if model.decode_step is not None:
        kept = None if identity is None else _passed(model, kernels, identity)
        if kept is not None and kept.is_file():
            return
        model.decode_step_refused = step_disagreement(model)
        if model.decode_step_refused is not None:  # a wrong step never writes tokens: the module path serves
            model.decode_step = None
        elif kept is not None:
            try:
                kept.parent.mkdir(parents=True, exist_ok=True)
                kept.touch()
            except OSError:
                pass  # only the next open's speed is at stake


def _passed(model, kernels, identity: str):
    """Where a passed check of this step is kept: keyed by the weights, the kernel library (its name holds
    its build's digest), torch, and what the model computes in (dtype, codes, activations) and with (this
    module's and the model's code). Only a pass is kept: a refusal is checked again at every open
    (engine/BENCHMARKS.md, "Opening a model file")."""
    import hashlib
    import json
    from pathlib import Path

    from .. import model as model_module
    from ..user_cache import user_cache

    layout = sorted({f"{type(m).__name__}:{getattr(m, 'mode', '')}:{getattr(m, 'tiles', '')}" for m in model.modules()})
    facts = [identity, Path(kernels.path).name, torch.__version__, str(model.norm.weight.dtype), model.activations]
    h = hashlib.sha256(json.dumps([*facts, layout]).encode())
    for source in (__file__, model_module.__file__):
        h.update(Path(source).read_bytes())
    return user_cache("step-checks") / h.hexdigest()[:32]


STEP_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 6e-2, torch.float16: 2e-2}  # of the logits' largest
INT8_TOLERANCE = 5e-2  # int8 activations: the step and the module path differ by ~1% there (SmolLM2 Q4_1)


@torch.inference_mode()
def step_disagreement(model) -> str | None:
    """The whole one-call decode step on this model, at load, against the module path's decode of the same
    two positions (the same weights, codes and fused layers, each product through its own checked kernel;
    the second position decoded after the first). None when they agree; else why, for the panel. The
    kernels' per-function checks against torch pass a wrong step only where layers meet (a fused product of
    mixed types, an offset on a block a file holds): this catches those before a token is written. The
    module path, not a two-position prefill, is the reference: a prefill dequantizes every weight, which took
    most of the check's time on a 4-bit file (engine/BENCHMARKS.md, "Opening a model file"). A mixture's step
    takes the experts the module path chose, so the check compares the products, not two roundings' choices."""
    from ..kv_cache import make_cache

    cfg, dtype = model.cfg, model.norm.weight.dtype
    ids = torch.tensor([[1, 2]]) % cfg.vocab_size
    step, fresh = make_cache(cfg, 2, dtype, "cpu"), make_cache(cfg, 2, dtype, "cpu")
    kept, model.decode_step = model.decode_step, None
    try:
        with _routes_taken(model) as routes:
            model.forward(ids[:, :1], fresh)
            want = model.forward(ids[:, 1:], fresh)[0, -1].float()  # module by module
    finally:
        model.decode_step = kept
    with _routes_given(kept, routes[:1]):
        model.forward(ids[:, :1], step)
    with _routes_given(kept, routes[1:]):
        got = model.forward(ids[:, 1:], step)[0, -1].float()  # the step (one position, on the kernels' cache)
    err = float((got - want).abs().max()) / max(float(want.abs().max()), 1e-6)
    limit = INT8_TOLERANCE if model.activations == "int8" else STEP_TOLERANCE[dtype]
    if not torch.isfinite(got).all() or err > limit:
        return f"the one-call decode step disagreed with the module path on this model ({err:.2g} of the logits)"
    return None


@contextlib.contextmanager
def _routes_taken(model):
    """While open, each mixture layer's choice of experts for one position is appended to the list it yields: one
    list of [top_k] int32 tensors (one a mixture layer, in order) a forward pass."""
    mixtures = [b.mlp for b in model.layers if isinstance(b.mlp, MoE)]
    passes: list[list[torch.Tensor]] = []

    def taking(moe, route):
        def taken(x):
            weights, chosen = route(x)
            if moe is mixtures[0]:
                passes.append([])
            passes[-1].append(chosen[0].to(torch.int32).contiguous())
            return weights, chosen

        return taken

    for moe in mixtures:
        moe.route = taking(moe, moe.route)
    try:
        yield passes
    finally:
        for moe in mixtures:
            del moe.route  # the class's own again


@contextlib.contextmanager
def _routes_given(step, passes: list[list[torch.Tensor]]):
    """While open, the step's mixture layers take the first pass's choice of experts (none: their own). The
    check compares what the step computes, not where two roundings of a near-tie route (random weights put
    experts at near-ties: one ulp anywhere flips a choice, and a flipped choice moves the logits far)."""
    layers = [layer for layer in step.layers if layer.n_experts]
    for layer, route in zip(layers, passes[0] if passes else []):
        layer.route = route.data_ptr()
    try:
        yield
    finally:
        for layer in layers:
            layer.route = None


class _Linear(ctypes.Structure):  # kv_linear in csrc/kernels.h
    _fields_ = [
        ("w", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("out", ctypes.c_int64),
        ("in_", ctypes.c_int64),
        ("group", ctypes.c_int64),
        ("mode", ctypes.c_int64),
        ("act", ctypes.c_int64),
        ("tiles", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):  # kv_layer in csrc/kernels.h
    _fields_ = [
        ("attn_norm", ctypes.c_void_p),
        ("mlp_norm", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("router", _Linear),
        ("experts", ctypes.c_void_p),  # a kv_linear array (expert_tables holds it)
        ("n_experts", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
        ("norm_topk", ctypes.c_int64),
        ("expert_f", ctypes.c_int64),
        ("sinks", ctypes.c_void_p),
        ("window", ctypes.c_int64),
        ("topk_first", ctypes.c_int64),
        ("swiglu_limit", ctypes.c_float),
        ("swiglu_alpha", ctypes.c_float),
        ("route", ctypes.c_void_p),  # int32 [top_k] given in place of the router's choice (the check's), or NULL
    ]


MAX_EXPERTS, MAX_TOP_K = 512, 64  # KV_MAX_EXPERTS, KV_MAX_TOP_K in csrc/kernels.h


class DecodeLayers:
    """A model's blocks as kv_decode_layers reads them, so that a decode step's layers run in one call
    with nothing crossing into Python between them. Built once the model is final (the loader does);
    it holds the tensors it points at, so a module swapped later cannot leave it reading freed memory."""

    def __init__(self, kernels, model):
        cfg = model.cfg
        if not cfg.step_blocks:  # the C step computes the Llama shape (its MLP possibly a mixture) and gpt-oss's
            raise ValueError(f"the {cfg.family} family's blocks are not the shape the one-call step computes")
        if cfg.num_experts > MAX_EXPERTS or cfg.experts_per_token > MAX_TOP_K:
            raise ValueError(f"{cfg.num_experts} experts, {cfg.experts_per_token} a token: past what the step routes")
        self.dtype = model.norm.weight.dtype
        self.fn = kernels._decode[self.dtype]
        self.kept: list[torch.Tensor] = []
        self.layers = (_Layer * len(model.layers))()
        self.cache_at: tuple | None = None  # the cache (addresses and shape) the layers point into

        def addr(t):
            if t is None:
                return None
            if not (t.is_cpu and t.is_contiguous()):
                raise ValueError("a weight is not a contiguous CPU tensor")
            self.kept.append(t)
            return t.data_ptr()

        def linear(m) -> _Linear:
            operands = getattr(m, "kernel_operands", lambda _: None)(kernels)
            if operands is None or (operands[5] == 0 and operands[0].dtype != self.dtype):
                raise ValueError(f"{type(m).__name__} has no kernel layout")
            w, scales, mins, bias, group, bits, tiles = operands
            act = 8 if getattr(m, "activations", "float32") == "int8" else 0
            return _Linear(
                addr(w), addr(scales), addr(mins), addr(bias), m.out_features, m.in_features, group, bits, act, tiles
            )

        self.expert_tables = []  # each mixture layer's kv_linear array, kept alive while the step points at it
        for i, (layer, block) in enumerate(zip(self.layers, model.layers)):
            a = block.attn
            layer.attn_norm, layer.mlp_norm = addr(block.attn_norm.weight), addr(block.mlp_norm.weight)
            layer.window = cfg.window(i) or 0  # each layer's own (gpt-oss: every other one slides)
            if a.sinks is not None:  # gpt-oss's sinks, as the kernels' attention reads them
                sinks = getattr(a, "sinks_f32", None)
                layer.sinks = addr(sinks if sinks is not None else a.sinks.detach().float().contiguous())
            layer.q_norm = addr(None if a.q_norm is None else a.q_norm.weight)
            layer.k_norm = addr(None if a.k_norm is None else a.k_norm.weight)
            layer.qkv, layer.o = linear(a.qkv), linear(a.o)
            if isinstance(block.mlp, MoE):  # a mixture: the router as a float product, each expert's two linears
                moe = block.mlp
                router = moe.router.weight
                if router.dtype != self.dtype:
                    raise ValueError("the router's weights are not of the model's dtype")
                bias = addr(moe.router.bias)  # gpt-oss's router has one
                layer.router = _Linear(addr(router), None, None, bias, router.shape[0], router.shape[1], 0, 0, 0, 0)
                table = (_Linear * (2 * len(moe.experts)))(
                    *[lin for e in moe.experts for lin in (linear(e.gate_up), linear(e.down))]
                )
                self.expert_tables.append(table)
                layer.experts = ctypes.addressof(table)
                layer.n_experts, layer.top_k, layer.norm_topk = len(moe.experts), moe.k, int(moe.normalize)
                layer.expert_f, layer.topk_first = moe.experts[0].f, int(moe.topk_first)
                limit = moe.experts[0].limit  # gpt-oss's clamped SwiGLU
                layer.swiglu_limit, layer.swiglu_alpha = (limit, moe.experts[0].alpha) if limit is not None else (0, 1)
            else:
                layer.gate_up, layer.down = linear(block.mlp.gate_up), linear(block.mlp.down)
        self.qk_eps = cfg.rms_norm_eps if cfg.qk_norm else 0.0
        self.eps = cfg.rms_norm_eps  # (each layer's window is its own: kv_layer.window)
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.hidden, self.mlp = cfg.hidden_size, cfg.intermediate_size
        width = (self.heads + 2 * self.kv_heads) * self.head_dim
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        linears += [lin for table in self.expert_tables for lin in table]
        linears += [layer.router for layer in self.layers if layer.n_experts]
        widest = max([self.mlp] + [layer.expert_f for layer in self.layers])
        new = lambda n, dt=self.dtype: torch.empty(n, dtype=dt)
        self.scratch = [
            new(self.hidden),
            new(width),
            new(self.heads * self.head_dim),
            new(max(self.hidden, cfg.num_experts)),
            new(2 * widest),
            new(self.hidden),
            new(max(lin.in_ for lin in linears), torch.float32),
            new(max(lin.out for lin in linears), torch.float32),
        ]  # h, qkv, att, t (a router's logits too), gu, acc, fx, fy
        self.scratch_at = [t.data_ptr() for t in self.scratch]
        self.kernels = kernels
        self.batch_fn = kernels._decode_batch[self.dtype]
        self.rows_fn = kernels._linear_rows[self.dtype]
        try:  # the output head as kv_linear_rows reads it: several sequences' logits in one pass over it
            self.head = linear(model.lm_head)
        except ValueError:
            self.head = None
        self.t_stride, self.gu_stride = max(self.hidden, cfg.num_experts), 2 * widest  # a batch's scratch rows
        self._batch_scratch: tuple[int, list[torch.Tensor]] | None = None  # (rows, the scratch for that many)

    def usable(self, cache) -> bool:
        """Whether this step can run on `cache`: batch 1, K/V in the model's dtype on the CPU (a cache of its own,
        or a sequence's blocks of the KV pool)."""
        return cache is not None and cache.readable_by_kernels(self.dtype)

    @property
    def batches(self) -> bool:
        """Whether several sequences' steps may run in one call: the library's products of several rows gave
        each row's one-row product when it was checked (kernel_checks.rows_agree)."""
        return bool(self.kernels.batch_rows)

    def takes(self, caches: list) -> bool:
        """Whether run_batch takes these caches: the step's, of one size of buffers (one pool's sequences, or caches
        of one capacity), each with room for a position."""
        slots = caches[0].k.shape[3]
        return all(self.usable(c) and c.k.shape[3] == slots and c.length < c.capacity for c in caches)

    def run_batch(self, x: torch.Tensor, caches: list, cos: torch.Tensor, sin: torch.Tensor, positions=None) -> None:
        """x [B, D] (B sequences' embedded tokens, updated in place), each row at its cache's length (or at
        `positions`: rows of one sequence at consecutive positions, each attending to those before it) and its K/V
        written there; cos, sin [B, d] each row's rotation. Each row computed as `run` computes it alone."""
        B = len(caches)
        pos = [c.length for c in caches] if positions is None else list(positions)
        if not self.takes(caches) or any(p >= c.capacity for p, c in zip(pos, caches)):
            raise ValueError("a batch's caches must be the step's, of one capacity, with room")
        rows_of = (x.shape == (B, self.hidden), cos.shape == sin.shape == (B, self.head_dim))
        if not all(rows_of) or {x.dtype, cos.dtype, sin.dtype} != {self.dtype}:
            raise ValueError("a batch's rows must be [B, D] and its rotations [B, d], in the model's dtype")
        if self._batch_scratch is None or self._batch_scratch[0] < B:
            sizes = [self.hidden, self.scratch[1].numel(), self.heads * self.head_dim, self.t_stride, self.gu_stride,
                     self.hidden]  # fmt: skip
            rows = [torch.empty(B * n, dtype=self.dtype) for n in sizes]
            rows += [torch.empty(B * t.numel(), dtype=torch.float32) for t in self.scratch[6:]]  # fx, fy
            self._batch_scratch = (B, rows)
        rows = self._batch_scratch[1]
        lo = [0] * B  # (each layer starts at its own window: kv_layer.window)
        n, slots = len(self.layers), caches[0].k.shape[3]
        tables = [c.kernel_table() for c in caches]
        for p, t in zip(pos, tables):
            check_slots(p, slots, t)
        kc = (ctypes.c_void_p * (B * n))(*[c.k[i, 0].data_ptr() for c in caches for i in range(n)])
        vc = (ctypes.c_void_p * (B * n))(*[c.v[i, 0].data_ptr() for c in caches for i in range(n)])
        tb = (ctypes.c_void_p * B)(*self.kernels.memory(*tables))
        x_, cos_, sin_ = self.kernels.memory(x, cos, sin)
        self.batch_fn(
            self.layers, n, B, x_, cos_, sin_, self.eps, self.qk_eps, slots,
            (ctypes.c_int64 * B)(*pos), (ctypes.c_int64 * B)(*lo), tb, kc, vc, self.heads, self.kv_heads,
            self.head_dim, self.hidden, self.mlp, self.t_stride, self.gu_stride,
            *[t.data_ptr() for t in rows], torch.get_num_threads(),
        )  # fmt: skip

    def head_rows(self, h: torch.Tensor) -> torch.Tensor | None:
        """The output head on B normalised rows h [B, D] -> [B, V] in the model's dtype, each row as the head's
        one-row product gives it; None where the head has no kernel layout."""
        if self.head is None:
            return None
        B = h.shape[0]
        if h.shape != (B, self.hidden) or h.dtype != self.dtype:
            raise ValueError("the head's rows must be [B, D] in the model's dtype")
        y = torch.empty(B, self.head.out, dtype=self.dtype)
        fx, fy = (torch.empty(B * n, dtype=torch.float32) for n in (self.head.in_, self.head.out))
        h_, y_, fx_, fy_ = self.kernels.memory(h.contiguous(), y, fx, fy)
        self.rows_fn(ctypes.byref(self.head), B, h_, y_, fx_, fy_, torch.get_num_threads())
        return y

    def run(self, x: torch.Tensor, cache, pos: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """x [D] (the embedded token, updated in place to the last block's output); writes the position's
        K/V into `cache`; cos, sin [d] the rope tables' row for `pos`."""
        if not 0 <= pos < cache.capacity:
            raise ValueError(f"position {pos} is outside the cache's {cache.capacity}")
        table, slots = cache.kernel_table(), cache.k.shape[3]
        check_slots(pos, slots, table)
        at = (cache.k.data_ptr(), cache.v.data_ptr(), tuple(cache.k.shape))
        if at != self.cache_at:  # another cache (or another one at the same address): point every layer at it
            for i, layer in enumerate(self.layers):
                layer.k_cache, layer.v_cache = cache.k[i, 0].data_ptr(), cache.v[i, 0].data_ptr()
            self.cache_at = at
        lo = 0  # (each layer starts at its own window: kv_layer.window)
        x_, cos_, sin_ = self.kernels.memory(x, cos, sin)
        self.fn(
            self.layers,
            len(self.layers),
            x_,
            cos_,
            sin_,
            self.eps,
            self.qk_eps,
            slots,
            pos,
            lo,
            self.kernels.memory(table)[0],
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.hidden,
            self.mlp,
            *self.scratch_at,
            torch.get_num_threads(),
        )
