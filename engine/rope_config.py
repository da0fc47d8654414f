"""The rotary settings a checkpoint's config.json gives (transformers 4.x and 5.x forms): the frequency scaling kind
and its parameters (linear, llama3, longrope, yarn), a partial rotary, Qwen2.5-VL's sections, each checked as it is
read, and the words the cache's fingerprint compares them by."""

from __future__ import annotations

import dataclasses
import hashlib
import math

from .errors import ModelLoadError
from .rotary import yarn_mscale


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # default | linear | llama3 | longrope | yarn
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    factors: tuple[float, ...] = ()  # per-frequency divisors a GGUF file carries (rope_freqs.weight)
    short_factor: tuple[float, ...] = ()  # longrope (Phi-3): divisors up to the original context
    long_factor: tuple[float, ...] = ()  # longrope: divisors for a context past the original
    attention_factor: float = 1.0  # longrope: cos and sin scaled by it
    partial: float = 1.0  # the fraction of each head's width that rotates (Phi-4-mini: 0.75)
    sections: tuple[int, ...] = ()  # mrope (Qwen2.5-VL): the frequencies rotated by a position's t, h and w parts
    beta_fast: float = 32.0  # yarn: the ramp between kept and interpolated frequencies starts at this many turns
    beta_slow: float = 1.0  # yarn: and ends at this many
    truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions (gpt-oss: not)

    def describe(self) -> str:
        """The rotary settings in words, exact (the cache's fingerprint compares them, a cache-drop reason
        shows them): "θ 500,000, llama3 scaling ×32 (frequency factors 1–4, original context 8,192)"."""
        text = f"θ {exact(self.theta)}"
        if self.type == "linear":
            text += f", linear scaling ×{exact(self.factor)}"
        elif self.type != "default":
            text += (
                f", {self.type} scaling ×{exact(self.factor)} (frequency factors {exact(self.low_freq_factor)}–"
                f"{exact(self.high_freq_factor)}, original context {self.original_max_position_embeddings:,})"
            )
        if self.type == "yarn":
            text += (
                f", yarn ramp {exact(self.beta_slow)}–{exact(self.beta_fast)} turns"
                f"{'' if self.truncate else ' (untruncated)'}, attention factor {exact(self.attention_factor)}"
            )
        if self.type == "longrope":
            text += (
                f", longrope (original context {self.original_max_position_embeddings:,}, attention factor "
                f"{exact(self.attention_factor)})"
            )
        if self.partial != 1.0:
            text += f", rotating {exact(self.partial)} of each head"
        if self.sections:
            text += f", multimodal positions (frequencies {' + '.join(map(str, self.sections))} by t, h, w)"
        if self.factors:  # the values themselves are too many to show: their digest tells two sets apart
            digest = hashlib.sha256(repr(self.factors).encode()).hexdigest()[:8]
            text += f", {len(self.factors)} per-frequency factors from the file (digest {digest})"
        return text


def exact(v: float) -> str:
    """A float as a person reads it and without losing a digit: 10,000 and 1,000,000.5 (17 significant
    digits hold any double)."""
    return f"{v:,.17g}"


def rope_params(raw: dict, kind: str = "full_attention") -> dict:
    """The rotary parameters of one layer kind in the transformers 5.x form ("rope_parameters", itself per layer
    kind for Gemma 3) or 4.x form (rope_theta, rope_scaling or null)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and kind in params:  # per-layer-type form
        params = params[kind]
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    return params


def rope_from(raw: dict, params: dict | None = None) -> RopeConfig:
    params = rope_params(raw) if params is None else params
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    kind = "longrope" if kind == "su" else kind  # Phi-3's first files name it su
    sections = params.get("mrope_section")
    kind = "default" if kind == "mrope" else kind  # Qwen2.5-VL's 4.x files: default frequencies, split by section
    if kind not in ("default", "linear", "llama3", "longrope", "yarn"):
        raise ModelLoadError(
            f"rope type {kind!r} is not supported (supported: default, linear, llama3, longrope, yarn)"
        )

    def positive(key: str, value) -> float:
        """A rotary parameter: a finite number above 0 (0, negative or NaN make every position's angle garbage)."""
        try:
            x = float(value)
        except (TypeError, ValueError):
            x = math.nan
        if not (math.isfinite(x) and x > 0):
            raise ModelLoadError(f"config.json's {key} is {value!r}: it must be a finite number above 0")
        return x

    partial = positive(
        "partial_rotary_factor", params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1))
    )
    original = params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings", 8192))
    original = int(positive("rope_scaling.original_max_position_embeddings", original))
    extra = {}
    implied = params.get("factor") or raw.get("max_position_embeddings", original) / original  # longrope's, yarn's
    factor = positive(  # longrope's factor lives in its two lists: the scaling itself is 1
        "rope_scaling.factor", 1.0 if kind == "longrope" else implied if kind == "yarn" else params.get("factor", 1.0)
    )
    if kind == "longrope":
        attention = params.get("attention_factor")
        if attention is None:
            attention = math.sqrt(1 + math.log(implied) / math.log(original)) if implied > 1 else 1.0
        half = int(int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]) * partial) // 2
        for key in ("short_factor", "long_factor"):
            values = params.get(key)
            if not isinstance(values, list) or len(values) != half:
                raise ModelLoadError(f"config.json's longrope {key} must hold {half} numbers")
            extra[key] = tuple(positive(f"rope_scaling.{key}", v) for v in values)
        extra["attention_factor"] = positive("rope_scaling.attention_factor", attention)
    if kind == "yarn":  # transformers' _compute_yarn_parameters
        attention = params.get("attention_factor")
        if attention is None:
            mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim) if mscale and all_dim else (
                yarn_mscale(factor))  # fmt: skip
        extra.update(
            attention_factor=positive("rope_scaling.attention_factor", attention),
            beta_fast=positive("rope_scaling.beta_fast", params.get("beta_fast") or 32),
            beta_slow=positive("rope_scaling.beta_slow", params.get("beta_slow") or 1),
            truncate=bool(params.get("truncate", True)),
        )
    if sections is not None:
        half = int(int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]) * partial) // 2
        ok = isinstance(sections, list) and len(sections) == 3 and all(isinstance(v, int) and v >= 0 for v in sections)
        if not ok or sum(sections) != half:
            raise ModelLoadError(f"config.json's mrope_section must be 3 counts summing to {half}, not {sections!r}")
        extra["sections"] = tuple(sections)
    return RopeConfig(
        theta=positive("rope_theta", params.get("rope_theta", raw.get("rope_theta", 10000.0))),
        type=kind,
        factor=factor,
        low_freq_factor=positive("rope_scaling.low_freq_factor", params.get("low_freq_factor", 1.0)),
        high_freq_factor=positive("rope_scaling.high_freq_factor", params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        partial=partial,
        **extra,
    )
