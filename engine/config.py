"""Model configuration, read from a checkpoint's config.json (transformers 4.x and 5.x styles).

One dataclass covers every family kvchat runs: the Llama shape, and the fields by which Gemma, Phi-3, SmolLM3,
Granite, OLMo 2, the mixtures of experts, gpt-oss, DeepSeek and the hybrids (LFM2, Granite 4.0-H, Qwen3-Next) depart
from it
(engine/MODELS.md, "Model families"); each family's rules are engine.family_fields', the rotary settings
engine.rope_config's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .errors import ModelLoadError
from .family_fields import expert_count, family_fields, lfm2_width, whole
from .rope_config import RopeConfig, exact, rope_from, rope_params
from .text_configs import text_config_of

# Architecture name in config.json -> family. The families differ only in the fields below.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # 4B and larger: its text model, beside its vision tower
    "Idefics3ForConditionalGeneration": "llama",  # SmolVLM: a Llama text model beside a SigLIP tower
    "SmolVLMForConditionalGeneration": "llama",
    "Qwen2_5_VLForConditionalGeneration": "qwen2",  # a Qwen2 text model with multimodal rotary positions (mrope)
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
    "GraniteForCausalLM": "granite",
    "Olmo2ForCausalLM": "olmo2",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Lfm2ForCausalLM": "lfm2",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "Qwen3NextForCausalLM": "qwen3_next",
}
TIED = ("gemma2", "gemma3", "lfm2")  # families whose head is the embedding unless config.json says otherwise
MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")  # multi-head latent attention (engine.latent_attention)
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", *MLA_FAMILIES)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}  # config name -> ours


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
    sliding_window: int | None = None  # W: a sliding layer attends to at most this many positions back
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    # --- where other families depart from the Llama shape (the defaults are Llama's) ---
    layer_types: tuple[str, ...] = ()  # "sliding" | "full" per layer; () with a window: every layer slides (Mistral)
    rope_local: RopeConfig | None = None  # the sliding layers' own rotary settings (Gemma 3)
    rope_layers: tuple[bool, ...] = ()  # per layer, whether it rotates q and k; () all do (SmolLM3 skips some)
    hidden_act: str = "silu"  # silu | gelu_tanh (Gemma's GeGLU)
    norm_offset: float = 0.0  # Gemma's norms scale by (1 + w)
    norm_placement: str = "pre"  # pre (Llama) | sandwich (Gemma: also after attention and MLP) | post (OLMo 2)
    qk_norm_span: str = "head"  # QK norm over each head (Qwen3, Gemma 3) | "all" heads at once (OLMo 2)
    embed_scale: float = 1.0  # the embedding multiplied by it (Gemma: √D, Granite: embedding_multiplier)
    residual_scale: float = 1.0  # each block's outputs multiplied by it before the residual add (Granite)
    attention_scale: float | None = None  # the scores' factor; None: 1/√d (Gemma: query_pre_attn_scalar^-½)
    attn_softcap: float | None = None  # scores → c·tanh(scores / c) (Gemma 2)
    final_softcap: float | None = None  # logits → c·tanh(logits / c) (Gemma 2)
    logits_scale: float = 1.0  # the logits divided by it (Granite's logits_scaling)
    num_experts: int = 0  # E, routed experts per MoE layer (0: dense)
    experts_per_token: int = 0  # k, the experts each position is routed to
    moe_intermediate_size: int = 0  # F of one expert
    norm_topk_prob: bool = True  # the k routing weights renormalised to sum to 1
    moe_layers: tuple[bool, ...] = ()  # per layer, whether its MLP is the mixture; () every layer when E > 0
    # --- gpt-oss ---
    sinks: bool = False  # a learned logit per query head joins each softmax's denominator (attention sinks)
    router_bias: bool = False  # the router's linear has a bias
    router_topk_first: bool = False  # the k highest router logits, then a softmax over those k
    expert_bias: bool = False  # each expert's gate/up and down have biases
    swiglu_limit: float | None = None  # the clamped SwiGLU: (clamp(up, ±l) + 1) · g·σ(α·g), g = min(gate, l)
    swiglu_alpha: float = 1.702  # α of that SwiGLU
    # --- DeepSeek: multi-head latent attention (MLA; head_dim is then the rotary width d_r) and its router ---
    kv_lora_rank: int = 0  # d_c, the latent a position caches (0: not MLA)
    q_lora_rank: int = 0  # the queries' own low-rank step (0: one projection D -> H·(d_n + d_r))
    qk_nope_head_dim: int = 0  # d_n, each head's unrotated part of q and k
    v_head_dim: int = 0  # d_v, each head's value width
    rope_interleave: bool = False  # rotary pairs adjacent (x0, x1), (x2, x3) as DeepSeek lays them out
    shared_experts: int = 0  # experts every position goes through beside its k routed ones (one MLP k times wide)
    router_scoring: str = "softmax"  # softmax | sigmoid (DeepSeek-V3): each expert's score from its logit
    router_groups: int = 0  # n_group: the experts in groups, a position's k chosen from its best topk_group groups
    router_topk_groups: int = 0
    router_choice_bias: bool = False  # a bias on the scores the choice reads, not the weights (V3's correction)
    routed_scaling: float = 1.0  # the routed experts' weights multiplied by it
    shared_mlp: int = 0  # the width of an MLP every position goes through beside its experts (Granite 4.0-H)
    # --- hybrids: layers that keep a state in place of K/V (engine.state_cache) ---
    conv_layers: tuple[bool, ...] = ()  # per layer, whether it is a short convolution (LFM2) in place of attention
    conv_kernel: int = 0  # K, the convolution's width (LFM2's conv_L_cache)
    conv_bias: bool = False
    mamba_layers: tuple[bool, ...] = ()  # per layer, whether it is a Mamba-2 mixer (Granite 4.0-H) in its place
    mamba_heads: int = 0  # H_m, the scan's heads
    mamba_head_dim: int = 0  # P, each head's channels (H_m · P = the mixer's inner width I)
    mamba_state: int = 0  # N, the state's width per channel (d_state)
    mamba_groups: int = 1  # G_m, the groups B and C are shared by (heads H_m / G_m each)
    mamba_kernel: int = 0  # K_m, the convolution's width before the scan
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    dt_limit: tuple[float, float] = (0.0, float("inf"))  # the step Δ clamped to it (time_step_limit)
    delta_layers: tuple[bool, ...] = ()  # per layer, whether it is a gated DeltaNet (Qwen3-Next) in attention's place
    delta_k_heads: int = 0  # H_k, the DeltaNet's query and key heads
    delta_v_heads: int = 0  # H_v, its value heads (a multiple of H_k: each query/key head serves H_v / H_k)
    delta_k_dim: int = 0  # d_k, a query or key head's width (the state's rows)
    delta_v_dim: int = 0  # d_v, a value head's width (the state's columns)
    delta_kernel: int = 0  # K_δ, the convolution's width before the delta rule
    # --- Qwen3-Next's gates ---
    attn_output_gate: bool = False  # attention's output × σ(gate), each query head's rows followed by its gate's
    shared_gate: bool = False  # the shared MLP's output × σ(a linear of its input), one value a position

    @property
    def state_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it keeps a state in place of K/V (a short convolution, a Mamba-2 mixer, a gated
        DeltaNet); () none do."""
        return self.conv_layers or self.mamba_layers or self.delta_layers

    @property
    def delta_conv_width(self) -> int:
        """The channels a gated DeltaNet convolves: q and k (H_k · d_k each), then v (H_v · d_v)."""
        return 2 * self.delta_k_heads * self.delta_k_dim + self.delta_v_heads * self.delta_v_dim

    @property
    def mamba_inner(self) -> int:
        """I = H_m · P, the width the Mamba-2 mixer scans."""
        return self.mamba_heads * self.mamba_head_dim

    @property
    def mamba_conv_width(self) -> int:
        """The channels the mixer's convolution runs over: x, then B and C, I + 2 · G_m · N."""
        return self.mamba_inner + 2 * self.mamba_groups * self.mamba_state

    @property
    def shared_width(self) -> int:
        """The width of the MLP beside a mixture's routed experts (0: none): DeepSeek's shared experts as one MLP
        that many times wide, or Granite 4.0-H's shared MLP."""
        return self.moe_intermediate_size * self.shared_experts or self.shared_mlp

    @property
    def mla(self) -> bool:
        """Whether attention is multi-head latent attention: a position caches a latent, not K and V."""
        return self.kv_lora_rank > 0

    @property
    def cache_heads(self) -> int:
        """The heads a cache keeps a position's K and V for (H_kv; one for MLA)."""
        return 1 if self.mla else self.num_kv_heads

    @property
    def cache_width(self) -> int:
        """The values a cache keeps per (position, head) in each of K and V: d, or for MLA half the latent and the
        rotary key together, (d_c + d_r) / 2 (the one vector held as the cache's K and V halves)."""
        return (self.kv_lora_rank + self.head_dim) // 2 if self.mla else self.head_dim

    @property
    def plain_attention_width(self) -> int:
        """What a position's K and V take per head with plain attention (d_k + d_v): MLA's figure for comparison."""
        return self.qk_nope_head_dim + self.head_dim + self.v_head_dim if self.mla else 2 * self.head_dim

    def plain_attention_bytes(self, positions: int, bytes_per_value: int) -> int:
        """What `positions` would take with plain attention on every layer over the K/V heads (MLA's: all its heads),
        L · T · H_kv · (d_k + d_v) · b: the figure MLA's and a hybrid's caches are compared with."""
        return self.num_layers * positions * self.num_kv_heads * self.plain_attention_width * bytes_per_value

    @property
    def kv_layers(self) -> int:
        """The layers that keep K/V for every position: all of them, or a hybrid's attention layers."""
        return self.state_layers.count(False) if self.state_layers else self.num_layers

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def window(self, layer: int) -> int | None:
        """The sliding window layer `layer` attends within, None for a full-attention layer."""
        if self.sliding_window is None:
            return None
        if not self.layer_types or self.layer_types[layer] == "sliding":
            return self.sliding_window
        return None

    def rope_kind(self, layer: int) -> int | None:
        """Which rotary table layer `layer` reads: 0 the global one, 1 the sliding layers' own, None no rotation."""
        if self.rope_layers and not self.rope_layers[layer]:
            return None
        return 1 if self.rope_local is not None and self.window(layer) is not None else 0

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of routed experts."""
        return self.num_experts > 0 and (not self.moe_layers or self.moe_layers[layer])

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's window (None: full attention)."""
        return tuple(self.window(i) for i in range(self.num_layers))

    @property
    def plain(self) -> bool:
        """The Llama shape: pre-norms, SwiGLU, rotary everywhere, 1/√d, one window for every layer, no scales, caps
        or experts."""
        return self.plain_blocks and self.num_experts == 0

    @property
    def plain_blocks(self) -> bool:
        """The Llama shape's blocks, a layer's MLP possibly a mixture of experts (Qwen3-MoE, Mixtral): one window for
        every layer, no sinks, no biases or clamps in the mixture."""
        return (
            self.step_blocks
            and len(set(self.windows)) <= 1
            and self.rope.attention_factor == 1.0
            and not self.sinks
            and self.swiglu_limit is None
            and not (self.router_bias or self.expert_bias or self.router_topk_first)
        )

    @property
    def step_blocks(self) -> bool:
        """The blocks the one-call C decode step computes: the plain ones, and gpt-oss's (attention sinks, a window on
        some layers, the router's bias and its top k's softmax, biased experts with the clamped SwiGLU; yarn's
        attention factor is in the rotary tables the step is given)."""
        return (
            self.hidden_act == "silu"
            and self.norm_offset == 0.0
            and self.norm_placement == "pre"
            and self.qk_norm_span == "head"
            and self.embed_scale == 1.0
            and self.residual_scale == 1.0
            and self.attention_scale is None
            and self.attn_softcap is None
            and self.final_softcap is None
            and self.logits_scale == 1.0
            and self.rope_local is None
            and all(self.rope_layers or (True,))
            and self.rope.partial == 1.0
            and self.rope.type != "longrope"
            and not self.mla
            and not any(self.state_layers)
            and not self.shared_experts
            and not self.attn_output_gate
            and self.router_scoring == "softmax"
            and not self.router_groups
            and self.routed_scaling == 1.0
        )

    def describe_attention(self) -> str:
        """What attention computes besides its sizes, in words (part of the cache's fingerprint): windows per
        layer kind, caps, scales, unrotated layers."""
        parts = []
        windows = self.windows
        if any(w is not None for w in windows):
            sliding = sum(w is not None for w in windows)
            parts.append(
                f"window {self.sliding_window:,}"
                + ("" if sliding == self.num_layers else f" on {sliding} of {self.num_layers} layers")
            )
        if self.qk_norm:
            parts.append("QK norm" + (" over all heads" if self.qk_norm_span == "all" else ""))
        if self.attention_scale is not None:
            parts.append(f"scores ×{exact(self.attention_scale)}")
        if self.attn_softcap is not None:
            parts.append(f"scores capped at {exact(self.attn_softcap)}")
        if self.sinks:
            parts.append("attention sinks")
        if any(self.conv_layers):
            convs = sum(self.conv_layers)
            parts.append(f"{convs} of {self.num_layers} layers short convolutions (width {self.conv_kernel})")
        if any(self.mamba_layers):
            parts.append(
                f"{sum(self.mamba_layers)} of {self.num_layers} layers Mamba-2 (heads {self.mamba_heads} × "
                f"{self.mamba_head_dim}, state {self.mamba_state}, groups {self.mamba_groups}, width "
                f"{self.mamba_kernel})"
            )
        if any(self.delta_layers):
            parts.append(
                f"{sum(self.delta_layers)} of {self.num_layers} layers gated DeltaNet (key heads {self.delta_k_heads} "
                f"× {self.delta_k_dim}, value heads {self.delta_v_heads} × {self.delta_v_dim}, width "
                f"{self.delta_kernel})"
            )
        if self.attn_output_gate:
            parts.append("gated attention output")
        if self.mla:
            parts.append(
                f"latent attention (d_c {self.kv_lora_rank}, d_r {self.head_dim}, d_n {self.qk_nope_head_dim}, "
                f"d_v {self.v_head_dim}{', pairs interleaved' if self.rope_interleave else ''})"
            )
        if self.rope_layers and not all(self.rope_layers):
            parts.append(f"{self.rope_layers.count(False)} layers unrotated")
        if self.rope_local is not None:
            parts.append(f"sliding layers' rotary {self.rope_local.describe()}")
        return ", ".join(parts)


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


