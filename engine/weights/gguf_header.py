"""A GGUF file's header read in one checked pass over the mapped file: its metadata (numbers as Python
scalars, numeric arrays as numpy arrays over the file, strings decoded, a long array of strings when first
read) and its tensor table, each tensor a numpy view of its bytes. The file is untrusted: every count,
length and type is walked against the file's size, and every tensor's extent checked (aligned, whole blocks
of its type, inside the file, none overlapping) before anything is allocated; a forged length is an error
at once, never a loop or an allocation. One pass, and no Python object per number of an array, is what
makes opening a file quick (engine/BENCHMARKS.md, "Opening a model file")."""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ModelLoadError

MAGIC = b"GGUF"


def is_gguf(path) -> bool:
    """A file that starts with the GGUF magic."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            return p.is_file() and f.read(4) == MAGIC
    except OSError:
        return False


# The header's value types (gguf's GGUFValueType) as struct formats (numpy reads the same); 8 is a string, 9 an array.
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
SCALAR_TYPES = {k: np.dtype(f) for k, f in SCALAR_FORMATS.items()}
SCALAR_BYTES = {k: t.itemsize for k, t in SCALAR_TYPES.items()}
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32  # where tensor data starts and each tensor's offset is a multiple of (general.alignment)
MAX_ALIGNMENT = 1 << 20
MAX_DIMS = 4  # a tensor's dimensions, at most (GGML_MAX_DIMS)
MAX_ELEMENTS = 1 << 48  # a tensor's values, at most (far past any model; its bytes are checked against the file)
# GGML's tensor types (ggml.h, as the gguf package's GGMLQuantizationType and GGML_QUANT_SIZES list them; a test
# keeps the two equal): number -> (name, values a block, bytes a block). Kept here so that opening a file does not
# import the gguf package (0.1 s); it is imported only to dequantize a type kvchat does not hold natively.
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17), 40: ("NVFP4", 64, 36), 41: ("Q1_0", 128, 18),
}  # fmt: skip
_BY_NAME = {name: (values, nbytes) for name, values, nbytes in GGML_TYPES.values()}
# The block kinds the kernels write straight into a product's buffers (kv_gguf_rows, csrc/gguf_rows.c): name ->
# (its number in kernels.h's KV_GGUF_ enum, bytes a block, values a block, values one of its scales covers). The
# geometry is GGML_TYPES'; a test holds the numbers to the C header's enum.
GGUF_ROWS = {
    name: (code, _BY_NAME[name][1], _BY_NAME[name][0], group)
    for code, (name, group) in enumerate(
        (("Q4_0", 32), ("Q4_1", 32), ("Q8_0", 32), ("Q4_K", 32), ("Q6_K", 16), ("Q5_K", 32))
    )
}


class GGMLType(int):
    """A tensor's GGML type: its number (it compares equal to gguf's GGMLQuantizationType of that number),
    with llama.cpp's name for it."""

    @property
    def name(self) -> str:
        return GGML_TYPES[int(self)][0]

    def __repr__(self) -> str:
        return f"GGMLType.{self.name}"


# how a tensor's data is viewed, by GGML type: its values where they are plain numbers, else its bytes
PLAIN_TYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64, 28: np.float64}


LAZY_STRINGS = 64  # string arrays longer than this (a vocabulary, its merges) are decoded on first read


class StringArray(Sequence):
    """An array of strings in the header, decoded on first read: a vocabulary and its merges (~100,000
    strings) are only walked while the header is read, and never decoded when the tokenizer built from
    them is read back from the cache. Its extent was checked when it was walked; text that is not UTF-8
    raises `error` (a ModelLoadError) when it is read."""

    def __init__(self, mm, at: int, count: int, error: Exception):
        self._mm, self._at, self._count, self._error, self._items = mm, at, count, error, None

    def _decoded(self) -> list[str]:
        if self._items is None:
            m, at, u64, out = self._mm, self._at, struct.Struct("<Q").unpack_from, []
            for _ in range(self._count):
                n = u64(m, at)[0]
                out.append(m[at + 8 : at + 8 + n])
                at += 8 + n
            try:
                self._items = [b.decode("utf-8") for b in out]
            except UnicodeDecodeError:
                raise self._error from None
        return self._items

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):
        return self._decoded()[i]

    def __iter__(self):
        return iter(self._decoded())


@dataclass
class Tensor:
    """One tensor of the table: `dims` innermost first, as the file lists them; `data` a read-only view of
    the mapped file, [outer dims..., values] for plain types and [outer dims..., bytes] for block types."""

    name: str
    dims: tuple[int, ...]
    tensor_type: GGMLType
    data_offset: int  # from the start of the file
    n_bytes: int
    n_elements: int
    data: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """Outer dimension first (the order torch and Hugging Face use)."""
        return tuple(reversed(self.dims))


@dataclass
class Header:
    fields: dict  # key -> value
    metadata_end: int  # where the metadata ends (the tensor table follows)
    tensors: list[Tensor]
    mm: mmap.mmap  # the mapped file the views read (madvise drops pages once a tensor is read)


