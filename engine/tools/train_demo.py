"""Train the bundled demo model: `python -m engine.tools.train_demo --out DIR [--steps N] [--device D] [--seed S]`.

Writes a complete Hugging Face style Llama checkpoint (config, safetensors, tokenizer, chat
template, generation config, model card). Deterministic for a seed on a given thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..config import config_from_dict
from ..model import Transformer
from ..weights.hf_names import hf_state_dict
from . import demo_corpus

SPECIALS = ["<|bos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('kvchat-demo knows the roles system, user and assistant, not ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=2048,
    max_position_embeddings=2048,
)
MAX_TOKENS = 512  # longer training chats are skipped


def build_tokenizer(seed: int, vocab_size: int) -> HFTokenizer:
    """Byte-level BPE over the corpus's message texts; every digit is its own token."""
    rng = random.Random(seed + 1)
    texts = [m["content"] for _ in range(20000) for m in demo_corpus.conversation(rng, currency_questions=False)]
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def encode_chat(tok: HFTokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """ids as the chat template renders them, and a mask that is 1 on assistant tokens (content + <|end|>)."""
    ids, mask = [tok.token_to_id("<|bos|>")], [0]
    end = tok.token_to_id("<|end|>")
    for m in messages:
        body = tok.encode(m["content"], add_special_tokens=False).ids + [end]
        ids += [tok.token_to_id(f"<|{m['role']}|>")] + body
        mask += [0] + [int(m["role"] == "assistant")] * len(body)
    return ids, mask


def write_checkpoint(out: Path, model: Transformer, tok: HFTokenizer, raw_cfg: dict, card: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model)
    tensors.pop("lm_head.weight", None)  # tied to the embedding
    save_file(
        {k: v.float().contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (out / "config.json").write_text(json.dumps(raw_cfg, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|end|>",
                "pad_token": "<|pad|>",
                "model_max_length": raw_cfg["max_position_embeddings"],
                "add_bos_token": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
        + "\n"
    )
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": raw_cfg["bos_token_id"],
                "eos_token_id": [raw_cfg["eos_token_id"]],
                "pad_token_id": tok.token_to_id("<|pad|>"),
                "do_sample": False,
            },
            indent=2,
        )
        + "\n"
    )
    (out / "README.md").write_text(card)


def lr_at(step: int, steps: int, peak: float, warmup: int = 100) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine.tools.train_demo", description=__doc__)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--steps", type=int, default=2400)
    ap.add_argument("--batch", type=int, default=16, help="chats per step")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast for the matmuls")
    ap.add_argument(
        "--init",
        type=Path,
        default=None,
        help="continue from this checkpoint (its tokenizer and weights) instead of starting fresh",
    )
    ap.add_argument("--currency-weight", type=float, default=4.0, help="loss weight of currency tokens")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument(
        "--no-currency-questions", action="store_true", help="the first stage's corpus: no 'which currency?' follow-ups"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()

    tok = (
        HFTokenizer.from_file(str(args.init / "tokenizer.json"))
        if args.init
        else build_tokenizer(args.seed, SHAPE["vocab_size"])
    )
    raw_cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **SHAPE,
        "head_dim": SHAPE["hidden_size"] // SHAPE["num_attention_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": tok.token_to_id("<|bos|>"),
        "eos_token_id": tok.token_to_id("<|end|>"),
        "pad_token_id": tok.token_to_id("<|pad|>"),
        "torch_dtype": "float32",
    }
    raw_cfg["vocab_size"] = tok.get_vocab_size()
    cfg = config_from_dict(raw_cfg)
    if args.init:
        from ..weights.loading import load_model

        model = load_model(args.init, device=args.device, dtype="float32").model.requires_grad_(True).train()
        seen_before = (
            json.loads((args.init / "training.json").read_text())
            if (args.init / "training.json").is_file()
            else {"stages": []}
        )
    else:
        model = Transformer(cfg).to(args.device)
        seen_before = {"stages": []}
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.num_layers) if name.endswith(("o.weight", "down.weight")) else 0.02
                torch.nn.init.normal_(p, std=std)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    rng = random.Random(args.seed)
    pad = tok.token_to_id("<|pad|>")
    # Copying the facts is what the demo is for: digits and the word after a number weigh 4x.
    digit_ids = torch.tensor([tok.token_to_id(str(i)) for i in range(10)])
    currency_ids = torch.tensor([tok.encode(" " + c).ids[0] for c in demo_corpus.CURRENCIES])
    seen_tokens = 0
    for step in range(args.steps):
        batch = []
        while len(batch) < args.batch:
            ids, mask = encode_chat(
                tok, demo_corpus.conversation(rng, currency_questions=not args.no_currency_questions)
            )
            if len(ids) <= MAX_TOKENS:
                batch.append((ids, mask))
        width = max(len(ids) for ids, _ in batch)
        x = torch.full((len(batch), width), pad, dtype=torch.long)
        w = torch.zeros((len(batch), width))
        for i, (ids, mask) in enumerate(batch):
            x[i, : len(ids)] = torch.tensor(ids)
            w[i, : len(ids)] = torch.tensor(mask, dtype=torch.float)
        is_digit = torch.isin(x, digit_ids)
        w[:, 1:] *= 1 + 3 * (is_digit[:, 1:] | is_digit[:, :-1]).float()
        w *= torch.where(torch.isin(x, currency_ids), args.currency_weight / 4, 1.0)
        x, w = x.to(args.device), w.to(args.device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        with torch.autocast(device_type=torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(x[:, :-1])  # [B, T-1, V]
        loss_all = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
        target_w = w[:, 1:].reshape(-1)
        loss = (loss_all * target_w).sum() / target_w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        seen_tokens += int(sum(len(ids) for ids, _ in batch))
        if step % 50 == 0 or step == args.steps - 1:
            now = time.time()
            print(
                f"step {step:5d}  loss {loss.item():.4f}  lr {lr_at(step, args.steps, args.lr, args.warmup):.2e}  "
                f"{seen_tokens / (now - t0):.0f} tok/s  {now - t0:.0f}s",
                flush=True,
            )
    stages = seen_before["stages"] + [
        {
            "command": "python -m engine.tools.train_demo " + " ".join(sys.argv[1:] if argv is None else argv),
            "steps": args.steps,
            "minutes": round((time.time() - t0) / 60, 1),
        }
    ]
    minutes = sum(st["minutes"] for st in stages)
    params = model.parameter_count()
    commands = "\n".join(f"    {st['command']}    # {st['steps']} steps, {st['minutes']} min" for st in stages)
    card = MODEL_CARD.format(
        params=params,
        params_m=params / 1e6,
        minutes=minutes,
        steps=sum(st["steps"] for st in stages),
        batch=args.batch,
        command=commands,
        threads=args.threads,
        layers=cfg.num_layers,
        hidden=cfg.hidden_size,
        heads=cfg.num_heads,
        kv_heads=cfg.num_kv_heads,
        vocab=cfg.vocab_size,
        final_loss=loss.item(),
    )
    write_checkpoint(args.out, model, tok, raw_cfg, card)
    (args.out / "training.json").write_text(json.dumps({"stages": stages}, indent=2) + "\n")
    print(f"wrote {args.out} ({params} parameters) in {minutes:.1f} min")
    return 0


MODEL_CARD = """# kvchat-demo

A {params_m:.1f}M-parameter Llama-architecture chat model trained by the kvchat project so the app
works out of the box, with no download. It is a **demo**, not a general assistant.

## What it was trained on
Only synthetic travel-planning chats from `engine/demo_corpus.py` (a seeded generator in the
kvchat repository; no downloaded data): a traveller states a city, a number of nights, a group
size, a budget with its currency and what they like; the assistant answers with a short plan
that repeats those facts, answers questions about them ("What is my budget?"), follows a changed
value ("Actually, my budget is 750 yuan now."), says thanks and hello, and declines what it
cannot do (bookings, weather, poems, arithmetic).

## What it can and cannot do
- It can: plan a short trip for one of ~65 cities, copy the budget (digits are single tokens),
  currency, nights and group size into its plan, and follow an edited or updated budget, so an
  edit of an earlier message visibly changes the regenerated reply.
- It cannot: answer anything outside that script, know facts about the cities, do arithmetic,
  or handle very long chats (trained on chats of at most {max_tokens} tokens). It has no safety
  tuning; it is a toy-sized model for watching inference, not for advice.

## Size and shape
{params} parameters: {layers} layers, hidden {hidden}, {heads} query heads, {kv_heads} KV heads
(grouped-query attention), vocabulary {vocab} (byte-level BPE trained on the corpus, digits split),
tied embeddings, float32 safetensors.

## How it was made
In stages, each continuing from the one before (`--init`):

{command}

{steps} steps of {batch} chats in all, AdamW, loss on assistant tokens only (digits and the token
after a digit weighted 4x; currency words as `--currency-weight` says), on {threads} CPU threads in
{minutes:.1f} minutes; final training loss {final_loss:.3f}.
Evaluation: `python -m engine.tools.eval_demo` (figures in kvchat's engine/MODELS.md, "The bundled demo model").
""".replace("{max_tokens}", str(MAX_TOKENS))


if __name__ == "__main__":
    raise SystemExit(main())
