"""Loading a Hugging Face style model folder: config, safetensors weights (never pickle), tokenizer.

Weights stream block by block from the safetensors files straight into their final dtype, device
and layout (fused q/k/v and gate/up; transposed, quantized): no whole-model intermediate copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import struct
from pathlib import Path, PurePath

import torch
from safetensors import safe_open
from torch import nn

from .backends import kernels as kernel_library
from .backends.cpu_layouts import LinearT, fast_cpu_linears, transposed_embedding
from .backends.decode_step import use_kernels
from .backends.quantized import (
    HEAD_MODE,
    QuantEmbedding,
    QuantLinear,
    quantize_head,
    use_int4_tiles,
    use_integer_activations,
    weight_bytes,
)
from .bundled import DEMO_MODEL
from .config import ModelConfig, config_from_dict, load_config
from .errors import ModelLoadError
from .gguf_file import GGUFModel, is_gguf
from .kv_cache import bytes_per_position
from .model import Transformer
from .quant import DEFAULT_GROUP_SIZE, PreQuantized, check_activations, check_mode, describe, group_for
from .tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str | None = None) -> torch.device:
    """cuda, then mps, then cpu when `name` is None or "auto"."""
    if name in (None, "", "auto"):
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device cuda was asked for, but torch sees no CUDA GPU")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ModelLoadError("device mps was asked for, but it is not available")
    return device


def default_threads() -> int:
    """Threads for torch's kernels: KVCHAT_THREADS, else one per physical core (hyperthreads share a
    core's memory bandwidth and only add contention to a memory-bound decode)."""
    env = os.environ.get("KVCHAT_THREADS")
    if env and env.isdigit() and int(env) > 0:
        return int(env)
    n = os.cpu_count() or 1
    try:
        smt = Path("/sys/devices/system/cpu/smt/active").read_text().strip() == "1"
    except OSError:
        smt = False
    return max(1, n // 2) if smt else n


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """bfloat16 on a GPU, float32 on the CPU, unless asked otherwise."""
    if name in (None, "", "auto"):
        return torch.bfloat16 if device.type in ("cuda", "mps") else torch.float32
    if name not in DTYPES:
        raise ModelLoadError(f"dtype {name!r} is not supported (supported: {', '.join(DTYPES)})")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _weight_files(model_dir: Path) -> dict[str, Path]:
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
        return {name: single for name in _read_names(single)}
    pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt*"))
    if pickles:
        raise ModelLoadError(
            f"only pickle weights found ({', '.join(pickles)}); kvchat never unpickles model files "
            "(they can run code). Convert them to model.safetensors first",
            model_dir,
        )
    raise ModelLoadError("missing model.safetensors (or model.safetensors.index.json)", model_dir)


@contextlib.contextmanager
def _opened(path: Path):
    """A safetensors file's handle; any failure inside becomes a ModelLoadError naming the file."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield f
    except ModelLoadError:
        raise
    except Exception as e:  # SafetensorError, OSError: a truncated or corrupt file
        raise ModelLoadError(f"corrupt or truncated safetensors file: {e}", path) from None


def _read_names(path: Path) -> list[str]:
    with _opened(path) as f:
        return list(f.keys())


def _check_against_headers(cfg: ModelConfig, files: dict[str, Path]) -> None:
    """The config's sizes against the weights' own headers, before anything is allocated: the layer count
    and the embedding's shape (every other tensor is checked against the config as it is read)."""
    shapes = {}
    for path in set(files.values()):
        with _opened(path) as f:
            shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys() if files.get(n) == path})
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


def _header_digest(paths) -> str:
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


