"""Safetensors checkpoints (never pickle): which file holds each tensor, the files' headers checked against
the config, and a reader that streams named tensors a chunk of rows at a time, so no whole second copy of a
tensor is ever mapped or held."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import struct
from pathlib import Path, PurePath

import torch
from safetensors import safe_open
from torch import nn

from ..config import ModelConfig
from ..errors import ModelLoadError
from ..quant import MXFP4_GROUP, PreQuantized


def weight_files(model_dir: Path) -> dict[str, Path]:
    """tensor name -> file holding it, from model.safetensors or a sharded index."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelLoadError(f"the shard index is unreadable: {e!r}", index) from None
        files = {}
        for name, fname in weight_map.items():
            # A shard is named by a plain file name in this folder; the file itself may be a symlink
            # (the Hugging Face cache links every snapshot file into its blobs/ folder).
            if not isinstance(fname, str) or fname in ("", ".", "..") or PurePath(fname).name != fname or "\\" in fname:
                raise ModelLoadError(f"the shard index points outside the model folder: {fname!r}", index)
            files[name] = model_dir / fname
        for path in set(files.values()):
            if not path.is_file():
                raise ModelLoadError("a shard named in model.safetensors.index.json is missing", path)
        return files
    if single.is_file():
        return {name: single for name in read_names(single)}
    pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt*"))
    if pickles:
        raise ModelLoadError(
            f"only pickle weights found ({', '.join(pickles)}); kvchat never unpickles model files "
            "(they can run code). Convert them to model.safetensors first",
            model_dir,
        )
    raise ModelLoadError("missing model.safetensors (or model.safetensors.index.json)", model_dir)


