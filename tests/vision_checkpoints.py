"""Tiny random-weight checkpoints of the families that see images (Gemma 3, Idefics3 / SmolVLM), written by
transformers with their image processors' settings, and pictures to show them."""

from __future__ import annotations

import io
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from checkpoints import SPECIAL_TOKENS, TEXT
from engine.tools.bench.shapes import TINY

IMAGE_TOKENS = {
    "gemma3": ["<start_of_image>", "<image_soft_token>", "<end_of_image>"],
    "idefics3": ["<fake_token_around_image>", "<image>", "<global-img>"]
    + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)],
    "qwen2_5_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"],
}
QWEN_TEMPLATE = (  # Qwen2.5-VL's, the images' part of it
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
IDEFICS3_TEMPLATE = (  # SmolVLM's own
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def _tokenizer(family: str) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = SPECIAL_TOKENS + ["<end_of_utterance>"] + IMAGE_TOKENS[family]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False, initial_alphabet=alphabet
    )
    tok.train_from_iterator(TEXT + ["User: Assistant: \n\n"], trainer)
    return tok.to_str()


def make_vision_checkpoint(out: Path, family: str = "gemma3", seed: int = 0, split: bool = True) -> Path:
    """A tiny `family` model that sees images: 28-pixel images (Gemma 3, 4 positions each) or 28-pixel tiles
    (Idefics3, 4 positions a tile, split above 28 pixels), its chat template, tokenizer and image processor's
    settings."""
    import torch
    import transformers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok_str = _tokenizer(family)
    (out / "tokenizer.json").write_text(tok_str)
    tok = Tokenizer.from_str(tok_str)
    vocab = tok.get_vocab_size()
    sizes = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")
    text = dict(vocab_size=vocab, **{k: TINY[k] for k in sizes}, max_position_embeddings=512, rms_norm_eps=1e-6,
                bos_token_id=0, eos_token_id=1, pad_token_id=None)  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                  patch_size=7, layer_norm_eps=1e-6)  # fmt: skip
    if family == "qwen2_5_vl":  # windows of 2×2 cells, the second layer over the whole image; mrope sections 2+3+3
        text["rope_parameters"] = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
        cfg = transformers.Qwen2_5_VLConfig(
            text_config=text,
            vision_config=dict(
                depth=2,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=64,
                fullatt_block_indexes=[1],
                window_size=56,
            ),  # fmt: skip
            image_token_id=tok.token_to_id("<|image_pad|>"),
            vision_start_token_id=tok.token_to_id("<|vision_start|>"),
            vision_end_token_id=tok.token_to_id("<|vision_end|>"),
        )
        model = transformers.Qwen2_5_VLForConditionalGeneration(cfg)
        clip = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
        pre = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 40,
               "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2, "resample": 3, **clip}  # fmt: skip
        template = QWEN_TEMPLATE
    elif family == "gemma3":
        text.update(head_dim=16, query_pre_attn_scalar=16, sliding_window=6, num_hidden_layers=3,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"])  # fmt: skip
        cfg = transformers.Gemma3Config(
            text_config=transformers.Gemma3TextConfig(**text),
            vision_config=dict(vision, model_type="siglip_vision_model", vision_use_head=False),
            mm_tokens_per_image=4,
            image_token_id=tok.token_to_id("<image_soft_token>"),
            boi_token_id=tok.token_to_id("<start_of_image>"),
            eoi_token_id=tok.token_to_id("<end_of_image>"),
            tie_word_embeddings=True,
        )
        model = transformers.Gemma3ForConditionalGeneration(cfg)
        pre = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 28, "width": 28}, "resample": 2}
        template = GEMMA3_TEMPLATE
    else:
        cfg = transformers.Idefics3Config(
            text_config=dict(text, model_type="llama"),
            vision_config=vision,
            scale_factor=2,
            image_token_id=tok.token_to_id("<image>"),
            tie_word_embeddings=False,
        )
        model = transformers.Idefics3ForConditionalGeneration(cfg)
        pre = {"image_processor_type": "Idefics3ImageProcessor", "size": {"longest_edge": 56}, "resample": 1,
               "max_image_size": {"longest_edge": 28}, "do_image_splitting": split}  # fmt: skip
        template = IDEFICS3_TEMPLATE
    pre = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255} | pre
    torch.manual_seed(seed)
    with torch.no_grad():  # larger-than-default weights so logits differ visibly between tokens and images
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif "norm" in name and p.shape[0] in (TINY["hidden_size"], 16):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.1)
    model.save_pretrained(out, safe_serialization=True)
    (out / "preprocessor_config.json").write_text(json.dumps(pre))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": template}))  # fmt: skip
    (out / "generation_config.json").unlink(missing_ok=True)
    return out


def picture(width: int = 40, height: int = 30, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A picture's file bytes: smooth colour gradients and a block, different for each seed."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = rng.uniform(0, 255, 3)
    rgb = np.stack([(base[c] + x * (c + 1) * 3 + y * (3 - c) * 2) % 256 for c in range(3)], axis=-1)
    rgb[height // 3 : height // 2, width // 4 : width // 2] = rng.uniform(0, 255, 3)
    buf = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buf, format=fmt)
    return buf.getvalue()
