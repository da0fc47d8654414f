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

from .kv_cache import make_cache
from .loader import load_model
from .session import Request, Session

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


def _cache_for(loaded, kv: str, capacity: int):
    return make_cache(loaded.config, capacity, loaded.dtype, loaded.device, kv)


@torch.inference_mode()
def _logits(loaded, kv: str, ids: list[int]) -> torch.Tensor:
    """[T, V] float32 logits for every position, through a cache of the given precision."""
    x = torch.tensor([ids], device=loaded.device)
    return loaded.model(x, _cache_for(loaded, kv, len(ids)))[0].float()


def _greedy(loaded, kv: str, prompt_ids: list[int], n: int) -> tuple[list[int], float | None]:
    s = Session(loaded, capacity=len(prompt_ids) + n, kv=kv)
    fin = list(s.generate(Request(prompt_ids=tuple(prompt_ids), max_new_tokens=n)))[-1]
    return list(fin.token_ids), fin.trace.get("decode_tok_s")


def _prompt_ids(loaded, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)  # already token ids (random-weight shapes have no real tokenizer)
    tok = loaded.tokenizer
    msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if tok.has_chat_template:
        return tok.apply_chat_template(msgs)
    return tok.encode(msgs[-1]["content"], add_special_tokens=True)


def compare(full, quant, kv: str, prompts, new_tokens: int = 48, near_tie: float = 0.5) -> dict:
    """Per prompt and overall: agreement, KL, first divergence, near-tie flips, decode speed."""
    per_prompt, agree, kls, flips, positions = [], 0, [], 0, 0
    speed_full, speed_quant = [], []
    for prompt in prompts:
        ids = _prompt_ids(full, prompt)
        ref, tf = _greedy(full, "none", ids, new_tokens)
        got, tq = _greedy(quant, kv, ids, new_tokens)
        speed_full += [tf] if tf else []
        speed_quant += [tq] if tq else []
        diverge = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b),
                       None if len(ref) == len(got) else min(len(ref), len(got)))
        if not ref:
            continue
        seq = ids + ref
        lf = _logits(full, "none", seq)[len(ids) - 1:len(seq) - 1]  # [n, V]: predicting each reply token
        lq = _logits(quant, kv, seq)[len(ids) - 1:len(seq) - 1]
        top_f, top_q = lf.argmax(-1), lq.argmax(-1)
        kl = torch.nn.functional.kl_div(lq.log_softmax(-1), lf.log_softmax(-1), log_target=True,
                                        reduction="none").sum(-1)  # KL(full || quant) per position
        two = lf.topk(2, dim=-1).values
        close = (two[:, 0] - two[:, 1]) < near_tie
        n_flip = int((close & (top_f != top_q)).sum())
        agree += int((top_f == top_q).sum())
        positions += len(ref)
        kls += kl.tolist()
        flips += n_flip
        per_prompt.append({"prompt_tokens": len(ids), "reply_tokens": len(ref), "first_divergence": diverge,
                           "top1_agreement": round(float((top_f == top_q).float().mean()), 4),
                           "mean_kl": round(float(kl.mean()), 6), "near_tie_flips": n_flip,
                           "full_reply": full.tokenizer.decode(ref), "quant_reply": quant.tokenizer.decode(got),
                           "full_tokens": [full.tokenizer.token_text(t) for t in ref],
                           "quant_tokens": [quant.tokenizer.token_text(t) for t in got],
                           "agree_per_token": (top_f == top_q).tolist(),
                           "kl_per_token": [round(v, 6) for v in kl.tolist()]})
    return {"positions": positions, "top1_agreement": round(agree / max(positions, 1), 4),
            "mean_kl": round(sum(kls) / max(len(kls), 1), 6), "near_tie_flips": flips,
            "near_tie_threshold": near_tie,
            "prompts_diverged": sum(p["first_divergence"] is not None for p in per_prompt),
            "decode_tok_s_full": round(sum(speed_full) / len(speed_full), 2) if speed_full else None,
            "decode_tok_s_quant": round(sum(speed_quant) / len(speed_quant), 2) if speed_quant else None,
            "per_prompt": per_prompt}


