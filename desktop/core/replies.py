"""A reply as the app records and words it, Qt-free: its figures (ReplyStats, filled from the engine's events),
its status and stop reason in words, the engine and model that made it, its footer, the records of its tokens,
and what the worker adds after it (Accounting)."""

from __future__ import annotations

import dataclasses

from engine import trace as figures
from engine.events import STOP_REASONS, Failed, Finished, PrefillDone, PrefillProgress, PrefillStarted, Token
from engine.logprobs import reply_confidence
from engine.request import OVERFLOW_POLICIES

from .store import Message

STATUS_BY_REASON = {k: r.status for k, r in STOP_REASONS.items()}  # a message's status (else "failed")
CONTINUABLE = ("length", "stopped", "incomplete")  # statuses a reply can be continued from
STOP_NAMES = {k: r.words for k, r in STOP_REASONS.items()}  # the stop reasons as a reply's footer names them
MADE_BY = (
    "name", "backend", "server", "server_kind", "dtype", "weights", "head_weights", "activations", "kv_cache",
    "device", "capacity", "kv_bytes_per_position", "kv_source", "layers", "kv_heads", "head_dim", "bytes_per_value",
    "kv_layer_kinds", "latent", "state",
)  # fmt: skip  # the facts a reply is stamped with: who made it, and what its cache figures are read against


def made_by(facts: dict | None) -> dict | None:
    """The engine and model a reply was made by (the facts in use when it was sent), kept with the reply so
    that its panel and footer still say so after the engine or model is switched."""
    return None if not facts else {k: facts.get(k) for k in MADE_BY if k in facts}


def branch_mark(versions, path: list[Message]) -> str:
    """Which branch a path is on, as the ‹ › arrows show it: the place among its versions of the deepest
    message on the way that has more than one ("‹2/3›"); "" when none has."""
    for m in reversed(path):
        i, n = versions.get(m.id, (0, 1))
        if n > 1:
            return f"‹{i + 1}/{n}›"
    return ""


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def model_words(made: dict | None) -> str:
    """Which model and engine made a reply, in words: "SmolLM2 (gguf Q4_1 · KV int8) · same process"."""
    if not isinstance(made, dict) or not isinstance(made.get("name"), str):
        return "model not recorded"
    weights = made.get("weights")
    precision = weights if isinstance(weights, str) and weights != "none" else made.get("dtype")
    kv = made.get("kv_cache")
    inside = " · ".join(str(p) for p in (precision, None if kv in (None, "none") else f"KV {kv}") if p)
    kind = made.get("server_kind")
    where = "same process"
    if made.get("backend") == "remote":
        where = f"remote {f'{kind} ' if kind else ''}server at {made.get('server')}"
    return f"{made['name']}" + (f" ({inside})" if inside else "") + f" · {where}"


def tokens_words(carried: int, made: int, unit: str = "") -> str:
    """A reply's token count: "106", or "106 (103 made now)" for one that went on from 3 kept tokens (`unit`
    after the total: "106 tokens (103 made now)")."""
    return f"{carried + made:,}{unit} ({made:,} made now)" if carried else f"{made:,}{unit}"


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def reply_footer(record: dict | None) -> str:
    """A reply's figures in one line, under it and in exports: tokens, tok/s, TTFT, why it stopped, which
    model made it. Read from the stored record (an import's may hold anything: what is not a number is left
    out)."""
    if not isinstance(record, dict):
        return ""
    trace = record.get("trace") if isinstance(record.get("trace"), dict) else {}
    parts = []
    if _number(trace.get("tokens")):
        carried = record["carried_tokens"] if _count(record.get("carried_tokens")) else 0
        parts.append(tokens_words(carried, trace["tokens"], " tokens"))
    if _number(trace.get("decode_tok_s")):
        parts.append(f"{trace['decode_tok_s']:,.1f} tok/s after the first")  # 1000/TPOT, not the whole request's mean
    if _number(trace.get("ttft_ms")):
        parts.append(f"TTFT {trace['ttft_ms']:,.1f} ms")
    if record.get("status") == "failed":
        parts.append(f"failed: {record.get('error') or 'unknown error'}")
    elif record.get("reason") in STOP_NAMES:
        parts.append(STOP_NAMES[record["reason"]])
    spec = trace.get("speculative") if isinstance(trace.get("speculative"), dict) else None
    if spec and isinstance(spec.get("draft"), str):
        rate = spec.get("acceptance")
        parts.append(f"drafts: {spec['draft']}" + (f", {rate:.0%} accepted" if _number(rate) else ""))
    if record.get("made_by"):
        parts.append(model_words(record["made_by"]))
    return " · ".join(parts)


@dataclasses.dataclass(frozen=True)
class Fork:
    """A new branch of reply `mid` from its token `index`: the tokens before it kept, then `token` (an
    alternative of that step, as the reply keeps it: token_id, text, logprob, sampled_logprob) or, None, a
    token drawn again there."""

    mid: int
    index: int
    token: dict | None


