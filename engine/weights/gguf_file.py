"""GGUF model files — what llama.cpp, LM Studio, Ollama, Jan and GPT4All run — read with the `gguf`
package's reader: the config from the metadata, the tokenizer from `tokenizer.ggml.*` built as a
`tokenizers` tokenizer, and the weights from their own codes.

Q8_0 and Q4_0 blocks are exactly kvchat's int8 / int4 with one scale per 32 values (Q4_0's codes run
−8..7, and −8 is kept), so those tensors keep their codes and run on the quantized kernels. Every
other type is dequantized at load into the model dtype with `gguf.quants.dequantize` (llama.cpp's
definitions), and `summary()` says which tensors and what that costs. The file is untrusted: every
tensor's extent is checked against the file's size, shapes against the metadata, and the chat
template runs in the tokenizer's sandbox.
"""

from __future__ import annotations

import hashlib
import math
import mmap
import struct
from pathlib import Path

import numpy as np
import torch

from ..errors import ModelLoadError
from ..quant import PreQuantized, pack_int5

MAGIC = b"GGUF"
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
PERMUTED = ("llama",)  # llama.cpp's converter interleaves q/k rows for these (rotate pairs, not halves)
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values

# Hugging Face tensor names -> GGUF names ("{i}": the block)
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
BLOCK_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

# How text is split before byte-level BPE, by tokenizer.ggml.pre (llama.cpp's pre-tokenizer types)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
DIGITS_FIRST = ("smollm", "starcoder", "refact", "codeshell")  # each digit its own piece, then GPT-2's split


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
NUMBER = (int, float)
KINDS = {str: "string", int: "whole number", NUMBER: "number"}  # how an error names what a key should hold
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


