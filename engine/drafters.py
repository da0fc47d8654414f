"""The drafters of speculative decoding (engine.speculative): n-gram lookup in the conversation, and a draft model —
the loaded model quantized to int4, or a smaller model with the same tokenizer — decoding on a cache of its own that
follows the target's accepted tokens. Each proposes up to k tokens after the context; the target checks them."""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch

from .errors import EngineError
from .kv_cache import make_cache
from .prefix_store import common_prefix
from .sampling import greedy_pick, sampling_logits

KINDS = ("int4", "lookup")  # besides a path to a draft model with the target's tokenizer
LOOKUP_MIN, LOOKUP_MAX = 2, 16  # prompt lookup's match: at least two tokens (one matches too much), weighed up to 16
SPAN = (9, 64)  # a catch-up of this many positions goes as rows of the batched decode step (see _consume)
CHUNK = 256  # positions a draft model consumes in one pass (its prefill's, a prompt's chunks)
# The int4 draft's own precision (the target's never changes): a scale per 32 weights, top-1 agreement with the full
# weights 72% against 66% at the default 64, and int8 activations where the kernels have them (the same agreement; at
# 32 a scale the step then costs what 64 on float32 activations did); engine/BENCHMARKS.md, "Speculative decoding"
INT4_DRAFT = {"group_size": 32, "activations": "int8"}


def check_kind(kind: str) -> None:
    """`kind` names a drafter: int4, lookup, or a model file or folder that exists."""
    if kind in KINDS:
        return
    path = Path(kind).expanduser()
    if not path.exists():
        raise EngineError(f"speculative draft {kind!r} is neither {' nor '.join(KINDS)} nor a model file or folder")


def same_tokenizer(target, draft) -> str | None:
    """Why a draft model cannot draft for the target (another tokenizer), in words; None when it can."""
    a = target.tokenizer.tok.get_vocab(with_added_tokens=True)
    b = draft.tokenizer.tok.get_vocab(with_added_tokens=True)
    if a == b:
        return None
    if len(a) != len(b):
        return f"its tokenizer has {len(b):,} tokens, the model's {len(a):,}"
    differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
    token, at = differ[0]
    return f"its tokenizer maps {token!r} to another id than the model's (near id {at:,})"


@dataclasses.dataclass
class Draft:
    """Up to k proposed tokens and, for a model's drafts under sampling, the distribution each was drawn from
    ([V] probabilities; None: a point mass, as lookup's and greedy drafts are)."""

    tokens: list[int]
    probs: list[torch.Tensor | None]


class LookupDrafter:
    """Prompt lookup: the tokens that followed the earlier occurrence of the context's end that matches it longest
    (at least LOOKUP_MIN tokens, weighed up to LOOKUP_MAX; the most recent of equals), copied as the draft. Where a
    passage occurs twice — a prompt's code and the model's half-rewritten copy of it — the longer match picks the
    one the reply is following. Costs nothing where nothing matches."""

    name = "lookup"
    label = "n-gram lookup in the conversation"
    free = True  # drafting costs nothing: a round's drafts cost only their verify rows (Adaptive.horizon)

    def propose(self, context: list[int], k: int, params, generator) -> Draft:
        at = longest_match(context)
        got = [] if at is None else context[at : at + k]
        return Draft(got, [None] * len(got))

    def prepare(self, ids: list[int]) -> None:
        """Nothing to prepare: the lookup reads the context afresh."""

    def accepted(self, context: list[int]) -> None:
        """Nothing to keep in step: the lookup reads the context afresh."""

    def release(self) -> None:
        pass