def _expected(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, with its shape, under Hugging Face names."""
    D, F, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qd, kvd = cfg.num_heads * d, cfg.num_kv_heads * d
    out = {"model.embed_tokens.weight": (cfg.vocab_size, D), "model.norm.weight": (D,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, D)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": (qd, D),
                p + "self_attn.k_proj.weight": (kvd, D),
                p + "self_attn.v_proj.weight": (kvd, D),
                p + "self_attn.o_proj.weight": (D, qd),
                p + "mlp.gate_proj.weight": (F, D),
                p + "mlp.up_proj.weight": (F, D),
                p + "mlp.down_proj.weight": (D, F),
                p + "input_layernorm.weight": (D,),
                p + "post_attention_layernorm.weight": (D,),
            }
        )
        if cfg.qkv_bias:
            out.update(
                {
                    p + "self_attn.q_proj.bias": (qd,),
                    p + "self_attn.k_proj.bias": (kvd,),
                    p + "self_attn.v_proj.bias": (kvd,),
                }
            )
        if cfg.o_bias:
            out[p + "self_attn.o_proj.bias"] = (D,)
        if cfg.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    return out


class _Reader:
    """Reads named tensors (checking their shapes) group by group. Each group opens the file(s) anew,
    so only that group's pages are mapped at a time: the process never holds the whole file next
    to the weights built from it."""

    ROWS_PER_CHUNK = 4096

    def __init__(self, files: dict[str, Path], expected: dict[str, tuple[int, ...]]):
        self.files, self.expected = files, expected
        for name in expected:
            if name not in files:
                where = next(iter(set(files.values())), None)
                raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint", where)

    _opened = staticmethod(_opened)

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
        for a, b in spans:
            with contextlib.nullcontext(f) if f is not None else self._opened(path) as g:
                sl = g.get_slice(name)
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

    def native(self, names: list[str], dtype: torch.dtype, device: torch.device) -> PreQuantized | None:
        """The tensors' own codes, where the file holds codes kvchat computes with (safetensors: never)."""
        return None

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

    def rows(self, names: list[str], dtype: torch.dtype, device: torch.device) -> _Rows:
        """2-D tensors stacked along rows as a row source, read a chunk at a time by whoever consumes it."""
        return _Rows(self, names, dtype, device)

    def read_transposed(self, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A [R, C] tensor straight into a [C, R] buffer, a few thousand rows at a time."""
        path = self.files[name]
        with self._opened(path) as f:
            sl = f.get_slice(name)
            self._check(path, name, sl.get_shape())
            rows, cols = sl.get_shape()
            dst = torch.empty((cols, rows), dtype=dtype, device=device)  # [C, R]
            for a in range(0, rows, self.ROWS_PER_CHUNK):
                b = min(rows, a + self.ROWS_PER_CHUNK)
                dst[:, a:b].copy_(sl[a:b].t())
            return dst


@dataclasses.dataclass
class _Rows:
    """Checkpoint matrices stacked along rows (one, or fused q/k/v and gate/up), read a chunk of rows
    at a time (at most ROWS_PER_CHUNK rows and LARGE values), each chunk in `dtype` on `device` through
    _Reader._copy_into: engine.quant.QuantLinear quantizes them chunk by chunk, so their float copy
    never exists whole."""

    reader: _Reader
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


class _GGUFReader(_Reader):
    """The _Reader interface over a GGUF file: tensors by Hugging Face name, dequantized where they must
    be, or as their own codes (`native`) where kvchat computes with them."""

    def __init__(self, model: GGUFModel, cfg: ModelConfig):
        self.model, self.cfg = model, cfg
        self.expected = _expected(cfg)
        have = model.names()
        for name, shape in self.expected.items():
            if name not in have:
                raise ModelLoadError(f"tensor {model.gguf_name(name)!r} is missing from the GGUF file", model.path)
            got = model.shape(model.tensors[have[name]])
            if got != shape:
                raise ModelLoadError(
                    f"tensor {have[name]!r} has shape {list(got)}, the metadata implies {list(shape)}", model.path
                )

    def read(self, names, dtype, device):
        return {n: self.model.read_float(n, self.cfg, dtype, device) for n in names}

    def read_cat(self, names, dtype, device):
        return torch.cat([self.model.read_float(n, self.cfg, dtype, device) for n in names])

    def read_transposed(self, name, dtype, device):
        return self.model.read_float(name, self.cfg, dtype, device).t().contiguous()

    def rows(self, names, dtype, device):
        return _GGUFRows(self, names, dtype, device)

    def native(self, names, dtype, device):
        return self.model.read_codes(names, self.cfg, dtype, device)


class _GGUFRows(_Rows):
    """GGUF matrices stacked along rows, dequantized a chunk of rows at a time (for quantizing as read)."""

    def row_chunks(self):
        step = max(1, _Reader.LARGE // math.prod(self.shape[1:]))
        offset = 0
        for name in self.names:
            rows = self.reader.expected[name][0]
            for a in range(0, rows, step):
                b = min(rows, a + step)
                yield offset + a, self.reader.model.read_float(name, self.reader.cfg, self.dtype, self.device, a, b)
            offset += rows


class _ReturnFreedMemory:
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


LINEARS = ("attn.qkv", "attn.o", "mlp.gate_up", "mlp.down")  # a block's linears, by module path


def _block_sources(cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """One block's tensors under the module's names -> the checkpoint tensors each is read from
    (several: stacked along rows, as q/k/v and gate/up are fused)."""
    p = f"model.layers.{i}."
    a = p + "self_attn."
    out = {
        "attn.qkv.weight": [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"],
        "attn.o.weight": [a + "o_proj.weight"],
        "mlp.gate_up.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
        "mlp.down.weight": [p + "mlp.down_proj.weight"],
        "attn_norm.weight": [p + "input_layernorm.weight"],
        "mlp_norm.weight": [p + "post_attention_layernorm.weight"],
    }
    if cfg.qkv_bias:
        out["attn.qkv.bias"] = [a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]
    if cfg.o_bias:
        out["attn.o.bias"] = [a + "o_proj.bias"]
    if cfg.qk_norm:
        out["attn.q_norm.weight"], out["attn.k_norm.weight"] = [a + "q_norm.weight"], [a + "k_norm.weight"]
    return out


def _block_state(reader: _Reader, sources: dict[str, list[str]], dtype, device) -> dict[str, torch.Tensor]:
    """Tensors by module name, fused ones read straight into their stacked buffers."""
    single = {mine: theirs[0] for mine, theirs in sources.items() if len(theirs) == 1}
    got = reader.read(list(single.values()), dtype, device)
    out = {mine: got[theirs] for mine, theirs in single.items()}
    out.update({mine: reader.read_cat(theirs, dtype, device) for mine, theirs in sources.items() if len(theirs) > 1})
    return out


def _load_block(
    reader: _Reader, cfg: ModelConfig, i: int, block: nn.Module, dtype, device, weights: str, group_size: int
) -> None:
    """Block i's weights into `block` (on the meta device until now). A linear whose codes the file holds
    (a GGUF's Q8_0 / Q4_0) keeps them; quantized (`weights`), each other linear is built from its rows a
    chunk at a time, so no float copy of the block exists."""
    sources = _block_sources(cfg, i)
    native = {path: reader.native(sources[path + ".weight"], dtype, device) for path in LINEARS}
    swapped = [path for path in LINEARS if native[path] is not None or weights != "none"]
    skip = {path + ".weight" for path in swapped}
    state = _block_state(reader, {k: v for k, v in sources.items() if k not in skip}, dtype, device)
    for path in swapped:
        parent, name = path.split(".")
        bias = state.pop(path + ".bias", None)
        if native[path] is not None:
            layer = QuantLinear.from_codes(native[path], bias)
        else:
            rows = reader.rows(sources[path + ".weight"], dtype, device)
            layer = QuantLinear(rows, bias, weights, group_for(rows.shape[1], group_size))
        setattr(getattr(block, parent), name, layer)
    block.load_state_dict(state, strict=not swapped, assign=True)


def _build_model(
    reader: _Reader,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    weights: str,
    group_size: int,
    kern,
    progress=None,
    activations: str = "float32",
) -> Transformer:
    """The model, streamed block by block from the files into its final form: each block is read,
    fused, cast, put on the device and given its layout before the next one is read, so the peak is
    the final weights plus about one block; quantized weights, the embedding and head included, are
    quantized a chunk of rows at a time as they are read. `kern`: kvchat's CPU kernels, or None;
    `progress(fraction)` is told after the embedding and head and after each block. `activations="int8"`:
    the quantized layers' one-row products on int8 activations where the kernels have them (model.activations
    says what runs)."""
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
    model.norm.weight = reader.read_one("model.norm.weight", dtype, device)
    steps = cfg.num_layers + 1
    progress(1 / steps)
    for i, block in enumerate(model.layers):
        _load_block(reader, cfg, i, block, dtype, device, weights, group_size)
        if weights == "none" and device.type == "cpu":
            fast_cpu_linears([block], dtype)
        progress((i + 2) / steps)
    if activations == "int8" and use_integer_activations(model):
        model.activations = "int8"
    use_int4_tiles(model)
    if kern is not None:
        use_kernels(model, kern)
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


@dataclasses.dataclass
class LoadedModel:
    """A model ready to run: the module, its config and tokenizer, and what its K/V depend on."""

    path: Path
    config: ModelConfig
    model: Transformer
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype
    fingerprint: dict[str, str]
    kernels: kernel_library.Kernels | None = None  # kvchat's CPU kernels, when decode runs on them
    file_tensors: dict | None = None  # a GGUF's tensors by file type: how many, bytes in the file, held as, bytes held
    title: str | None = None  # a name where the file's own says nothing (an Ollama blob: the model's general.name)

    @property
    def name(self) -> str:
        return self.title or self.path.name

    @property
    def parameter_count(self) -> int:
        return self.model.parameter_count()

    @property
    def quantization(self) -> str:
        return self.fingerprint["quantization"]

    @property
    def activations(self) -> str:
        """What the quantized layers' decode products multiply their codes by: float32, or int8 (integer products)."""
        return self.model.activations

    @property
    def weight_bytes(self) -> int:
        return weight_bytes(self.model)

    def kv_bytes_per_position(self, kv: str = "none") -> int:
        """Bytes one cached position takes at KV precision `kv` (none: the model dtype)."""
        return bytes_per_position(self.config, self.dtype, kv)

    @property
    def decode_kernels(self) -> str:
        """What runs the one-row products of decode: kvchat's CPU kernels, or torch (and why)."""
        if self.kernels is not None:
            tiles = max((m.tiles for m in self.model.modules() if isinstance(m, QuantLinear)), default=0)
            tiled = f"; int4 in {tiles}-row tiles" if tiles else ""
            if self.activations == "int8":
                return f"kvchat ({self.kernels.isa}; int8 activations: {self.kernels.int_isa}{tiled})"
            return f"kvchat ({self.kernels.isa}{tiled})"
        if self.device.type != "cpu":
            return f"torch ({self.device.type})"
        return kernel_library.status()

    @property
    def head_quantization(self) -> str:
        """How the output head (and embedding) is stored: "none" (the model dtype) or e.g. "int8/g32"."""
        head = self.model.lm_head
        if not isinstance(head, QuantLinear):
            return "none"
        return describe(head.mode, head.group_size, head.in_features)

    def facts(self, kv: str = "none") -> dict:
        """What the CLI's `info`, the panel and the benchmark show about the model, at KV precision `kv`."""
        c = self.config
        return {
            "path": str(self.path),
            "name": self.name,
            "architecture": c.architecture,
            "parameters": self.parameter_count,
            "dtype": dtype_name(self.dtype),
            "device": str(self.device),
            "layers": c.num_layers,
            "heads": c.num_heads,
            "kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_position_embeddings,
            "bytes_per_value": torch.empty((), dtype=self.dtype).element_size(),
            "weights": self.quantization,
            "head_weights": self.head_quantization,
            "weight_bytes": self.weight_bytes,
            "decode_kernels": self.decode_kernels,
            "activations": self.activations,
            "kv_cache": kv,
            "kv_bytes_per_position": self.kv_bytes_per_position(kv),
            "format": "gguf" if self.file_tensors is not None else "safetensors",
            "file_tensors": self.file_tensors,
        }


def load_model(
    model_dir=None,
    device: str | None = None,
    dtype: str | None = None,
    weights: str = "none",
    group_size: int = DEFAULT_GROUP_SIZE,
    progress=None,
    activations: str = "float32",
) -> LoadedModel:
    """Load a model folder or GGUF file (the bundled demo model when None); `progress(fraction, what)`
    is told how far reading the weights is (what: the file's or folder's name). `weights` = none | int8 | int4
    quantizes the block linears (quantize, then swap the module) with one scale per `group_size`
    inputs (0: one per output channel), and the embedding and output head in int8 with the same
    grouping (engine.backends.quantized.quantize_head). `activations` = float32 | int8: what the quantized
    layers' decode products multiply their codes by (int8: quantized per 32 inputs, integer dot products; an
    approximation the exact float32 path does not make, measured by `python -m engine quality`)."""
    try:
        check_activations(activations)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    if model_dir is None:
        if not (DEMO_MODEL / "config.json").is_file():
            raise ModelLoadError("no --model given and the bundled demo model is not installed", DEMO_MODEL)
        model_dir = DEMO_MODEL
    model_dir = Path(model_dir).expanduser()
    if model_dir.is_dir() and not (model_dir / "config.json").exists():
        ggufs = sorted(p for p in model_dir.glob("*.gguf") if is_gguf(p))
        if len(ggufs) == 1:  # a folder holding one GGUF file (LM Studio keeps them so)
            model_dir = ggufs[0]
        elif ggufs:
            raise ModelLoadError(f"the folder holds {len(ggufs)} GGUF files: open one of them", model_dir)
    if model_dir.is_file():
        if not is_gguf(model_dir):
            raise ModelLoadError(
                "not a model: a model is a folder (config.json, safetensors) or a GGUF file", model_dir
            )
        return _load_gguf(model_dir, device, dtype, weights, group_size, progress, activations)
    if not model_dir.is_dir():
        raise ModelLoadError("model folder or file not found", model_dir)
    cfg = load_config(model_dir)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    files = _weight_files(model_dir)
    _check_against_headers(cfg, files)
    tokenizer = Tokenizer.from_dir(model_dir, extra_stop_ids=cfg.eos_token_id)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model only {cfg.vocab_size} embeddings",
            model_dir / "tokenizer.json",
        )
    weights, quantization = _weight_mode(weights, group_size)
    kern = kernel_library.for_dtype(dt) if dev.type == "cpu" else None  # decode kernels for this dtype
    with _ReturnFreedMemory():
        model = _build_model(
            _Reader(files, _expected(cfg)),
            cfg,
            dt,
            dev,
            weights,
            group_size,
            kern,
            _told(progress, model_dir.name),
            activations,
        )
    fingerprint = _fingerprint(_header_digest(files.values()), cfg, dt, dev, quantization, tokenizer, model)
    return LoadedModel(model_dir, cfg, model, tokenizer, dev, dt, fingerprint, kern)


def _weight_mode(weights: str | None, group_size: int) -> tuple[str, str]:
    """(the weight precision asked for, its name in the facts): none, or int8/int4 checked."""
    weights = weights or "none"
    if weights == "none":
        return weights, "none"
    try:
        check_mode(weights)
    except ValueError as e:
        raise ModelLoadError(str(e)) from None
    return weights, describe(weights, group_size)


def _fingerprint(
    weights_digest: str, cfg: ModelConfig, dt, dev, quantization: str, tokenizer: Tokenizer, model: Transformer
) -> dict:
    """What cached K/V depend on: weights, dtype, quantization and the activations its products take,
    tokenizer, rotary and attention settings, device."""
    return {
        "weights": weights_digest,
        "dtype": dtype_name(dt),
        "quantization": quantization,
        "activations": model.activations,
        "tokenizer": tokenizer.digest[:16],
        "rope": repr(cfg.rope),
        "attention": f"heads={cfg.num_heads} kv_heads={cfg.num_kv_heads} d={cfg.head_dim} "
        f"window={cfg.sliding_window} qk_norm={cfg.qk_norm}",
        "device": str(dev),
    }


def _told(progress, what: str):
    """progress(fraction, what) as a one-argument callback (None stays None)."""
    return None if progress is None else (lambda fraction: progress(fraction, what))


def _load_gguf(path: Path, device, dtype, weights, group_size, progress=None, activations="float32") -> LoadedModel:
    """A GGUF file: config and tokenizer from its metadata, weights from its tensors (Q8_0 and Q4_0 as their
    own codes; other types dequantized into `dtype`; float ones quantized when `weights` asks)."""
    if progress is not None:
        progress(0.0, path.name)  # the metadata first: a large vocabulary takes seconds to read
    gm = GGUFModel(path)
    cfg = config_from_dict(gm.config_dict(), path)
    factors = gm.rope_factors()
    if factors:
        if len(factors) != cfg.head_dim // 2:
            raise ModelLoadError(f"rope_freqs.weight has {len(factors)} values, not head_dim / 2", path)
        cfg = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, factors=factors))
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    tokenizer = gm.tokenizer(stop_extra=cfg.eos_token_id)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(
            f"the vocabulary has {tokenizer.vocab_size} tokens but the model only {cfg.vocab_size} embeddings", path
        )
    weights, quantization = _weight_mode(weights, group_size)
    kern = kernel_library.for_dtype(dt) if dev.type == "cpu" else None
    with _ReturnFreedMemory():
        model = _build_model(
            _GGUFReader(gm, cfg), cfg, dt, dev, weights, group_size, kern, _told(progress, path.name), activations
        )
    file_quant = f"gguf {gm.quantization()}"
    quantization = file_quant if quantization == "none" else f"{file_quant}, rest {quantization}"
    fingerprint = _fingerprint(gm.digest(), cfg, dt, dev, quantization, tokenizer, model)
    title = (gm.meta("general.name") or "an Ollama model") if path.name.startswith("sha256-") else None
    return LoadedModel(path, cfg, model, tokenizer, dev, dt, fingerprint, kern, gm.summary(), title)