def read_header(path: Path) -> Header:
    """The file's metadata and tensor table, every length checked against the file's size first: gguf's own
    reader takes each array element by element and reads past the end as empty ones, so a 100-byte file
    claiming 2^62 values loops, and grows, without end."""

    def bad(what: str):
        return ModelLoadError(f"not a readable GGUF file: {what}", path)

    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    size = len(m)
    u64 = struct.Struct("<Q").unpack_from

    def need(at: int, n: int, what: str) -> None:
        if n < 0 or at + n > size:
            raise bad(f"{what} runs past the end of the file (truncated, or a forged length)")

    def string(at: int, what: str) -> tuple[str, int]:
        need(at, 8, what)
        n = u64(m, at)[0]
        need(at + 8, n, what)
        try:
            return m[at + 8 : at + 8 + n].decode("utf-8"), at + 8 + n
        except UnicodeDecodeError:
            raise bad(f"{what} is not UTF-8 text") from None

    def strings(at: int, count: int, what: str) -> tuple[list[str] | StringArray, int]:
        need(at, count * 8, what)  # each string is at least its length
        first = at
        for _ in range(count):  # only walked: a long array is decoded when it is first read
            at += 8 + u64(m, at)[0]
            if at > size:
                raise bad(f"{what} runs past the end of the file (truncated, or a forged length)")
        array = StringArray(m, first, count, bad(f"{what} holds text that is not UTF-8"))
        return (array if count > LAZY_STRINGS else list(array)), at

    def value(at: int, kind: int, what: str):
        if kind in SCALAR_TYPES:
            need(at, SCALAR_BYTES[kind], what)
            return struct.unpack_from(SCALAR_FORMATS[kind], m, at)[0], at + SCALAR_BYTES[kind]
        if kind == STRING:
            return string(at, what)
        if kind == ARRAY:
            need(at, 12, what)
            item, count = struct.unpack_from("<IQ", m, at)
            at += 12
            if item in SCALAR_TYPES:
                need(at, count * SCALAR_BYTES[item], what)
                return np.frombuffer(m, SCALAR_TYPES[item], count, at), at + count * SCALAR_BYTES[item]
            if item == STRING:
                return strings(at, count, what)
            raise bad(f"{what} is an array of value type {item}, which kvchat does not read")
        raise bad(f"{what} has an unknown value type {kind}")

    need(0, 24, "the header")
    if m[:4] != MAGIC:
        raise bad("it does not start with the GGUF magic")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
    if version not in (2, 3):
        raise bad(f"GGUF version {version} (kvchat reads versions 2 and 3)")
    at = 24
    if at + n_kv * 12 > size:  # each entry is at least a key's length and a type
        raise bad(f"the header claims {n_kv:,} metadata entries, more than the file could hold")
    fields = {}
    for i in range(n_kv):
        key, at = string(at, f"metadata entry {i}'s key")
        need(at, 4, f"metadata {key!r}")
        fields[key], at = value(at + 4, struct.unpack_from("<I", m, at)[0], f"metadata {key!r}")
    metadata_end = at
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not (isinstance(alignment, int) and 0 < alignment <= MAX_ALIGNMENT and alignment & (alignment - 1) == 0):
        raise bad(f"general.alignment is not a power of two up to {MAX_ALIGNMENT:,}")
    if at + n_tensors * 24 > size:  # each is at least a name's length, a dimension, a type and an offset
        raise bad(f"the header claims {n_tensors:,} tensors, more than the file could hold")
    infos = []
    for i in range(n_tensors):
        name, end = string(at, f"tensor {i}'s name")
        need(end, 4, f"tensor {name!r}")
        n_dims = struct.unpack_from("<I", m, end)[0]
        if not 1 <= n_dims <= MAX_DIMS:
            raise bad(f"tensor {name!r} has {n_dims:,} dimensions (at most {MAX_DIMS})")
        need(end + 4, 8 * n_dims + 12, f"tensor {name!r}")
        dims = struct.unpack_from(f"<{n_dims}Q", m, end + 4)
        if math.prod(dims) > MAX_ELEMENTS:
            raise bad(f"tensor {name!r} claims {' × '.join(f'{d:,}' for d in dims)} values")
        infos.append((name, dims, *struct.unpack_from("<IQ", m, end + 4 + 8 * n_dims)))
        at = end + 4 + 8 * n_dims + 12
    start = -(-at // alignment) * alignment
    return Header(fields, metadata_end, _tensors(infos, start, alignment, m, bad), m)


def _tensors(infos: list, start: int, alignment: int, m, bad) -> list[Tensor]:
    """Each tensor's data inside the file, at an aligned offset, in whole blocks of its type, and no two
    overlapping (llama.cpp refuses the same); `start`: where the data section begins."""
    spans, out = [], []
    for name, dims, kind, offset in infos:
        if kind not in GGML_TYPES:
            raise bad(f"tensor {name!r} has type {kind}, which is not a GGML type")
        _, block, block_bytes = GGML_TYPES[kind]
        if dims[0] % block:
            raise bad(f"tensor {name!r} has rows of {dims[0]:,} values, not whole blocks of {block}")
        if offset % alignment:
            raise bad(f"tensor {name!r} starts at offset {offset:,}, not a multiple of the alignment {alignment}")
        n = math.prod(dims) // block * block_bytes
        if start + offset + n > len(m):
            raise bad(f"the data of tensor {name!r} runs past the end of the file (truncated, or a forged offset)")
        spans.append((offset, offset + n, name))
        outer = tuple(reversed(dims[1:]))
        if kind in PLAIN_TYPES:
            data = np.frombuffer(m, PLAIN_TYPES[kind], math.prod(dims), start + offset).reshape(*outer, dims[0])
        else:
            data = np.frombuffer(m, np.uint8, n, start + offset).reshape(*outer, dims[0] // block * block_bytes)
        out.append(Tensor(name, dims, GGMLType(kind), start + offset, n, math.prod(dims), data))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise bad(f"tensors {a!r} and {b!r} overlap in the file")
    return out
