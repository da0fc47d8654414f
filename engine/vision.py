"""The vision side of a model that sees images: its SigLIP encoder and the projector that turns the encoder's
patches into the text model's embedding rows, for Gemma 3 (4B and up) and SmolVLM / Idefics3; read from a Hugging
Face folder beside the text model.

Plain PyTorch, as engine.model: the architecture as the checkpoints define it. Shapes: N images (tiles), C channels
(3), S side in pixels, p patch side, P = (S/p)² patches, E encoder width, D the text model's width, n positions an
image (tile) takes in the prompt.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .config import read_json
from .errors import ModelLoadError
from .model import RMSNorm

VISION_ARCHITECTURES = {  # config.json's architecture -> the vision family
    "Gemma3ForConditionalGeneration": "gemma3",
    "Idefics3ForConditionalGeneration": "idefics3",
    "SmolVLMForConditionalGeneration": "idefics3",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
}
MAX_ENCODER_SIZE = 8192  # width, MLP width, layers and heads are checked against it (a hostile config.json)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The encoder's shape, the projector's, and what an image becomes in the prompt."""

    family: str  # gemma3 | idefics3
    hidden_size: int  # E
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int  # S, the side the encoder takes (a tile's, for Idefics3)
    patch_size: int  # p
    layer_norm_eps: float
    text_hidden: int  # D
    image_token_id: int  # the id the template's expansion writes for each image position
    tokens_per_image: int  # n: positions one image (Gemma 3) or one tile (Idefics3) takes
    scale_factor: int = 1  # Idefics3's pixel shuffle: s² patches folded into one position (Qwen2.5-VL's merge: s×s)
    temporal_patch: int = 1  # Qwen2.5-VL: frames a patch spans (an image is its frame twice)
    window: int = 0  # Qwen2.5-VL: the side in pixels of the windows most layers attend within
    full_layers: tuple[int, ...] = ()  # Qwen2.5-VL: the layers that attend over the whole image

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def _whole(raw: dict, key: str, default=None, high: int = MAX_ENCODER_SIZE) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ModelLoadError(f"config.json's vision {key} is {value!r}: out of range (1 to {high:,})")
    return value


def token_ids(raw: dict) -> dict:
    """config.json with its image token ids under one name each: image_token_id, boi_token_id, eoi_token_id
    (Gemma 3's files name them ..._index)."""
    out = dict(raw)
    for what in ("image", "boi", "eoi"):
        if f"{what}_token_id" not in out and f"{what}_token_index" in out:
            out[f"{what}_token_id"] = out[f"{what}_token_index"]
    return out


def vision_config(raw: dict, text_hidden: int, path: Path | None = None) -> VisionConfig | None:
    """The vision side a config.json describes, None for a text-only architecture."""
    arch = (raw.get("architectures") or [None])[0]
    family = VISION_ARCHITECTURES.get(arch)
    if family is None:
        return None
    if family == "qwen2_5_vl":
        return qwen_vision_config(raw, text_hidden, _whole(token_ids(raw), "image_token_id", 151655, 1 << 30))
    v = raw.get("vision_config")
    if not isinstance(v, dict):
        raise ModelLoadError("config.json lacks the vision tower's vision_config", path)
    defaults = {"gemma3": (1152, 4304, 27, 16, 896, 14), "idefics3": (1152, 3072, 12, 16, 224, 32)}[family]
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size", "patch_size")
    sizes = {k: _whole(v, k, d) for k, d in zip(keys, defaults)}
    if sizes["hidden_size"] % sizes["num_attention_heads"] or sizes["image_size"] % sizes["patch_size"]:
        raise ModelLoadError("config.json's vision sizes do not divide (width by heads, image by patch)", path)
    side = sizes["image_size"] // sizes["patch_size"]
    if family == "gemma3":
        per_image = _whole(raw, "mm_tokens_per_image", 256, side * side)
        per_side = int(round(per_image**0.5))
        if per_side * per_side != per_image or side % per_side:
            raise ModelLoadError(f"mm_tokens_per_image={per_image} is not a square that divides {side}×{side}", path)
        token, scale = _whole(token_ids(raw), "image_token_id", 262144, 1 << 30), 1
    else:
        scale = _whole(raw, "scale_factor", 2, side)
        if side % scale:
            raise ModelLoadError(f"scale_factor={scale} does not divide the {side}×{side} patches", path)
        per_image, token = (side // scale) ** 2, _whole(token_ids(raw), "image_token_id", 128257, 1 << 30)
    eps = v.get("layer_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ModelLoadError(f"config.json's vision layer_norm_eps is {eps!r}: out of range", path)
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"the vision tower's hidden_act {act!r} is not supported (gelu_pytorch_tanh)", path)
    return VisionConfig(
        family,
        sizes["hidden_size"],
        sizes["intermediate_size"],
        sizes["num_hidden_layers"],
        sizes["num_attention_heads"],
        sizes["image_size"],
        sizes["patch_size"],
        float(eps),
        text_hidden,
        token,
        per_image,
        scale,
    )


def qwen_vision_config(raw: dict, text_hidden: int, image_token_id: int) -> VisionConfig:
    """The encoder a Qwen2.5-VL config.json describes (transformers 5's and 4.x's names)."""
    v = raw.get("vision_config")
    if not isinstance(v, dict):
        raise ModelLoadError("config.json lacks the vision tower's vision_config")

    def whole(key: str, default, high: int = MAX_ENCODER_SIZE) -> int:
        value = v.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise ModelLoadError(f"config.json's vision {key} is {value!r}: out of range (1 to {high:,})")
        return value

    width, heads = whole("hidden_size", 1280), whole("num_heads", 16)
    if width % heads or (width // heads) % 4:
        raise ModelLoadError("config.json's vision width does not split into heads a multiple of 4 wide")
    full = v.get("fullatt_block_indexes", [7, 15, 23, 31])
    depth = whole("depth", 32)
    if not isinstance(full, list) or not all(isinstance(i, int) and 0 <= i < depth for i in full):
        raise ModelLoadError("config.json's vision fullatt_block_indexes are not layers of the encoder")
    if v.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"the vision tower's hidden_act {v.get('hidden_act')!r} is not supported (silu)")
    merge, patch = whole("spatial_merge_size", 2, 8), whole("patch_size", 14, 64)
    frames, window = whole("temporal_patch_size", 2, 4), whole("window_size", 112, 1 << 14)
    return VisionConfig(
        "qwen2_5_vl", width, whole("intermediate_size", 3420), depth, heads, 0, patch, 1e-6,
        whole("out_hidden_size", text_hidden), image_token_id, 0, merge, temporal_patch=frames, window=window,
        full_layers=tuple(full),
    )  # fmt: skip


# --- the encoder ----------------------------------------------------------------------------------
class EncoderAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        e = cfg.hidden_size
        self.heads = cfg.num_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(e, e) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, p, e = x.shape  # [N, P, E]
        q, k, v = (f(x).view(n, p, self.heads, -1).transpose(1, 2) for f in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # [N, heads, P, E/heads]: every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(n, p, e))


class EncoderMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = EncoderAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = EncoderMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.patches, cfg.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [N, C, S, S] -> [N, P, E]
        return x + self.position_embedding.weight  # a full tile: patch i at position i (Idefics3's buckets agree)


class Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))


