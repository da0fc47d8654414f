"""Qwen3-Next's DeltaNet projections as its checkpoint interleaves them: `in_proj_qkvz` [H_k · (2 d_k + 2 r d_v), D]
holds, for each key head in turn, its q, its k, then the v and z of its r = H_v / H_k value heads; `in_proj_ba`
[H_k · 2r, D] each key head's r b's then its r a's. kvchat's GatedDeltaNet wants them apart (q, k, v of every head,
then z, b, a): this reads each part as a selection of the checkpoint's rows, under the names Qwen3.5's checkpoints
give the parts they hold apart (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`), and joins them back on the
way out. The same selections read an older GGUF's `ssm_in` (the interleaved tensor as it is) and every GGUF's
`ssm_ba` (engine.weights.gguf_file).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from ..config import ModelConfig
from ..errors import ModelLoadError

PARTS = {
    "in_proj_qkv": "in_proj_qkvz",
    "in_proj_z": "in_proj_qkvz",
    "in_proj_b": "in_proj_ba",
    "in_proj_a": "in_proj_ba",
}


def part_name(i: int, part: str) -> str:
    """The name layer i's DeltaNet `part` (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) is read under."""
    return f"model.layers.{i}.linear_attn.{part}.weight"


def selection(cfg: ModelConfig, part: str) -> np.ndarray:
    """The rows of the interleaved tensor that make `part`, in kvchat's order: [n] indices."""
    hk, r, dk, dv = cfg.delta_k_heads, cfg.delta_v_heads // cfg.delta_k_heads, cfg.delta_k_dim, cfg.delta_v_dim
    if part in ("in_proj_b", "in_proj_a"):  # each key head's [b × r, a × r]
        group, spans = 2 * r, [(0, r)] if part == "in_proj_b" else [(r, r)]
    else:  # each key head's [q d_k, k d_k, v r·d_v, z r·d_v]
        group = 2 * dk + 2 * r * dv
        spans = [(0, dk), (dk, dk), (2 * dk, r * dv)] if part == "in_proj_qkv" else [(2 * dk + r * dv, r * dv)]
    heads = np.arange(hk)[:, None] * group
    return np.concatenate([(heads + off + np.arange(width)[None, :]).reshape(-1) for off, width in spans])


def interleaved_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """The two interleaved tensors' shapes, by their names' ends."""
    D, hk, hv = cfg.hidden_size, cfg.delta_k_heads, cfg.delta_v_heads
    return {"in_proj_qkvz": (hk * 2 * cfg.delta_k_dim + 2 * hv * cfg.delta_v_dim, D), "in_proj_ba": (2 * hv, D)}


@dataclasses.dataclass(frozen=True)
class SelectedRows:
    """A part as a selection of a tensor's rows (`rows`: the tensor's row for each of the part's), read a span of the
    file at a time."""

    base: str
    rows_of: tuple[int, ...]
    paths: tuple[Path, ...]
    mxfp4: bool = False  # (what the reader asks of every derived part: none of these holds MXFP4 codes)
    what: str = "weight"

    @property
    def count(self) -> int:
        return len(self.rows_of)

    def rows(self, a: int, b: int, opened) -> torch.Tensor:
        sel = np.asarray(self.rows_of[a:b])
        lo = int(sel.min())
        with opened(self.paths[0]) as f:
            span = f.get_slice(self.base)[lo : int(sel.max()) + 1]
        return span[torch.from_numpy(sel - lo)]


def delta_parts(cfg: ModelConfig, files: dict[str, Path], shapes) -> dict[str, SelectedRows]:
    """Each DeltaNet part's name -> the selection of the interleaved tensor it is read from, that tensor's shape
    checked against the config first (a checkpoint that holds the parts apart, Qwen3.5's, needs none)."""
    out = {}
    want = interleaved_shapes(cfg)
    for i, delta in enumerate(cfg.delta_layers):
        if not delta:
            continue
        for part, whole in PARTS.items():
            name = f"model.layers.{i}.linear_attn.{whole}.weight"
            if name not in files:
                if part_name(i, part) in files:
                    continue  # held apart
                raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint", next(iter(files.values())))
            if tuple(shapes(name)) != want[whole]:
                raise ModelLoadError(
                    f"tensor {name!r} has shape {list(shapes(name))}, the config implies {list(want[whole])}"
                )
            out[part_name(i, part)] = SelectedRows(name, tuple(selection(cfg, part).tolist()), (files[name],))
    return out


def delta_state(cfg: ModelConfig, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict under the parts' names with each layer's parts joined back into the interleaved tensors."""
    for i, delta in enumerate(cfg.delta_layers):
        if not delta:
            continue
        for whole, parts in (
            ("in_proj_qkvz", ("in_proj_qkv", "in_proj_z")),
            ("in_proj_ba", ("in_proj_b", "in_proj_a")),
        ):
            rows = torch.cat([out.pop(part_name(i, p)) for p in parts])
            order = np.concatenate([selection(cfg, p) for p in parts])  # checkpoint row of each of `rows`
            joined = torch.empty_like(rows)
            joined[torch.from_numpy(order)] = rows
            out[f"model.layers.{i}.linear_attn.{whole}.weight"] = joined
    return out
