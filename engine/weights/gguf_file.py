"""GGUF model files — what llama.cpp, LM Studio, Ollama, Jan and GPT4All run — read with the `gguf`
package's definitions and kvchat's own header reader (gguf_header): the config from the metadata, the
tokenizer from `tokenizer.ggml.*` built as a `tokenizers` tokenizer, and the weights from their own codes.

Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K blocks keep their codes, in the forms engine.weights.gguf_blocks
and engine/MODELS.md list, and run on the quantized kernels; every other type is dequantized at load into
the model dtype with `gguf.quants.dequantize` (llama.cpp's definitions), and `summary()` says which
tensors and what that costs. The file is untrusted: every
tensor's extent is checked against the file's size, shapes against the metadata, and the chat
template runs in the tokenizer's sandbox.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import mmap
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError
from ..quant import PreQuantized, storage_bytes
from . import gguf_vocab
from .delta_rows import selection
from .gguf_blocks import INT4_PACKED, INT5, MXFP4, NATIVE, OFFSETS, fast_rows
from .gguf_config import ARCHITECTURES, config_dict
from .gguf_header import GGUF_ROWS, StringArray, Tensor, read_header
from .gguf_names import gguf_name
from .gguf_vocab import NUMBER
from .hf_names import block_sources, linears

KINDS = {str: "string", int: "whole number", NUMBER: "number"}  # how an error names what a key should hold
PERMUTED = (
    "llama",
    "granite",
    "smollm3",
    "granitehybrid",
)  # llama.cpp's converter interleaves q/k rows for these (rotate pairs)
# a depthwise convolution's kernel: [C, K] in the file
KERNELS = ("conv.conv.weight", "mamba.conv1d.weight", "linear_attn.conv1d.weight")
# one row here, [H, 1] or [G, I / G] in the file; A as its logarithm, the file's A = −exp(A_log)
MAMBA_FLAT = ("mamba.A_log", "mamba.D", "mamba.norm.weight", "linear_attn.A_log")
NORM_PLUS_ONE = ("gemma2", "gemma3", "qwen3next")  # llama.cpp's converter stores (1 + w) norms with the 1 added
SELECTED = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")  # Qwen3-Next's parts


class GGUFModel:
    """One GGUF file: its metadata, its tensors by Hugging Face name, and what each is held as."""

    def __init__(self, path, check_architecture: bool = True):
        """`check_architecture`: refuse an architecture kvchat does not run (the catalog lists it instead)."""
        self.path = Path(path)
        try:
            header = read_header(self.path)
        except ImportError:
            raise ModelLoadError("reading GGUF files needs the gguf package (pip install gguf)", self.path) from None
        except (OSError, ValueError) as e:  # unreadable, or too small to map
            raise ModelLoadError(f"not a readable GGUF file: {e}", self.path) from None
        self.fields, self.mm, self.metadata_end = header.fields, header.mm, header.metadata_end
        self.file_tensors = header.tensors  # as the file stores them (a mixture's experts stacked): for counting
        self.tensors = {t.name: t for t in header.tensors}
        for t in header.tensors:  # a mixture's experts stacked in one tensor: each expert's rows by name too
            if (t.name.endswith("_exps.weight") and len(t.dims) == 3) or (
                t.name.endswith("_exps.bias") and len(t.dims) == 2  # gpt-oss's experts' biases [E, rows]
            ):
                self.tensors.update({e.name: e for e in _experts(t)})
        self.arch = self.meta("general.architecture")
        if check_architecture and self.arch not in ARCHITECTURES:
            raise ModelLoadError(
                f"GGUF architecture {self.arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})", self.path
            )
        self.held: dict[
            str, tuple[str, str, int, int]
        ] = {}  # gguf name -> (file type, held as, file bytes, held bytes)

    # --- metadata --------------------------------------------------------------------------------
    def meta(self, key: str, default=None):
        """A metadata value: a number, a string, a list of strings, or a numpy array of numbers."""
        return self.fields.get(key, default)

    def meta_as(self, key: str, kind: type | tuple, default=None):
        """Metadata that must be of a kind (str, int, or a list of one: `[str]`): a file that stores
        something else there is a clear error naming the key, not a failure deep in the tokenizer."""
        value = self.meta(key, default)
        if value is None or value is default:
            return value
        if isinstance(kind, list):
            want = kind[0]
            if want is str:
                ok = isinstance(value, StringArray) or (
                    isinstance(value, list) and all(isinstance(v, str) for v in value)
                )
            else:  # numbers come as a numpy array: integers for `int`, integers or floats for NUMBER
                kinds = "iu" if want is int else "iuf"
                ok = isinstance(value, np.ndarray) and value.dtype.kind in kinds
            said = f"an array of {KINDS[want]}s"
        else:
            ok = isinstance(value, kind) and not isinstance(value, bool)
            said = f"a {KINDS[kind]}"
        if not ok:
            raise ModelLoadError(f"GGUF metadata {key!r} should be {said}", self.path)
        return value

    def metadata_bytes(self) -> bytes:
        """The header up to the tensor table: every metadata key and value as the file holds them."""
        return self.mm[: self.metadata_end]

    def arch_value(self, key: str, default=None):
        """A metadata value under the file's architecture ("{arch}.{key}")."""
        return self.meta(f"{self.arch}.{key}", default)

    def config_dict(self) -> dict:
        """The model's config in config.json's terms, from the metadata (engine.weights.gguf_config)."""
        return config_dict(self)

    def kv_b(self, hf: str) -> tuple | None:
        """Latent attention's kv_b (d_c -> H·(d_n + d_v)) as llama.cpp's converter splits it, k_b [H, d_c, d_n] and
        v_b [H, d_v, d_c], read as one [H·(d_n + d_v), d_c]: the two tensors, or None for any other name."""
        if self.arch != "deepseek2" or not hf.endswith("self_attn.kv_b_proj.weight"):
            return None
        k_name = self.gguf_name(hf)
        k_b, v_b = self.tensors.get(k_name), self.tensors.get(k_name.replace("attn_k_b", "attn_v_b"))
        if k_b is None or v_b is None:
            return None
        if len(k_b.shape) != 3 or len(v_b.shape) != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
            said = f"{k_name} {list(k_b.shape)} and attn_v_b {list(v_b.shape)} are not one kv_b"
            raise ModelLoadError(said, self.path)
        return k_b, v_b

    def hf_shape(self, hf: str, gname: str, cfg=None) -> tuple[int, ...]:
        """A tensor's shape under its Hugging Face name (kv_b's joined from its two parts, a convolution's kernel
        [D, 1, K] where the file holds [D, K], a selection's rows)."""
        parts = self.kv_b(hf)
        if parts is None:
            shape = self.shape(self.tensors[gname])
            chosen = self.permutation(hf, cfg) if cfg is not None else None
            if chosen is not None:
                return (len(chosen), *shape[1:])
            if hf.endswith(MAMBA_FLAT):  # A and D [H, 1], the gated norm [G, I / G]: one row
                return (math.prod(shape),)
            return (shape[0], 1, *shape[1:]) if hf.endswith(KERNELS) and len(shape) == 2 else shape
        (heads, latent, nope), values = parts[0].shape, parts[1].shape[1]
        return (heads * (nope + values), latent)

    def rope_factors(self) -> tuple[float, ...]:
        """Per-frequency divisors from `rope_freqs.weight` (how Llama 3.1+ files carry their rope scaling)."""
        t = self.tensors.get("rope_freqs.weight")
        if t is None:
            return ()
        return tuple(float(v) for v in self.float_rows(t).reshape(-1))

    def tokenizer(self, stop_extra=()):
        """The file's Tokenizer (engine.weights.gguf_vocab)."""
        return gguf_vocab.tokenizer(self, stop_extra)

    # --- tensors -----------------------------------------------------------------------------------
    def gguf_name(self, hf: str) -> str | None:
        name = gguf_name(self.arch, hf)
        if name is not None and "|" in name:  # the form this file holds (Granite 4.0-H's shared MLP)
            return next((n for n in name.split("|") if n in self.tensors), name.split("|")[0])
        if name is not None and name.endswith(("attn_qkv.weight", "attn_gate.weight")) and self._legacy(name):
            return name.rsplit(".", 2)[0] + ".ssm_in.weight"  # an older Qwen3-Next file: q, k, v, z interleaved
        return name

    def _legacy(self, name: str) -> bool:
        """Whether this Qwen3-Next file holds its DeltaNet's projections as the checkpoint does, in one interleaved
        `ssm_in` (llama.cpp's converter before it split them), where `name` would be."""
        return (
            self.arch == "qwen3next"
            and name not in self.tensors
            and name.rsplit(".", 2)[0] + ".ssm_in.weight" in self.tensors
        )

    def names(self, wanted) -> dict[str, str]:
        """Of the Hugging Face names `wanted`, those this file holds -> their GGUF names."""
        out = {}
        for hf in wanted:
            gname = self.gguf_name(hf)
            if gname is not None and gname in self.tensors:
                out[hf] = gname
        return out

    @staticmethod
    def shape(t) -> tuple[int, ...]:
        """A tensor's shape, outer dimension first (GGUF lists the innermost first)."""
        return t.shape

    def file_type(self, gname: str) -> str:
        return self.tensors[gname].tensor_type.name

    def float_rows(self, t, a: int = 0, b: int | None = None) -> np.ndarray:
        """Rows a:b of a tensor as float32 values (1-D tensors whole), through llama.cpp's definitions."""
        data = t.data if t.data.ndim == 1 else t.data[a:b]
        if t.tensor_type.name == "F32":
            return np.asarray(data, dtype=np.float32)
        if t.tensor_type.name == "F16":
            return np.asarray(data).astype(np.float32)
        from gguf import GGMLQuantizationType, quants  # the other types: llama.cpp's definitions, in numpy

        try:
            return quants.dequantize(np.asarray(data), GGMLQuantizationType(int(t.tensor_type)))
        except (NotImplementedError, ValueError):  # ValueError: a type this gguf release does not know
            raise ModelLoadError(
                f"tensor {t.name!r} is stored as {t.tensor_type.name}, which kvchat cannot read yet", self.path
            ) from None

    def permutation(self, hf: str, cfg) -> np.ndarray | None:
        """The rows to read, in order: the order that undoes llama.cpp's q/k interleaving, or a Qwen3-Next part's
        selection of the tensor that interleaves it with others (None when the rows are as Hugging Face has them)."""
        if self.arch == "qwen3next" and hf.endswith(SELECTED):
            whole = self.gguf_name(hf).endswith(("ssm_in.weight", "ssm_ba.weight"))
            return selection(cfg, hf.rsplit(".", 2)[1]) if whole else None
        if self.arch not in PERMUTED:
            return None
        if hf.endswith(("q_proj.weight", "q_proj.bias")):
            heads = cfg.num_heads
        elif hf.endswith(("k_proj.weight", "k_proj.bias")):
            heads = cfg.num_kv_heads
        else:
            return None
        rows = heads * cfg.head_dim
        gguf_holds = np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(-1)
        return np.argsort(gguf_holds)  # hf[r] = gguf[order[r]]

    def read_float(self, hf: str, cfg, dtype, device, a: int = 0, b: int | None = None) -> torch.Tensor:
        """A tensor (rows a:b of it) in `dtype` on `device`, dequantized where the file holds codes."""
        gname = self.gguf_name(hf)
        parts = self.kv_b(hf)
        if parts is not None:  # [H, d_c, d_n] transposed beside [H, d_v, d_c], each head's rows together
            k_b, v_b = (self.float_rows(t) for t in parts)
            joined = np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1).reshape(-1, k_b.shape[1])
            self._note(gname, dtype)
            return torch.from_numpy(np.ascontiguousarray(joined[a:b])).to(device=device, dtype=dtype)
        t = self.tensors[gname]
        order = self.permutation(hf, cfg)
        if order is not None:  # small (q and k): whole, then reordered
            rows = self.float_rows(t)[order][a:b]
        else:
            rows = self.float_rows(t, a, b)
        self._note(gname, dtype)
        if b is None or b >= t.data.shape[0]:
            self._release(t)
        rows = np.ascontiguousarray(rows)
        if not rows.flags.writeable:  # a view of the mapped file (F32): copied, never kept
            rows = rows.copy()
        if hf.endswith(MAMBA_FLAT):  # one row, A as its logarithm (the file holds A = −exp(A_log))
            rows = np.log(-rows).reshape(-1) if hf.endswith("A_log") else rows.reshape(-1)
        out = torch.from_numpy(rows).to(device=device, dtype=dtype)
        return out.unsqueeze(1) if hf.endswith(KERNELS) and out.dim() == 2 else out  # LFM2's [D, K], Mamba-2's [C, K]

    def read_codes(self, hfs: list[str], cfg, dtype, device, tiles: int = 0) -> PreQuantized | None:
        """Tensors stacked along rows as their own codes, when every one is of a type the kernels compute
        (NATIVE). Tensors of different types (a Q4_K_M file's q and k in Q4_K, v in Q6_K) share the widest
        form: int8 codes if any is int8, the smallest group (a scale repeated for a larger one), offsets
        if any has them (0 for the others): each value is the file's, only the storage widens. `tiles`: int4
        codes may come in the kernels' tiles of that many rows (PreQuantized.tiles says whether they do)."""
        types = [self.file_type(self.gguf_name(h)) for h in hfs]
        if not all(t in NATIVE for t in types) or (len(set(types)) > 1 and "MXFP4" in types):
            return None  # (MXFP4 stacks with MXFP4 only)
        fast = fast_rows() if device.type == "cpu" else None
        if fast is not None and all(t in GGUF_ROWS for t in types):
            return self._rows_in_c(fast, hfs, types, cfg, dtype, tiles)
        mode, group = _product_form(types)
        if mode == "int5":  # their own five bits
            decode = INT5
        elif mode == "mxfp4":
            decode = MXFP4
        else:
            decode = INT4_PACKED if mode == "int4" else {t: NATIVE[t][2] for t in types}  # int4: two a byte
        parts = []
        for hf, ftype in zip(hfs, types):
            gname = self.gguf_name(hf)
            c, s, m = decode[ftype](np.asarray(self.tensors[gname].data))
            order = self.permutation(hf, cfg)
            if order is not None:
                c, s, m = c[order], s[order], None if m is None else m[order]
            self._release(self.tensors[gname])
            widen = NATIVE[ftype][1] // group
            parts.append((c, s.repeat(widen, -1), None if m is None else m.repeat(widen, -1)))
        offsets = any(m is not None for _, _, m in parts)
        for hf, ftype, (c, s, _) in zip(hfs, types, parts):
            held = c.size + s.size * s.itemsize * (2 if offsets else 1)  # codes: a byte each, or packed (int4, int5)
            form = f"{mode}/g{group}" + ("+min" if offsets else "")
            self._hold(self.gguf_name(hf), ftype, form, int(held), self.permutation(hf, cfg))

        def stacked(arrays, kind):  # one tensor of the parts' rows (a single part as it is: no copy)
            whole = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
            return torch.from_numpy(np.ascontiguousarray(whole, dtype=kind)).to(device)

        codes = stacked([c for c, _, _ in parts], np.int8 if mode == "int8" else np.uint8)
        scales = stacked([s for _, s, _ in parts], np.uint8 if mode == "mxfp4" else np.float32)  # MXFP4: e8m0
        mins = stacked([np.zeros_like(s) if m is None else m for _, s, m in parts], np.float32) if offsets else None
        return PreQuantized(codes, scales, mode, group, dtype, mins, packed=mode in ("int4", "mxfp4"))

    def _rows_in_c(self, k, hfs: list[str], types: list[str], cfg, dtype, tiles: int) -> PreQuantized:
        """read_codes for tensors of the kinds the kernels convert (GGUF_ROWS: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K, Q5_K), in
        read_codes' form: each written by the kernels straight from the mapped file into the product's final
        buffers (kv_gguf_rows), rows reordered, groups widened and int4 tiled on the way, with no array in between
        (engine/BENCHMARKS.md, "Opening a model file")."""
        mode, group = _product_form(types)
        offsets = any(t in OFFSETS for t in types)
        parts = [self.tensors[self.gguf_name(h)] for h in hfs]
        orders = [self.permutation(h, cfg) for h in hfs]
        n = sum(t.data.shape[0] if o is None else len(o) for t, o in zip(parts, orders))
        width = parts[0].n_elements // parts[0].data.shape[0]  # values a row
        tile = tiles if mode == "int4" and tiles and n % tiles == 0 else 1
        per = storage_bytes(width, mode, 0)  # code bytes a row
        codes = torch.empty((n // tile, tile * per), dtype=torch.int8 if mode == "int8" else torch.uint8)
        scales = torch.empty((n // tile, tile * width // group), dtype=torch.float32)
        mins = torch.empty_like(scales) if offsets else None
        form = f"{mode}/g{group}" + ("+min" if offsets else "")
        r0 = 0
        for ftype, t, order in zip(types, parts, orders):
            rows = t.data.shape[0] if order is None else len(order)
            k.gguf_rows(t.data, GGUF_ROWS[ftype], mode, order, r0, tile, group, codes, scales, mins)
            self._release(t)
            held = storage_bytes(rows * width, mode, rows * width // group * (2 if offsets else 1))
            self._hold(t.name, ftype, form, held, order)
            r0 += rows
        return PreQuantized(
            codes, scales, mode, group, dtype, mins, packed=mode == "int4", tiles=tile if tile > 1 else 0
        )

    def _release(self, t) -> None:
        """Drop a tensor's pages of the mapped file once it is read: they would count in the process's
        memory, next to the weights built from them, until the whole load ends."""
        mm = self.mm
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, t.data_offset + int(t.n_bytes) - start)
        except (OSError, ValueError):
            pass  # only memory is at stake

    def _hold(self, gname: str, ftype: str, form: str, held: int, order) -> None:
        """What a tensor is held as: a part read by rows (Qwen3-Next's b and a of one ssm_ba) adds to the parts
        before it."""
        before = self.held.get(gname)
        parted = order is not None and len(order) < self.tensors[gname].data.shape[0] and before is not None
        self.held[gname] = (ftype, form, int(self.tensors[gname].n_bytes), held + (before[3] if parted else 0))

    def _note(self, gname: str, dtype) -> None:
        t = self.tensors[gname]
        size = torch.empty((), dtype=dtype).element_size()
        ftype = t.tensor_type.name
        held = str(dtype).removeprefix("torch.") + ("" if ftype in ("F32", "F16", "BF16") else " (dequantized)")
        self.held[gname] = (ftype, held, int(t.n_bytes), int(t.n_elements) * size)

    def summary(self) -> dict:
        """By file type: how many tensors, their bytes in the file, what they are held as and their bytes held."""
        out: dict[str, dict] = {}
        for ftype, held, file_bytes, held_bytes in self.held.values():
            row = out.setdefault(f"{ftype} → {held}", {"tensors": 0, "file_bytes": 0, "held_bytes": 0})
            row["tensors"] += 1
            row["file_bytes"] += file_bytes
            row["held_bytes"] += held_bytes
        return out

    def held_estimate(self, cfg, float_bytes: int = 4) -> int:
        """The bytes the weights take once loaded (what the Models dialog weighs against free memory): the
        products whose codes the loader keeps (each block's linears as hf_names stacks them, the embedding and an
        untied head) in their held form (_product_form: the widest of their types), codes and a float32 scale
        (and offset) per group; every other tensor (norms, a router, a type the kernels do not compute) held
        dequantized, `float_bytes` a value. A file's size understates it: Q6_K's 6.56 bits a value are held in
        10, and q and k widen to int8 where v is Q6_K."""
        products = [[h + ".weight" for h in ("model.embed_tokens",)]]
        if not cfg.tie_word_embeddings:
            products.append(["lm_head.weight"])
        for i in range(cfg.num_layers):
            sources = block_sources(cfg, i)
            products += [sources[path + ".weight"] for path in linears(cfg, i)]
        total, counted = 0, set()
        for hfs in products:
            parts = [self.tensors[g] for g in map(self.gguf_name, hfs) if g in self.tensors]
            types = [t.tensor_type.name for t in parts]
            if len(parts) != len(hfs) or not all(t in NATIVE for t in types):
                continue  # read as floats: counted below with the rest
            n = sum(int(t.n_elements) for t in parts)
            mode, group = _product_form(types)
            total += storage_bytes(n, mode, n // group * (2 if any(t in OFFSETS for t in types) else 1))
            counted.update(t.name.split("#")[0] for t in parts)  # a mixture's experts: their stacked tensor
        return total + sum(int(t.n_elements) * float_bytes for t in self.file_tensors if t.name not in counted)

    def quantization(self) -> str:
        """The file's quantization as people name it (its most common tensor type among the matrices)."""
        counts: dict[str, int] = {}
        for t in self.file_tensors:
            if len(t.shape) > 1:
                counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
        return max(counts, key=counts.get) if counts else "F32"

    def digest(self) -> str:
        """What identifies the weights cheaply: the file's name, size and mtime and its tensor table."""
        st = self.path.stat()
        h = hashlib.sha256(f"{self.path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        for t in self.tensors.values():
            h.update(f"{t.name}:{t.tensor_type.name}:{list(t.dims)}:{t.data_offset}".encode())
        return h.hexdigest()[:16]


def _product_form(types: list[str]) -> tuple[str, int]:
    """(mode, values per scale) of a product stacking tensors of these GGUF types: int5 where all are 5-bit
    (their own five bits), else int8 if any is held as int8, else int4; the smallest group among them."""
    if all(t in INT5 for t in types):
        return "int5", 32
    if all(t in MXFP4 for t in types):
        return "mxfp4", 32
    return ("int8" if any(NATIVE[t][0] == "int8" for t in types) else "int4"), min(NATIVE[t][1] for t in types)


def _experts(t: Tensor) -> list[Tensor]:
    """A stacked experts' tensor [E, rows, cols] (or their biases [E, rows]) as E tensors [rows, cols] ([rows]),
    each a view of its own rows."""
    count = t.dims[-1]
    each = t.n_bytes // count
    return [
        dataclasses.replace(
            t,
            name=f"{t.name}#{j}",
            dims=t.dims[:-1],
            data_offset=t.data_offset + j * each,
            n_bytes=each,
            n_elements=t.n_elements // count,
            data=t.data[j],
        )
        for j in range(count)
    ]
