"""Passes over a whole model's quantized layers (QuantLinear, QuantEmbedding: engine.backends.quantized): the
embedding and head in HEAD_MODE, int8 activations and the kernels' tiles where the kernels have them, float
weights for torch where no kernel reads a file's codes, and what the weights take."""

from __future__ import annotations

from torch import nn

from ..devices import free_memory
from ..quant import group_for
from .cpu_layouts import EmbeddingT, LinearT
from .quantized import QuantEmbedding, QuantLinear

HEAD_MODE = "int8"  # the output head and embedding under either weight mode (see quantize_head)


def use_integer_activations(model: nn.Module) -> int:
    """Switch every quantized layer whose kernels can to int8 activations in its one-row products (decode);
    returns how many did. Products of many rows (prefill's) are unchanged: dequantized weights by float activations.
    Layers already in int4 tiles (a file's, written so as it was read; use_tiles runs after this) switch where the
    kernels have the tiles' integer products (int4_integer_tiles), and keep float32 ones otherwise."""
    switched = 0
    for m in model.modules():
        if (
            isinstance(m, QuantLinear)
            and m.decoder is not None
            and m.mode in m.decoder.integer_modes
            and (not m.tiles or m.decoder.int4_integer_tiles)
        ):
            m.activations = "int8"
            switched += 1
    return switched


def use_tiles(model: nn.Module) -> int:
    """Lay every int4 layer, and every int8 one under int8 activations, out in the kernels' tiles where they have
    them (QuantLinear.tiles_fit); int4 embedding tables stay in rows, which their lookups gather (an int8 table's
    lookups gather its tiles: the head of an int4 model, read by every decode step). Returns how many were tiled."""
    tables = {id(m.table) for m in model.modules() if isinstance(m, QuantEmbedding) and m.table.mode != "int8"}
    tiled = 0
    for m in model.modules():
        if isinstance(m, QuantLinear) and id(m) not in tables and m.tiles_fit():
            m.use_tiles()
            tiled += 1
    return tiled


def quantize_head(model: nn.Module, group_size: int, embed=None, lm_head=None) -> None:
    """The embedding and the output head (one matrix when tied) as HEAD_MODE codes, whichever mode the
    blocks take: the head is read whole for every token and decides every token, so it keeps 8 bits
    (as llama.cpp's own quantizer keeps it at Q8_0 in a Q4_0 file). `embed` and `lm_head` are the
    weights (or the loader's row sources); the model's own by default."""
    g = group_for(model.cfg.hidden_size, group_size)
    model.embed = QuantEmbedding(QuantLinear(model.embed.weight if embed is None else embed, None, HEAD_MODE, g))
    if model.cfg.tie_word_embeddings:  # one matrix: the head multiplies by the embedding's table
        model.lm_head = model.embed.table
    else:
        model.lm_head = QuantLinear(model.lm_head.weight if lm_head is None else lm_head, None, HEAD_MODE, g)


FLOAT_SHARE = 0.5  # the share of the memory free at load that weights dequantized for torch may take


def dequantize_for_torch(model: nn.Module, free: int | None = -1) -> int:
    """Without kvchat's kernels, the layers no torch kernel reads (a file's codes with offsets, K-quants,
    int5, int4 off torch's groups: each product would dequantize the whole weight again, seconds a token)
    are dequantized once into the model's dtype, in torch's fast one-row layout (LinearT; a tied table as
    EmbeddingT), when they fit in FLOAT_SHARE of the free memory. Returns the bytes they now take (0: none,
    or they did not fit and stay dequantized per product)."""
    layers = {
        id(m): m
        for m in model.modules()
        if isinstance(m, QuantLinear) and m.decoder is None and m.kernel is None and m.codes.device.type == "cpu"
    }  # by id: a tied table and head are one layer
    if not layers:
        return 0
    need = sum(m.out_features * m.in_features * m.compute_dtype.itemsize for m in layers.values())
    free = free_memory() if free == -1 else free
    if free is not None and need > FLOAT_SHARE * free:
        return 0
    embed = getattr(model, "embed", None)
    if isinstance(embed, QuantEmbedding) and id(embed.table) in layers:
        table = embed.table
        weight_t = table.dequantized_weight(table.compute_dtype).t().contiguous()  # [D, V]
        model.embed = EmbeddingT(weight_t)
        if model.lm_head is table:  # tied: the head multiplies by the same transposed table
            model.lm_head = LinearT(model.embed.weight_t)
        del layers[id(table)]
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in layers:
                bias = None if child.bias is None else child.bias.detach()
                setattr(parent, name, LinearT(child.dequantized_weight(child.compute_dtype).t().contiguous(), bias))
    return need


def weight_bytes(model: nn.Module) -> int:
    """What the model's weights take: quantized layers by their packed storage, the rest by their tensors."""
    total, seen = 0, set()
    for m in model.modules():  # each module once, each tensor once (a tied head shares the embedding's)
        if isinstance(m, QuantLinear):
            total += m.storage_bytes
        tensors = [m.bias] if isinstance(m, QuantLinear) else list(m.parameters(recurse=False))
        for p in tensors:
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total
