"""Model configuration, read from a checkpoint's config.json (transformers 4.x and 5.x styles)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

from .errors import ModelLoadError

# Architecture name in config.json -> family. The families differ only in the flags below.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    factors: tuple[float, ...] = ()  # per-frequency divisors a GGUF file carries (rope_freqs.weight)

    def describe(self) -> str:
        """The rotary settings in words, exact (the cache's fingerprint compares them, a cache-drop reason
        shows them): "θ 500,000, llama3 scaling ×32 (frequency factors 1–4, original context 8,192)"."""
        text = f"θ {_exact(self.theta)}"
        if self.type == "linear":
            text += f", linear scaling ×{_exact(self.factor)}"
        elif self.type != "default":
            text += (
                f", {self.type} scaling ×{_exact(self.factor)} (frequency factors {_exact(self.low_freq_factor)}–"
                f"{_exact(self.high_freq_factor)}, original context {self.original_max_position_embeddings:,})"
            )
        if self.factors:  # the values themselves are too many to show: their digest tells two sets apart
            digest = hashlib.sha256(repr(self.factors).encode()).hexdigest()[:8]
            text += f", {len(self.factors)} per-frequency factors from the file (digest {digest})"
        return text


def _exact(v: float) -> str:
    """A float as a person reads it and without losing a digit: 10,000 and 1,000,000.5 (17 significant
    digits hold any double)."""
    return f"{v:,.17g}"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F, width of the SwiGLU MLP
    num_layers: int  # L
    num_heads: int  # H, query heads
    num_kv_heads: int  # H_kv, key/value heads (GQA when < H)
    head_dim: int  # d
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2 always; Llama/Qwen3 with attention_bias)
    o_bias: bool = False  # bias on the output projection (Llama/Qwen3 with attention_bias)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # attend to at most this many positions back (Mistral)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _rope_from(raw: dict) -> RopeConfig:
    # transformers 5.x: "rope_parameters": {"rope_type": ..., "rope_theta": ..., ...}
    # transformers 4.x: "rope_theta": ..., "rope_scaling": {"type"|"rope_type": ..., ...} or null
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ModelLoadError(f"rope type {kind!r} is not supported (supported: default, linear, llama3)")

    def positive(key: str, value) -> float:
        """A rotary parameter: a finite number above 0 (0, negative or NaN make every position's angle garbage)."""
        try:
            x = float(value)
        except (TypeError, ValueError):
            x = math.nan
        if not (math.isfinite(x) and x > 0):
            raise ModelLoadError(f"config.json's {key} is {value!r}: it must be a finite number above 0")
        return x

    return RopeConfig(
        theta=positive("rope_theta", params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        type=kind,
        factor=positive("rope_scaling.factor", params.get("factor", 1.0)),
        low_freq_factor=positive("rope_scaling.low_freq_factor", params.get("low_freq_factor", 1.0)),
        high_freq_factor=positive("rope_scaling.high_freq_factor", params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            positive(
                "rope_scaling.original_max_position_embeddings", params.get("original_max_position_embeddings", 8192)
            )
        ),
    )


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
SIZES = (*REQUIRED_SIZES, "num_key_value_heads", "head_dim", "max_position_embeddings")
MAX_SIZE = 1 << 24  # no field of a real model comes near (checked again against the weights' headers)


def _check_size(raw: dict, key: str) -> None:
    """A size must be a whole number from 1 to MAX_SIZE: named in the error when it is not."""
    value = raw[key]
    if value is None and key not in REQUIRED_SIZES:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise ModelLoadError(f"config.json's {key} is {value!r}, not a whole number")
    if not 1 <= int(value) <= MAX_SIZE:
        raise ModelLoadError(f"config.json's {key} is {int(value):,}: out of range (1 to {MAX_SIZE:,})")


def config_from_dict(raw: dict, path: Path | None = None) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}", path
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    if raw.get("mlp_bias"):
        raise ModelLoadError("mlp_bias=true is not supported", path)
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act {raw.get('hidden_act')!r} is not supported (only silu)", path)
    try:
        for key in SIZES:
            if key in raw or key in REQUIRED_SIZES:
                _check_size(raw, key)
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ModelLoadError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        if not raw.get("head_dim") and hidden % heads:
            raise ModelLoadError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
        if int(raw.get("head_dim") or hidden // heads) % 2:
            raise ModelLoadError("the head width must be even (rotary embeddings rotate pairs)")
        eps = float(raw.get("rms_norm_eps", 1e-6))
        if not 0 < eps < 1:
            raise ModelLoadError(f"rms_norm_eps={eps} is out of range")
        window = raw.get("sliding_window")
        if family == "qwen2" or family == "qwen3":
            window = window if raw.get("use_sliding_window") else None
        return ModelConfig(
            architecture=arch,
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(raw.get("head_dim") or hidden // heads),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rms_norm_eps=eps,
            rope=_rope_from(raw),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=family != "qwen2" and bool(raw.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=int(window) if window else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=_ids(raw.get("eos_token_id")),
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks the field {e.args[0]!r}", path) from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"config.json has a malformed field: {e}", path) from None
    except ModelLoadError as e:
        raise ModelLoadError(str(e), path) from None


def read_json(path: Path, default: dict | None = None) -> dict:
    """A model folder's JSON file as a dict; `default` when it is absent (None: it is required)."""
    if not path.is_file():
        if default is not None:
            return default
        raise ModelLoadError(f"missing {path.name}", path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path.name} is not valid JSON: {e}", path) from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path.name} is not a JSON object", path)
    return raw


def load_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    return config_from_dict(read_json(path), path)
