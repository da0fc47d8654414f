"""Write a model folder as GGUF, so llama.cpp runs the very same weights in the benchmark.

Needs the `gguf` package (the `bench` extra). Tensor names and the q/k row permutation follow
llama.cpp's own converter: its "llama" architecture rotates adjacent pairs, Hugging Face rotates
halves, so q and k rows are interleaved; "qwen2"/"qwen3" rotate halves and are written as they are.
Quantized files (F16, Q8_0, Q4_0) come from llama.cpp's own quantizer (`quantize_gguf`).
The vocabulary is written as opaque tokens: the benchmark feeds token ids, never text.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..config import load_config
from ..errors import EngineError
from ..weights.gguf_file import KERNELS, NORM_PLUS_ONE, PERMUTED
from ..weights.gguf_names import gguf_name, pick_name

ARCHES = {  # kvchat's family -> llama.cpp's architecture (Mistral and Mixtral are "llama" files)
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "smollm3": "smollm3",
    "granite": "granite",
    "olmo2": "olmo2",
    "qwen3_moe": "qwen3moe",
    "mixtral": "llama",
    "gpt_oss": "gpt-oss",
    "lfm2": "lfm2",
    "deepseek_v2": "deepseek2",
    "deepseek_v3": "deepseek2",
    "granitemoehybrid": "granitehybrid",
    "qwen3_next": "qwen3next",
}
FTYPES = ("F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M", "Q6_K")  # quantize_gguf's


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Half-split rotary rows -> interleaved pairs, per head (llama.cpp's converter does the same)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir, out: Path, matrices: str = "F32", tokenizer: bool = False, types: dict | None = None) -> Path:
    """The checkpoint in model_dir as a GGUF at `out`: float32, or its 2-D matrices as `matrices`
    (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: gguf.quants' own quantizer; `types` overrides it per
    GGUF tensor name, raw bytes allowed as (type, bytes)). With `tokenizer`, the folder's byte-level
    BPE vocabulary, merges, special tokens and chat template are written too (what a real file has);
    without, opaque tokens."""
    import gguf

    from ..weights.safetensors import check_against_headers, opened, text_model_names, weight_files
    from ..weights.stacked_experts import ggml_mxfp4, resolve

    model_dir = Path(model_dir)
    cfg = load_config(model_dir)
    if cfg.family not in ARCHES:
        raise EngineError(f"no GGUF mapping for the {cfg.family!r} family")
    arch = "qwen2vl" if cfg.rope.sections else ARCHES[cfg.family]  # Qwen2.5-VL's text model: llama.cpp's own arch
    if cfg.rope.type not in ("default", "longrope") and (cfg.rope.type, cfg.family) not in (
        ("linear", "gemma3"), ("yarn", "gpt_oss"), ("yarn", "deepseek_v2"), ("yarn", "deepseek_v3")
    ):  # fmt: skip
        raise EngineError(f"GGUF export handles default rotary scaling only, not {cfg.rope.type!r}")
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(model_dir.name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_layers)
    w.add_feed_forward_length(cfg.moe_intermediate_size if cfg.family == "granitemoehybrid" and cfg.num_experts
                              else cfg.intermediate_size)  # fmt: skip
    w.add_head_count(cfg.num_heads)
    # latent attention as llama.cpp's converter writes it: one K/V head, the key the latent and the rotary key
    if cfg.state_layers and not cfg.delta_layers:  # a hybrid: K/V heads per layer, none on its state layers (as
        # llama.cpp's converter writes LFM2 and Granite 4.0-H; Qwen3-Next's layers go by full_attention_interval)
        w.add_head_count_kv([0 if state else cfg.num_kv_heads for state in cfg.state_layers])
        if cfg.conv_layers:
            w.add_shortconv_l_cache(cfg.conv_kernel)
    else:
        w.add_head_count_kv(1 if cfg.mla else cfg.num_kv_heads)
    w.add_key_length(cfg.kv_lora_rank + cfg.head_dim if cfg.mla else cfg.head_dim)
    w.add_value_length(cfg.kv_lora_rank if cfg.mla else cfg.head_dim)
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope.partial))
    w.add_rope_freq_base(cfg.rope.theta)
    if cfg.rope.sections:
        w.add_rope_dimension_sections([*cfg.rope.sections, 0])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    _family_metadata(w, cfg)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tokenizer:
        _write_tokenizer(w, model_dir, cfg.vocab_size)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list([f"<t{i}>" for i in range(cfg.vocab_size)])
        w.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
        w.add_token_merges(["<t 0>"])  # llama.cpp wants merges for a "gpt2" vocabulary; never used
        w.add_add_bos_token(False)

    from safetensors import safe_open

    files = weight_files(model_dir)
    stored = text_model_names(files)  # a model that sees images: its text model's tensors, by their usual names
    if stored:
        files = {mine: files[theirs] for mine, theirs in stored.items()} | (
            {"lm_head.weight": files["lm_head.weight"]} if "lm_head.weight" in files else {}
        )
    parts = resolve(cfg, files, check_against_headers(cfg, files, stored).__getitem__)  # gpt-oss: each expert's rows
    experts: dict[str, dict[int, torch.Tensor]] = {}  # a stacked experts' GGUF name -> its experts' matrices
    mxfp4: dict[str, dict[int, torch.Tensor]] = {}  # the same, where the folder holds MXFP4 codes: llama.cpp's rows
    tensors: list[tuple[str, torch.Tensor]] = []
    for name in sorted([*files, *parts], key=_order):
        gname = gguf_name(arch, name)
        if gname is None or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        gname = pick_name(gname, bool(cfg.num_experts))
        if name.endswith(("in_proj_b.weight", "in_proj_a.weight")):
            continue  # Qwen3-Next's b and a go as the checkpoint's in_proj_ba: llama.cpp's ssm_ba keeps it so
        if name in parts:
            part = parts[name]
            rows = getattr(part, "count", None) or (
                cfg.hidden_size if part.part == "down" else cfg.moe_intermediate_size
            )
            if part.mxfp4 and part.what == "weight":  # the file's own codes, as llama.cpp's converter keeps them
                stacked, j = gname.split("#")
                mxfp4.setdefault(stacked, {})[int(j)] = ggml_mxfp4(*part.codes(0, rows, opened))
                continue
            t = part.rows(0, rows, opened).float()
        else:
            with safe_open(str(files[name]), framework="pt", device="cpu") as f:
                t = f.get_tensor(stored.get(name, name)).float()
        if name.endswith(KERNELS):  # a kernel [C, 1, K] as [C, K], as llama.cpp's
            t = t.squeeze(1)
        if name.endswith(("mamba.A_log", "mamba.D")):  # [H, 1], A as −exp(A_log): llama.cpp's converter
            t = (-torch.exp(t) if name.endswith("A_log") else t)[:, None]
        elif name.endswith("linear_attn.A_log"):  # Qwen3-Next's: [H_v] as −exp(A_log)
            t = -torch.exp(t)
        elif name.endswith("mamba.norm.weight"):  # [G, I / G]
            t = t.view(cfg.mamba_groups, -1)
        if cfg.mla and name.endswith("kv_b_proj.weight"):  # as llama.cpp's converter: k_b transposed, v_b
            heads = t.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            k_b, v_b = heads.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)
            tensors += [(gname, k_b.transpose(1, 2).contiguous()), (gname.replace("attn_k_b", "attn_v_b"), v_b)]
            continue
        if arch in PERMUTED and gname.endswith(("attn_q.weight", "attn_q.bias")):
            t = _permute(t, cfg.num_heads)
        elif arch in PERMUTED and gname.endswith(("attn_k.weight", "attn_k.bias")):
            t = _permute(t, cfg.num_kv_heads)
        if arch in NORM_PLUS_ONE and gname.endswith("norm.weight") and not gname.endswith("ssm_norm.weight"):
            t = t + 1  # llama.cpp's converter stores Gemma's and Qwen3-Next's norms as 1 + w (not the DeltaNet's)
        if "#" in gname:
            stacked, j = gname.split("#")
            experts.setdefault(stacked, {})[int(j)] = t
        else:
            tensors.append((gname, t))
    tensors += [(g, torch.stack([e[j] for j in sorted(e)])) for g, e in experts.items()]  # [E, rows, cols]
    if cfg.rope.type == "longrope":  # Phi-3's factors travel as tensors
        tensors += [
            (f"rope_factors_{k}.weight", torch.tensor(getattr(cfg.rope, f"{k}_factor"))) for k in ("short", "long")
        ]
    types = dict(types or {})
    for g, e in mxfp4.items():
        types.setdefault(g, ("MXFP4", np.ascontiguousarray(torch.stack([e[j] for j in sorted(e)]).numpy())))
        tensors.append((g, None))
    for gname, t in tensors:
        kind = types.get(gname)
        if isinstance(kind, tuple):  # raw blocks made by the caller (K-quants) or kept from the folder (MXFP4)
            kind, raw = kind
            w.add_tensor(gname, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
            continue
        data = np.ascontiguousarray(t.numpy())
        # biases, the convolutions' kernels [C, K], the 1-D tensors and rows no whole number of blocks as they are
        # (llama.cpp's quantizer keeps them)
        small = data.ndim < 2 or gname.endswith((".bias", "conv1d.weight", "shortconv.conv.weight"))
        whole = matrices == "F32" or data.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[matrices]][0] == 0
        kind = kind or ("F32" if small or not whole else matrices)
        if kind == "F32":
            w.add_tensor(gname, data)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def write_mmproj(model_dir, out: Path, matrices: str = "F16") -> Path:
    """A model folder's vision tower and projector as llama.cpp's projector file (mmproj): its clip.* metadata
    and tensor names as its converter writes them (names from gguf-py's own map; Gemma 3's soft-embedding norm
    stored as 1 + w), the 2-D matrices in `matrices` (F16, F32, Q8_0)."""
    import json

    import gguf

    from ..weights.safetensors import weight_files

    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    pre = json.loads((model_dir / "preprocessor_config.json").read_text(encoding="utf-8"))
    arch = (raw.get("architectures") or [""])[0]
    kind = {"Gemma3ForConditionalGeneration": "gemma3", "Idefics3ForConditionalGeneration": "idefics3",
            "SmolVLMForConditionalGeneration": "idefics3"}.get(arch)  # fmt: skip
    if arch == "Qwen2_5_VLForConditionalGeneration":
        return _write_qwen_mmproj(model_dir, out, raw, pre, matrices)
    if kind is None:
        raise EngineError(f"no projector file for {arch!r}")
    v, text = raw["vision_config"], raw["text_config"]
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_name(model_dir.name)
    w.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    w.add_string(gguf.Keys.ClipVision.PROJECTOR_TYPE, kind)
    for key, value in ((gguf.Keys.ClipVision.IMAGE_SIZE, v["image_size"]), (gguf.Keys.ClipVision.PATCH_SIZE,
                       v["patch_size"]), (gguf.Keys.ClipVision.EMBEDDING_LENGTH, v["hidden_size"]),
                       (gguf.Keys.ClipVision.FEED_FORWARD_LENGTH, v["intermediate_size"]),
                       (gguf.Keys.ClipVision.PROJECTION_DIM, text["hidden_size"]),
                       (gguf.Keys.ClipVision.BLOCK_COUNT, v["num_hidden_layers"]),
                       (gguf.Keys.ClipVision.Attention.HEAD_COUNT, v["num_attention_heads"])):  # fmt: skip
        w.add_uint32(key, value)
    w.add_float32(gguf.Keys.ClipVision.Attention.LAYERNORM_EPS, v.get("layer_norm_eps", 1e-6))
    w.add_array(gguf.Keys.ClipVision.IMAGE_MEAN, pre.get("image_mean", [0.5] * 3))
    w.add_array(gguf.Keys.ClipVision.IMAGE_STD, pre.get("image_std", [0.5] * 3))
    w.add_bool(gguf.Keys.ClipVision.USE_GELU, True)
    side = v["image_size"] // v["patch_size"]
    if kind == "gemma3":
        scale = side // int(round(raw.get("mm_tokens_per_image", 256) ** 0.5))
    else:
        scale = raw.get("scale_factor", 2)
        w.add_uint32(gguf.Keys.ClipVision.PREPROC_IMAGE_SIZE, (pre.get("size") or {}).get("longest_edge", 4 * side))
    w.add_uint32(gguf.Keys.ClipVision.Projector.SCALE_FACTOR, scale)
    tensors: list[tuple[str, torch.Tensor]] = []
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.MMPROJ, v["num_hidden_layers"])
    from safetensors import safe_open

    files = weight_files(model_dir)
    for name in sorted(files):
        hf = name.replace("mm_input_projection_weight", "mm_input_projection.weight")
        if hf.startswith("vision_tower.") and not hf.startswith("vision_tower.vision_model."):  # transformers 5's
            hf = "vision_tower.vision_model." + hf[len("vision_tower.") :]
        if not hf.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_", "model.multi_modal",
                              "model.connector.", "model.vision_tower.")):  # fmt: skip
            continue
        gname = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise EngineError(f"no projector-file name for {name}")
        with safe_open(str(files[name]), framework="pt", device="cpu") as f:
            t = f.get_tensor(name).float()
        if gname.endswith("soft_emb_norm.weight"):
            t = t + 1  # llama.cpp's converter: Gemma's (1 + w)
        tensors.append((gname, t))
    return _written(w, tensors, matrices, out)


def _written(w, tensors, matrices: str, out: Path) -> Path:
    """A projector file's tensors added (its 2-D matrices in `matrices`, the patch and position embeddings as
    they are, as llama.cpp's converter keeps them) and the file written."""
    import gguf

    for gname, t in tensors:
        data = np.ascontiguousarray(t.numpy())
        if data.ndim == 2 and matrices != "F32" and "patch_embd" not in gname and "position_embd" not in gname:
            qtype = gguf.GGMLQuantizationType[matrices]
            w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _write_qwen_mmproj(model_dir: Path, out: Path, raw: dict, pre: dict, matrices: str) -> Path:
    """Qwen2.5-VL's projector file as llama.cpp's converter writes it: q, k and v split, the 3-D patch kernel as
    two 2-D ones (`v.patch_embd.weight`, `.weight.1`), the window pattern as `n_wa_pattern`."""
    import gguf
    from safetensors import safe_open

    from ..weights.safetensors import weight_files

    v = raw["vision_config"]
    text = raw.get("text_config") or raw
    full = v["fullatt_block_indexes"]
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_name(model_dir.name)
    w.add_bool(gguf.Keys.Clip.HAS_VISION_ENCODER, True)
    w.add_string(gguf.Keys.ClipVision.PROJECTOR_TYPE, gguf.VisionProjectorType.QWEN25VL)
    for key, value in ((gguf.Keys.ClipVision.IMAGE_SIZE, v.get("image_size", 560)),
                       (gguf.Keys.ClipVision.PATCH_SIZE, v.get("patch_size", 14)),
                       (gguf.Keys.ClipVision.EMBEDDING_LENGTH, v["hidden_size"]),
                       (gguf.Keys.ClipVision.FEED_FORWARD_LENGTH, v["intermediate_size"]),
                       (gguf.Keys.ClipVision.PROJECTION_DIM, v.get("out_hidden_size", text["hidden_size"])),
                       (gguf.Keys.ClipVision.BLOCK_COUNT, v["depth"]),
                       (gguf.Keys.ClipVision.Attention.HEAD_COUNT, v["num_heads"]),
                       (gguf.Keys.ClipVision.N_WA_PATTERN, full[0] + 1),
                       (gguf.Keys.ClipVision.WINDOW_SIZE, v.get("window_size", 112))):  # fmt: skip
        w.add_uint32(key, value)
    w.add_float32(gguf.Keys.ClipVision.Attention.LAYERNORM_EPS, 1e-6)
    w.add_array(gguf.Keys.ClipVision.IMAGE_MEAN, pre["image_mean"])
    w.add_array(gguf.Keys.ClipVision.IMAGE_STD, pre["image_std"])
    w.add_bool(gguf.Keys.ClipVision.USE_SILU, True)
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.MMPROJ, max(v["depth"], 3))
    files = weight_files(model_dir)
    tensors: list[tuple[str, torch.Tensor]] = []
    for name in sorted(files):
        hf = "visual." + name[len("model.visual.") :] if name.startswith("model.visual.") else name
        if not hf.startswith("visual."):
            continue
        with safe_open(str(files[name]), framework="pt", device="cpu") as f:
            t = f.get_tensor(name).float()
        if ".qkv." in hf:
            for part, piece in zip("qkv", t.chunk(3)):
                tensors.append((names.get_name(hf.replace("qkv", part), try_suffixes=(".weight", ".bias")), piece))
        elif hf.endswith("patch_embed.proj.weight"):  # [E, 3, 2, p, p] -> two [E, 3, p, p]
            tensors += [("v.patch_embd.weight", t[:, :, 0]), ("v.patch_embd.weight.1", t[:, :, 1])]
        else:
            tensors.append((names.get_name(hf, try_suffixes=(".weight", ".bias")), t))
    if any(gname is None for gname, _ in tensors):
        raise EngineError("a Qwen2.5-VL vision tensor has no projector-file name")
    return _written(w, tensors, matrices, out)