@contextlib.contextmanager
def opened(path: Path):
    """A safetensors file's handle; any failure inside becomes a ModelLoadError naming the file."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except ModelLoadError:
        raise
    except Exception as e:  # SafetensorError, OSError: a truncated or corrupt file
        raise ModelLoadError(f"corrupt or truncated safetensors file: {e}", path) from None


def read_names(path: Path) -> list[str]:
    with opened(path) as f:
        return list(f.keys())


def _by_file(files: dict[str, Path], names) -> dict[Path, list[str]]:
    """The names grouped by the file holding each, so each file is opened once."""
    out: dict[Path, list[str]] = {}
    for n in names:
        out.setdefault(files[n], []).append(n)
    return out


def check_shapes_in_headers(files: dict[str, Path], shapes: dict[str, tuple[int, ...]]) -> None:
    """Each named tensor's shape in its file's header against the one given, before anything is allocated."""
    for path, group in _by_file(files, shapes).items():
        with opened(path) as f:
            for n in group:
                stored = tuple(f.get_slice(n).get_shape())
                if stored != tuple(shapes[n]):
                    raise ModelLoadError(f"{n} is {list(stored)}, but config.json makes it {list(shapes[n])}", path)


def read_tensors(files: dict[str, Path], names):
    """(name, tensor) for each of `names`, read file by file, whole (a vision tower's few hundred MB); their
    shapes are check_shapes_in_headers' to check first, before the model they go into is allocated."""
    for path, group in _by_file(files, names).items():
        with opened(path) as f:
            for n in group:
                try:
                    yield n, f.get_tensor(n)
                except Exception as e:  # SafetensorError: a tensor the header names but the file cuts short
                    raise ModelLoadError(f"tensor {n!r} cannot be read: {e}", path) from None


# a multimodal checkpoint's text model (Gemma 3's, then SmolVLM's)
TEXT_PREFIXES = ("language_model.model.", "model.language_model.", "model.text_model.")


def text_model_names(files: dict[str, Path]) -> dict[str, str]:
    """For a checkpoint whose text model sits under another prefix (Gemma 3 4B and larger, with a vision tower:
    language_model.model.*), each of its tensors' usual name -> the name it is stored under; {} otherwise."""
    if "model.embed_tokens.weight" in files:
        return {}
    for prefix in TEXT_PREFIXES:
        if prefix + "embed_tokens.weight" in files:
            return {"model." + n[len(prefix) :]: n for n in files if n.startswith(prefix)}
    return {}


def check_against_headers(
    cfg: ModelConfig, files: dict[str, Path], stored: dict | None = None
) -> dict[str, tuple[int, ...]]:
    """The config's sizes against the weights' own headers, before anything is allocated: the layer count
    and the embedding's shape (every other tensor is checked against the config as it is read). `files` by the
    usual names, `stored` the names the files use where they differ. Returns every tensor's shape as the headers
    give it, by the usual names."""
    usual = {theirs: mine for mine, theirs in (stored or {}).items()}
    shapes = {}
    for path in set(files.values()):
        with opened(path) as f:
            for n in f.keys():
                mine = usual.get(n, n)
                if files.get(mine) == path:
                    shapes[mine] = tuple(f.get_slice(n).get_shape())
    layers = {n.split(".")[2] for n in shapes if n.startswith("model.layers.") and n.count(".") > 2}
    if len(layers) != cfg.num_layers:
        raise ModelLoadError(
            f"config.json says num_hidden_layers={cfg.num_layers:,} but the weights hold {len(layers):,} layers"
        )
    embed = shapes.get("model.embed_tokens.weight")
    if embed is None:
        where = next(iter(set(files.values())), None)
        raise ModelLoadError("tensor 'model.embed_tokens.weight' is missing from the checkpoint", where)
    if embed != (cfg.vocab_size, cfg.hidden_size):
        raise ModelLoadError(
            f"config.json says vocab_size={cfg.vocab_size:,}, hidden_size={cfg.hidden_size:,} but "
            f"model.embed_tokens.weight is {list(embed)}"
        )
    return shapes


def header_digest(paths) -> str:
    """What identifies the weights cheaply: each file's name, size, mtime and safetensors header."""
    h = hashlib.sha256()
    for path in sorted(set(paths)):
        st = path.stat()
        h.update(f"{path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) == 8:
                n = struct.unpack("<Q", head)[0]
                h.update(f.read(min(n, 100_000_000)))
    return h.hexdigest()[:16]


class Reader:
    """Reads named tensors (checking their shapes) group by group. Each group opens the file(s) anew,
    so only that group's pages are mapped at a time: the process never holds the whole file next
    to the weights built from it."""

    ROWS_PER_CHUNK = 4096

    def __init__(
        self, files: dict[str, Path], expected: dict[str, tuple[int, ...]], stored: dict | None = None,
        derived: dict | None = None,
    ):  # fmt: skip
        """`stored`: a name -> the name the file holds it under, where they differ (text_model_names). `derived`: a
        name no file holds -> what its rows are read from (engine.weights.stacked_experts.ExpertPart)."""
        self.files, self.expected, self.stored = dict(files), expected, stored or {}
        self.derived = derived or {}
        self.files.update({name: part.paths[0] for name, part in self.derived.items()})
        for name in expected:
            if name not in self.files:
                where = next(iter(set(files.values())), None)
                raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint", where)

    _opened = staticmethod(opened)

    def _by_file(self, names: list[str]) -> dict[Path, list[str]]:
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        return by_file

    def _check(self, path: Path, name: str, shape) -> None:
        if tuple(shape) != self.expected[name]:
            raise ModelLoadError(
                f"tensor {name!r} has shape {tuple(shape)}, config.json implies {self.expected[name]}", path
            )

    LARGE = 4 * 2**20  # values (16 MiB in float32): embeddings, output heads, the largest projections

    def _large(self, name: str) -> bool:
        """Read a chunk per mapping of the file (_copy_into without `f`), not through a shared open file."""
        return math.prod(self.expected[name]) >= self.LARGE

    def _copy_into(self, path: Path, name: str, dst: torch.Tensor, f=None, first: int = 0) -> None:
        """Copy a tensor (or its rows from `first` on, as many as `dst` holds) into `dst` (any
        dtype/device) a few thousand rows at a time, never a whole second copy in memory. With `f`,
        through that open file; without, each chunk through a fresh mapping of the file, so the pages
        read stay mapped (and counted in the process's memory) only while their chunk is copied: one
        mapping for a whole large embedding would hold it twice."""
        shape = self.expected[name]
        stop = first + dst.shape[0]
        spans = (
            [(0, shape[0])]
            if len(shape) <= 1
            else [(a, min(stop, a + self.ROWS_PER_CHUNK)) for a in range(first, stop, self.ROWS_PER_CHUNK)]
        )
        part = self.derived.get(name)
        for a, b in spans:
            if part is not None:  # rows of a stacked tensor, read from the file(s) holding it
                rows = part.rows(a, b, self._opened)
                if tuple(rows.shape) != (b - a, *shape[1:]):
                    raise ModelLoadError(f"{name}: rows {a}..{b} read as {list(rows.shape)}", path)
                dst[a - first : b - first].copy_(rows)
                continue
            with contextlib.nullcontext(f) if f is not None else self._opened(path) as g:
                sl = g.get_slice(self.stored.get(name, name))
                self._check(path, name, sl.get_shape())
                dst[a - first : b - first].copy_(sl[a:b])

    def read(self, names: list[str], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """name -> tensor in `dtype` on `device`; each file opened once for its small tensors, large ones
        a chunk per mapping. Always a copy: a tensor safetensors hands out may view the mapped file,
        and keeping one would keep the whole mapping (and its pages) alive."""
        out = {name: torch.empty(self.expected[name], dtype=dtype, device=device) for name in names}
        for path, group in self._by_file(names).items():
            large = [n for n in group if self._large(n)]
            with self._opened(path) as f:
                for name in group:
                    if name not in large:
                        self._copy_into(path, name, out[name], f)
            for name in large:
                self._copy_into(path, name, out[name])
        return out

    def read_one(self, name: str, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
        return nn.Parameter(self.read([name], dtype, device)[name], requires_grad=False)

    def native(self, names: list[str], dtype: torch.dtype, device: torch.device, tiles: int = 0) -> PreQuantized | None:
        """The tensors' own codes, where the file holds codes kvchat computes with: MXFP4 experts (gpt-oss), packed
        two a byte as int4's, each block's e8m0 scale byte kept (engine.quant.MXFP4_CODES, mxfp4_scales)."""
        parts = [self.derived.get(n) for n in names]
        if not parts or not all(p is not None and p.mxfp4 and p.what == "weight" for p in parts):
            return None
        got = [p.codes(0, self.expected[n][0], self._opened) for p, n in zip(parts, names)]
        packed = torch.cat([b.reshape(b.shape[0], -1) for b, _ in got]).contiguous()  # [R, in/2]
        scales = torch.cat([s for _, s in got]).to(torch.uint8).contiguous()  # [R, in/32] e8m0, as the kernels read
        return PreQuantized(packed.to(device), scales.to(device), "mxfp4", MXFP4_GROUP, dtype, packed=True)

    def read_cat(self, names: list[str], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Tensors stacked along rows (fused q/k/v, gate/up), each copied once into its slice."""
        rows = {n: self.expected[n][0] for n in names}
        offset = dict(zip(names, itertools.accumulate([0] + list(rows.values()))))
        dst = torch.empty((sum(rows.values()), *self.expected[names[0]][1:]), dtype=dtype, device=device)
        for path, group in self._by_file(names).items():
            with self._opened(path) as f:
                for name in group:
                    self._copy_into(path, name, dst[offset[name] : offset[name] + rows[name]], f)
        return dst

    def rows(self, names: list[str], dtype: torch.dtype, device: torch.device) -> Rows:
        """2-D tensors stacked along rows as a row source, read a chunk at a time by whoever consumes it."""
        return Rows(self, names, dtype, device)

    def read_transposed(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A [R, C] tensor straight into a [C, R] buffer, a few thousand rows at a time."""
        path = self.files[name]
        with self._opened(path) as f:
            sl = f.get_slice(self.stored.get(name, name))
            self._check(path, name, sl.get_shape())
            rows, cols = sl.get_shape()
            dst = torch.empty((cols, rows), dtype=dtype, device=device)  # [C, R]
            for a in range(0, rows, self.ROWS_PER_CHUNK):
                b = min(rows, a + self.ROWS_PER_CHUNK)
                dst[:, a:b].copy_(sl[a:b].t())
            return dst


@dataclasses.dataclass
class Rows:
    """Checkpoint matrices stacked along rows (one, or fused q/k/v and gate/up), read a chunk of rows
    at a time (at most ROWS_PER_CHUNK rows and LARGE values), each chunk in `dtype` on `device` through
    Reader._copy_into: engine.quant.QuantLinear quantizes them chunk by chunk, so their float copy
    never exists whole."""

    reader: Reader
    names: list[str]
    dtype: torch.dtype
    device: torch.device

    @property
    def shape(self) -> tuple[int, ...]:
        first = self.reader.expected[self.names[0]]
        return (sum(self.reader.expected[n][0] for n in self.names), *first[1:])

    def row_chunks(self):
        """(first row, [n, K] rows) for consecutive chunks."""
        r = self.reader
        step = max(1, min(r.ROWS_PER_CHUNK, r.LARGE // math.prod(self.shape[1:])))
        offset = 0
        for name in self.names:
            path, rows = r.files[name], r.expected[name][0]
            with contextlib.nullcontext() if r._large(name) else r._opened(path) as f:
                for a in range(0, rows, step):
                    chunk = torch.empty(
                        (min(rows, a + step) - a, *self.shape[1:]), dtype=self.dtype, device=self.device
                    )
                    r._copy_into(path, name, chunk, f, first=a)
                    yield offset + a, chunk
            offset += rows