MAX_EXPERTS = 1024  # routed experts per layer: real mixtures have 8 to 512


def _check_counts(raw: dict, moe: bool, window) -> None:
    """Counts something is sized from, checked before anything is: a mixture's experts and experts per token,
    a sliding window, the soft caps (a value out of range is a clear error when the model is listed)."""
    if window and not whole(window, 1, MAX_SIZE):
        raise ModelLoadError(f"config.json's sliding_window is {window!r}: out of range (1 to {MAX_SIZE:,})")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        v = raw.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
            raise ModelLoadError(f"config.json's {key} is {v!r}: a soft cap is a positive number")
    if not moe:
        return
    experts = expert_count(raw)
    if not whole(experts, 1, MAX_EXPERTS):
        raise ModelLoadError(f"the model's expert count is {experts!r}: out of range (1 to {MAX_EXPERTS:,})")
    per = raw.get("num_experts_per_tok") or 0
    if not whole(per, 1, int(experts)):
        raise ModelLoadError(f"the model routes each token to {per!r} experts: out of range (1 to {int(experts)})")
    inner = raw.get("moe_intermediate_size")
    if inner is not None and not whole(inner, 1, MAX_SIZE):
        raise ModelLoadError(f"config.json's moe_intermediate_size is {inner!r}: out of range (1 to {MAX_SIZE:,})")


