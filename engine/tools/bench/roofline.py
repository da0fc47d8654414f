"""The physical limit of batch-1 decode: the bytes a token must read (the weights it uses once, plus the K/V of
the context) over the bandwidth measured in the same run."""

from __future__ import annotations

from pathlib import Path

# the embedding's storage per value in each row's precision (kvchat's rows report their own: embed_bytes)
EMBED_BYTES_PER_VALUE = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "F32": 4,
    "F16": 2,
    "Q8_0": 34 / 32,
    "Q4_0": 18 / 32,
}


def bytes_per_token(
    weight_bytes: int, embed_bytes: int, tied: bool, kv_bytes_per_position: int, context: float
) -> float:
    """Bytes one batch-1 decode step must read: every weight once (an untied embedding only gives one
    row, so it is not counted), plus the cached K/V of `context` positions."""
    return weight_bytes - (0 if tied else embed_bytes) + kv_bytes_per_position * context


def roofline_tok_s(bandwidth: float, per_token: float) -> float:
    return bandwidth / per_token


def gguf_tensor_bytes(path: Path) -> tuple[int, int, int]:
    """All the tensors' bytes in the file, the embedding's, and those one decode step reads: a mixture's stacked
    experts' tensors count k of E (`expert_used_count` of `expert_count`)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def number(key: str) -> int:
        field = reader.fields.get(f"{arch}.{key}")
        return int(field.parts[-1][0]) if field is not None else 0

    used, count = number("expert_used_count"), number("expert_count")
    embed = next((int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight"), 0)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    unread = sum(int(t.n_bytes) for t in reader.tensors if "_exps." in t.name) * (1 - used / count) if count else 0
    return total, embed, int(total - unread)
