"""How float weights are stored and multiplied on the CPU, and which layout each dtype gets.

Batch-1 decode multiplies one row by every weight, so the layout that streams a weight fastest
wins; prefill multiplies many rows. Each layout is a drop-in for nn.Linear (same `weight`,
`in_features`, `out_features`), swapped in after loading ("quantize, then swap" applies to
layouts too). engine/BENCHMARKS.md, "What makes the CPU path fast", has the measurements behind each choice.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import nn

from ..devices import bf16_hardware
from ..model import block_linears
from . import kernels as kernel_library


class LinearT(nn.Module):
    """A Linear whose weight is stored transposed, [in, out]: on the CPU a one-row float32 product
    `x @ w_t` streams it faster than F.linear on the [out, in] layout (where the kernels are missing)."""

    def __init__(self, weight_t: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.in_features, self.out_features = weight_t.shape
        self.weight_t = weight_t if isinstance(weight_t, nn.Parameter) else nn.Parameter(weight_t, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)  # [out]

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> LinearT:
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(linear.weight.detach().t().contiguous(), bias)

    @property
    def weight(self) -> torch.Tensor:  # [out, in], a view: for export and quantization
        return self.weight_t.t()

    def forward(self, x):
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


class EmbeddingT(nn.Module):
    """A tied embedding stored once, transposed [D, V]: lookups gather rows of its transpose, and the
    output head is a LinearT over the same Parameter (no second copy of the matrix)."""

    def __init__(self, weight_t: torch.Tensor):
        super().__init__()
        self.weight_t = nn.Parameter(weight_t, requires_grad=False)  # [D, V]

    @property
    def weight(self) -> torch.Tensor:  # [V, D], a view
        return self.weight_t.t()

    def forward(self, ids):
        return self.weight[ids]  # [B, T, D]


class PackedLinear(nn.Module):
    """A Linear whose weight oneDNN has reordered into its blocked layout (float32 and bfloat16): one-row
    products stream it faster than either plain layout, and prefill uses the same kernel (bfloat16 on
    the CPU's bf16 units). The plain weight is not kept: `weight` unpacks it on demand."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        self.packed = nn.Parameter(
            torch.ops.mkldnn._reorder_linear_weight(w, 1), requires_grad=False
        )  # [out, in] blocked
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    @property
    def weight(self) -> torch.Tensor:  # [out, in], unpacked (a copy)
        return self.packed.to_dense()

    def forward(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


FEW_ROWS = 4  # rows a product takes through the kernels' several-rows products (their pass), not torch's GEMM
FEW_INTEGER_ROWS = 8  # the same under int8 activations (the integer products' pass; prefill's other path
# dequantizes every weight into bfloat16, whatever the rows)


class KernelLinear(nn.Linear):
    """A Linear whose one-row products (decode) run kvchat's kernel on the checkpoint's [out, in]
    layout; many rows (prefill) run torch's (many_rows_linear)."""

    kernels = None  # the loaded kernels.Kernels, set by from_linear

    def forward(self, x):
        if x.numel() == self.in_features:  # one row: decode
            return kernel_linear(self.kernels, x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        if 1 < rows <= FEW_ROWS and self.weight.dtype == torch.float32 and self.kernels.batch_rows:
            y = self.kernels.rows("float32", self.weight, x.reshape(rows, -1)).view(*x.shape[:-1], -1)
            return y if self.bias is None else y + self.bias  # a few positions, each as decode computes it
        return self.many_rows(x)

    def many_rows(self, x):
        return many_rows_linear(x, self.weight, self.bias)

    def kernel_operands(self, kernels):
        """(weight, scales, mins, bias, group, bits, tiles) as the one-call decode step reads them, when it can."""
        return (self.weight, None, None, self.bias, self.in_features, 0, 0) if kernels is self.kernels else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernels) -> KernelLinear:
        linear.__class__ = cls  # same parameters, another forward
        linear.kernels = kernels
        return linear


class KernelHead(KernelLinear):
    """The output head on the kernels: one row (decode) through them, many rows through F.linear."""

    def many_rows(self, x):
        return F.linear(x, self.weight, self.bias)


def kernel_linear(kernels, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for one row x [..., in] through the kernels: -> [..., out]."""
    y = kernels.matvec(weight, x.reshape(-1)).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


class HalfLinear(nn.Linear):
    """float16: torch's one-row float16 kernel streams the weight fastest of torch's layouts, but its
    many-row product is slow, so prefill computes in float32 (exact for float16 inputs) instead."""

    def forward(self, x):
        if x.numel() == x.shape[-1]:  # one row: decode
            return F.linear(x, self.weight, self.bias)
        return many_rows_linear(x, self.weight, self.bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> HalfLinear:
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
    one per thread and dtype: fresh memory for every call costs a page fault per 4 KiB of the matrix."""
    n = math.prod(shape)
    name = f"buf_{str(dtype).removeprefix('torch.')}"
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor: writable inside and outside inference mode
            buf = torch.empty(n, dtype=dtype)
            setattr(_scratch, name, buf)
    return buf[:n].view(shape)


WIDEN_CHUNK_BYTES = 8 << 20  # float32 rows of a 16-bit weight widened at a time (widened_linear)


def many_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for prefill on the CPU: float32 through oneDNN's inner product on the plain weight where
    that gives F.linear's numbers (faster than F.linear's GEMM); float16, and bfloat16 on a CPU without bf16
    instructions, computed in float32 (torch's many-row products of those are slow there, and float32 is
    exact for their inputs)."""
    if x.device.type == "cpu" and (
        weight.dtype == torch.float16 or (weight.dtype == torch.bfloat16 and not bf16_hardware())
    ):
        return widened_linear(x, weight, bias)
    if weight.dtype == torch.float32 and x.device.type == "cpu" and onednn_works(torch.float32, packed=False):
        return plain_onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear of a 16-bit weight [out, in] over many rows x [..., in], computed in float32 a chunk of the
    weight's rows at a time (each widened into a reused buffer of WIDEN_CHUNK_BYTES): the CPU's float32 GEMM
    speed, and no float32 copy of the weight. Each chunk's product [T, chunk] is rounded to x's dtype once, as
    F.linear's is, straight into its columns of the result (no transposed copy of the whole result after)."""
    n_out, n_in = weight.shape
    xf = x.reshape(-1, n_in).float()  # [T, in]
    out = torch.empty(xf.shape[0], n_out, dtype=x.dtype)  # [T, out]
    rows = max(64, WIDEN_CHUNK_BYTES // (4 * n_in))
    part = torch.empty(xf.shape[0], min(rows, n_out), dtype=torch.float32)  # [T, chunk]
    for a in range(0, n_out, rows):
        b = min(n_out, a + rows)
        w = weight_scratch((b - a, n_in)).copy_(weight[a:b])  # [chunk, in] float32
        p = part[:, : b - a]
        if bias is None:
            torch.mm(xf, w.t(), out=p)
        else:
            torch.addmm(bias[a:b].float(), xf, w.t(), out=p)
        out[:, a:b].copy_(p)
    return out.reshape(*x.shape[:-1], n_out)


def layout_for(dtype: torch.dtype):
    """The fastest CPU layout for float weights of `dtype`, as a function nn.Linear -> module, or None
    (keep nn.Linear): kvchat's kernels on the [out, in] layout where they build; else oneDNN-packed
    where it works, transposed for float32, and HalfLinear for float16."""
    k = kernel_library.for_dtype(dtype)
    if k is not None:
        return lambda linear: KernelLinear.from_linear(linear, k)
    if onednn_works(dtype):
        return PackedLinear
    if dtype == torch.float32:
        return LinearT.from_linear
    if dtype == torch.float16:
        return HalfLinear.from_linear
    return None


def fast_cpu_linears(blocks, dtype: torch.dtype) -> int:
    """Swap the block linears for the fastest CPU layout for `dtype`, one at a time (one extra matrix
    alive at most). Returns how many were swapped."""
    make = layout_for(dtype)
    if make is None:
        return 0
    n = 0
    for parent, name, child in list(block_linears(blocks)):
        if type(child) is nn.Linear:  # plain, as loaded (a file's own codes stay quantized)
            setattr(parent, name, make(child))
            n += 1
    return n


def transposed_embedding(model, weight_t: torch.Tensor) -> None:
    """A tied float32 model without the kernels: the embedding stored transposed once, [D, V], and the
    head a LinearT over that same Parameter (`x @ w_t` is torch's fast one-row layout)."""
    model.embed = EmbeddingT(weight_t)
    model.lm_head = LinearT(model.embed.weight_t)


def kernel_head(model, kernels) -> None:
    """The output head (a plain Linear, tied or not) on the kernels for decode."""
    if isinstance(model.lm_head, nn.Linear):  # not quantized
        model.lm_head = KernelHead.from_linear(model.lm_head, kernels)