def config_from_dict(raw: dict, path: Path | None = None) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    raw = text_config_of(raw, arch, path)  # a model that sees images: its text model's config
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}", path
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    if raw.get("mlp_bias"):
        raise ModelLoadError("mlp_bias=true is not supported", path)
    act = raw.get("hidden_activation") or raw.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"hidden_act {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})", path)
    try:
        for key in SIZES:
            if key in raw or key in REQUIRED_SIZES:
                _check_size(raw, key)
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        mla = family in MLA_FAMILIES
        kv_heads = heads if mla else int(raw.get("num_key_value_heads") or heads)  # MLA: no K/V heads of its own
        layers = int(raw["num_hidden_layers"])
        if heads % kv_heads:
            raise ModelLoadError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        if not raw.get("head_dim") and hidden % heads and not mla:
            raise ModelLoadError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
        head_dim = int(raw["qk_rope_head_dim"]) if mla else int(raw.get("head_dim") or hidden // heads)
        eps = float(raw.get("rms_norm_eps", raw.get("norm_eps", 1e-6)))
        if not 0 < eps < 1:
            raise ModelLoadError(f"rms_norm_eps={eps} is out of range")
        if family == "qwen3_next" and "partial_rotary_factor" not in {**raw, **rope_params(raw)}:
            raw = {**raw, "partial_rotary_factor": 0.25}  # Qwen3-Next rotates a quarter of each head unless it says
        rope = rope_from(raw)
        if int(head_dim * rope.partial) % 2 or int(head_dim * rope.partial) < 2:
            raise ModelLoadError("the rotating part of a head must be even (rotary embeddings rotate pairs)")
        window = raw.get("sliding_window")
        if family in ("qwen2", "qwen3", "qwen3_moe", "smollm3"):
            window = window if raw.get("use_sliding_window") else None
        moe = family in MOE_FAMILIES or (family in ("granitemoehybrid", "qwen3_next") and bool(expert_count(raw)))
        _check_counts(raw, moe, window)
        extra = family_fields(family, raw, layers, hidden, window)
        experts = int(expert_count(raw))
        if "rope_local" in extra:  # the sliding layers' own rotary parameters (Gemma 3)
            extra["rope_local"] = rope_from(raw, extra["rope_local"])
        return ModelConfig(
            architecture=arch,
            family=family,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=_mlp_width(family, raw, moe),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            rms_norm_eps=eps,
            rope=rope,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", raw.get("tie_embedding", family in TIED))),
            qkv_bias=family == "qwen2" or bool(raw.get("attention_bias", family == "gpt_oss")),
            o_bias=family != "qwen2" and bool(raw.get("attention_bias", family == "gpt_oss")),
            qk_norm=family in ("qwen3", "qwen3_moe", "gemma3", "olmo2", "lfm2", "qwen3_next"),
            sliding_window=int(window) if window else None,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=_ids(raw.get("eos_token_id")),
            hidden_act=ACTIVATIONS[act],
            num_experts=experts if moe else 0,
            experts_per_token=int(raw.get("num_experts_per_tok") or 0) if moe else 0,
            moe_intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]) if moe else 0,
            norm_topk_prob=bool(raw.get("norm_topk_prob", family != "deepseek_v2"))
            if family in ("qwen3_moe", "qwen3_next", *MLA_FAMILIES)
            else True,
            **extra,
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json lacks the field {e.args[0]!r}", path) from None
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"config.json has a malformed field: {e}", path) from None
    except ModelLoadError as e:
        raise ModelLoadError(str(e), path) from None


def _mlp_width(family: str, raw: dict, moe: bool) -> int:
    """F, a dense layer's MLP width: LFM2's worked out from its multipliers; Granite 4.0-H's shared MLP where it has
    no experts (intermediate_size is then an expert's width)."""
    if family == "lfm2":
        return lfm2_width(raw)
    if family == "granitemoehybrid" and not moe:
        return int(raw.get("shared_intermediate_size") or raw["intermediate_size"])
    return int(raw["intermediate_size"])


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
