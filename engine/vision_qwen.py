"""Qwen2.5-VL's vision encoder: an image at its own resolution (dynamic: a whole number of 28-pixel cells) as
14-pixel patches, a ViT with 2-D rotary positions, windowed attention in most layers and whole-image attention
in a few, and a merger of each 2×2 patches into one prompt position. The architecture as the checkpoint defines
it, as engine/vision.py does for SigLIP; its prompt positions' rotations are engine.image_prompt's.

Shapes: N patches of an image, E encoder width, F its MLP width, n = N/4 prompt positions, D the text model's
width, gh × gw the patch grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .model import RMSNorm
from .vision import VisionConfig, VisionModel, drained


class QwenAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: list[int]) -> torch.Tensor:
        n, e = x.shape  # [N, E]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)  # [N, heads, E/heads] each
        q, k = (_rotated(t, cos, sin) for t in (q, k))
        out = [
            F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)))  # a window's patches alone
            for a, b in zip(spans, spans[1:])
        ]
        return self.proj(torch.cat(out, dim=1).transpose(0, 1).reshape(n, e))


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, d] rotated in float32 (as the checkpoint was trained), half-split; cos/sin [N, d]."""
    f = x.float()
    half = f.shape[-1] // 2
    turned = torch.cat((-f[..., half:], f[..., :half]), dim=-1)
    return (f * cos[:, None] + turned * sin[:, None]).to(x.dtype)


class QwenMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        e, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(e, f), nn.Linear(e, f), nn.Linear(f, e)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QwenBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(cfg.hidden_size, 1e-6), RMSNorm(cfg.hidden_size, 1e-6)
        self.attn, self.mlp = QwenAttention(cfg), QwenMLP(cfg)

    def forward(self, x, cos, sin, spans):
        x = x + self.attn(self.norm1(x), cos, sin, spans)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p, t = cfg.patch_size, cfg.temporal_patch
        self.shape = (3, t, p, p)
        self.proj = nn.Conv3d(3, cfg.hidden_size, kernel_size=(t, p, p), stride=(t, p, p), bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.view(-1, *self.shape)).flatten(1)  # [N, 3·t·p·p] -> [N, E]


class Merger(nn.Module):
    """Each 2×2 patches' rows, normed, as one row of 4E, then an MLP (GELU) into the text model's width."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        wide = cfg.hidden_size * cfg.scale_factor**2
        self.ln_q = RMSNorm(cfg.hidden_size, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, cfg.text_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.mlp[0].in_features))


class QwenVisionModel(VisionModel):
    """Patches [N, 3·2·14·14] of one image and its grid (gh, gw) -> its prompt positions' rows [N/4, D], in the
    order the prompt holds them (row by row of 2×2 cells)."""

    def __init__(self, cfg: VisionConfig):
        nn.Module.__init__(self)
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(QwenBlock(cfg) for _ in range(cfg.num_layers))
        self.merger = Merger(cfg)
        self.register_buffer("inv_freq", self._frequencies(), persistent=False)
        self.kept: dict[int, torch.Tensor] = {}

    def _frequencies(self) -> torch.Tensor:
        """[d/4]: the 2-D rotary frequencies (a quarter of a head rotates by the row, a quarter by the column)."""
        d = self.cfg.hidden_size // self.cfg.num_heads
        return 1.0 / 10000.0 ** (torch.arange(0, d // 2, 2, dtype=torch.float) / (d // 2))

    def reset_buffers(self) -> None:
        self.inv_freq = self._frequencies().to(self.merger.ln_q.weight.device)

    @torch.inference_mode()
    def forward(self, pixels) -> torch.Tensor:
        return drained(self.steps(pixels))

    def steps(self, pixels):
        """The encoder a layer at a time (as VisionModel.steps); returns the rows [n, D]."""
        patches, (gh, gw) = pixels
        w = self.merger.ln_q.weight
        m = self.cfg.scale_factor
        order, windows = window_order(gh, gw, m, self.cfg.window // m // self.cfg.patch_size)
        unit = m * m
        x = self.patch_embed(patches.to(device=w.device, dtype=w.dtype))  # [N, E], cells of 2×2 patches in order
        x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)  # window by window
        cos, sin = self._rotations(gh, gw, m)
        cos, sin = (t.view(-1, unit, t.shape[-1])[order].flatten(0, 1) for t in (cos, sin))
        whole = [0, x.shape[0]]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, whole if i in self.cfg.full_layers else windows)
            yield
        return self.merger(x)[torch.argsort(order)]  # [n, D], back in the prompt's order

    def _rotations(self, gh: int, gw: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, d]: each patch's (row, column) angles, laid out cell by cell (2×2 patches together)."""
        h, w = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        cells = (gh // m, m, gw // m, m)
        h, w = (t.reshape(cells).transpose(1, 2).flatten() for t in (h, w))
        freqs = torch.cat((h[:, None] * self.inv_freq, w[:, None] * self.inv_freq), dim=-1)  # [N, d/2]
        freqs = torch.cat((freqs, freqs), dim=-1).to(self.inv_freq.device)
        return freqs.cos(), freqs.sin()


def window_order(gh: int, gw: int, m: int, side: int) -> tuple[torch.Tensor, list[int]]:
    """The cells (2×2 patches) of a gh × gw grid regrouped window by window (side × side cells each, the last ones
    cut at the edge), and where each window's patches start and end in that order."""
    ch, cw = gh // m, gw // m
    index = torch.arange(ch * cw).view(ch, cw)
    order, spans = [], [0]
    for r in range(0, ch, side):
        for c in range(0, cw, side):
            cell = index[r : r + side, c : c + side].flatten()
            order.append(cell)
            spans.append(spans[-1] + cell.numel() * m * m)
    return torch.cat(order), spans


def vision_model(cfg: VisionConfig) -> VisionModel:
    """The vision model a config describes: Qwen2.5-VL's, or SigLIP and its projector (engine.vision)."""
    return QwenVisionModel(cfg) if cfg.family == "qwen2_5_vl" else VisionModel(cfg)