def _family_metadata(w, cfg) -> None:
    """The metadata by which a family departs from Llama, under the keys llama.cpp's converter writes."""
    import gguf

    if cfg.sliding_window and ARCHES[cfg.family] != "llama":  # llama.cpp's "llama" has no window (Mistral's files)
        w.add_sliding_window(cfg.sliding_window)
        if cfg.layer_types and cfg.family != "gpt_oss":  # which layers slide, one flag each (gpt-oss: every other)
            w.add_sliding_window_pattern([kind == "sliding" for kind in cfg.layer_types])
    if cfg.attn_softcap is not None:
        w.add_attn_logit_softcapping(cfg.attn_softcap)
    if cfg.final_softcap is not None:
        w.add_final_logit_softcapping(cfg.final_softcap)
    if cfg.family == "gemma3" and cfg.rope.type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope.factor)
    if cfg.family == "granitemoehybrid":
        _granite_hybrid_metadata(w, cfg)
    if cfg.family == "qwen3_next":
        _qwen3_next_metadata(w, cfg)
    if cfg.family in ("granite", "granitemoehybrid"):
        w.add_embedding_scale(cfg.embed_scale)
        w.add_residual_scale(cfg.residual_scale)
        w.add_attention_scale(cfg.attention_scale)
        w.add_logit_scale(cfg.logits_scale)
    if cfg.rope.type == "longrope":
        w.add_rope_scaling_orig_ctx_len(cfg.rope.original_max_position_embeddings)
        w.add_rope_scaling_attn_factors(cfg.rope.attention_factor)
    if cfg.rope.type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(cfg.rope.factor)
        w.add_rope_scaling_orig_ctx_len(cfg.rope.original_max_position_embeddings)
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.experts_per_token)
        if cfg.family == "gpt_oss":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if cfg.family == "qwen3_moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
            w.add_expert_weights_norm(cfg.norm_topk_prob)
    if cfg.mla:
        _deepseek_metadata(w, cfg)


