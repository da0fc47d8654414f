"""`python -m engine quality`: what a precision change does to outputs, measured, not assumed.

The quantized model (weights and/or KV cache) is compared with the full-precision one on the
same prompts and output budget: top-1 agreement and mean KL divergence over teacher-forced
positions (the full model's greedy reply fed to both), the first position where the two greedy
replies diverge, near-tie flips (positions whose full-precision top-2 margin is below a
threshold and whose top-1 changed), perplexity of both on a held-out text, and the bytes and
decode speed of both. Scales come from each group's max |x|: no calibration data is used, so
nothing is shared between calibration and evaluation.
"""

from __future__ import annotations

import json
import math
import random

import torch

from ..compare import compare, reply_logits
from ..quant import ACTIVATIONS, DEFAULT_GROUP_SIZE
from ..weights.loading import load_model

DEFAULT_PROMPTS = [
    "I am planning a trip to Chengdu for 3 nights. My budget is 600 yuan.",
    "We are going to Lisbon. There are 2 of us. Our budget is 1450 euros. We like local food.",
    "Help me plan a trip to Kyoto. I have 5 nights. My budget is 88000 yen.",
    "Hello! Who are you?",
    "Plan a trip to New York for me. Budget: 2300 dollars. I love museums. For 4 nights.",
    "Can you book the hotel for me?",
    "I want to visit Seoul. It is a solo trip. I can spend 730 won. I enjoy nightlife.",
    "What can you do?",
]


def _heldout_text(loaded, n_chats: int = 6, seed: int = 777):
    """Held-out chats (a seed the demo model never trained on): rendered with the model's chat template
    when it has one (token ids), else their plain text."""
    from . import demo_corpus

    rng = random.Random(seed)
    chats = [demo_corpus.conversation(rng) for _ in range(n_chats)]
    if loaded.tokenizer.has_chat_template:
        return [i for chat in chats for i in loaded.tokenizer.apply_chat_template(chat, add_generation_prompt=False)]
    return "\n\n".join(m["content"] for chat in chats for m in chat)


def perplexity(loaded, kv: str, text, max_tokens: int = 1024) -> float:
    """exp(mean NLL) over a held-out text (or a list of token ids), each token predicted by the path a session
    takes (decode's, one position at a time, under int8 activations)."""
    ids = (text if isinstance(text, list) else loaded.tokenizer.encode(text, add_special_tokens=True))[:max_tokens]
    out = reply_logits(loaded, kv, ids, 1)  # [T - 1, V]: predicting ids[1:]
    nll = torch.nn.functional.cross_entropy(out, torch.tensor(ids[1:], device=out.device))
    return round(math.exp(float(nll)), 4)


def prompt_agreement(full, quant, text, max_tokens: int = 512) -> dict:
    """The held-out text through one prefill of each model (prefill's many-row products: under int8 activations,
    bfloat16 ones where the CPU has them): top-1 agreement and mean KL(full || quantized) at every position."""
    ids = (text if isinstance(text, list) else full.tokenizer.encode(text, add_special_tokens=True))[:max_tokens]
    x = torch.tensor([ids], device=full.device)
    with torch.inference_mode():
        a = full.model(x).float()[0].log_softmax(-1)  # [T, V]
        b = quant.model(x).float()[0].log_softmax(-1)
    kl = (a.exp() * (a - b)).sum(-1).mean()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean()
    return {"prompt_positions": len(ids), "prompt_top1_agreement": round(float(agree), 4),
            "prompt_mean_kl": round(float(kl), 6)}  # fmt: skip


