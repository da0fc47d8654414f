"""What the model weighed at one decode step: the chosen token's log-probability under the model's raw
distribution (the softmax of its logits at temperature 1, before any penalty or filter) and under the
distribution the sampler drew from, the raw distribution's entropy, and its k most likely tokens.

Raw is what the model says; sampled is what the settings made of it (temperature, top-k/top-p/min-p, the
repetition penalty). Greedy decoding draws from a point mass: the chosen token's sampled log-probability
is 0 and every other token's is None (it could not be drawn).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

MAX_TOP_LOGPROBS = 20  # alternatives a step may carry (OpenAI's limit for top_logprobs)
LOW_CONFIDENCE = 0.5  # a token chosen with a raw probability below this counts as low-confidence


@dataclasses.dataclass(frozen=True)
class Alternative:
    token_id: int
    text: str  # the token alone, decoded (special tokens kept)
    logprob: float  # raw
    sampled_logprob: float | None  # under the distribution drawn from; None: the sampler could not draw it

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class StepLogprobs:
    """One decode step's figures, log-probabilities in nats."""

    text: str  # the chosen token alone, decoded (a stream's delta may hold part of it, or more)
    logprob: float  # the chosen token's, raw
    sampled_logprob: float | None  # the chosen token's, under the distribution it was drawn from
    entropy: float | None  # of the raw distribution
    sampled_entropy: float | None  # of the distribution drawn from (0 for greedy)
    rank: int | None  # the chosen token's place in the raw distribution: 1 = the most likely
    top: tuple[Alternative, ...]  # the k most likely tokens, raw, most likely first
    # None: a remote server that does not report it (only OpenAI's token, logprob and top_logprobs)

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "top": [a.to_dict() for a in self.top]}


def check_top_logprobs(k: int) -> None:
    if not 0 <= k <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, not {k}")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _entropy(lp: torch.Tensor) -> torch.Tensor:
    """-Σ p·log p of log-probabilities lp [V] (-inf allowed: such a token adds 0); a dot product, which
    torch runs several times faster than `special.entr` over a vocabulary."""
    return -torch.dot(lp.exp(), lp.clamp_min(torch.finfo(lp.dtype).min))


CHUNK = 512  # values per block whose maximum bounds the top k from below (top_k)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of x [V] and their indices, largest first. On the CPU, torch.topk over a whole
    vocabulary costs ~0.25 ms; here the k-th largest of the blocks' maxima is a bound that at least k values
    reach, so topk runs only over the values at or above it (usually a few hundred)."""
    n = x.shape[0] // CHUNK
    if x.device.type != "cpu" or n < 4 * k:
        return torch.topk(x, k)
    maxima = x[: n * CHUNK].view(n, CHUNK).amax(1)  # [n]
    bound = torch.topk(maxima, k).values[-1]  # k blocks hold a value at or above it
    near = torch.nonzero(x >= bound).squeeze(1)  # [m], m >= k, the tail past the last block included
    values, j = torch.topk(x[near], k)
    return values, near[j]


def step_logprobs(
    raw: torch.Tensor,
    drawn: torch.Tensor,
    token: int,
    k: int,
    greedy: bool,
    text_of: Callable[[int], str],
    argmax: bool = False,
) -> StepLogprobs:
    """raw [V]: the model's logits; drawn [V]: the logits the sampler drew `token` from (sampling_logits).
    One transfer from the device for all the figures; the rank is counted only when the top k do not
    already say it, nor `argmax` (a greedy pick from unpenalized logits: rank 1)."""
    lp = torch.log_softmax(raw.float(), -1)  # [V]
    figures = [lp[token], _entropy(lp)]
    if not greedy:
        lq = torch.log_softmax(drawn.float(), -1)  # [V], -inf where filtered
        figures += [lq[token], _entropy(lq)]
    top_ids: list[int] = []
    if k:
        values, ids = top_k(lp, min(k, lp.shape[-1]))  # [k], most likely first
        figures += [values, *([] if greedy else [lq[ids]])]
        top_ids = ids.tolist()
    if token not in top_ids and not argmax:
        figures.append((lp > lp[token]).sum().float())
    flat = torch.cat([f.reshape(-1) for f in figures]).tolist()
    chosen, entropy = flat[:2]
    sampled, sampled_entropy = (0.0, 0.0) if greedy else flat[2:4]
    rest = flat[2 if greedy else 4 :]
    n = len(top_ids)
    raw_top, drawn_top = rest[:n], rest[n : 2 * n]
    if token in top_ids:
        rank = sum(v > chosen for v in raw_top) + 1
    else:
        rank = 1 if argmax else int(rest[-1]) + 1
    top = tuple(
        Alternative(
            i,
            text_of(i),
            raw_top[j],
            (0.0 if i == token else None) if greedy else _finite(drawn_top[j]),
        )
        for j, i in enumerate(top_ids)
    )
    return StepLogprobs(text_of(token), chosen, sampled, entropy, sampled_entropy, rank, top)


def reply_confidence(steps: list[dict]) -> dict:
    """Over a reply's steps (StepLogprobs.to_dict()s): the mean raw log-probability, the perplexity
    exp(-mean) and how many tokens were chosen with a raw probability below LOW_CONFIDENCE."""
    lps = [s["logprob"] for s in steps if isinstance(s, dict) and isinstance(s.get("logprob"), (int, float))]
    if not lps:
        return {"tokens": 0, "mean_logprob": None, "perplexity": None, "low_confidence": 0}
    mean = sum(lps) / len(lps)
    low = sum(lp < math.log(LOW_CONFIDENCE) for lp in lps)
    return {"tokens": len(lps), "mean_logprob": mean, "perplexity": math.exp(-mean), "low_confidence": low}
