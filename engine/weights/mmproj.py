"""llama.cpp's projector files (`mmproj-*.gguf`, beside a GGUF model that sees images): the SigLIP encoder and the
Gemma 3 or Idefics3 projector read into engine.vision's model, its config from the `clip.vision.*` metadata, each
tensor's shape checked against it before it is read (the file is untrusted: GGUFModel checks every extent)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError
from ..vision import VisionConfig, VisionModel
from ..vision_qwen import vision_model
from .gguf_file import GGUFModel
from .gguf_header import is_gguf

PROJECTORS = {"gemma3": "gemma3", "idefics3": "idefics3", "qwen2.5vl_merger": "qwen2_5_vl"}  # clip's type -> family
IMAGE_TOKENS = {  # the strings each family's prompt writes, looked up in the text model's vocabulary
    "gemma3": {
        "image_token_id": "<image_soft_token>",
        "boi_token_id": "<start_of_image>",
        "eoi_token_id": "<end_of_image>",
    },  # fmt: skip
    "idefics3": {"image_token_id": "<image>"},
    "qwen2_5_vl": {"image_token_id": "<|image_pad|>"},
}
QWEN_BLOCK = {  # Qwen2.5-VL's block: llama.cpp's name -> ours (engine.vision_qwen), q/k/v apart in the file
    "attn_out": "attn.proj", "ln1": "norm1", "ln2": "norm2", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # fmt: skip
BLOCK = {  # a block's tensors: llama.cpp's name -> ours (engine.vision), under v.blk.{i}. and encoder.layers.{i}.
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2", "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}  # fmt: skip
GLOBAL = {
    "v.patch_embd": "tower.embeddings.patch_embedding",
    "v.position_embd": "tower.embeddings.position_embedding",
    "v.post_ln": "tower.post_layernorm",
    "mm.input_projection": "projector.mm_input_projection_weight",
    "mm.soft_emb_norm": "projector.mm_soft_emb_norm",
    "mm.model.fc": "projector.modality_projection.proj",
}


def _planned(cfg: VisionConfig, f: GGUFModel, path: Path) -> tuple[VisionModel, dict]:
    """The model its metadata describes, allocated only where the file holds as many values as it has (metadata
    naming a huge tower is refused, not allocated), and its parameters' shapes."""
    with torch.device("meta"):
        planned = vision_model(cfg)
    shapes = {k: tuple(v.shape) for k, v in planned.state_dict().items()}
    held = sum(int(t.n_elements) for t in f.file_tensors)
    if planned.parameter_count() > held:
        raise ModelLoadError(f"its metadata names a tower of {planned.parameter_count():,} values, but the file "
                             f"holds {held:,}", path)  # fmt: skip
    model = planned.to_empty(device="cpu")
    model.reset_buffers()
    return model, shapes


def is_projector_file(path: Path) -> bool:
    """A projector file's name (llama.cpp's mmproj-*.gguf): its model's vision side, never a model of its own."""
    return path.name.startswith("mmproj")


def projector_beside(model: Path) -> Path | None:
    """The projector file in a GGUF model's folder: the one `mmproj*.gguf` there (several: the one whose name
    shares the model's stem, else None and the model opens for text only)."""
    found = sorted(p for p in model.parent.glob("mmproj*.gguf") if p != model and is_gguf(p))
    if len(found) == 1:
        return found[0]
    named = [p for p in found if model.stem.split(".")[0].lower() in p.stem.lower()]
    return named[0] if len(named) == 1 else None


def _our_name(gname: str) -> str | None:
    stem, _, kind = gname.rpartition(".")
    if stem.startswith("v.blk."):
        i, _, part = stem[len("v.blk.") :].partition(".")
        return f"tower.encoder.layers.{i}.{BLOCK[part]}.{kind}" if part in BLOCK and i.isdigit() else None
    if stem in GLOBAL:
        ours = GLOBAL[stem]
        return ours if ours.endswith("_weight") else f"{ours}.{kind}"
    return None