def run(
    model=None,
    weights="none",
    kv="none",
    group_size=DEFAULT_GROUP_SIZE,
    prompts=None,
    new_tokens=48,
    device=None,
    dtype=None,
    near_tie=0.5,
    random_ids=False,
    activations="float32",
) -> dict:
    full = load_model(model, device=device, dtype=dtype)
    quant = load_model(
        model, device=device, dtype=dtype, weights=weights, group_size=group_size, activations=activations
    )
    if random_ids:  # a random-weight shape: prompts and text are seeded random token ids
        g = torch.Generator().manual_seed(0)
        vocab = full.config.vocab_size
        prompts = prompts or [torch.randint(10, vocab, (64,), generator=g).tolist() for _ in range(4)]
        text = torch.randint(10, vocab, (512,), generator=g).tolist()
    else:
        prompts = prompts or DEFAULT_PROMPTS
        text = _heldout_text(full)
    result = compare(full, quant, kv, prompts, new_tokens, near_tie)
    result.update(
        model=str(full.path),
        weights=quant.quantization,
        activations=quant.activations,
        kv=kv,
        dtype=str(full.dtype).removeprefix("torch."),
        perplexity_full=perplexity(full, "none", text),
        perplexity_quant=perplexity(quant, kv, text),
        weight_bytes_full=full.weight_bytes,
        weight_bytes_quant=quant.weight_bytes,
        kv_bytes_per_position_full=full.kv_bytes_per_position("none"),
        kv_bytes_per_position_quant=quant.kv_bytes_per_position(kv),
        calibration="none (scales from each group's max |x|)",
        **prompt_agreement(full, quant, text),
    )
    return result


def add_arguments(p) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--shape", default=None, help="a random-weight shape instead of a model (smollm2-135m, ...)")
    p.add_argument("--weights", default="none", choices=["none", "int8", "int4"])
    p.add_argument("--kv", default="none", choices=["none", "int8", "int4"])
    p.add_argument(
        "--activations",
        default="float32",
        choices=ACTIVATIONS,
        help="what the quantized weights multiply (int8: integer products in decode, bfloat16 ones in prefill where "
        "the CPU has them; measured against the exact path)",
    )
    p.add_argument(
        "--group-size", type=int, default=DEFAULT_GROUP_SIZE, help="values per scale (0: one per output channel)"
    )
    p.add_argument("--prompts", default=None, help="a JSON list of prompts (strings or message lists)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--near-tie", type=float, default=0.5, help="top-2 logit margin that counts as a near tie")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", action="store_true")


def main(ns) -> int:
    prompts = None
    if ns.prompts:
        with open(ns.prompts, encoding="utf-8") as f:
            prompts = json.load(f)

    def measure(model, random_ids=False):
        return run(
            model,
            ns.weights,
            ns.kv,
            ns.group_size,
            prompts,
            ns.new_tokens,
            ns.device,
            ns.dtype,
            ns.near_tie,
            random_ids=random_ids,
            activations=ns.activations,
        )

    if ns.shape:
        import tempfile
        from pathlib import Path

        from .bench.shapes import write_random_checkpoint

        with tempfile.TemporaryDirectory(prefix="kvchat-quality-") as tmp:
            r = measure(str(write_random_checkpoint(Path(tmp) / ns.shape, ns.shape)), random_ids=True)
            r["model"] = f"random {ns.shape}"
    else:
        r = measure(ns.model)
    if ns.json:
        print(json.dumps(r, ensure_ascii=False))
        return 0
    print(
        f"model {r['model']} · {r['dtype']} · weights {r['weights']} · activations {r['activations']} · KV {r['kv']} · "
        f"calibration: {r['calibration']}"
    )
    rows = [
        ("weights bytes", r["weight_bytes_full"], r["weight_bytes_quant"]),
        ("KV bytes per position", r["kv_bytes_per_position_full"], r["kv_bytes_per_position_quant"]),
        ("perplexity (held-out text)", r["perplexity_full"], r["perplexity_quant"]),
        ("decode tok/s", r["decode_tok_s_full"], r["decode_tok_s_quant"]),
    ]
    print(f"{'':28s} {'full':>14s} {'quantized':>14s}")
    for name, a, b in rows:
        print(f"{name:28s} {a!s:>14s} {b!s:>14s}")
    print(f"top-1 agreement over {r['positions']} teacher-forced positions: {100 * r['top1_agreement']:.1f}%")
    print(f"mean KL(full || quantized): {r['mean_kl']:.5f} nats")
    print(
        f"a prompt's {r['prompt_positions']} positions through prefill: top-1 agreement "
        f"{100 * r['prompt_top1_agreement']:.1f}%, mean KL {r['prompt_mean_kl']:.5f} nats"
    )
    print(f"near-tie flips (top-2 margin < {r['near_tie_threshold']}): {r['near_tie_flips']}")
    print(
        f"greedy replies that diverge: {r['prompts_diverged']} of {len(r['per_prompt'])}; first divergence at "
        f"{[p['first_divergence'] for p in r['per_prompt']]}"
    )
    return 0
