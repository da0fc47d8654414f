"""The feed-forward halves of a block: the gated MLP and the mixture of experts, in plain PyTorch.

Apart from engine.model so the decoder stays one module of attention and blocks, and so the mixture's two decode
paths (stacked experts on a GPU, one expert at a time elsewhere) sit beside each other.
Shapes: D hidden, F MLP width, E experts, k experts per position, N positions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from .config import ModelConfig

ACT = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) · up(x)), SwiGLU or Gemma's GeGLU; an expert of gpt-oss's (`expert`) with
    biases and its clamped SwiGLU, down((clamp(up, ±l) + 1) · g·σ(α·g)) with g = min(gate, l)."""

    def __init__(self, cfg: ModelConfig, width: int | None = None, expert: bool = False):
        super().__init__()
        self.f = width or cfg.intermediate_size
        self.act = ACT[cfg.hidden_act]
        bias = expert and cfg.expert_bias
        self.limit, self.alpha = (cfg.swiglu_limit, cfg.swiglu_alpha) if expert else (None, 1.0)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * self.f, bias=bias)  # D -> 2F
        self.down = nn.Linear(self.f, cfg.hidden_size, bias=bias)  # F -> D

    def forward(self, x):
        gate, up = self.gate_up(x).split(self.f, dim=-1)  # [..., F] each
        if self.limit is not None:
            gate = gate.clamp(max=self.limit)
            glu = gate * torch.sigmoid(gate * self.alpha)
            return self.down((up.clamp(-self.limit, self.limit) + 1) * glu)
        return self.down(self.act(gate).mul_(up))  # the product into the activation's fresh buffer: one [.., F] less


