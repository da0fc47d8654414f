"""Constrained decoding: a grammar — a JSON schema, any JSON object, Lark or GBNF — says which tokens may come next,
and the sampler draws only among them, so what the model writes always parses. The grammar's work is llguidance's
(the library llama.cpp and vLLM use; engine/SERVING.md, "Structured output", says why it): it compiles the
grammar against the model's tokenizer and gives, at each step, the set of tokens allowed.

The glass box: at each step, how many tokens the grammar allowed, the probability mass the model had put on the
ones it forbade (under its own distribution: the softmax of its logits at temperature 1), and the token the model
preferred when the grammar forbade it (`MaskStep`).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from .errors import EngineError

KINDS = ("json_schema", "json_object", "lark", "gbnf")
MAX_SOURCE = 1 << 20  # a grammar's or schema's text: 1 MiB at most
ANY_OBJECT = {"type": "object"}  # response_format json_object: any JSON object
JSON_LAYOUT = {"whitespace_flexible": False}  # JSON as json.dumps writes it: ", " and ": ", no other whitespace


@dataclasses.dataclass(frozen=True)
class Grammar:
    """What a reply must parse as: `kind` (KINDS) and its text (a JSON schema as JSON text, or the grammar)."""

    kind: str
    source: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise EngineError(f"grammar kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if len(self.source) > MAX_SOURCE:
            raise EngineError(f"the grammar is {len(self.source):,} characters: past the {MAX_SOURCE:,} allowed")

    @classmethod
    def json_schema(cls, schema) -> Grammar:
        """A JSON schema (a dict, or its JSON text): the reply is a JSON value it validates."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        try:
            parsed = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise EngineError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(parsed, (dict, bool)):
            raise EngineError("a JSON schema is an object (or true/false)")
        return cls("json_schema", text)

    @classmethod
    def json_object(cls) -> Grammar:
        return cls("json_object", json.dumps(ANY_OBJECT))

    @classmethod
    def from_file(cls, path, kind: str | None = None) -> Grammar:
        """A grammar file: a JSON schema (.json), Lark (.lark) or GBNF (.gbnf; `kind` says where the name does not)."""
        path = Path(path)
        try:
            if path.stat().st_size > MAX_SOURCE:
                raise EngineError(f"{path.name} is larger than the {MAX_SOURCE:,} bytes a grammar may take")
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise EngineError(f"the grammar {path} cannot be read: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise EngineError(f"the grammar {path} is not UTF-8 text") from None
        kind = kind or {".json": "json_schema", ".lark": "lark", ".gbnf": "gbnf"}.get(path.suffix.lower())
        if kind is None:
            kind = "gbnf" if "::=" in text else "lark"
        return cls.json_schema(text) if kind == "json_schema" else cls(kind, text)

    def compiled(self) -> str:
        """The grammar as llguidance takes it."""
        import llguidance
        from llguidance.gbnf_to_lark import gbnf_to_lark

        if self.kind in ("json_schema", "json_object"):  # compact: a model cannot pad it with whitespace without end
            return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_LAYOUT)
        lark = gbnf_to_lark(self.source) if self.kind == "gbnf" else self.source
        return llguidance.LLMatcher.grammar_from_lark(lark)

    def check(self) -> None:
        """Refuse a grammar that does not compile (llguidance's own words: what, and where), before any model runs."""
        import llguidance

        try:
            problem = llguidance.LLMatcher.validate_grammar(self.compiled())
        except Exception as e:
            problem = str(e)
        if problem:
            raise EngineError(f"the {self.describe()} does not compile: {problem.strip()}")

    def describe(self) -> str:
        """In words, for the panel and the trace."""
        if self.kind == "json_object":
            return "any JSON object"
        if self.kind == "json_schema":
            title = json.loads(self.source).get("title") if self.source.lstrip().startswith("{") else None
            return "JSON schema" + (f" “{title}”" if isinstance(title, str) and title else "")
        n = len(self.source.splitlines())
        return f"{'GBNF' if self.kind == 'gbnf' else 'Lark'} grammar ({n:,} line{'' if n == 1 else 's'})"

    def to_dict(self) -> dict:
        return {"kind": self.kind, "source": self.source}


_WORKER = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvchat-grammar")  # masks beside the forward pass
_lock = threading.Lock()
_tokenizers: dict = {}  # (tokenizer digest, vocabulary, stop ids) -> llguidance.LLTokenizer: made once (~ms to 1 s)


def _lltokenizer(tokenizer, vocab: int):
    import llguidance

    key = (tokenizer.digest, vocab, tuple(sorted(tokenizer.stop_ids)))
    with _lock:
        if key not in _tokenizers:
            _tokenizers[key] = llguidance.LLTokenizer(
                tokenizer.tok.to_str(), n_vocab=vocab, eos_token=sorted(tokenizer.stop_ids) or None
            )
        return _tokenizers[key]