class SigLIP(nn.Module):
    """The SigLIP vision transformer both families use: patches in, one row per patch out."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixels)  # [N, P, E]
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)


# --- the projectors -------------------------------------------------------------------------------
class Gemma3Projector(nn.Module):
    """Patches averaged to n per image (a k×k pool), normed, then multiplied into the text model's width."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.side = cfg.image_size // cfg.patch_size
        self.pool = self.side // int(round(cfg.tokens_per_image**0.5))
        self.mm_soft_emb_norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_eps, offset=1.0)
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(cfg.hidden_size, cfg.text_hidden))  # [E, D]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, e = x.shape  # [N, P, E]
        grid = x.transpose(1, 2).reshape(n, e, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.pool, self.pool).flatten(2).transpose(1, 2)  # [N, n, E]
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight  # [N, n, D]


class ModalityProjection(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size * cfg.scale_factor**2, cfg.text_hidden, bias=False)


class Idefics3Connector(nn.Module):
    """s×s neighbouring patches folded into one position (the pixel shuffle), then a linear into the text width."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.scale = cfg.scale_factor
        self.modality_projection = ModalityProjection(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, p, e = x.shape  # [N, P, E]
        side, s = int(round(p**0.5)), self.scale
        x = x.view(n, side, side // s, e * s).permute(0, 2, 1, 3)  # [N, side/s, side, E·s]
        x = x.reshape(n, side // s, side // s, e * s * s).permute(0, 2, 1, 3)  # [N, side/s, side/s, E·s²]
        return self.modality_projection.proj(x.reshape(n, p // (s * s), e * s * s))  # [N, n, D]


class VisionModel(nn.Module):
    """Encoder and projector: pixels [N, C, S, S] -> the text model's rows [N, n, D]."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.tower = SigLIP(cfg)
        self.projector = Gemma3Projector(cfg) if cfg.family == "gemma3" else Idefics3Connector(cfg)
        self.kept: dict[int, torch.Tensor] = {}  # an image's key -> its rows [positions, D], the newest last

    @torch.inference_mode()
    def forward(self, pixels) -> torch.Tensor:
        return drained(self.steps(pixels))

    def steps(self, pixels: torch.Tensor):
        """The encoder a layer at a time: yields after each (the engine's other requests, and a Stop, go on
        between them), returns the rows [N, n, D]."""
        w = self.tower.post_layernorm.weight
        x = self.tower.embeddings(pixels.to(device=w.device, dtype=w.dtype))  # [N, P, E]
        for layer in self.tower.encoder.layers:
            x = layer(x)
            yield
        return self.projector(self.tower.post_layernorm(x))

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def reset_buffers(self) -> None:
        """Computed buffers (none here; Qwen2.5-VL's rotary frequencies), after a build on the meta device."""


def drained(steps):
    """What a generator of steps returns, its steps run through."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def preprocessor(model_dir: Path) -> dict:
    """preprocessor_config.json ({} where there is none: the family's defaults)."""
    return read_json(Path(model_dir) / "preprocessor_config.json", default={})