class MoE(nn.Module):
    """A mixture of experts: each position goes through the k experts its router scores highest, their outputs
    weighted by the router's softmax (renormalised over the k where the config says). One position reads only its
    k experts' weights; many positions are grouped by expert, each expert's rows in one product.

    A decode step picks its experts on the device where the experts are stacked (`stack_experts`, a GPU's float
    weights): the k chosen are gathered by index, so the step never waits for the router's choice. Elsewhere the
    choice comes to the host once per layer and the k experts run one at a time (quantized modules, the CPU)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.router_bias)  # D -> E
        self.experts = nn.ModuleList(MLP(cfg, cfg.moe_intermediate_size, expert=True) for _ in range(cfg.num_experts))
        self.k, self.normalize = cfg.experts_per_token, cfg.norm_topk_prob
        self.topk_first = cfg.router_topk_first  # gpt-oss: the k highest logits, then their softmax
        self.scoring, self.scaling = cfg.router_scoring, cfg.routed_scaling  # DeepSeek: sigmoid (V3), a scale
        self.groups, self.best_groups = cfg.router_groups, cfg.router_topk_groups  # the k from the best groups
        # [E] added to the scores the choice reads, never to the weights (DeepSeek-V3's load-balancing correction)
        self.choice_bias = nn.Parameter(torch.zeros(cfg.num_experts)) if cfg.router_choice_bias else None
        # every position's MLP beside its k routed experts (DeepSeek's shared experts as one MLP that many times wide,
        # Granite 4.0-H's shared MLP)
        self.shared = MLP(cfg, cfg.shared_width) if cfg.shared_width else None
        # D -> 1: the shared MLP's output × σ of it (Qwen3-Next's shared expert gate)
        self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if cfg.shared_gate else None
        self.act = ACT[cfg.hidden_act]
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None  # ([E, 2F, D], [E, D, F]), views shared

    def mlps(self) -> list[MLP]:
        """Every MLP in the mixture: the routed experts, then the shared one (if any)."""
        return [*self.experts, *([self.shared] if self.shared is not None else [])]

    def unread(self, measure) -> int:
        """What one position leaves unread of the experts, by `measure` (values, bytes): all but the k largest."""
        return sum(sorted((measure(e) for e in self.experts), reverse=True)[self.k :])

    def stack_experts(self) -> bool:
        """Lay the experts' weights in two stacked tensors, each expert's linears re-pointed at its slice (no second
        copy), so a decode step gathers the chosen k on the device. Only where every expert is a plain float
        linear; returns whether it did."""
        linears = [(e.gate_up, e.down) for e in self.experts]
        if any(e.limit is not None or e.gate_up.bias is not None for e in self.experts):  # gpt-oss's: one by one
            return False
        if not all(type(g) is nn.Linear and type(d) is nn.Linear for g, d in linears):
            return False
        gate_up = torch.stack([g.weight for g, _ in linears])  # [E, 2F, D]
        down = torch.stack([d.weight for _, d in linears])  # [E, D, F]
        for e, (g, d) in enumerate(linears):
            g.weight = nn.Parameter(gate_up[e], requires_grad=False)
            d.weight = nn.Parameter(down[e], requires_grad=False)
        self.stacked = (gate_up, down)
        return True

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k] in x's dtype, experts [N, k])."""
        if self.topk_first:
            top, chosen = self.router(x).topk(self.k, dim=-1)  # [N, k] each
            return torch.softmax(top, dim=-1).to(x.dtype), chosen
        if self.scoring == "sigmoid":
            scores = torch.sigmoid(self.router(x).float())  # [N, E]
        else:
            scores = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)  # [N, E]
        if self.groups or self.choice_bias is not None:
            chosen = self.choose(scores)
            weights = scores.gather(1, chosen)  # [N, k]
        else:
            weights, chosen = scores.topk(self.k, dim=-1)
        if self.normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if self.scoring == "sigmoid" else 0.0))
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return weights.to(x.dtype), chosen

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """scores [N, E] -> the k experts [N, k] DeepSeek routes to: by the scores plus the correction bias (V3), only
        from the best `best_groups` groups of experts (a group's worth: its best score (V2), its best two summed
        (V3))."""
        choice = scores if self.choice_bias is None else scores + self.choice_bias.float()
        if self.groups:
            n = choice.shape[0]
            grouped = choice.view(n, self.groups, -1)  # [N, G, E/G]
            worth = grouped.amax(-1) if self.choice_bias is None else grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
            best = worth.topk(self.best_groups, dim=-1).indices  # [N, g]
            keep = torch.zeros_like(worth, dtype=torch.bool).scatter_(1, best, True)  # [N, G]
            choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(n, -1)
        return choice.topk(self.k, dim=-1).indices

    def forward(self, x):
        routed = self.routed(x)
        if self.shared is None:
            return routed
        shared = self.shared(x)
        return routed + (shared if self.shared_gate is None else shared * torch.sigmoid(self.shared_gate(x)))

    def routed(self, x):
        """x [..., D] through each position's k routed experts, weighted."""
        flat = x.reshape(-1, x.shape[-1])  # [N, D]
        weights, chosen = self.route(flat)
        if flat.shape[0] == 1:
            return (self._gathered if self.stacked is not None else self._one_by_one)(flat, weights, chosen).view(
                x.shape
            )
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():  # prefill: each expert once, over the positions routed to it
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, self.experts[e](flat[rows]) * weights[rows, slot, None])
        return out.view(x.shape)

    def _gathered(self, flat, weights, chosen):
        """One position through its k experts gathered from the stacks: no value leaves the device."""
        gate_up, down = self.stacked
        f = down.shape[-1]
        h = torch.einsum("kfd,d->kf", gate_up[chosen[0]], flat[0])  # [k, 2F]
        a = self.act(h[:, :f]).mul_(h[:, f:])  # [k, F]
        y = torch.einsum("kdf,kf->kd", down[chosen[0]], a)  # [k, D]
        return (weights[0] @ y)[None]  # [1, D]

    def _one_by_one(self, flat, weights, chosen):
        """One position through its k experts one at a time: the choice read once (one wait on a device)."""
        picks = torch.cat((weights[0].float(), chosen[0].float())).tolist()
        out = None
        for w, e in zip(picks[: self.k], picks[self.k :]):
            y = self.experts[int(e)](flat).mul_(w)
            out = y if out is None else out.add_(y)
        return out