@dataclasses.dataclass(frozen=True)
class MaskStep:
    """What the grammar did at one step: the tokens it allowed (of the vocabulary), the probability the model had
    put on the tokens it forbade (raw: softmax at temperature 1), and the token the model preferred where the
    grammar forbade it (its id and text; None where the model's own first choice was allowed)."""

    allowed: int
    vocab: int
    removed: float
    preferred: int | None = None
    preferred_text: str | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class Guide:
    """One reply's grammar: the tokens allowed next (`allowed`), each chosen token taken in (`consume`), whether the
    grammar has ended (`done`: only a stop token may follow, or nothing). `mask_s`: the time its masks took."""

    def __init__(self, grammar: Grammar, tokenizer, vocab: int, overlap: bool = False):
        import llguidance

        self.grammar, self.vocab, self.tokenizer = grammar, vocab, tokenizer
        try:
            compiled = grammar.compiled()
        except Exception as e:  # the library's own words: what does not parse, and where
            raise EngineError(f"the {grammar.describe()} does not compile: {e}") from None
        self.matcher = llguidance.LLMatcher(_lltokenizer(tokenizer, vocab), compiled)
        if self.matcher.is_error():
            raise EngineError(f"the {grammar.describe()} does not compile: {self.matcher.get_error()}")
        self.mask_s = 0.0  # the masks' own time, summed
        self.wait_s = 0.0  # the part of it the steps waited for (the rest ran beside the model's forward pass)
        self.steps = 0
        self._stopped = False
        self.overlap = overlap
        self._next = self._start()  # the first mask, while the prompt is prefilled (with `overlap`)

    def _start(self):
        """With `overlap`, the next mask computed on the grammar's worker while the model runs its step (a GPU's
        step leaves the CPU idle); without, when the step has run (on the CPU the step holds every core, and a
        mask beside it costs more than one after it: engine/BENCHMARKS.md, "Structured output")."""
        return _WORKER.submit(self._compute) if self.overlap else None

    def _compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next mask, on the grammar's worker thread (llguidance drops the GIL while it computes): the tokens
        allowed as bool [V] and as their ids, long [n]."""
        t0 = time.perf_counter()
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # [ceil(V/32)*4]
        bits = np.unpackbits(packed, bitorder="little")[: self.vocab]  # uint8 [V], 0 or 1
        allowed = torch.from_numpy(bits).view(torch.bool), torch.from_numpy(np.flatnonzero(bits))  # [V], [n]
        self.mask_s += time.perf_counter() - t0
        return allowed

    def allowed(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens that may come next, bool [V] and ids [n] on `device`: the mask computed since the last token
        was taken in."""
        if self._next is None:  # computed now: all of its time is waited for
            before = self.mask_s
            mask, ids = self._compute()
            self.wait_s += self.mask_s - before
        else:
            t0 = time.perf_counter()
            mask, ids = self._next.result()
            self.wait_s += time.perf_counter() - t0
        self.steps += 1
        return mask.to(device), ids.to(device)

    def restrict(self, row: torch.Tensor, allowed) -> torch.Tensor:
        """The logits `row` [V] with every token the grammar forbids at -inf."""
        mask, ids = allowed
        if len(ids) * 8 < len(row):  # few allowed: gather them (cheaper than a pass over the whole row)
            return torch.full_like(row, float("-inf")).index_copy_(0, ids, row[ids])
        return torch.where(mask, row, float("-inf"))

    def weigh(self, row: torch.Tensor, allowed) -> MaskStep:
        """What the mask does to the model's logits `row` [V]: the glass box's figures. The mass removed is one
        minus the allowed tokens' share of the softmax; the model's first choice is looked up only where the
        grammar forbade it (the best allowed logit is below the best logit)."""
        mask, ids = allowed
        row = row.float()
        top = row.max()
        weights = torch.exp(row - top)  # [V]: the softmax's numerators, the largest 1
        share = float(weights[ids].sum() / weights.sum()) if len(ids) else 0.0
        preferred = text = None
        if not len(ids) or float(row[ids].max()) < float(top):
            preferred = int(torch.argmax(row))
            text = self.tokenizer.token_text(preferred)
        return MaskStep(len(ids), self.vocab, min(1.0, max(0.0, 1.0 - share)), preferred, text)

    def consume(self, token: int) -> None:
        """Take in the chosen token and start the next mask, to run beside the step that consumes the token."""
        if not self.matcher.consume_token(token):
            raise EngineError(f"the grammar refused token {token}: {self.matcher.get_error() or 'not allowed'}")
        self._stopped = self.matcher.is_stopped()  # read here: the matcher is the worker's while a mask computes
        if not self._stopped:
            self._next = self._start()

    @property
    def done(self) -> bool:
        """The grammar has ended: only a stop token, or nothing, may follow."""
        return self._stopped

    def summary(self, steps: list[MaskStep]) -> dict:
        """The reply's grammar in figures: its kind, the mean mass removed, the steps where it overrode the model's
        choice, the mask's time per token."""
        n = len(steps)
        return {
            "grammar": self.grammar.describe(),
            "kind": self.grammar.kind,
            "steps": n,
            "mean_removed": sum(s.removed for s in steps) / n if n else None,
            "overridden": sum(s.preferred is not None for s in steps),
            "mask_us": round(self.mask_s / self.steps * 1e6, 1) if self.steps else None,
            "wait_us": round(self.wait_s / self.steps * 1e6, 1) if self.steps else None,
        }


def grammar_line(g: dict) -> str:
    """A reply's grammar summary in one line (the command line's, after the reply)."""
    removed = "—" if g["mean_removed"] is None else f"{g['mean_removed']:.0%}"
    mask = "—" if g["mask_us"] is None else f"{g['mask_us']:.0f} µs a token ({g['wait_us']:.0f} µs of it waited for)"
    return (
        f"grammar: {g['grammar']} · {g['steps']} steps · {removed} of the model's probability removed a step "
        f"(mean) · the model's first choice forbidden {g['overridden']} times · mask {mask}"
    )