def _granite_hybrid_metadata(w, cfg) -> None:
    """Granite 4.0-H's Mamba-2 widths under llama.cpp's ssm.* keys (the heads as the time-step rank), whether its
    attention rotates (the converter's flag), the experts' and the shared MLP's widths."""
    w.add_ssm_conv_kernel(cfg.mamba_kernel)
    w.add_ssm_state_size(cfg.mamba_state)
    w.add_ssm_group_count(cfg.mamba_groups)
    w.add_ssm_inner_size(cfg.mamba_inner)
    w.add_ssm_time_step_rank(cfg.mamba_heads)
    w.add_rope_scaling_finetuned(not cfg.rope_layers)
    if cfg.num_experts:
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_width)


def _qwen3_next_metadata(w, cfg) -> None:
    """Qwen3-Next's DeltaNet widths under llama.cpp's ssm.* keys (the key heads as the group count, the value heads
    as the time-step rank, d_k as the state size), where its attention layers are, the experts' widths."""
    every = cfg.delta_layers.index(False) + 1 if False in cfg.delta_layers else cfg.num_layers + 1
    if cfg.delta_layers != tuple((i + 1) % every != 0 for i in range(cfg.num_layers)):
        raise EngineError("llama.cpp's qwen3next holds attention every full_attention_interval-th layer only")
    w.add_ssm_conv_kernel(cfg.delta_kernel)
    w.add_ssm_state_size(cfg.delta_k_dim)
    w.add_ssm_group_count(cfg.delta_k_heads)
    w.add_ssm_time_step_rank(cfg.delta_v_heads)
    w.add_ssm_inner_size(cfg.delta_v_heads * cfg.delta_v_dim)
    w.add_full_attention_interval(every)
    if cfg.num_experts:
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_width)
        w.add_expert_weights_norm(cfg.norm_topk_prob)


