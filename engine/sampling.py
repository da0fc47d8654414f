"""Choosing the next token from logits: pure functions, an explicit torch.Generator for randomness."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy: argmax, the lowest index wins ties
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [V]; seen: ids already in the context. Positive logits are divided, negative multiplied."""
    if penalty == 1.0 or seen.numel() == 0:
        return logits
    picked = logits[seen]
    logits = logits.clone()
    logits[seen] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (always at least one)."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = (cum - sorted_logits.softmax(-1)) >= p  # mass before this token already reaches p
    drop_sorted[0] = False  # the most likely token stays, even for a p that rounds to 0 in float32
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.max(), float("-inf"))


def sampling_logits(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None) -> torch.Tensor:
    """logits [V] -> the logits the sampler draws from [V] (float32): the repetition penalty, then (sampling
    only) the temperature and the top-k, top-p and min-p filters; a filtered token's logit is -inf. Greedy
    takes the argmax of these."""
    logits = logits.float()
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    if params.greedy:
        return logits
    # shifted so the top logit is 0 before the division: a temperature that underflows (1e-40) sends the others to
    # -inf, never the top one to inf (the same distribution: softmax and the filters ignore a shift)
    logits = (logits - logits.max()) / params.temperature
    return filter_min_p(filter_top_p(filter_top_k(logits, params.top_k), params.top_p), params.min_p)


def greedy_pick(logits: torch.Tensor) -> int:
    """The first maximal index of logits [V] (the lowest wins a tie; a NaN's own index, as argmax): max's indices,
    a third of argmax's time over a vocabulary on the CPU (engine/BENCHMARKS.md, "The scheduler's own time")."""
    return int(logits.max(0).indices)


def draw(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    seen: torch.Tensor | None = None,
) -> tuple[int, torch.Tensor]:
    """logits [V] -> (one token id, the logits it was drawn from [V]; sampling_logits)."""
    drawn = sampling_logits(logits, params, seen)
    if params.greedy:
        return greedy_pick(drawn), drawn
    return int(torch.multinomial(drawn.softmax(-1), 1, generator=generator)), drawn


def choose(
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    seen: torch.Tensor | None = None,
) -> int:
    """logits [V] -> one token id."""
    return draw(logits, params, generator, seen)[0]
