"""A GGUF file's header walked against the file's size before the `gguf` package reads it: every count,
length and type, and every tensor's extent (aligned, whole blocks of its type, inside the file, none
overlapping). The file is untrusted: a forged length is an error at once, never a loop or an allocation."""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

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


# The header's value types (gguf's GGUFValueType) and their sizes in bytes; 8 is a string, 9 an array.


SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32  # where tensor data starts and each tensor's offset is a multiple of (general.alignment)
MAX_ALIGNMENT = 1 << 20
MAX_DIMS = 4  # a tensor's dimensions, at most (GGML_MAX_DIMS)
MAX_ELEMENTS = 1 << 48  # a tensor's values, at most (far past any model; its bytes are checked against the file)


def check_header(path: Path) -> None:
    """Walk the header's counts and lengths against the file's size before the gguf package reads it:
    its reader takes each array element by element and reads past the end as empty ones, so a 100-byte
    file claiming 2^62 values loops, and grows, without end. Every length, count and type is checked
    here, in one pass over the header (the tensors' data is not read)."""

    def bad(what: str):
        return ModelLoadError(f"not a readable GGUF file: {what}", path)

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        size = len(m)

        def need(at: int, n: int, what: str) -> None:
            if n < 0 or at + n > size:
                raise bad(f"{what} runs past the end of the file (truncated, or a forged length)")

        def string(at: int, what: str) -> int:
            need(at, 8, what)
            n = struct.unpack_from("<Q", m, at)[0]
            need(at + 8, n, what)
            return at + 8 + n

        def value(at: int, kind: int, what: str, nested: bool = False) -> int:
            if kind in SCALAR_BYTES:
                need(at, SCALAR_BYTES[kind], what)
                return at + SCALAR_BYTES[kind]
            if kind == STRING:
                return string(at, what)
            if kind == ARRAY and not nested:
                need(at, 12, what)
                item, count = struct.unpack_from("<IQ", m, at)
                at += 12
                if item in SCALAR_BYTES:
                    need(at, count * SCALAR_BYTES[item], what)
                    return at + count * SCALAR_BYTES[item]
                if item == STRING:
                    need(at, count * 8, what)  # each string is at least its length
                    for _ in range(count):
                        at = string(at, what)
                    return at
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
        alignment = DEFAULT_ALIGNMENT
        for i in range(n_kv):
            end = string(at, f"metadata entry {i}'s key")
            key = bytes(m[at + 8 : end]).decode("utf-8", "replace")
            need(end, 4, f"metadata {key!r}")
            kind = struct.unpack_from("<I", m, end)[0]
            at = value(end + 4, kind, f"metadata {key!r}")
            if key == "general.alignment":
                alignment = int.from_bytes(m[end + 4 : at], "little") if kind in (4, 10) else 0  # uint32/uint64
        if not (0 < alignment <= MAX_ALIGNMENT and alignment & (alignment - 1) == 0):
            raise bad(f"general.alignment is not a power of two up to {MAX_ALIGNMENT:,}")
        if at + n_tensors * 24 > size:  # each is at least a name's length, a dimension, a type and an offset
            raise bad(f"the header claims {n_tensors:,} tensors, more than the file could hold")
        infos = []
        for i in range(n_tensors):
            end = string(at, f"tensor {i}'s name")
            name = bytes(m[at + 8 : end]).decode("utf-8", "replace")
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
        _check_extents(infos, -(-at // alignment) * alignment, alignment, size, bad)


def _check_extents(infos: list, start: int, alignment: int, size: int, bad) -> None:
    """Each tensor's data inside the file, at an aligned offset, in whole blocks of its type, and no two
    overlapping (llama.cpp refuses the same); `start`: where the data section begins."""
    from gguf.constants import GGML_QUANT_SIZES

    spans = []
    for name, dims, kind, offset in infos:
        if kind not in GGML_QUANT_SIZES:
            raise bad(f"tensor {name!r} has type {kind}, which is not a GGML type")
        block, block_bytes = GGML_QUANT_SIZES[kind]
        if dims[0] % block:
            raise bad(f"tensor {name!r} has rows of {dims[0]:,} values, not whole blocks of {block}")
        if offset % alignment:
            raise bad(f"tensor {name!r} starts at offset {offset:,}, not a multiple of the alignment {alignment}")
        n = math.prod(dims) // block * block_bytes
        if start + offset + n > size:
            raise bad(f"the data of tensor {name!r} runs past the end of the file (truncated, or a forged offset)")
        spans.append((offset, offset + n, name))
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise bad(f"tensors {a!r} and {b!r} overlap in the file")