@dataclasses.dataclass(frozen=True)
class Accounting:
    """What the worker adds after a reply's last event: each request message's token count (counted
    after the reply, so TTFT never pays for it) and the session's summary over every request."""

    message_tokens: tuple[int, ...]
    summary: dict


@dataclasses.dataclass
class ReplyStats:
    """Everything the panel shows for one reply, from engine events (live) or a stored trace. Figures
    come from engine.trace, the one place that computes them."""

    arrival: float | None = None
    token_times: list = dataclasses.field(default_factory=list)
    trace: dict | None = None  # the engine's final trace, once finished
    reuse: dict | None = None
    cache_positions: int | None = 0  # None: a remote server that does not report it
    prompt_tokens: int = 0
    status: str = "idle"  # idle | prefill | decoding | finished | cancelled | failed
    reason: str | None = None
    error: str | None = None
    prefill_done: int = 0
    prefill_total: int = 0
    first_paint: float | None = None  # when token 1 was painted on screen (the window's paint, on trace.now)
    stored_on_screen_ms: float | None = None  # from a stored reply
    made_by: dict | None = None  # the engine and model that made it (chat.made_by); None: not recorded
    allocated_bytes: int | None = None  # the cache's allocation when it ended; None: not known
    steps: list = dataclasses.field(default_factory=list)  # each token's figures (token_record), as they come
    steps_reported: bool | None = None  # False: the engine (a remote server) sent none; None: not known yet
    carried: int = 0  # the reply's tokens from before this request (a fork's kept ones, a continued reply's)

    @classmethod
    def from_record(cls, record: dict, status: str) -> ReplyStats:
        """A stored reply's stats (what `record()` saved)."""
        trace = record.get("trace")
        cache = record.get("cache") or {}
        return cls(
            stored_on_screen_ms=record.get("on_screen_ms"),
            trace=trace,
            reuse=record.get("reuse"),
            cache_positions=cache.get("positions", 0),
            prompt_tokens=(trace or {}).get("prompt_tokens", 0),
            status=record.get("status", status),
            reason=record.get("reason"),
            error=record.get("error"),
            made_by=record.get("made_by") if isinstance(record.get("made_by"), dict) else None,
            allocated_bytes=cache.get("allocated_bytes"),
            steps=[s for s in record.get("tokens") or () if isinstance(s, dict)]
            if isinstance(record.get("tokens"), list)
            else [],
            steps_reported=record.get("tokens_reported"),
            carried=record["carried_tokens"] if _count(record.get("carried_tokens")) else 0,
        )

    @property
    def tokens(self) -> int:
        """The tokens this request made."""
        return len(self.token_times) if self.trace is None else self.trace.get("tokens", 0)

    @property
    def tokens_words(self) -> str:
        """The reply's tokens, and, where it went on from earlier ones (a fork, Continue), how many were made now."""
        return tokens_words(self.carried, self.tokens)

    @property
    def on_screen_ms(self) -> float | None:
        """Send to token 1 painted: TTFT's formula on the paint's time; the difference from TTFT is the
        seam's own latency."""
        if self.first_paint is not None:
            return figures.ttft_ms(self.arrival, [self.first_paint])
        return self.stored_on_screen_ms

    def figure(self, name: str):
        """ttft_ms, tpot_ms, decode_tok_s or e2e_ms: the engine's once finished, computed live before."""
        if self.trace is not None:
            return self.trace.get(name)
        live = {
            "ttft_ms": lambda: figures.ttft_ms(self.arrival, self.token_times),
            "tpot_ms": lambda: figures.tpot_ms(self.token_times),
            "decode_tok_s": lambda: figures.decode_tok_s(figures.tpot_ms(self.token_times)),
            "e2e_ms": lambda: figures.e2e_ms(self.arrival, self.token_times),
        }
        return live[name]() if name in live else None

    @property
    def gaps_ms(self) -> list:
        if self.trace is not None:
            return self.trace.get("gaps_ms") or []
        return figures.gaps_ms(self.token_times)

    def apply(self, ev) -> str:
        """Take one engine event into the stats; returns the text it adds to the reply."""
        if isinstance(ev, PrefillStarted):
            self.reuse, self.prompt_tokens, self.prefill_total = ev.reuse.to_dict(), ev.prompt_tokens, ev.reuse.computed
        elif isinstance(ev, PrefillProgress):
            self.prefill_done, self.cache_positions = ev.done, ev.cache_positions
        elif isinstance(ev, PrefillDone):
            self.status, self.cache_positions, self.prefill_done = "decoding", ev.cache_positions, ev.computed
        elif isinstance(ev, Token):
            self.token_times.append(ev.time)
            self.cache_positions = ev.cache_positions
            if ev.logprobs is not None:
                self.steps.append(token_record(ev.text, ev.token_id, ev.logprobs, ev.draft, ev.grammar))
            return ev.text
        elif isinstance(ev, Finished):
            self.trace, self.reuse, self.reason = ev.trace, ev.reuse.to_dict(), ev.reason
            self.cache_positions = ev.cache["positions"]
            self.allocated_bytes = ev.cache.get("allocated_bytes")
            self.status = "cancelled" if ev.reason == "cancelled" else "finished"
            if ev.logprobs and not self.steps:  # a remote server's: the tokens as it names them
                ids = ev.token_ids or (-1,) * len(ev.logprobs)
                self.steps = [token_record(s.text, i, s) for s, i in zip(ev.logprobs, ids)]
            self.steps_reported = bool(self.steps) or not self.token_times
            return ev.tail
        elif isinstance(ev, Failed):
            self.status, self.error = "failed", f"{ev.error} ({self.failed_at})"
            if ev.cache:
                self.cache_positions = ev.cache["positions"]
                self.allocated_bytes = ev.cache.get("allocated_bytes")
        return ""

    @property
    def failed_at(self) -> str:
        """Where a request stood when it failed: before its prefill, inside it, or after some tokens."""
        if self.reuse is None:
            return "before its prefill"
        if not self.token_times:
            return f"during its prefill, {self.prefill_done:,} of {self.prefill_total:,} positions computed"
        return f"after {len(self.token_times):,} tokens"

    @property
    def title(self) -> str:
        """The panel's heading for this reply."""
        done = f"Reply · {STOP_NAMES.get(self.reason, self.reason)}" if self.reason else "Reply"
        return {
            "finished": done,
            "complete": done,  # a stored reply: its message's status
            "length": done,
            "stopped": "Reply · stopped",
            "incomplete": "Reply · incomplete (the app closed mid-reply)",
            "cancelled": "Reply · stopped",
            "prefill": "Prefill…",
            "decoding": "Generating…",
            "failed": f"Reply · failed: {self.error}",
            "idle": "No reply yet",
        }.get(self.status, self.status)

    @property
    def confidence(self) -> dict:
        """The reply's mean log-probability, perplexity and low-confidence tokens (engine.logprobs)."""
        return reply_confidence(self.steps)

    def to_json(self) -> dict:
        return {
            "tokens": self.steps,
            "confidence": self.confidence,
            "made_by": self.made_by,
            "status": self.status,
            "reason": self.reason,
            "error": self.error,
            "trace": self.trace,
            "reuse": self.reuse,
            "cache_positions": self.cache_positions,
            "prompt_tokens": self.prompt_tokens,
        }