def _deepseek_metadata(w, cfg) -> None:
    """DeepSeek's latent attention and router under llama.cpp's deepseek2 keys."""
    import gguf

    if cfg.q_lora_rank:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_kv_lora_rank(cfg.kv_lora_rank)
    w.add_key_length_mla(cfg.qk_nope_head_dim + cfg.head_dim)
    w.add_value_length_mla(cfg.v_head_dim)
    w.add_leading_dense_block_count(cfg.moe_layers.index(True) if True in cfg.moe_layers else cfg.num_layers)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_expert_shared_count(cfg.shared_experts)
    w.add_expert_weights_scale(cfg.routed_scaling)
    w.add_expert_weights_norm(cfg.norm_topk_prob)
    sigmoid = cfg.router_scoring == "sigmoid"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if cfg.router_groups:
        w.add_expert_group_count(cfg.router_groups)
        w.add_expert_group_used_count(cfg.router_topk_groups)
    if cfg.rope.type == "yarn":  # llama.cpp's 0.1 · mscale_all_dim: what the scores' scale grew by, undone
        mscale = (cfg.attention_scale * (cfg.qk_nope_head_dim + cfg.head_dim) ** 0.5) ** 0.5
        w.add_rope_scaling_yarn_log_mul((mscale - 1) / math.log(cfg.rope.factor) if cfg.rope.factor > 1 else 0.0)


