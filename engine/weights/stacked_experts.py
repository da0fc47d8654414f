"""Experts a checkpoint stores stacked, one tensor a layer for all of them (gpt-oss): each expert's gate, up and down
read under names of its own, as rows of the stacked tensors, so the loader fuses, casts and quantizes them as it
does any family's experts.

gpt-oss keeps `mlp.experts.gate_up_proj` [E, D, 2F] (inputs first, gate and up interleaved column by column) and
`down_proj` [E, F, D] with their biases [E, 2F] and [E, D]; or, as released, MXFP4: `*_blocks` [E, out, in/32, 16]
(two 4-bit e2m1 codes a byte, the low nibble first) with `*_scales` [E, out, in/32] (e8m0: 2^(s − 127) per 32
values). Shapes: E experts, D hidden, F an expert's width.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import ModelLoadError
from ..quant import MXFP4_GROUP, dequantize, mxfp4_scales, unpack_mxfp4
from .delta_rows import delta_parts


def expert_name(i: int, j: int, part: str, what: str = "weight") -> str:
    """The name layer i's expert j's `part` (gate, up or down) is read under: a name no file holds."""
    return f"model.layers.{i}.mlp.experts.{j}.{part}_proj.{what}"


def stacked(cfg: ModelConfig) -> bool:
    """Whether this family's checkpoints stack their experts as gpt-oss does."""
    return cfg.family == "gpt_oss"


def granite_name(i: int, part: str, j: int | None = None) -> str:
    """The name Granite 4.0-H's layer i's shared MLP's (j None) or expert j's `part` (gate, up, down) is read under:
    rows of the tensors its checkpoint holds fused (a name no file holds)."""
    where = "shared_mlp" if j is None else f"block_sparse_moe.experts.{j}"
    return f"model.layers.{i}.{where}.{part}_proj.weight"


@dataclasses.dataclass(frozen=True)
class FusedRows:
    """One part as rows offset..offset+count of a tensor the checkpoint holds fused (Granite 4.0-H's
    `input_linear`: gate rows then up rows; `output_linear`), expert `expert`'s of a stacked [E, rows, in] one."""

    base: str
    expert: int | None
    part: str
    offset: int
    count: int
    paths: tuple[Path, ...]
    what: str = "weight"
    mxfp4: bool = False

    def rows(self, a: int, b: int, opened) -> torch.Tensor:
        with opened(self.paths[0]) as f:
            sl = f.get_slice(self.base)
            if self.expert is None:
                return sl[self.offset + a : self.offset + b]
            return sl[self.expert : self.expert + 1, self.offset + a : self.offset + b][0]


