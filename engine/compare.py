"""Full precision against a quantized model on the same prompts, token by token.

What a precision change does to outputs, measured: top-1 agreement and KL divergence over
teacher-forced positions (the full model's greedy reply fed to both), the first position where
the two greedy replies diverge, and near-tie flips (positions whose full-precision top-2 margin is
below a threshold and whose top-1 changed). The app's Compare and `python -m engine quality` both
use it.
"""

from __future__ import annotations

import torch

from .errors import EngineError
from .kv_cache import make_cache
from .session import Request, Session


def cache_for(loaded, kv: str, capacity: int):
    return make_cache(loaded.config, capacity, loaded.dtype, loaded.device, kv)


@torch.inference_mode()
def logits(loaded, kv: str, ids: list[int]) -> torch.Tensor:
    """[T, V] float32 logits for every position, through a cache of the given precision."""
    x = torch.tensor([ids], device=loaded.device)
    return loaded.model(x, cache_for(loaded, kv, len(ids)))[0].float()


@torch.inference_mode()
def stepped_logits(loaded, kv: str, ids: list[int], prompt: int) -> torch.Tensor:
    """[len(ids) - prompt, V] float32 logits predicting ids[prompt:], as a session computes them: the first
    `prompt` ids in one prefill, then one position at a time (decode's own products, which int8 activations
    change and prefill does not)."""
    cache = cache_for(loaded, kv, len(ids))
    out = [loaded.model(torch.tensor([ids[:prompt]], device=loaded.device), cache, last_only=True)[0, -1]]
    for t in ids[prompt:-1]:
        out.append(loaded.model(torch.tensor([[t]], device=loaded.device), cache, last_only=True)[0, -1])
    return torch.stack(out).float()


def reply_logits(loaded, kv: str, seq: list[int], prompt: int) -> torch.Tensor:
    """[len(seq) - prompt, V]: the logits predicting each reply token, by the path that computes them in a
    session (one position at a time where decode differs from a batched pass: int8 activations)."""
    if loaded.activations != "float32":
        return stepped_logits(loaded, kv, seq, prompt)
    return logits(loaded, kv, seq)[prompt - 1 : len(seq) - 1]


def _greedy(loaded, kv: str, prompt_ids: list[int], n: int) -> tuple[list[int], float | None]:
    s = Session(loaded, capacity=len(prompt_ids) + n, kv=kv)
    fin = list(s.generate(Request(prompt_ids=tuple(prompt_ids), max_new_tokens=n)))[-1]
    return list(fin.token_ids), fin.trace.get("decode_tok_s")


def _prompt_ids(loaded, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)  # already token ids (random-weight shapes have no real tokenizer)
    tok = loaded.tokenizer
    msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if any(m.get("images") for m in msgs):
        raise EngineError("Compare runs text prompts only: this conversation holds images")
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
        diverge = next(
            (i for i, (a, b) in enumerate(zip(ref, got)) if a != b),
            None if len(ref) == len(got) else min(len(ref), len(got)),
        )
        if not ref:
            continue
        seq = ids + ref
        lf = reply_logits(full, "none", seq, len(ids))  # [n, V]: predicting each reply token
        lq = reply_logits(quant, kv, seq, len(ids))
        top_f, top_q = lf.argmax(-1), lq.argmax(-1)
        kl = torch.nn.functional.kl_div(lq.log_softmax(-1), lf.log_softmax(-1), log_target=True, reduction="none").sum(
            -1
        )  # KL(full || quant) per position
        two = lf.topk(2, dim=-1).values
        close = (two[:, 0] - two[:, 1]) < near_tie
        n_flip = int((close & (top_f != top_q)).sum())
        agree += int((top_f == top_q).sum())
        positions += len(ref)
        kls += kl.tolist()
        flips += n_flip
        per_prompt.append(
            {
                "prompt_tokens": len(ids),
                "reply_tokens": len(ref),
                "first_divergence": diverge,
                "top1_agreement": round(float((top_f == top_q).float().mean()), 4),
                "mean_kl": round(float(kl.mean()), 6),
                "near_tie_flips": n_flip,
                "full_reply": full.tokenizer.decode(ref),
                "quant_reply": quant.tokenizer.decode(got),
                "full_tokens": [full.tokenizer.token_text(t) for t in ref],
                "quant_tokens": [quant.tokenizer.token_text(t) for t in got],
                "agree_per_token": (top_f == top_q).tolist(),
                "kl_per_token": [round(v, 6) for v in kl.tolist()],
            }
        )
    return {
        "positions": positions,
        "top1_agreement": round(agree / max(positions, 1), 4),
        "mean_kl": round(sum(kls) / max(len(kls), 1), 6),
        "near_tie_flips": flips,
        "near_tie_threshold": near_tie,
        "prompts_diverged": sum(p["first_divergence"] is not None for p in per_prompt),
        "decode_tok_s_full": round(sum(speed_full) / len(speed_full), 2) if speed_full else None,
        "decode_tok_s_quant": round(sum(speed_quant) / len(speed_quant), 2) if speed_quant else None,
        "per_prompt": per_prompt,
    }
