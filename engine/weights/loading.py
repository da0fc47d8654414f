"""Opening a model: a Hugging Face style folder (config.json, safetensors, tokenizer) or a GGUF file, into a
LoadedModel with its facts and the fingerprint its cached K/V are valid under."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..backends import kernels as kernel_library
from ..backends.quantized import QuantLinear
from ..backends.quantized_model import weight_bytes
from ..config import ModelConfig, config_from_dict, load_config, read_json
from ..devices import dtype_name, resolve_device, resolve_dtype
from ..errors import ModelLoadError
from ..feedforward import MoE
from ..image_prompt import ImageFormat
from ..kv_cache import bytes_per_position
from ..model import Transformer
from ..quant import DEFAULT_GROUP_SIZE, check_activations, check_mode, describe
from ..tokenizer import Tokenizer
from ..vision import VisionModel, preprocessor, vision_config
from .build import ReturnFreedMemory, build_model
from .bundled import DEMO_MODEL
from .gguf_file import NORM_PLUS_ONE, GGUFModel
from .gguf_header import is_gguf
from .gguf_reader import GGUFReader
from .hf_names import expected
from .mmproj import is_projector_file, projector_beside, read_projector
from .safetensors import Reader, check_against_headers, header_digest, text_model_names, weight_files
from .stacked_experts import resolve
from .vision_weights import load_vision


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
    vision: VisionModel | None = None  # the encoder and projector of a model that sees images (engine.vision)
    vision_note: str | None = None  # why a checkpoint with a vision tower was opened for text only

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
    def sees_images(self) -> str | None:
        """The vision side in words: its encoder and what an image takes; why not, where it was left out."""
        if self.vision is None:
            return self.vision_note
        v, n = self.vision.cfg, self.vision.parameter_count()
        size = f"{n / 1e6:,.1f} M" if n >= 100_000 else f"{n:,}"
        if v.family == "qwen2_5_vl":
            cell = v.patch_size * v.scale_factor
            return (f"{v.family}: ViT {v.num_layers} layers of {v.hidden_size}, any size in {cell}-pixel cells, "
                    f"a position a cell, {size} parameters")  # fmt: skip
        return (f"{v.family}: SigLIP {v.num_layers} layers of {v.hidden_size}, {v.image_size}-pixel "
                f"{'tiles' if v.family == 'idefics3' else 'images'} of {v.tokens_per_image} positions, "
                f"{size} parameters")  # fmt: skip

    @property
    def weight_bytes(self) -> int:
        return weight_bytes(self.model)

    @property
    def active_weight_bytes(self) -> int:
        """The weight bytes one position's decode reads: all of them for a dense model; for a mixture, k of the E
        experts in each layer (the largest k: an upper bound where the experts are held differently)."""
        return self.weight_bytes - sum(b.mlp.unread(weight_bytes) for b in self.model.layers if isinstance(b.mlp, MoE))

    def latent_facts(self) -> dict | None:
        """Multi-head latent attention's widths (the panel's formula for its cache), and what a position would take
        with plain attention over the same heads, K (d_n + d_r) and V (d_v) per head in the model dtype; None for
        a model without it."""
        c = self.config
        if not c.mla:
            return None
        size = torch.empty((), dtype=self.dtype).element_size()
        return {
            "heads": c.num_heads,
            "kv_lora_rank": c.kv_lora_rank,
            "rope_dim": c.head_dim,
            "nope_dim": c.qk_nope_head_dim,
            "value_dim": c.v_head_dim,
            "plain_bytes_per_position": c.plain_attention_bytes(1, size),
        }

    def kv_bytes_per_position(self, kv: str = "none") -> int:
        """Bytes one cached position takes at KV precision `kv` (none: the model dtype)."""
        return bytes_per_position(self.config, self.dtype, kv)

    @property
    def decode_kernels(self) -> str:
        """What runs the one-row products of decode: kvchat's CPU kernels, or torch (and why)."""
        if self.kernels is not None:
            tiled = {(m.mode, m.tiles) for m in self.model.modules() if isinstance(m, QuantLinear) and m.tiles}
            notes = "".join(f"; {mode} in {rows}-row tiles" for mode, rows in sorted(tiled, reverse=True))
            if self.model.decode_step_refused:  # the one-call step failed its load-time check
                notes += f"; layer by layer: {self.model.decode_step_refused}"
            notes += f"; {kernel_library.built(self.kernels)}"
            if self.activations == "int8":
                return f"kvchat ({self.kernels.isa}; int8 activations: {self.kernels.int_isa}{notes})"
            return f"kvchat ({self.kernels.isa}{notes})"
        if self.device.type != "cpu":
            return f"torch ({self.device.type})"
        done = self.model.dequantized_bytes
        if done:  # the file's codes no torch kernel reads, dequantized once
            return f"{kernel_library.status()}; the file's codes dequantized once for torch ({done / 2**20:,.1f} MiB)"
        return kernel_library.status()

    @property
    def weight_pages(self) -> str | None:
        """The pages the CPU weights lie on: 2 MB where engine.huge_pages moved them, else the system's (None on
        a GPU)."""
        moved = self.model.huge_page_bytes
        if self.device.type != "cpu":
            return None
        return f"2 MB ({moved / 2**20:,.0f} MiB of weights)" if moved else "the system's (none moved to 2 MB)"

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
            "latent": self.latent_facts(),
            "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_position_embeddings,
            "bytes_per_value": torch.empty((), dtype=self.dtype).element_size(),
            "weights": self.quantization,
            "head_weights": self.head_quantization,
            "weight_bytes": self.weight_bytes,
            "active_parameters": self.model.active_parameter_count(),  # what one position computes with
            "active_weight_bytes": self.active_weight_bytes,  # what one position's decode reads
            "experts": f"{c.experts_per_token} of {c.num_experts}" if c.num_experts else None,
            "attention_kinds": c.describe_attention() or None,
            "decode_kernels": self.decode_kernels,
            "weight_pages": self.weight_pages,
            "activations": self.activations,
            "images": self.sees_images,
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
    grouping (engine.backends.quantized_model.quantize_head). `activations` = float32 | int8: what the quantized
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
        # a projector file (mmproj-*.gguf) beside the model is the model's vision side, not another model
        ggufs = sorted(p for p in model_dir.glob("*.gguf") if is_gguf(p) and not is_projector_file(p))
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
    seeing = vision_config(read_json(model_dir / "config.json"), cfg.hidden_size, model_dir / "config.json")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    files = all_files = weight_files(model_dir)
    stored = text_model_names(files)  # a multimodal checkpoint: its text model's tensors, by their usual names
    if stored:
        files = {mine: files[theirs] for mine, theirs in stored.items()} | (
            {"lm_head.weight": files["lm_head.weight"]} if "lm_head.weight" in files else {}
        )
    shapes = check_against_headers(cfg, files, stored)
    derived = resolve(cfg, files, shapes.__getitem__)  # gpt-oss's stacked experts
    tokenizer = Tokenizer.from_dir(model_dir, extra_stop_ids=cfg.eos_token_id)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model only {cfg.vocab_size} embeddings",
            model_dir / "tokenizer.json",
        )
    weights, quantization = _weight_mode(weights, group_size)
    kern = kernel_library.for_dtype(dt) if dev.type == "cpu" else None  # decode kernels for this dtype
    digest = header_digest(files.values())
    with ReturnFreedMemory():
        model = build_model(
            Reader(files, expected(cfg), stored, derived),
            cfg,
            dt,
            dev,
            weights,
            group_size,
            kern,
            _told(progress, model_dir.name),
            activations,
            identity=f"{digest}:{weights}:{group_size}",
        )
    if any(part.mxfp4 for part in derived.values()):  # gpt-oss as released: its experts' own codes, kept
        held = "mxfp4" if any(getattr(m, "mode", None) == "mxfp4" for m in model.modules()) else "int8 (exact)"
        experts = f"experts the file's MXFP4, held as {held}"  # (as QuantLinear chose: engine.backends.quantized)
        quantization = experts if quantization == "none" else f"{experts}, rest {quantization}"
    fingerprint = _fingerprint(digest, cfg, dt, dev, quantization, tokenizer, model)
    vision, note = None, None
    if seeing is not None:  # a model that sees images: its encoder, and its family's image processor
        try:
            images = ImageFormat(seeing, preprocessor(model_dir), tokenizer.tok.id_to_token,
                                 read_json(model_dir / "config.json"))  # fmt: skip
            vision = load_vision(seeing, all_files, dt, dev)
            tokenizer.images = images
        except ModelLoadError as e:  # its text model still runs: opened without images, and says why
            note = f"opened for text only: {e.message}"
    return LoadedModel(model_dir, cfg, model, tokenizer, dev, dt, fingerprint, kern, vision=vision, vision_note=note)


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
        "rope": cfg.rope.describe(),
        "attention": ", ".join(
            filter(
                None,
                [
                    f"{cfg.num_heads} query heads, {cfg.num_kv_heads} KV heads of width {cfg.head_dim}",
                    cfg.describe_attention(),
                ],
            )
        ),
        "device": str(dev),
    }