def _write_tokenizer(w, model_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json as llama.cpp's converter writes it: tokens by id (control tokens
    marked), merges, BOS/EOS from tokenizer_config.json and its chat template."""
    import json

    import gguf

    tj = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tc = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab = dict(tj["model"]["vocab"])
    special = {a["content"] for a in tj.get("added_tokens", []) if a.get("special")}
    vocab.update({a["content"]: a["id"] for a in tj.get("added_tokens", [])})
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    for t, i in vocab.items():
        tokens[i] = t
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]])
    for key, add in (("bos_token", w.add_bos_token_id), ("eos_token", w.add_eos_token_id)):
        if tc.get(key) in vocab:
            add(vocab[tc[key]])
    w.add_add_bos_token(False)
    if tc.get("chat_template"):
        w.add_chat_template(tc["chat_template"])


def _split(name: str) -> tuple[int | None, str]:
    """ "model.layers.3.mlp.up_proj.weight" -> (3, "mlp.up_proj.weight"); other names -> (None, name)."""
    if name.startswith("model.layers."):
        i, rest = name[len("model.layers.") :].split(".", 1)
        return int(i), rest
    return None, name


def _order(name: str):
    """Embedding first, then the blocks in order, then the rest (as llama.cpp's converter writes them)."""
    i, rest = _split(name)
    return (1, i, rest) if i is not None else (0 if "embed" in name else 2, 0, name)


def quantize_gguf(src: Path, dst: Path, ftype: str, threads: int) -> Path:
    """llama.cpp's own quantizer (its default choices for every tensor), through llama-cpp-python."""
    import llama_cpp

    from .llamacpp import quiet

    quiet()
    if ftype not in FTYPES:
        raise EngineError(f"GGUF type {ftype!r} is not one of {', '.join(FTYPES)}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise EngineError(f"llama.cpp could not quantize {src.name} to {ftype} (code {rc})")
    return dst