@dataclasses.dataclass(frozen=True)
class ExpertPart:
    """One expert's part, as rows of a layer's stacked tensor: `base` the stacked tensor's name (without _blocks),
    `mxfp4` whether the file holds its codes, `paths` the file(s) holding it."""

    base: str
    expert: int
    part: str  # gate | up | down
    what: str  # weight | bias
    mxfp4: bool
    paths: tuple[Path, ...]  # the weights' (blocks, scales) or the one tensor's file

    def rows(self, a: int, b: int, opened) -> torch.Tensor:
        """Rows a..b-1 of this part ([b-a, in] for a weight, [b-a] for a bias), as stored (float), `opened(path)`
        a context giving the file's safe_open handle."""
        j, interleaved = self.expert, self.part in ("gate", "up")
        first = 1 if self.part == "up" else 0
        if self.what == "bias":  # [E, 2F] interleaved, or [E, D]
            with opened(self.paths[0]) as f:
                row = f.get_slice(self.base + "_bias")[j : j + 1]  # [1, 2F] or [1, D]
            return (row[0, first::2] if interleaved else row[0])[a:b]
        if self.mxfp4:
            return dequantize_mxfp4(*self.codes(a, b, opened))
        with opened(self.paths[0]) as f:  # [E, in, out]: the part's rows are columns
            sl = f.get_slice(self.base)
            if interleaved:
                cols = sl[j : j + 1, :, 2 * a : 2 * b][0]  # [in, 2(b-a)]
                return cols[:, first::2].t()
            return sl[j : j + 1, :, a:b][0].t()  # [b-a, in]

    def codes(self, a: int, b: int, opened) -> tuple[torch.Tensor, torch.Tensor]:
        """An MXFP4 weight's rows a..b-1 as the file holds them: (blocks [b-a, in/32, 16], scales [b-a, in/32]);
        the stacked tensors' rows are the outputs (gate's and up's interleaved)."""
        j, interleaved = self.expert, self.part in ("gate", "up")
        lo, hi = (2 * a + (self.part == "up"), 2 * b) if interleaved else (a, b)
        with opened(self.paths[0]) as f:
            blocks = f.get_slice(self.base + "_blocks")[j : j + 1, lo:hi][0]  # [n, in/32, 16]
        with opened(self.paths[1]) as f:
            scales = f.get_slice(self.base + "_scales")[j : j + 1, lo:hi][0]  # [n, in/32]
        step = 2 if interleaved else 1
        return blocks[::step], scales[::step]


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [n, in/32, 16] uint8, scales [n, in/32] uint8 (e8m0) -> [n, in] float32: each byte's low nibble then
    its high one, the e2m1 values times 2^(scale − 127) (engine.quant's doubled codes by their halved scales)."""
    return dequantize(unpack_mxfp4(blocks.reshape(blocks.shape[0], -1)), mxfp4_scales(scales))


def ggml_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 as a checkpoint holds it (blocks [n, in/32, 16], value 2k in byte k's low nibble, 2k+1 in its high one;
    scales [n, in/32]) -> llama.cpp's MXFP4 rows [n, in/32 · 17] uint8: each block its e8m0 byte, then 16 bytes
    holding value k in the low nibble and value k + 16 in the high one."""
    b = blocks.to(torch.uint8)
    codes = torch.stack((b & 15, b >> 4), dim=-1).flatten(-2)  # [n, in/32, 32] in order
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # [n, in/32, 16]
    return torch.cat((scales.to(torch.uint8)[..., None], packed), dim=-1).flatten(1)


def stacked_sources(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """Layer i's router and experts under kvchat's names -> the names they are read under."""
    p = f"model.layers.{i}.mlp."
    out = {"mlp.router.weight": [p + "router.weight"], "mlp.router.bias": [p + "router.bias"]}
    for j in range(cfg.num_experts):
        out[f"mlp.experts.{j}.gate_up.weight"] = [expert_name(i, j, "gate"), expert_name(i, j, "up")]
        out[f"mlp.experts.{j}.down.weight"] = [expert_name(i, j, "down")]
        out[f"mlp.experts.{j}.gate_up.bias"] = [expert_name(i, j, "gate", "bias"), expert_name(i, j, "up", "bias")]
        out[f"mlp.experts.{j}.down.bias"] = [expert_name(i, j, "down", "bias")]
    return out


def resolve(cfg: ModelConfig, files: dict[str, Path], shapes) -> dict:
    """Each expert part's name -> where its rows come from, the stacked tensors' shapes (`shapes(name)`: a header's)
    checked against the config first: a file that does not bear out the expert count or widths is refused here.
    Likewise the parts other checkpoints hold in one tensor: Granite 4.0-H's fused MLPs, Qwen3-Next's DeltaNet
    projections (engine.weights.delta_rows)."""
    if cfg.family == "granitemoehybrid":
        return _granite_parts(cfg, files, shapes)
    if any(cfg.delta_layers):  # Qwen3-Next's DeltaNet projections, interleaved per key head
        return delta_parts(cfg, files, shapes)
    ends = (".experts.gate_up_proj", ".experts.gate_up_proj_blocks")
    if not stacked(cfg) or not any(n.endswith(ends) for n in files):
        return {}  # (a GGUF's experts come by their own names, views of its stacked tensors)
    E, D, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    out = {}
    for i in range(cfg.num_layers):
        for base, (rows, cols) in (("gate_up_proj", (2 * F, D)), ("down_proj", (D, F))):
            name = f"model.layers.{i}.mlp.experts.{base}"
            mxfp4 = name + "_blocks" in files
            if mxfp4:
                if cols % MXFP4_GROUP:
                    raise ModelLoadError(f"{name}: MXFP4 needs whole blocks of {MXFP4_GROUP} inputs, not {cols}")
                blocks = cols // MXFP4_GROUP
                want = {name + "_blocks": (E, rows, blocks, MXFP4_GROUP // 2), name + "_scales": (E, rows, blocks)}
                paths = (files[name + "_blocks"], files.get(name + "_scales"))
            else:
                want = {name: (E, cols, rows)}
                paths = (files.get(name),)
            want[name + "_bias"] = (E, rows)
            for tensor, shape in want.items():
                if tensor not in files:
                    raise ModelLoadError(f"tensor {tensor!r} is missing from the checkpoint", next(iter(paths)))
                got = tuple(shapes(tensor))
                if got != shape:
                    raise ModelLoadError(f"tensor {tensor!r} has shape {list(got)}, the config implies {list(shape)}")
            bias_path = (files[name + "_bias"],)
            for j in range(E):
                for part in ("gate", "up") if base == "gate_up_proj" else ("down",):
                    out[expert_name(i, j, part)] = ExpertPart(name, j, part, "weight", mxfp4, paths)
                    out[expert_name(i, j, part, "bias")] = ExpertPart(name, j, part, "bias", False, bias_path)
    return out


def _granite_parts(cfg: ModelConfig, files: dict[str, Path], shapes) -> dict[str, FusedRows]:
    """Granite 4.0-H's MLP parts as rows of its fused tensors: the shared MLP's `input_linear` [2F_s, D] (gate, then
    up), the experts' `input_linear` [E, 2F, D] and `output_linear` [E, D, F]."""
    if not any(n.endswith("shared_mlp.input_linear.weight") for n in files):
        return {}  # (a GGUF holds the parts apart, under their own names)
    E, D, F, Fs = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_width or cfg.intermediate_size
    out = {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        want = {p + "shared_mlp.input_linear.weight": (2 * Fs, D)}
        if E:
            want.update({p + "block_sparse_moe.input_linear.weight": (E, 2 * F, D),
                         p + "block_sparse_moe.output_linear.weight": (E, D, F)})  # fmt: skip
        for tensor, shape in want.items():
            if tensor not in files:
                raise ModelLoadError(f"tensor {tensor!r} is missing from the checkpoint", next(iter(files.values())))
            if tuple(shapes(tensor)) != shape:
                raise ModelLoadError(
                    f"tensor {tensor!r} has shape {list(shapes(tensor))}, the config implies {list(shape)}"
                )
        shared = p + "shared_mlp.input_linear.weight"
        for part, offset in (("gate", 0), ("up", Fs)):
            out[granite_name(i, part)] = FusedRows(shared, None, part, offset, Fs, (files[shared],))
        for j in range(E):
            fused, down = p + "block_sparse_moe.input_linear.weight", p + "block_sparse_moe.output_linear.weight"
            out[granite_name(i, "gate", j)] = FusedRows(fused, j, "gate", 0, F, (files[fused],))
            out[granite_name(i, "up", j)] = FusedRows(fused, j, "up", F, F, (files[fused],))
            out[granite_name(i, "down", j)] = FusedRows(down, j, "down", 0, D, (files[down],))
    return out


def granite_state(cfg: ModelConfig, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Granite 4.0-H's parts under their own names joined back as its checkpoint holds them (the way back)."""
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        gate, up = out.pop(granite_name(i, "gate")), out.pop(granite_name(i, "up"))
        out[p + "shared_mlp.input_linear.weight"] = torch.cat((gate, up))
        if cfg.num_experts:
            parts = [
                [out.pop(granite_name(i, part, j)) for j in range(cfg.num_experts)] for part in ("gate", "up", "down")
            ]
            out[p + "block_sparse_moe.input_linear.weight"] = torch.stack([torch.cat(gu) for gu in zip(*parts[:2])])
            out[p + "block_sparse_moe.output_linear.weight"] = torch.stack(parts[2])
    return out


def expert_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """Layer i's router bias and experts' biases under kvchat's names -> their shapes."""
    F, D = cfg.moe_intermediate_size, cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {"mlp.router.bias": (cfg.num_experts,)}
    for j in range(cfg.num_experts):
        out[f"mlp.experts.{j}.gate_up.bias"], out[f"mlp.experts.{j}.down.bias"] = (2 * F,), (D,)
    return out


def stacked_state(model) -> dict[str, torch.Tensor]:
    """The experts of a stacking family's model as its checkpoint holds them (float: gate_up_proj [E, D, 2F] with
    gate and up interleaved, down_proj [E, F, D], and their biases): the way back, for writing checkpoints."""
    out = {}
    for i, block in enumerate(model.layers):
        p = f"model.layers.{i}.mlp."
        out[p + "router.weight"], out[p + "router.bias"] = block.mlp.router.weight, block.mlp.router.bias
        gate_up, down, gu_bias, d_bias = [], [], [], []
        for e in block.mlp.experts:
            gate, up = e.gate_up.weight.chunk(2)  # [F, D] each
            gate_up.append(torch.stack((gate.t(), up.t()), dim=-1).flatten(1))  # [D, 2F] interleaved
            down.append(e.down.weight.t())  # [F, D]
            g_b, u_b = e.gate_up.bias.chunk(2)
            gu_bias.append(torch.stack((g_b, u_b), dim=-1).flatten())
            d_bias.append(e.down.bias)
        x = p + "experts."
        out[x + "gate_up_proj"], out[x + "down_proj"] = torch.stack(gate_up), torch.stack(down)
        out[x + "gate_up_proj_bias"], out[x + "down_proj_bias"] = torch.stack(gu_bias), torch.stack(d_bias)
    return out
