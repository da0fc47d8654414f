"""Building the model from a reader (safetensors or GGUF), block by block into its final dtype, device and
layout (fused q/k/v and gate/up; transposed, quantized): the peak is the final weights plus about one block."""

from __future__ import annotations

import torch
from torch import nn

from .. import huge_pages
from ..backends.cpu_layouts import LinearT, fast_cpu_linears, transposed_embedding
from ..backends.decode_step import use_kernels
from ..backends.quantized import QuantEmbedding, QuantLinear
from ..backends.quantized_model import (
    HEAD_MODE,
    dequantize_for_torch,
    quantize_head,
    use_integer_activations,
    use_tiles,
)
from ..config import ModelConfig
from ..devices import bf16_hardware
from ..feedforward import MoE
from ..model import Transformer
from ..quant import group_for
from .hf_names import block_sources, final_norm, linears
from .safetensors import Reader


class ReturnFreedMemory:
    """While loading, glibc is told to serve large blocks with mmap, so the per-block temporaries go
    back to the system when freed instead of fragmenting the heap and raising the peak; afterwards
    the threshold is set to where glibc's own adjustment would have taken it
    and the heap is trimmed. A no-op where the C library is not glibc."""

    M_MMAP_THRESHOLD = -3

    def __enter__(self):
        try:
            import ctypes

            self.libc = ctypes.CDLL("libc.so.6")
            self.libc.mallopt(self.M_MMAP_THRESHOLD, 1 << 20)
        except (OSError, AttributeError):
            self.libc = None
        return self

    def __exit__(self, *exc):
        if self.libc is not None:
            self.libc.mallopt(self.M_MMAP_THRESHOLD, 32 << 20)
            self.libc.malloc_trim(0)
        return False


def _block_state(reader: Reader, sources: dict[str, list[str]], dtype, device) -> dict[str, torch.Tensor]:
    """Tensors by module name, fused ones read straight into their stacked buffers."""
    single = {mine: theirs[0] for mine, theirs in sources.items() if len(theirs) == 1}
    got = reader.read(list(single.values()), dtype, device)
    out = {mine: got[theirs] for mine, theirs in single.items()}
    out.update({mine: reader.read_cat(theirs, dtype, device) for mine, theirs in sources.items() if len(theirs) > 1})
    return out


def _load_block(
    reader: Reader,
    cfg: ModelConfig,
    i: int,
    block: nn.Module,
    dtype,
    device,
    weights: str,
    group_size: int,
    tiles: int = 0,
) -> None:
    """Block i's weights into `block` (on the meta device until now). A linear whose codes the file holds
    (a GGUF's Q8_0 / Q4_0) keeps them, int4 ones written in the kernels' tiles of `tiles` rows where the
    reader can; quantized (`weights`), each other linear is built from its rows a chunk at a time, so no float
    copy of the block exists."""
    sources = block_sources(cfg, i)
    paths = linears(cfg, i)
    native = {path: reader.native(sources[path + ".weight"], dtype, device, tiles) for path in paths}
    swapped = [path for path in paths if native[path] is not None or weights != "none"]
    skip = {path + ".weight" for path in swapped}
    state = _block_state(reader, {k: v for k, v in sources.items() if k not in skip}, dtype, device)
    for path in swapped:
        parent, name = path.rsplit(".", 1)
        bias = state.pop(path + ".bias", None)
        if native[path] is not None:
            layer = QuantLinear.from_codes(native[path], bias)
        else:
            rows = reader.rows(sources[path + ".weight"], dtype, device)
            layer = QuantLinear(rows, bias, weights, group_for(rows.shape[1], group_size))
        setattr(block.get_submodule(parent), name, layer)
    block.load_state_dict(state, strict=not swapped, assign=True)