def left_out(messages, upto: list[Message], reuse: dict | None) -> list[int]:
    """The ids of the branch's messages a request's overflow policy left out of its prompt (its
    `dropped_messages` are indices into the request's messages: the system prompt, if any, then `upto`)."""
    dropped = (reuse or {}).get("dropped_messages") or ()
    first = 1 if messages and messages[0].get("role") == "system" else 0
    return [upto[i - first].id for i in dropped if 0 <= i - first < len(upto)]


def token_record(shown: str, token_id: int, step, draft: str = "", grammar=None) -> dict:
    """One token of a reply as it is kept with the reply: the text it added on screen (`shown`; a token inside
    a character shows nothing, the next shows the character), its id (-1: a server that does not say), what
    the model weighed at its step (engine.logprobs.StepLogprobs), with drafts its part in them (Token.draft), with
    a grammar what the grammar did there (engine.grammar.MaskStep)."""
    record = {"shown": shown, "token_id": token_id, **step.to_dict(), **({"draft": draft} if draft else {})}
    if grammar is not None:
        record["grammar"] = grammar.to_dict()
    return record


def title_from(text: str) -> str:
    """A conversation's title from its first message."""
    return text[:48] + ("…" if len(text) > 48 else "")


def first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def transcript_marks(path: list[Message]) -> dict[int, dict]:
    """What the transcript says beside a branch's messages, from its stored replies, by message id: the model that
    made each reply (`model`), a line where the model changed between replies (`changed`), and the messages the
    last reply did not see (`left_out`: its overflow policy left them out)."""
    replies = [m for m in path if m.role == "assistant" and isinstance(m.trace, dict)]
    record = replies[-1].trace if replies else {}
    policy = OVERFLOW_POLICIES.get((record.get("reuse") or {}).get("overflow"), "")
    left = f"Not seen by the model for the last reply: left out to fit the cache ({policy})"
    marks = {mid: {"left_out": left} for mid in record.get("left_out") or ()}
    before = None
    for m in replies:
        name = (m.trace.get("made_by") or {}).get("name")
        marks.setdefault(m.id, {})["model"] = name
        if before is not None and name is not None and name != before:
            marks[m.id]["changed"] = f"Model changed: {before} → {name} (a new model: its cache started empty)"
        before = name or before
    return marks
