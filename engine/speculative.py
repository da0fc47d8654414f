"""Speculative decoding: a cheap drafter proposes the next few tokens, the model (the target) checks them all in one
pass over its weights, keeps those it agrees with and corrects the first it does not. Three drafters: the loaded
model quantized to int4 (its own draft: the same tokenizer, no second file), a smaller model with the same
tokenizer, and n-gram lookup in the conversation itself (what an edit, a rewrite or code already holds): those live
in engine.drafters; here, the rounds of drafting and checking, how many to draft, and their counts.

Under greedy sampling the output is token for token the target's alone: on kvchat's kernels the verify pass is the
target's own decode step for each drafted position (rows of one sequence in the batched step), bit for bit. Under
sampling the accept/reject rule of Leviathan et al. (2023) and Chen et al. (2023) keeps the target's
distribution. Rejected positions are rolled back in both caches before anything stores them.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import threading
import time

import torch

from . import passes
from .drafters import Draft
from .errors import EngineError
from .events import WAITING
from .generation import Decoder, Reply, StepWanted
from .sampling import sampling_logits

DEFAULT_TOKENS = 4  # tokens drafted a round
MAX_TOKENS = 16
ADAPT_WINDOW = 8  # drafting rounds the adaptive k weighs
FIRST_REACH = 2  # tokens the first drafting round drafts at most (then twice as many after each round taken whole)
PROBE_EVERY = 16  # plain rounds after drafting stopped paying, before it tries again (doubling, to MAX_IDLE)
MAX_IDLE = 256
CLEAR_LOSS = 0.8  # a draft taken less often than this share of its cost (in steps) pauses drafting at once
CHEAPEST_DRAFT = 0.01  # a draft's cost, as a share of a plain step, below which timing noise is all there is


def check_tokens(k: int) -> None:
    if not 1 <= k <= MAX_TOKENS:
        raise EngineError(f"draft tokens must be between 1 and {MAX_TOKENS}, not {k}")


def accept_or_correct(p: torch.Tensor, q: torch.Tensor | None, token: int, generator) -> tuple[int, bool]:
    """Leviathan et al.'s rule for one drafted token: p [V] the target's probabilities, q [V] the draft's (None: a
    point mass on `token`). Accept with probability min(1, p(x)/q(x)); else draw from max(0, p − q) normalised.
    The token that comes out is distributed as p, whatever q was. Returns (the token, whether the draft's)."""
    qx = 1.0 if q is None else float(q[token])
    px = float(p[token])
    u = float(torch.rand((), generator=generator))
    if qx > 0 and u < min(1.0, px / qx):
        return token, True
    rest = p.clone()
    if q is None:
        rest[token] = 0.0
    else:
        rest = torch.clamp(rest - q, min=0.0)
    total = float(rest.sum())
    if total <= 0:  # p ≤ q everywhere but where they are equal: any token of p's support
        rest = p
    return int(torch.multinomial(rest / rest.sum(), 1, generator=generator)), False


class Adaptive:
    """How many tokens to draft. Each round drafts one past what the last round's target took (one after a rejected
    first draft), twice as many after a round taken whole, up to k: drafts come right or wrong in runs (a passage
    copied, then a changed word), and a verify's rows cost more with each where the products are arithmetic-bound (a
    4-bit model: engine/BENCHMARKS.md, "Speculative decoding"), so a round after a miss is short. k itself follows what
    drafting has cost: a drafting round's time per token it gave (its drafts, its verify) against a plain step of the
    model (`target_ms`). Where drafting costs more than the model alone, k halves; at one and still dearer — or, for a
    draft model, at once where a round of one draft clearly would not pay either, its draft taken less often than it
    costs as a share of a step (`rates`; a 4-bit draft of a bfloat16 model on free text; lookup's drafts cost nothing to
    make, and a run of copying may begin at any token) — nothing is drafted for a while (plain steps: PROBE_EVERY
    rounds, twice as long after each probe that fails, up to MAX_IDLE), then k tries again from two; well cheaper, k
    grows back to what was asked. So text where drafts fail costs about what the model alone costs
    (engine/BENCHMARKS.md, "The Intel Xeon, 2026-12-08: drafting weighed against a step it can pay for"). The first
    round drafts FIRST_REACH at most: where a verify's rows are dear (a 4-bit file's on float32 activations: each row
    its own FMAs) a long first round that misses costs several plain steps. Where drafts cost nothing to make and their
    rows are cheap (lookup's on a float model: a row ~6% of a step) a round drafts on past a miss as far as a draft
    still pays for itself (`horizon`); a model's drafts keep the rule of runs (measured: engine/BENCHMARKS.md, "The
    Intel Xeon, 2026-12-07 (night): lookup follows its longest match, and drafts on where rows are cheap"). A sampled
    reply with a seed keeps k (`fixed`): its random draws, drafts' and accept tests', then come in one order whatever
    the machine's timings, and the seed gives the same reply."""

    def __init__(self, k: int, fixed: bool = False, free: bool = False):
        self.k = self.asked = k
        self.free = free  # the drafter's drafts cost nothing to make (lookup's): `horizon` weighs their rows
        # from the last round: twice its length where all were taken, else one past the taken
        self.reach = k if fixed else min(k, FIRST_REACH)
        self.fixed = fixed  # a seeded sampled reply: the same draws in the same order, whatever the timings
        self.steps: list[float] = []  # the recent plain steps' times (ms)
        self.checks: list[float] = []  # the recent verify passes' times (ms): each at least a plain step's work
        self.tried: list[tuple[float, int, int]] = []  # (ms, drafted, accepted): the last ADAPT_WINDOW drafting rounds
        self.since = 0  # of those, the rounds since k last changed: what k is weighed on
        self.idle = 0  # plain rounds left before drafting again
        self.backoff = PROBE_EVERY

    def now(self) -> int:
        """Tokens to draft this round (0: a plain step). The first round is plain: what drafting is weighed
        against."""
        if not self.steps:
            return 0
        if self.idle:
            self.idle -= 1
            return 0
        return min(self.k, max(self.reach, self.horizon()))

    def horizon(self) -> int:
        """How many of a free drafter's drafts pay, whatever the last round did: the last position i at which a^i —
        the chance that the drafts up to it are all taken, a the recent rounds' share of the drafts tested that were
        taken — exceeds c, what one more draft's verify row costs as a share of a plain step (the recent rounds'
        time past a plain step each, over their drafts). 1 until three rounds have run; 1 for a model's drafts,
        whose runs after a miss fail sooner than the rounds' average says (drafting on by it, measured, cost the
        int4 draft's rewrite a tenth)."""
        if not self.free or self.target_ms is None or len(self.tried) < 3:
            return 1
        a, c = self.rates(self.tried)
        if a <= 0:
            return 1
        if a >= 1 or c < CHEAPEST_DRAFT:
            return self.k if c < 1 else 1
        return max(1, math.ceil(math.log(c) / math.log(a)) - 1)

    def rates(self, rounds: list[tuple[float, int, int]]) -> tuple[float, float]:
        """(a, c) over drafting rounds: a the share of the drafts tested that were taken (a miss ends a round: the
        drafts after it go untested), c what one draft costs as a share of a plain step (the rounds' time past a
        plain step each, over their drafts: its making, its verify row, a draft model's catch-up)."""
        c = max(sum(ms for ms, _, _ in rounds) / self.target_ms - len(rounds), 0.0) / sum(d for _, d, _ in rounds)
        taken = sum(t for _, _, t in rounds)
        return taken / (taken + sum(t < d for _, d, t in rounds)), c

    @property
    def target_ms(self) -> float | None:
        """A plain step's time: the least of the recent plain steps and verify passes (a step's own cost: noise only
        ever adds). A verify of several positions does a plain step's work and more, so it bounds the step where the
        only plain step timed ran on cold caches — the first after a prompt runs up to a third slower, and after a
        draft model's prefill up to two fifths — and drafting that never pauses times no other."""
        return min(self.steps + self.checks) if self.steps else None

    def plain(self, ms: float) -> None:
        self.steps = [*self.steps[-(ADAPT_WINDOW - 1) :], ms]

    def round(self, drafted: int, tokens: int, ms: float, verify_ms: float | None = None) -> None:
        """A drafting round of `drafted` tokens gave `tokens` (the accepted and the target's own) in `ms`, its verify
        pass `verify_ms` of them."""
        if not drafted or self.fixed:
            return
        if verify_ms is not None:
            self.checks = [*self.checks[-(ADAPT_WINDOW - 1) :], verify_ms]
        self.reach = 2 * drafted if tokens > drafted else tokens  # all taken (and the target's own): longer
        self.tried = [*self.tried[-(ADAPT_WINDOW - 1) :], (ms, drafted, tokens - 1)]
        self.since = min(self.since + 1, ADAPT_WINDOW)
        if self.target_ms is None or self.since < 3:
            return
        recent = self.tried[-self.since :]
        per_token = sum(m for m, _, _ in recent) / sum(t + 1 for _, _, t in recent)
        if per_token > self.target_ms:  # drafting, as it ran, cost more than the model alone
            self.since = 0
            a, c = self.rates(self.tried)  # over every recent round: a steadier measure than since k changed
            if self.k > 1 and (self.free or a >= CLEAR_LOSS * c):  # a round of one draft: 1 + a tokens, 1 + c steps
                self.k = (self.k + 1) // 2  # 8, 4, 2, 1; 3 (grown back) to 2
            else:
                self.idle, self.k = self.backoff, min(2, self.asked)
                self.backoff = min(MAX_IDLE, 2 * self.backoff)
        elif per_token < 0.7 * self.target_ms:
            self.backoff = PROBE_EVERY
            if self.k < self.asked:
                self.k += 1
                self.since = 0


@dataclasses.dataclass
class SpecStats:
    """A reply's drafting, as the panel, the trace and the server's report count it."""

    draft: str
    label: str
    k: int
    rounds: int = 0  # verify passes that checked one or more drafted tokens
    drafted: int = 0
    accepted: int = 0
    by_position: list[int] = dataclasses.field(default_factory=list)  # accepted at draft position i (of rounds)
    offered: list[int] = dataclasses.field(default_factory=list)  # drafted at position i
    draft_ms: float = 0.0
    draft_prefill_ms: float = 0.0  # the draft model's own prefill of the prompt, before token 1
    plain_ms: list[float] = dataclasses.field(default_factory=list)  # the target's plain decode steps in this reply
    checks: list[float] = dataclasses.field(default_factory=list)  # its verify passes' ms (each a step's work, more)
    rolled_back: int = 0  # drafted positions written and then thrown away

    def add(self, drafted: int, accepted: int) -> None:
        self.rounds += drafted > 0
        self.drafted += drafted
        self.accepted += accepted
        for i in range(drafted):
            while len(self.offered) <= i:
                self.offered.append(0)
                self.by_position.append(0)
            self.offered[i] += 1
            self.by_position[i] += i < accepted

    def to_dict(self, tokens: int, seconds: float | None) -> dict:
        rate = self.accepted / self.drafted if self.drafted else None
        per_token = seconds / tokens * 1000 if seconds and tokens else None
        step = None
        if self.plain_ms:  # the median: robust to a slow first one; a verify pass bounds it (Adaptive.target_ms)
            step = round(min([statistics.median(self.plain_ms), *self.checks]), 3)
        speedup = step / per_token if step and per_token else None
        return {
            "draft": self.draft,
            "label": self.label,
            "k": self.k,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": rate,
            "acceptance_by_position": [a / o if o else None for a, o in zip(self.by_position, self.offered)],
            "draft_ms": round(self.draft_ms, 3),
            "draft_prefill_ms": self.draft_prefill_ms,
            "verify_ms": round(sum(self.checks), 3),
            "rolled_back": self.rolled_back,
            "target_step_ms": step,
            "plain_steps": len(self.plain_ms),
            "ms_per_token": per_token,
            "speedup": speedup,
        }


def _ms_since(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


def speculate(req, logits: torch.Tensor, decoder: Decoder, ids: list[int], tok, stream, trace,
              cancel: threading.Event, drafter, k: int):  # fmt: skip
    """The decode loop with drafts. Token 1 comes from the prompt's `logits` ([1, 1, V]) and one plain step of the
    target follows (timed: what the drafting is weighed against). Then each round: the drafter proposes up to k
    tokens after the last chosen one; the target consumes that token and the drafts in one pass (passes.span)
    and chooses, position by position, the token it would have chosen there — a draft it agrees with is accepted
    (under sampling: accepted or replaced by accept_or_correct), the first it does not is corrected, and the
    positions written for the drafts after it are rolled back. Where nothing is drafted the round is a plain
    decode step (a StepWanted, batched with other requests'). Between rounds, WAITING lets a scheduler run the
    others. Returns the Reply; `trace.speculative` holds the counts."""
    cache, model, params = decoder.cache, decoder.loaded.model, req.sampling
    reply = Reply(req, tok, stream, trace, cache, cancel)
    stats = trace.speculative = SpecStats(drafter.name, drafter.label, k)
    plan = Adaptive(k, fixed=not params.greedy and params.seed is not None, free=drafter.free)
    kind, rejected = "target", 0
    t0 = time.perf_counter()
    drafter.prepare(ids)  # a draft model's own prefill of the prompt: inside TTFT, not inside decode
    stats.draft_prefill_ms = round(_ms_since(t0), 3)
    row = reply.row(logits[0, -1])  # [V]
    token, drawn = reply.choose(row, ids)
    while True:
        event = reply.emit(token, row, drawn, cache.length, kind, rejected)
        if event is None:
            return reply
        yield event
        if reply.done(cache.length):
            return reply
        room = min(plan.now(), cache.capacity - cache.length - 1, req.max_new_tokens - len(reply.out) - 1)
        draft = Draft([], [])
        began = time.perf_counter()
        if room > 0:
            draft = drafter.propose(ids + [token], room, params, reply.generator)
            stats.draft_ms += _ms_since(began)
        if not draft.tokens:
            t0 = time.perf_counter()
            logits = yield StepWanted(decoder, token)  # [1, 1, V]
            ids.append(token)
            row = reply.row(logits[0, -1])
            token, drawn = reply.choose(row, ids)
            stats.plain_ms.append(_ms_since(t0))
            plan.plain(stats.plain_ms[-1])
            kind, rejected = "target", 0
            continue
        t0 = time.perf_counter()
        rows = passes.span(model, [token, *draft.tokens], cache)  # [j + 1, V]
        ids.append(token)
        p, j = len(ids), len(draft.tokens)  # positions consumed through the chosen token; drafts
        accepted = 0
        for i in range(j + 1):
            row = reply.row(rows[i])
            seen = ids + draft.tokens[:i]
            if i < j and params.greedy:
                token, drawn = reply.choose(row, seen)
                ok = token == draft.tokens[i]
            elif i < j:
                drawn = sampling_logits(row, params, reply.seen(seen, row))
                token, ok = accept_or_correct(drawn.softmax(-1), draft.probs[i], draft.tokens[i], reply.generator)
            else:
                token, drawn = reply.choose(row, seen)
                ok = False
            if i == 0:
                checked = _ms_since(t0)  # the choice of the first reads the logits: the pass has run
                stats.checks.append(checked)
            kind = "accepted" if ok else "corrected" if i < j else "target"
            if not ok:
                break
            accepted += 1
            event = reply.emit(token, row, drawn, p + i, kind)
            if event is not None:
                yield event
            if event is None or reply.done(p + i):
                _keep(cache, p + i, stats)
                ids.extend(draft.tokens[:i])
                stats.add(j, accepted)
                return reply
        stats.add(j, accepted)
        rejected = j - accepted
        _keep(cache, p + accepted, stats)  # the chosen token and the accepted drafts; the rest rolled back
        ids.extend(draft.tokens[:accepted])
        drafter.accepted(ids)
        plan.round(j, accepted + 1, _ms_since(began), checked)
        yield WAITING


def _keep(cache, n: int, stats: SpecStats) -> None:
    """Keep n consumed positions: those written for rejected drafts are rolled back (their blocks given back)."""
    if cache.length > n:
        stats.rolled_back += cache.length - n
        cache.truncate(n)


def nothing_drafted(spec: dict) -> str:
    """Why a finished reply drafted nothing, from its counts: it ended before a drafting round (the step after
    token 1 is the model's own, what drafting is weighed against), lookup found nothing to copy, or there was no
    room; a server's report says only that it drafted none."""
    plain = spec.get("plain_steps")
    if plain is None:
        return "the server drafted none for this reply"
    if plain <= 1:
        return "the reply ended before its first drafting round (its first steps are the model's own)"
    if spec.get("draft") == "lookup":
        return "the reply's last tokens never occurred earlier in the conversation (the model ran alone)"
    return "no room to draft (the reply's token limit or the cache's end)"


def draft_line(s: dict) -> str:
    """A reply's drafting in one line (the CLI's): what drafted, how much the target took, by position, the
    costs, and the speed against the target's own step measured in the reply."""
    if not s.get("drafted"):
        return f"drafts ({s['label']}): none this reply — {nothing_drafted(s)}"
    by = " ".join("—" if r is None else f"{r:.0%}" for r in s["acceptance_by_position"])
    speed = f" · {s['speedup']:.2f}× the model alone ({s['target_step_ms']:.1f} ms a step)" if s.get("speedup") else ""
    return (f"drafts ({s['label']}): {s['accepted']:,} of {s['drafted']:,} accepted ({s['acceptance']:.0%}; by "
            f"position {by}) in {s['rounds']:,} rounds · drafting {s['draft_ms']:,.0f} ms, verifying "
            f"{s['verify_ms']:,.0f} ms{speed}")  # fmt: skip