def perplexity(loaded, kv: str, text, max_tokens: int = 1024) -> float:
    """exp(mean NLL) over a held-out text (or a list of token ids)."""
    ids = (text if isinstance(text, list) else loaded.tokenizer.encode(text, add_special_tokens=True))[:max_tokens]
    logits = _logits(loaded, kv, ids)
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:], device=logits.device))
    return round(math.exp(float(nll)), 4)


def kv_bytes_per_position(loaded, kv: str) -> int:
    return _cache_for(loaded, kv, 1).bytes_per_position


def run(model=None, weights="none", kv="none", group_size=64, prompts=None, new_tokens=48, device=None,
        dtype=None, near_tie=0.5, random_ids=False) -> dict:
    full = load_model(model, device=device, dtype=dtype)
    quant = load_model(model, device=device, dtype=dtype, weights=weights, group_size=group_size)
    if random_ids:  # a random-weight shape: prompts and text are seeded random token ids
        g = torch.Generator().manual_seed(0)
        vocab = full.config.vocab_size
        prompts = prompts or [torch.randint(10, vocab, (64,), generator=g).tolist() for _ in range(4)]
        text = torch.randint(10, vocab, (512,), generator=g).tolist()
    else:
        prompts = prompts or DEFAULT_PROMPTS
        text = _heldout_text(full)
    result = compare(full, quant, kv, prompts, new_tokens, near_tie)
    result.update(model=str(full.path), weights=quant.quantization, kv=kv, dtype=str(full.dtype).removeprefix("torch."),
                  perplexity_full=perplexity(full, "none", text), perplexity_quant=perplexity(quant, kv, text),
                  weight_bytes_full=full.weight_bytes, weight_bytes_quant=quant.weight_bytes,
                  kv_bytes_per_position_full=kv_bytes_per_position(full, "none"),
                  kv_bytes_per_position_quant=kv_bytes_per_position(quant, kv),
                  calibration="none (scales from each group's max |x|)")
    return result


def add_arguments(p) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--shape", default=None, help="a random-weight shape instead of a model (smollm2-135m, ...)")
    p.add_argument("--weights", default="none", choices=["none", "int8", "int4"])
    p.add_argument("--kv", default="none", choices=["none", "int8", "int4"])
    p.add_argument("--group-size", type=int, default=64, help="values per scale (0: one per output channel)")
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
    if ns.shape:
        import tempfile
        from pathlib import Path

        from .bench import write_random_checkpoint
        with tempfile.TemporaryDirectory(prefix="kvchat-quality-") as tmp:
            path = write_random_checkpoint(Path(tmp) / ns.shape, ns.shape)
            r = run(str(path), ns.weights, ns.kv, ns.group_size, prompts, ns.new_tokens, ns.device, ns.dtype,
                    ns.near_tie, random_ids=True)
            r["model"] = f"random {ns.shape}"
    else:
        r = run(ns.model, ns.weights, ns.kv, ns.group_size, prompts, ns.new_tokens, ns.device, ns.dtype,
                ns.near_tie)
    if ns.json:
        print(json.dumps(r, ensure_ascii=False))
        return 0
    print(f"model {r['model']} · {r['dtype']} · weights {r['weights']} · KV {r['kv']} · calibration: {r['calibration']}")
    rows = [("weights bytes", r["weight_bytes_full"], r["weight_bytes_quant"]),
            ("KV bytes per position", r["kv_bytes_per_position_full"], r["kv_bytes_per_position_quant"]),
            ("perplexity (held-out text)", r["perplexity_full"], r["perplexity_quant"]),
            ("decode tok/s", r["decode_tok_s_full"], r["decode_tok_s_quant"])]
    print(f"{'':28s} {'full':>14s} {'quantized':>14s}")
    for name, a, b in rows:
        print(f"{name:28s} {a!s:>14s} {b!s:>14s}")
    print(f"top-1 agreement over {r['positions']} teacher-forced positions: {100 * r['top1_agreement']:.1f}%")
    print(f"mean KL(full || quantized): {r['mean_kl']:.5f} nats")
    print(f"near-tie flips (top-2 margin < {r['near_tie_threshold']}): {r['near_tie_flips']}")
    print(f"greedy replies that diverge: {r['prompts_diverged']} of {len(r['per_prompt'])}; first divergence at "
          f"{[p['first_divergence'] for p in r['per_prompt']]}")
    return 0