def _told(progress, what: str):
    """progress(fraction, what) as a one-argument callback (None stays None)."""
    return None if progress is None else (lambda fraction: progress(fraction, what))


def _load_gguf(path: Path, device, dtype, weights, group_size, progress=None, activations="float32") -> LoadedModel:
    """A GGUF file: config and tokenizer from its metadata, weights from its tensors (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K
    and Q6_K as their own codes, engine.weights.gguf_blocks; other types dequantized into `dtype`; float ones
    quantized when `weights` asks)."""
    if progress is not None:
        progress(0.0, path.name)  # the metadata and the tokenizer first, then the weights block by block
    gm = GGUFModel(path)
    cfg = config_from_dict(gm.config_dict(), path)
    if gm.arch in NORM_PLUS_ONE:  # the file's norms already hold Gemma's 1 + w
        cfg = dataclasses.replace(cfg, norm_offset=0.0)
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
    with ReturnFreedMemory():
        model = build_model(
            GGUFReader(gm, cfg), cfg, dt, dev, weights, group_size, kern, _told(progress, path.name), activations,
            identity=f"{gm.digest()}:{weights}:{group_size}",
        )  # fmt: skip
    file_quant = f"gguf {gm.quantization()}"
    quantization = file_quant if quantization == "none" else f"{file_quant}, rest {quantization}"
    vision, note, digest = None, None, gm.digest()
    projector = projector_beside(path)
    if projector is not None:  # llama.cpp's projector file beside it: the model sees images
        try:
            vision, ids, pre = read_projector(projector, cfg.hidden_size, tokenizer.tok.token_to_id, dt, dev)
            tokenizer.images = ImageFormat(vision.cfg, pre, tokenizer.tok.id_to_token, ids)
            digest += f"+{GGUFModel(projector, check_architecture=False).digest()}"  # its images' K/V depend on it
        except ModelLoadError as e:
            vision, tokenizer.images, note = None, None, f"opened for text only: {e}"
    fingerprint = _fingerprint(digest, cfg, dt, dev, quantization, tokenizer, model)
    title = (gm.meta("general.name") or "an Ollama model") if path.name.startswith("sha256-") else None
    return LoadedModel(path, cfg, model, tokenizer, dev, dt, fingerprint, kern, gm.summary(), title=title,
                       vision=vision, vision_note=note)  # fmt: skip
