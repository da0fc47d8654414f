"""The safetensors reader's interface over a GGUF file, so one model builder serves both formats."""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig
from .gguf_file import GGUFModel
from .hf_names import check_shapes, expected
from .safetensors import Reader, Rows


def check_gguf_shapes(model: GGUFModel, cfg: ModelConfig) -> None:
    """The metadata's sizes against the file's tensor table (hf_names.check_shapes), by GGUF name."""
    have = model.names(expected(cfg))
    shapes = {hf: model.hf_shape(hf, g, cfg) for hf, g in have.items()}
    check_shapes(cfg, shapes, lambda hf: have.get(hf) or model.gguf_name(hf), model.path)


class GGUFReader(Reader):
    """The Reader interface over a GGUF file: tensors by Hugging Face name, dequantized where they must
    be, or as their own codes (`native`) where kvchat computes with them."""

    def __init__(self, model: GGUFModel, cfg: ModelConfig):
        self.model, self.cfg = model, cfg
        self.expected = expected(cfg)
        check_gguf_shapes(model, cfg)

    def read(self, names, dtype, device):
        return {n: self.model.read_float(n, self.cfg, dtype, device) for n in names}

    def read_cat(self, names, dtype, device):
        return torch.cat([self.model.read_float(n, self.cfg, dtype, device) for n in names])

    def read_transposed(self, name, dtype, device):
        return self.model.read_float(name, self.cfg, dtype, device).t().contiguous()

    def rows(self, names, dtype, device):
        return GGUFRows(self, names, dtype, device)

    def native(self, names, dtype, device, tiles: int = 0):
        return self.model.read_codes(names, self.cfg, dtype, device, tiles)


class GGUFRows(Rows):
    """GGUF matrices stacked along rows, dequantized a chunk of rows at a time (for quantizing as read)."""

    def row_chunks(self):
        step = max(1, Reader.LARGE // math.prod(self.shape[1:]))
        offset = 0
        for name in self.names:
            rows = self.reader.expected[name][0]
            for a in range(0, rows, step):
                b = min(rows, a + step)
                yield offset + a, self.reader.model.read_float(name, self.reader.cfg, self.dtype, self.device, a, b)
            offset += rows