def read_projector(path: Path, text_hidden: int, token_id, dtype, device) -> tuple[VisionModel, dict, dict]:
    """(the vision model, a config.json's image token ids, a preprocessor_config.json's settings) from a projector
    file; `token_id(text)`: the text model's id of a token's string (None where it has none)."""
    f = GGUFModel(path, check_architecture=False)

    def number(key: str, default=None, high: int = 1 << 16) -> int:
        v = f.meta(f"clip.vision.{key}", default)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 1 <= int(v) <= high:
            raise ModelLoadError(f"the projector file's clip.vision.{key} is {v!r}: out of range", path)
        return int(v)

    kind = f.meta("clip.vision.projector_type") or f.meta("clip.projector_type")
    if kind not in PROJECTORS:
        raise ModelLoadError(f"projector type {kind!r} is not one kvchat runs ({', '.join(PROJECTORS)})", path)
    family = PROJECTORS[kind]
    if family == "qwen2_5_vl":
        return _read_qwen(f, path, number, text_hidden, token_id, dtype, device)
    size, patch = number("image_size"), number("patch_size")
    if size % patch:
        raise ModelLoadError("the projector file's image size is not a whole number of patches", path)
    side, scale = size // patch, number("projector.scale_factor", 4 if family == "gemma3" else 2, size)
    if side % scale:
        raise ModelLoadError(f"its scale factor {scale} does not divide the {side}×{side} patches", path)
    tokens = {k: token_id(text) for k, text in IMAGE_TOKENS[family].items()}
    missing = [IMAGE_TOKENS[family][k] for k, v in tokens.items() if v is None]
    if missing:
        raise ModelLoadError(f"the model's vocabulary lacks {', '.join(missing)}, which its images need", path)
    if number("projection_dim") != text_hidden:
        raise ModelLoadError(f"the projector file is for a text model of width {number('projection_dim')}, "
                             f"not {text_hidden}", path)  # fmt: skip
    eps = float(f"{float(f.meta('clip.vision.attention.layer_norm_epsilon', 1e-6)):.7g}")  # float32 in the file
    width, inner = number("embedding_length"), number("feed_forward_length")
    layers, heads = number("block_count", high=256), number("attention.head_count", high=1024)
    cfg = VisionConfig(family, width, inner, layers, heads, size, patch, eps, text_hidden, tokens["image_token_id"],
                       (side // scale) ** 2, 1 if family == "gemma3" else scale)  # fmt: skip
    if cfg.hidden_size % cfg.num_heads or not 0 < cfg.layer_norm_eps < 1:
        raise ModelLoadError("the projector file's width does not divide into its heads, or its epsilon is wrong", path)
    model, shapes = _planned(cfg, f, path)
    state = {}
    for gname, t in f.tensors.items():
        ours = _our_name(gname)
        if ours is None or ours not in shapes:
            continue
        if tuple(t.shape) != shapes[ours]:
            raise ModelLoadError(f"{gname} is {list(t.shape)}, but its metadata makes it {list(shapes[ours])}", path)
        values = torch.from_numpy(f.float_rows(t).reshape(shapes[ours]).copy())
        if gname.startswith("mm.soft_emb_norm"):
            values = values - 1  # llama.cpp's converter stores Gemma's (1 + w)
        state[ours] = values.to(dtype)
    missing = sorted(set(shapes) - set(state))
    if missing:
        raise ModelLoadError(f"the projector file lacks the tensor for {missing[0]}", path)
    model.load_state_dict(state)
    mean, std = (f.meta(f"clip.vision.image_{k}", [0.5] * 3) for k in ("mean", "std"))
    pre = {"image_mean": [float(x) for x in mean], "image_std": [float(x) for x in std],
           "max_image_size": {"longest_edge": size}}  # fmt: skip
    if family == "idefics3":
        pre["size"] = {"longest_edge": number("preproc_image_size", 4 * size, 8192)}
    return model.to(device=device, dtype=dtype).eval(), tokens, pre


def _read_qwen(f: GGUFModel, path: Path, number, text_hidden: int, token_id, dtype, device):
    """Qwen2.5-VL's projector file: the window pattern from `n_wa_pattern` (every n-th layer over the whole image),
    q/k/v joined back into one product, the two 2-D patch kernels back into the 3-D one."""
    image = token_id(IMAGE_TOKENS["qwen2_5_vl"]["image_token_id"])
    if image is None:
        raise ModelLoadError("the model's vocabulary lacks <|image_pad|>, which its images need", path)
    if number("projection_dim") != text_hidden:
        raise ModelLoadError(f"the projector file is for a text model of width {number('projection_dim')}", path)
    layers, every = number("block_count", high=256), number("n_wa_pattern", high=256)
    width, heads = number("embedding_length"), number("attention.head_count", high=1024)
    if width % heads or (width // heads) % 4:
        raise ModelLoadError("the projector file's width does not split into heads a multiple of 4 wide", path)
    full = tuple(range(every - 1, layers, every))
    cfg = VisionConfig(
        "qwen2_5_vl",
        width,
        number("feed_forward_length"),
        layers,
        heads,
        0,
        number("patch_size"),
        1e-6,
        text_hidden,
        image,
        0,
        2,
        temporal_patch=2,
        window=number("window_size", 112, 1 << 14),
        full_layers=full,
    )  # fmt: skip (llama.cpp's files without a window size: its 112 pixels)
    model, shapes = _planned(cfg, f, path)

    def read(gname: str) -> torch.Tensor:
        t = f.tensors.get(gname)
        if t is None:
            raise ModelLoadError(f"the projector file lacks {gname}", path)
        return torch.from_numpy(f.float_rows(t).reshape(t.shape).copy())

    state = {"patch_embed.proj.weight": torch.stack((read("v.patch_embd.weight"), read("v.patch_embd.weight.1")), 2),
             "merger.ln_q.weight": read("v.post_ln.weight")}  # fmt: skip
    for i in (0, 2):
        state |= {f"merger.mlp.{i}.{k}": read(f"mm.{i}.{k}") for k in ("weight", "bias")}
    for i in range(layers):
        for k in ("weight", "bias"):
            state[f"blocks.{i}.attn.qkv.{k}"] = torch.cat([read(f"v.blk.{i}.attn_{p}.{k}") for p in "qkv"])
            for theirs, ours in QWEN_BLOCK.items():
                if k == "weight" or not theirs.startswith("ln"):  # the norms are RMS norms: no bias
                    state[f"blocks.{i}.{ours}.{k}"] = read(f"v.blk.{i}.{theirs}.{k}")
    for name, t in state.items():
        if tuple(t.shape) != shapes.get(name):
            raise ModelLoadError(
                f"{name} is {list(t.shape)}, but the metadata makes it {list(shapes.get(name, ()))}", path
            )
    model.load_state_dict(state)
    mean, std = (f.meta(f"clip.vision.image_{k}", None) for k in ("mean", "std"))
    pre = (
        {}
        if mean is None or std is None
        else {"image_mean": [float(x) for x in mean], "image_std": [float(x) for x in std]}
    )
    return model.to(device=device, dtype=dtype).eval(), {"image_token_id": image}, pre