def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian float16 values from their bytes [..., 2k] -> float32 [..., k]."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., m] bytes -> [..., 2m] values 0..15: the low nibbles first, then the high ones (ggml's order
    within a block: value i in byte i's low nibble, value m + i in its high one)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(qh: np.ndarray, n: int) -> np.ndarray:
    """[..., n/8] bytes -> [..., n] bits, bit i of the little-endian word being value i's."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")[..., :n]


def _recentred(d: np.ndarray, m: np.ndarray, centre: int) -> np.ndarray:
    """The offset that keeps x = d · q + m when codes q are stored as q − centre (the kernels' int4 nibbles
    are −8..7, int5 codes −16..15): m + centre · d per group, rounded once from float64 to float32."""
    return (m.astype(np.float64) + centre * d.astype(np.float64)).astype(np.float32)


def _centred(codes: np.ndarray, d: np.ndarray, m: np.ndarray, centre: int) -> tuple:
    """Unsigned codes q with x = d · q + m (d, m per group) as signed codes q − centre, and their offsets."""
    return (codes.astype(np.int16) - centre).astype(np.int8), _recentred(d, m, centre)


# Each block type -> (rows [N, bytes] -> codes int8 [N, K], scales float32 [N, K/g], offsets float32 [N, K/g] or
# None), with x = s · q (+ m) exactly as llama.cpp's dequantization defines each type (gguf.quants is the test's
# reference). Block layouts are ggml's (ggml-common.h).
def _q8_0(raw):
    b = raw.reshape(raw.shape[0], -1, 34)  # d, 32 int8
    return b[..., 2:].copy().view(np.int8).reshape(len(raw), -1), _f16(b[..., :2]).reshape(len(raw), -1), None


def _q4_0(raw):
    b = raw.reshape(raw.shape[0], -1, 18)  # d, 16 bytes of nibbles: x = d · (q − 8)
    codes = _nibbles(b[..., 2:]).astype(np.int8) - 8
    return codes.reshape(len(raw), -1), _f16(b[..., :2]).reshape(len(raw), -1), None


def _q4_1(raw):
    b = raw.reshape(raw.shape[0], -1, 20)  # d, m, 16 bytes of nibbles: x = d · q + m
    d, m = _f16(b[..., 0:2])[..., 0], _f16(b[..., 2:4])[..., 0]
    codes, mins = _centred(_nibbles(b[..., 4:]), d, m, 8)
    return codes.reshape(len(raw), -1), d, mins


def _q5_0(raw):
    b = raw.reshape(raw.shape[0], -1, 22)  # d, 4 bytes of fifth bits, 16 bytes of nibbles: x = d · (q − 16)
    q = _nibbles(b[..., 6:]) | (_bits(b[..., 2:6], 32) << 4)
    return (q.astype(np.int8) - 16).reshape(len(raw), -1), _f16(b[..., :2]).reshape(len(raw), -1), None


def _q5_1(raw):
    b = raw.reshape(raw.shape[0], -1, 24)  # d, m, 4 bytes of fifth bits, 16 bytes of nibbles: x = d · q + m
    q = _nibbles(b[..., 8:]) | (_bits(b[..., 4:8], 32) << 4)
    return q.astype(np.int8).reshape(len(raw), -1), _f16(b[..., 0:2])[..., 0], _f16(b[..., 2:4])[..., 0]


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of a Q4_K/Q5_K super-block -> its 8 six-bit scales and 8 six-bit mins."""
    d, m, md = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_groups(b: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A Q4_K/Q5_K super-block's header -> each group of 32's scale d · sc and offset −dmin · mn."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [N, nb, 1]
    sc, mn = _k_scales(b[..., 4:16])
    return (d * sc).reshape(n, -1), (-(dmin * mn)).reshape(n, -1)


def _q4_k(raw):
    n = raw.shape[0]
    b = raw.reshape(n, -1, 144)  # d, dmin, 12 bytes of scales, 128 bytes: 4 × 32 bytes = 8 groups of 32 nibbles
    scales, mins = _k_groups(b, n)
    qs = b[..., 16:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
    codes, mins = _centred((qs & 0x0F).reshape(n, -1), scales, mins, 8)
    return codes, scales, mins


def _q5_k(raw):
    n = raw.shape[0]
    b = raw.reshape(n, -1, 176)  # d, dmin, 12 bytes of scales, 32 bytes of fifth bits, 128 bytes of nibbles
    scales, mins = _k_groups(b, n)
    ql = (b[..., 48:].reshape(n, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    qh = (b[..., 16:48].reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 0x01
    q = ql.reshape(n, -1, 8, 32) | (qh << 4)
    return q.astype(np.int8).reshape(n, -1), scales, mins


def _q6_k(raw):
    n = raw.shape[0]
    b = raw.reshape(n, -1, 210)  # 128 bytes low nibbles, 64 bytes of high pairs, 16 int8 scales, d
    ql = (b[..., :128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    qh = (b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 3
    q = ql.reshape(n, -1, 8, 32) | (qh.reshape(n, -1, 8, 32) << 4)
    scales = _f16(b[..., 208:210]) * b[..., 192:208].copy().view(np.int8).astype(np.float32)  # [N, nb, 16]
    return (q.astype(np.int8) - 32).reshape(n, -1), scales.reshape(n, -1), None


def _q5_blocks(raw, size: int):
    """Q5_0 (`size` 22) / Q5_1 (24) blocks as the kernels' int5 layout (each block without its float16
    scale and minimum: 4 bytes of fifth bits, 16 of nibbles, code q meaning q − 16), scales d and offsets:
    x = d · (q − 16) for Q5_0; x = d · q + m = d · (q − 16) + (m + 16 · d) for Q5_1."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, size)
    d = _f16(b[..., 0:2])[..., 0]
    if size == 22:
        return np.ascontiguousarray(b[..., 2:]).reshape(n, -1), d, None
    return np.ascontiguousarray(b[..., 4:]).reshape(n, -1), d, _recentred(d, _f16(b[..., 2:4])[..., 0], 16)


def _q5_k_int5(raw):
    """Q5_K super-blocks in the int5 layout: each group of 32's codes q (0..31) repacked as Q5_0 packs a
    block, with x = s · q + m = s · (q − 16) + (m + 16 · s)."""
    codes, scales, mins = _q5_k(raw)  # codes 0..31 [N, K], scale and offset per 32
    packed = pack_int5(torch.from_numpy(codes.astype(np.int8) - 16)).numpy()
    return packed, scales, _recentred(scales, mins, 16)


# Held as int5 codes (their own five bits) when a product is of these alone: type -> rows -> (codes in the
# int5 layout, scales, offsets or None).
INT5 = {"Q5_0": lambda raw: _q5_blocks(raw, 22), "Q5_1": lambda raw: _q5_blocks(raw, 24), "Q5_K": _q5_k_int5}
# GGUF type -> (mode its codes are held in, values per scale, decoder): computed natively by the kernels.
NATIVE = {
    "Q8_0": ("int8", 32, _q8_0),
    "Q4_0": ("int4", 32, _q4_0),
    "Q4_1": ("int4", 32, _q4_1),
    "Q5_0": ("int8", 32, _q5_0),
    "Q5_1": ("int8", 32, _q5_1),
    "Q4_K": ("int4", 32, _q4_k),
    "Q5_K": ("int8", 32, _q5_k),
    "Q6_K": ("int8", 16, _q6_k),
}


class GGUFModel:
    """One GGUF file: its metadata, its tensors by Hugging Face name, and what each is held as."""

    def __init__(self, path, check_architecture: bool = True):
        """`check_architecture`: refuse an architecture kvchat does not run (the catalog lists it instead)."""
        self.path = Path(path)
        try:
            check_header(self.path)
        except ImportError:
            raise ModelLoadError("reading GGUF files needs the gguf package (pip install gguf)", self.path) from None
        except (OSError, ValueError) as e:  # unreadable, or too small to map
            raise ModelLoadError(f"not a readable GGUF file: {e}", self.path) from None
        try:
            from gguf import GGUFReader

            self.reader = GGUFReader(str(self.path), "r")
        except ImportError:
            raise ModelLoadError("reading GGUF files needs the gguf package (pip install gguf)", self.path) from None
        except Exception as e:  # the reader raises ValueError, struct errors, numpy errors on a bad file
            raise ModelLoadError(f"not a readable GGUF file: {type(e).__name__}: {e}", self.path) from None
        size = self.path.stat().st_size
        self.tensors = {}
        for t in self.reader.tensors:
            if t.data_offset + int(t.n_bytes) > size:
                raise ModelLoadError(f"tensor {t.name!r} runs past the end of the file (truncated?)", self.path)
            self.tensors[t.name] = t
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
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise ModelLoadError(f"GGUF metadata {key!r} is unreadable: {e}", self.path) from None

    def meta_as(self, key: str, kind: type | tuple, default=None):
        """Metadata that must be of a kind (str, int, or a list of one: `[str]`): a file that stores
        something else there is a clear error naming the key, not a failure deep in the tokenizer."""
        value = self.meta(key, default)
        if value is None or value is default:
            return value
        if isinstance(kind, list):
            want = kind[0]
            ok = isinstance(value, list) and all(isinstance(v, want) and not isinstance(v, bool) for v in value)
            said = f"an array of {KINDS[want]}s"
        else:
            ok = isinstance(value, kind) and not isinstance(value, bool)
            said = f"a {KINDS[kind]}"
        if not ok:
            raise ModelLoadError(f"GGUF metadata {key!r} should be {said}", self.path)
        return value

    def _arch(self, key: str, default=None):
        return self.meta(f"{self.arch}.{key}", default)

    def config_dict(self) -> dict:
        """The model's config in config.json's terms, from the metadata (sizes checked by engine.config)."""
        heads = self._arch("attention.head_count")
        hidden = self._arch("embedding_length")
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        vocab = self._arch("vocab_size") or (len(tokens.data) if tokens is not None else None)
        head_dim = self._arch("attention.key_length") or (hidden // heads if hidden and heads else None)
        raw = {
            "architectures": [ARCHITECTURES[self.arch]],
            "model_type": self.arch,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": self._arch("feed_forward_length"),
            "num_hidden_layers": self._arch("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._arch("attention.head_count_kv", heads),
            "head_dim": head_dim,
            "max_position_embeddings": self._arch("context_length", 4096),
            "rms_norm_eps": self._arch("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self._arch("rope.freq_base", 10000.0),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors and self.arch != "qwen2",
            "bos_token_id": self.meta("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.meta("tokenizer.ggml.eos_token_id"),
            "hidden_act": "silu",
        }
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if raw[key] is None:
                raise ModelLoadError(f"the GGUF metadata lacks {key} ({self.arch}.*)", self.path)
        scaling = self._arch("rope.scaling.type")
        if scaling == "linear":
            raw["rope_scaling"] = {"type": "linear", "factor": self._arch("rope.scaling.factor", 1.0)}
        elif scaling not in (None, "none"):
            raise ModelLoadError(f"rope scaling {scaling!r} is not supported (supported: none, linear)", self.path)
        rope_dims = self._arch("rope.dimension_count")
        if rope_dims is not None and rope_dims != head_dim:
            raise ModelLoadError(f"partial rotary embeddings ({rope_dims} of {head_dim}) are not supported", self.path)
        return raw

    def rope_factors(self) -> tuple[float, ...]:
        """Per-frequency divisors from `rope_freqs.weight` (how Llama 3.1+ files carry their rope scaling)."""
        t = self.tensors.get("rope_freqs.weight")
        if t is None:
            return ()
        return tuple(float(v) for v in self._float_rows(t).reshape(-1))

    # --- the tokenizer -----------------------------------------------------------------------------
    def tokenizer(self, stop_extra=()):
        """A Tokenizer from tokenizer.ggml.*: byte-level BPE (model "gpt2") or SentencePiece-style BPE with
        scores (model "llama"), control tokens as special tokens, the file's chat template and stop ids."""
        from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

        from ..tokenizer import Tokenizer

        kind = self.meta("tokenizer.ggml.model")
        tokens = self.meta_as("tokenizer.ggml.tokens", [str])
        if not tokens:
            raise ModelLoadError("the GGUF file has no vocabulary (tokenizer.ggml.tokens)", self.path)
        types = self.meta_as("tokenizer.ggml.token_type", [int]) or [1] * len(tokens)
        if kind == "gpt2":
            spelling = _bytes_to_unicode()
            alphabet = set(spelling.values())
            vocab = {}
            for i, t in enumerate(tokens):
                vocab[t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))] = i
            merges = _known(vocab, [tuple(m.split(" ", 1)) for m in self.meta_as("tokenizer.ggml.merges", [str]) or []])
            tok = self._bpe(vocab, merges, fuse_unk=False)
            pre = self.meta("tokenizer.ggml.pre", "default")
            if pre in SPLITS:
                tok.pre_tokenizer = pre_tokenizers.Sequence(
                    [
                        pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                    ]
                )
            elif pre in DIGITS_FIRST:
                tok.pre_tokenizer = pre_tokenizers.Sequence(
                    [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
                )
            else:
                tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
            special_ok = lambda t: set(t) <= alphabet
        elif kind == "llama":
            scores = self.meta_as("tokenizer.ggml.scores", [NUMBER]) or [0.0] * len(tokens)
            vocab = {t: i for i, t in enumerate(tokens)}
            merges = self.meta_as("tokenizer.ggml.merges", [str])
            merges = (
                _known(vocab, [tuple(m.split(" ", 1)) for m in merges])
                if merges
                else _merges_from_scores(vocab, scores)
            )
            unk = self.meta("tokenizer.ggml.unknown_token_id", 0)
            unk = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
            tok = self._bpe(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
            prefix = self.meta("tokenizer.ggml.add_space_prefix", True)
            tok.normalizer = normalizers.Sequence(
                [normalizers.Prepend("\u2581")] * bool(prefix) + [normalizers.Replace(" ", "\u2581")]
            )
            strip = [decoders.Strip(" ", 1, 0)] if prefix else []
            tok.decoder = decoders.Sequence(
                [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
            )
            special_ok = lambda t: True
        else:
            raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)", self.path)
        control = [t for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL and special_ok(t)]
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
        user = [t for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED and t in vocab]
        if user:
            tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

        def token(key):
            i = self.meta(f"tokenizer.ggml.{key}")
            return (i, tokens[i]) if isinstance(i, int) and 0 <= i < len(tokens) else (None, None)

        bos_id, bos = token("bos_token_id")
        add_bos = self.meta("tokenizer.ggml.add_bos_token", kind == "llama")
        if add_bos and bos is not None:
            tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
        special = {}
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
        ):
            _, text = token(key)
            if text is not None:
                special[name] = text
        stop = {int(i) for i in stop_extra}
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            i, _ = token(key)
            if i is not None:
                stop.add(i)
        # Built: the parsed arrays (an object per token) go before the weights come.
        for key in ("tokens", "merges", "scores", "token_type"):
            self.reader.fields.pop(f"tokenizer.ggml.{key}", None)
        template = self.meta_as("tokenizer.chat_template", str)
        digest = hashlib.sha256()
        for part in (kind or "", self.meta("tokenizer.ggml.pre", "") or "", template or "", str(len(tokens))):
            digest.update(part.encode())
        digest.update(tok.to_str().encode())
        return Tokenizer(tok, special, template, stop, digest.hexdigest())

    def _bpe(self, vocab, merges, **kw):
        """A tokenizers BPE over the file's vocabulary; a vocabulary it refuses is a clear error."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models

        try:
            return HFTokenizer(models.BPE(vocab, merges, **kw))
        except Exception as e:  # the Rust side raises plain Exception
            raise ModelLoadError(f"the GGUF vocabulary cannot be built: {e}", self.path) from None

    # --- tensors -----------------------------------------------------------------------------------
    def gguf_name(self, hf: str) -> str | None:
        if hf in GLOBAL_NAMES:
            return GLOBAL_NAMES[hf]
        if hf.startswith("model.layers."):
            i, rest = hf[len("model.layers.") :].split(".", 1)
            if rest in BLOCK_NAMES:
                return f"blk.{i}.{BLOCK_NAMES[rest]}"
        return None

    def names(self) -> dict[str, str]:
        """Every Hugging Face name this file holds -> its GGUF name."""
        block = {v: k for k, v in BLOCK_NAMES.items()}
        top = {v: k for k, v in GLOBAL_NAMES.items()}
        out = {}
        for gname in self.tensors:
            if gname.startswith("blk."):
                _, i, rest = gname.split(".", 2)
                hf = f"model.layers.{i}.{block[rest]}" if rest in block else None
            else:
                hf = top.get(gname)
            if hf is not None:
                out[hf] = gname
        return out

    @staticmethod
    def shape(t) -> tuple[int, ...]:
        """A tensor's shape, outer dimension first (GGUF lists the innermost first)."""
        return tuple(int(n) for n in reversed(t.shape.tolist()))

    def file_type(self, gname: str) -> str:
        return self.tensors[gname].tensor_type.name

    def _float_rows(self, t, a: int = 0, b: int | None = None) -> np.ndarray:
        """Rows a:b of a tensor as float32 values (1-D tensors whole), through llama.cpp's definitions."""
        from gguf import GGMLQuantizationType, quants

        data = t.data if t.data.ndim == 1 else t.data[a:b]
        if t.tensor_type == GGMLQuantizationType.F32:
            return np.asarray(data, dtype=np.float32)
        if t.tensor_type == GGMLQuantizationType.F16:
            return np.asarray(data).astype(np.float32)
        try:
            return quants.dequantize(np.asarray(data), t.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(
                f"tensor {t.name!r} is stored as {t.tensor_type.name}, which kvchat cannot read yet", self.path
            ) from None

    def permutation(self, hf: str, cfg) -> np.ndarray | None:
        """The row order that undoes llama.cpp's q/k interleaving (None when the rows are as Hugging Face has them)."""
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
        t = self.tensors[gname]
        order = self.permutation(hf, cfg)
        if order is not None:  # small (q and k): whole, then reordered
            rows = self._float_rows(t)[order][a:b]
        else:
            rows = self._float_rows(t, a, b)
        self._note(gname, dtype)
        if b is None or b >= t.data.shape[0]:
            self._release(t)
        rows = np.ascontiguousarray(rows)
        if not rows.flags.writeable:  # a view of the mapped file (F32): copied, never kept
            rows = rows.copy()
        return torch.from_numpy(rows).to(device=device, dtype=dtype)

    def read_codes(self, hfs: list[str], cfg, dtype, device) -> PreQuantized | None:
        """Tensors stacked along rows as their own codes, when every one is of a type the kernels compute
        (NATIVE). Tensors of different types (a Q4_K_M file's q and k in Q4_K, v in Q6_K) share the widest
        form: int8 codes if any is int8, the smallest group (a scale repeated for a larger one), offsets
        if any has them (0 for the others): each value is the file's, only the storage widens."""
        types = [self.file_type(self.gguf_name(h)) for h in hfs]
        if not all(t in NATIVE for t in types):
            return None
        if all(t in INT5 for t in types):  # their own five bits
            mode, group = "int5", 32
            decode = INT5
        else:
            mode = "int8" if any(NATIVE[t][0] == "int8" for t in types) else "int4"
            group = min(NATIVE[t][1] for t in types)
            decode = {t: NATIVE[t][2] for t in types}
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
            held = c.size * (4 if mode == "int4" else 8) // 8 + s.size * 4 * (2 if offsets else 1)  # int5: packed
            form = f"{mode}/g{group}" + ("+min" if offsets else "")
            gname = self.gguf_name(hf)
            self.held[gname] = (ftype, form, int(self.tensors[gname].n_bytes), int(held))

        def stacked(arrays, kind):  # one tensor of the parts' rows (a single part as it is: no copy)
            whole = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
            return torch.from_numpy(np.ascontiguousarray(whole, dtype=kind)).to(device)

        codes = stacked([c for c, _, _ in parts], np.uint8 if mode == "int5" else np.int8)
        scales = stacked([s for _, s, _ in parts], np.float32)
        mins = stacked([np.zeros_like(s) if m is None else m for _, s, m in parts], np.float32) if offsets else None
        return PreQuantized(codes, scales, mode, group, dtype, mins)

    def _release(self, t) -> None:
        """Drop a tensor's pages of the mapped file once it is read: they would count in the process's
        memory, next to the weights built from them, until the whole load ends."""
        mm = getattr(self.reader.data, "_mmap", None)
        if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = t.data_offset // mmap.PAGESIZE * mmap.PAGESIZE
        try:
            mm.madvise(mmap.MADV_DONTNEED, start, t.data_offset + int(t.n_bytes) - start)
        except (OSError, ValueError):
            pass  # only memory is at stake

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

    def quantization(self) -> str:
        """The file's quantization as people name it (its most common tensor type among the matrices)."""
        counts: dict[str, int] = {}
        for t in self.tensors.values():
            if len(t.shape) > 1:
                counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(t.n_elements)
        return max(counts, key=counts.get) if counts else "F32"

    def digest(self) -> str:
        """What identifies the weights cheaply: the file's name, size and mtime and its tensor table."""
        st = self.path.stat()
        h = hashlib.sha256(f"{self.path.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        for t in self.tensors.values():
            h.update(f"{t.name}:{t.tensor_type.name}:{t.shape.tolist()}:{t.data_offset}".encode())
        return h.hexdigest()[:16]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from bytes to printable characters (how byte-level vocabularies spell every byte)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _known(vocab: dict[str, int], merges: list[tuple]) -> list[tuple[str, str]]:
    """The merges whose two parts and whose result are tokens of the vocabulary (a file may carry others:
    llama.cpp never applies them, and tokenizers refuses them)."""
    return [m for m in merges if len(m) == 2 and m[0] in vocab and m[1] in vocab and m[0] + m[1] in vocab]


def _merges_from_scores(vocab: dict[str, int], scores) -> list[tuple[str, str]]:
    """BPE merges a SentencePiece vocabulary implies: every split of a token into two tokens of the
    vocabulary, best-scored token first (as transformers derives them)."""
    merges = []
    for token, score in zip(vocab, scores):
        local = [
            (token[:k], token[k:], score) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]
