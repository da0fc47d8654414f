"""A vision tower's weights (engine.vision) from a checkpoint's safetensors files: the encoder's and projector's
tensors found under the prefixes the families' files use, each shape checked against the model's before it is
read."""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import ModelLoadError
from ..vision import VisionConfig, VisionModel
from ..vision_qwen import vision_model
from .safetensors import check_shapes_in_headers, read_tensors

TOWER_PREFIXES = {  # where the encoder's tensors are stored (transformers 5's names, then the original checkpoints')
    "gemma3": (
        "model.vision_tower.vision_model.",
        "vision_tower.vision_model.",
        "model.vision_tower.",
        "vision_tower.",
    ),
    "idefics3": ("model.vision_model.", "vision_model."),
}
QWEN_PREFIXES = ("model.visual.", "visual.")  # Qwen2.5-VL's encoder and merger, under one name each
PROJECTOR_PREFIXES = {
    "gemma3": ("model.multi_modal_projector.", "multi_modal_projector."),
    "idefics3": ("model.connector.", "connector."),
}


def load_vision(cfg: VisionConfig, files: dict[str, Path], dtype: torch.dtype, device) -> VisionModel:
    """The encoder and projector from the checkpoint's safetensors files (`files`: each tensor's file): the model's
    shapes worked out on the meta device and every tensor's checked against its file's header before anything is
    allocated (a config.json that names a huge tower is refused, not allocated), then read."""
    with torch.device("meta"):
        model = vision_model(cfg)
    wanted: dict[str, str] = {}  # the file's name -> ours
    parts = [("", QWEN_PREFIXES)] if cfg.family == "qwen2_5_vl" else [
        ("tower.", TOWER_PREFIXES[cfg.family]), ("projector.", PROJECTOR_PREFIXES[cfg.family])]  # fmt: skip
    for part, prefixes in parts:
        prefix = next((p for p in prefixes if any(n.startswith(p) for n in files)), None)
        if prefix is None:
            raise ModelLoadError(f"the checkpoint holds no vision tensors under {' or '.join(prefixes)}")
        wanted |= {n: part + n[len(prefix) :] for n in files if n.startswith(prefix)}
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(set(shapes) - set(wanted.values()))
    if missing:
        raise ModelLoadError(f"the vision tower's tensor {missing[0]!r} is missing from the checkpoint")
    wanted = {theirs: mine for theirs, mine in wanted.items() if mine in shapes}
    expected = {n: shapes[m] for n, m in wanted.items()}
    check_shapes_in_headers(files, expected)
    model = model.to_empty(device="cpu")  # no random values computed: every parameter is read next
    model.reset_buffers()
    model.load_state_dict({wanted[n]: t.to(dtype) for n, t in read_tensors(files, expected)})  # shapes checked above
    return model.to(device=device, dtype=dtype).eval()