class ModelDrafter:
    """A draft model's greedy (or, under sampling, drawn) continuation of the context, k tokens, decoded on a cache
    of its own that follows the target's accepted tokens (what it drafted and the target rejected is rolled back)."""

    free = False  # each draft a step of the draft model

    def __init__(self, loaded, name: str, label: str, capacity: int, vocab: int):
        self.loaded, self.name, self.label = loaded, name, label
        self.vocab = vocab  # the target's logits' width: a draft's padded embedding rows are never proposed
        self.cache = make_cache(loaded.config, capacity, loaded.dtype, loaded.device)
        self.ids: list[int] = []  # what its cache holds

    def prepare(self, ids: list[int]) -> None:
        """Its cache holds `ids` (the prompt, before token 1: its prefill is then part of TTFT, not of decode);
        what it held past their common prefix is rolled back."""
        self.accepted(ids)
        self._consume(ids[len(self.ids) :])

    def _consume(self, tokens: list[int]) -> torch.Tensor | None:
        """`tokens` into its cache in one pass (a prompt in chunks of CHUNK): a round's catch-up — the token the target
        chose after the last accepted draft, the last draft where all were taken, what plain steps chose — reads the
        draft's weights once, not once a token; the logits after the last ([V]), None for none. A gap of SPAN
        positions (plain steps' tokens after a pause in drafting) goes as rows of the batched decode step: a forward
        of more than a few positions first dequantizes every weight for prefill's products, several times the
        cost (engine/BENCHMARKS.md, "The Intel Xeon, 2026-12-07: the 4-bit file's verify rows, and the file on
        int8 activations")."""
        device, model = self.loaded.device, self.loaded.model
        if SPAN[0] <= len(tokens) <= SPAN[1]:  # the gap after plain steps: rows of the batched decode step
            out = model.forward_spans([(tokens, self.cache)])  # [1, 1, V], or None where the step cannot take them
            if out is not None:
                self.ids.extend(tokens)
                return out[0][0, -1]
        logits = None
        for a in range(0, len(tokens), CHUNK):
            piece = tokens[a : a + CHUNK]
            logits = model(torch.tensor([piece], device=device), self.cache, last_only=True)  # [1, 1, V]
            self.ids.extend(piece)
        return None if logits is None else logits[0, -1]

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Its cache holds context[:-1] and the logits after context[-1] come back ([V]): what it lacks, in one pass."""
        self.accepted(context[:-1])
        return self._consume(context[len(self.ids) :])

    def propose(self, context: list[int], k: int, params, generator) -> Draft:
        room = self.cache.capacity - len(context) - 1
        k = min(k, room)
        if k <= 0:
            return Draft([], [])
        row = self._sync(context)
        out, probs = [], []
        device, model = self.loaded.device, self.loaded.model
        for i in range(k):
            row = _width(row, self.vocab)  # [V] of the target: q and the target's p weigh the same tokens
            drawn = sampling_logits(row, params)  # the draft samples as the target does (no penalty: cheaper)
            if params.greedy:
                token, p = greedy_pick(drawn), None
            else:
                p = drawn.softmax(-1)
                token = int(torch.multinomial(p, 1, generator=generator))
            out.append(token)
            probs.append(p)
            if i + 1 < k:
                row = model(torch.tensor([[token]], device=device), self.cache, last_only=True)[0, -1]
                self.ids.append(token)
        return Draft(out, probs)

    def accepted(self, context: list[int]) -> None:
        """The target kept `context`: drafts past it are rolled back at the next proposal (its cache follows)."""
        keep = common_prefix(self.ids, context)
        if keep < len(self.ids):
            self.cache.truncate(keep)
            del self.ids[keep:]

    def release(self) -> None:
        self.cache.release()
        self.ids = []


def open_drafter(kind: str, target, capacity: int, load: Callable) -> LookupDrafter | ModelDrafter:
    """The drafter `kind` names for the target model (`load(path, weights, **options)`: the engine's loader, on the
    engine's thread): int4 — the target's own weights quantized to int4 (its float or int8 weights: a file's own 4- or
    5-bit codes are refused, with the reason); lookup; or a model with the target's tokenizer (refused with the
    reason otherwise)."""
    check_kind(kind)
    if kind == "lookup":
        return LookupDrafter()
    vocab = target.config.vocab_size
    if kind == "int4":
        held = target.quantization
        if held != "none" and not held.startswith("int8"):
            raise EngineError(f"an int4 draft is the model's float (or int8) weights in int4; this one holds {held}: "
                              "draft with lookup, or with a smaller model of the same tokenizer")  # fmt: skip
        draft = load(target.path, "int4", **INT4_DRAFT)
        return ModelDrafter(draft, "int4", "the model itself in int4", capacity, vocab)
    draft = load(Path(kind).expanduser(), "none")
    why = same_tokenizer(target, draft)
    if why is not None:
        raise EngineError(f"{Path(kind).name} cannot draft for {target.name}: {why}")
    return ModelDrafter(draft, Path(kind).name, draft.name, capacity, vocab)


def longest_match(context: list[int]) -> int | None:
    """Where the tokens after the best earlier match of the context's end begin: of the earlier occurrences of its
    last LOOKUP_MIN tokens (followed by at least one token), the one whose match reaches furthest back (up to
    LOOKUP_MAX), the most recent of equals; None where its end occurs nowhere earlier."""
    n = len(context)
    if n <= LOOKUP_MIN:
        return None
    ids = torch.frombuffer(array.array("q", context), dtype=torch.int64)  # [n] (a long context: ~1 ms at 32K)
    hit = torch.ones(n - LOOKUP_MIN, dtype=torch.bool)  # [n - LOOKUP_MIN]: windows that end before the last token
    for j in range(LOOKUP_MIN):
        hit &= ids[j : j + n - LOOKUP_MIN] == context[n - LOOKUP_MIN + j]
    starts = hit.nonzero().flatten().tolist()
    best, at = 0, None
    for start in reversed(starts):  # the most recent first: it keeps a tie
        m = LOOKUP_MIN
        while (
            m < LOOKUP_MAX
            and start + LOOKUP_MIN - m - 1 >= 0
            and context[start + LOOKUP_MIN - m - 1] == context[n - m - 1]
        ):
            m += 1
        if m > best:
            best, at = m, start + LOOKUP_MIN
    return at


def _width(row: torch.Tensor, n: int) -> torch.Tensor:
    """Logits [V'] over the first n tokens: cut, or padded with -inf (tokens the draft cannot propose)."""
    if row.shape[-1] == n:
        return row
    if row.shape[-1] > n:
        return row[:n]
    return torch.cat([row, row.new_full((n - row.shape[-1],), float("-inf"))])