def build_model(
    reader: Reader,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    weights: str,
    group_size: int,
    kern,
    progress=None,
    activations: str = "float32",
    identity: str | None = None,
) -> Transformer:
    """The model, streamed block by block from the files into its final form: each block is read,
    fused, cast, put on the device and given its layout before the next one is read, so the peak is
    the final weights plus about one block; quantized weights, the embedding and head included, are
    quantized a chunk of rows at a time as they are read. `kern`: kvchat's CPU kernels, or None;
    `progress(fraction)` is told after the embedding and head and after each block. `activations="int8"`:
    the quantized layers' one-row products on int8 activations where the kernels have them (model.activations
    says what runs). `identity`: what identifies the weights (use_kernels keeps its check's pass under it)."""
    progress = progress or (lambda fraction: None)
    transposed = kern is None and device.type == "cpu" and dtype == torch.float32  # torch's fast one-row layout
    with torch.device("meta"):
        model = Transformer(cfg)
    embed_codes = reader.native(["model.embed_tokens.weight"], dtype, device)
    head_codes = None if cfg.tie_word_embeddings else reader.native(["lm_head.weight"], dtype, device)
    if embed_codes is not None or head_codes is not None:  # a GGUF's own codes, kept
        _file_head(model, reader, cfg, embed_codes, head_codes, dtype, device, weights, group_size)
    elif weights != "none":  # quantized as they are read, a few thousand rows at a time
        untied = None if cfg.tie_word_embeddings else reader.rows(["lm_head.weight"], dtype, device)
        quantize_head(model, group_size, reader.rows(["model.embed_tokens.weight"], dtype, device), untied)
    elif transposed and cfg.tie_word_embeddings:
        transposed_embedding(model, reader.read_transposed("model.embed_tokens.weight", dtype, device))
    else:
        model.embed.weight = reader.read_one("model.embed_tokens.weight", dtype, device)
        if cfg.tie_word_embeddings:
            model.tie()
        elif transposed:
            model.lm_head = LinearT(reader.read_transposed("lm_head.weight", dtype, device))
        else:
            model.lm_head.weight = reader.read_one("lm_head.weight", dtype, device)
    model.norm.weight = reader.read_one(final_norm(cfg), dtype, device)
    steps = cfg.num_layers + 1
    progress(1 / steps)
    # a file's int4 codes go straight into the tiles use_tiles would lay them in (float32 activations, or
    # int8 ones where the kernels have the tiles' integer products)
    tiles = kern.int4_tile_rows if kern is not None and (activations == "float32" or kern.int4_integer_tiles) else 0
    for i, block in enumerate(model.layers):
        _load_block(reader, cfg, i, block, dtype, device, weights, group_size, tiles)
        if weights == "none" and device.type == "cpu":
            fast_cpu_linears([block], dtype)
        elif device.type != "cpu" and isinstance(block.mlp, MoE):  # a GPU's decode step picks experts on the device
            block.mlp.stack_experts()
        progress((i + 2) / steps)
    if activations == "int8" and use_integer_activations(model):
        model.activations = "int8"
    use_tiles(model)
    if device.type == "cpu" and dtype == torch.bfloat16 and not bf16_hardware():
        model.widen_bf16_attention()
    if kern is None and device.type == "cpu":  # a file's codes no torch kernel reads: dequantized once, when they fit
        model.dequantized_bytes = dequantize_for_torch(model)
    if device.type == "cpu":  # before the kernels take the weights' addresses
        model.huge_page_bytes = huge_pages.gather(model.requires_grad_(False))
    if kern is not None:
        use_kernels(model, kern, identity)
    return model.eval().requires_grad_(False)


def _file_head(model, reader, cfg, embed_codes, head_codes, dtype, device, weights: str, group_size: int) -> None:
    """Embedding and output head where the file holds codes for one of them: those keep their codes;
    the other is float, or quantized to HEAD_MODE when `weights` asks for quantization."""
    g = group_for(cfg.hidden_size, group_size)
    if embed_codes is not None:
        model.embed = QuantEmbedding(QuantLinear.from_codes(embed_codes))
    elif weights != "none":
        model.embed = QuantEmbedding(
            QuantLinear(reader.rows(["model.embed_tokens.weight"], dtype, device), None, HEAD_MODE, g)
        )
    else:
        model.embed.weight = reader.read_one("model.embed_tokens.weight", dtype, device)
    if cfg.tie_word_embeddings:
        if isinstance(model.embed, QuantEmbedding):
            model.lm_head = model.embed.table
        else:
            model.tie()
    elif head_codes is not None:
        model.lm_head = QuantLinear.from_codes(head_codes)
    elif weights != "none":
        model.lm_head = QuantLinear(reader.rows(["lm_head.weight"], dtype, device), None, HEAD_MODE, g)
    else:
        model.lm_head.weight = reader.read_one("lm_head.weight", dtype, device)
