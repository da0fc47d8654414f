"""The chat logic without Qt: send, edit, regenerate, continue and branch switching over the
conversation store, the request each builds, and what each engine event does to the reply.

The window drives a ChatController and shows what it holds; tests drive it with a fake client.
The controller talks back through a listener (the window) with four calls: the transcript
changed, the reply progressed, the reply finished, an error to show.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Protocol

from engine import trace as figures
from engine.events import STOP_REASONS, Failed, Finished, PrefillDone, PrefillProgress, PrefillStarted, Token
from engine.logprobs import MAX_TOP_LOGPROBS, reply_confidence
from engine.session import Request

from .cache_map import CacheMap
from .settings import Settings
from .store import Message, Store
from .store_file import StoreError

SAVE_EVERY_S = 0.25  # partial replies reach the database this often while streaming
STATUS_BY_REASON = {k: r.status for k, r in STOP_REASONS.items()}  # a message's status (else "failed")
CONTINUABLE = ("length", "stopped", "incomplete")  # statuses a reply can be continued from
STOP_NAMES = {k: r.words for k, r in STOP_REASONS.items()}  # the stop reasons as a reply's footer names them
MADE_BY = (
    "name", "backend", "server", "server_kind", "dtype", "weights", "head_weights", "activations", "kv_cache",
    "device", "capacity", "kv_bytes_per_position", "kv_source", "layers", "kv_heads", "head_dim", "bytes_per_value",
    "kv_layer_kinds",
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


def reply_footer(record: dict | None) -> str:
    """A reply's figures in one line, under it and in exports: tokens, tok/s, TTFT, why it stopped, which
    model made it. Read from the stored record (an import's may hold anything: what is not a number is left
    out)."""
    if not isinstance(record, dict):
        return ""
    trace = record.get("trace") if isinstance(record.get("trace"), dict) else {}
    parts = []
    if _number(trace.get("tokens")):
        parts.append(f"{trace['tokens']:,} tokens")
    if _number(trace.get("decode_tok_s")):
        parts.append(f"{trace['decode_tok_s']:,.1f} tok/s after the first")  # 1000/TPOT, not the whole request's mean
    if _number(trace.get("ttft_ms")):
        parts.append(f"TTFT {trace['ttft_ms']:,.1f} ms")
    if record.get("status") == "failed":
        parts.append(f"failed: {record.get('error') or 'unknown error'}")
    elif record.get("reason") in STOP_NAMES:
        parts.append(STOP_NAMES[record["reason"]])
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


class Client(Protocol):
    """Where replies come from: the worker thread (desktop.client) or, in tests, a fake."""

    def stream(self, request: Request) -> AsyncIterator[tuple]: ...

    def stop(self) -> None: ...


class Listener(Protocol):
    def transcript_changed(self) -> None: ...

    def reply_progressed(self) -> None: ...

    def first_token(self) -> None: ...

    def reply_finished(self, final, highlight: tuple[int, int, int] | None) -> None: ...

    def show_error(self, text: str) -> None: ...


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
        )

    @property
    def tokens(self) -> int:
        return len(self.token_times) if self.trace is None else self.trace.get("tokens", 0)

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
                self.steps.append(token_record(ev.text, ev.token_id, ev.logprobs))
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


def token_record(shown: str, token_id: int, step) -> dict:
    """One token of a reply as it is kept with the reply: the text it added on screen (`shown`; a token inside
    a character shows nothing, the next shows the character), its id (-1: a server that does not say) and
    what the model weighed at its step (engine.logprobs.StepLogprobs)."""
    return {"shown": shown, "token_id": token_id, **step.to_dict()}


def title_from(text: str) -> str:
    """A conversation's title from its first message."""
    return text[:48] + ("…" if len(text) > 48 else "")


def first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class ChatController:
    """One conversation at a time over the store; at most one reply streaming."""

    def __init__(self, store: Store, client: Client, settings: Settings, listener: Listener, clock):
        self.store, self.client, self.settings, self.listener, self.clock = store, client, settings, listener, clock
        self.current_cid: int | None = None
        self.generating = False
        self.streaming_mid: int | None = None
        self.stream_text = ""  # the streaming reply's text so far
        self.stats = ReplyStats()  # the reply the panel shows
        self.engine_facts: dict | None = None  # the engine and model in use (the window's, once loaded)
        self.stats_by_message: dict[int, ReplyStats] = {}
        self.selected_mid: int | None = None
        self.summary: dict | None = None  # the session's figures after the last reply
        self.store_state: dict | None = None  # the prefix store after the last reply or probe
        self._edit: tuple[int, int] | None = None  # (new message id, first changed character) of an edit
        self.cache_map = CacheMap()  # the KV cache now: what each position holds and where it came from

    # --- the store, guarded --------------------------------------------------------------------
    def guard(self, fn, *args, **kw):
        """Run a store call; a locked or failing database becomes a message, not a crash."""
        try:
            return fn(*args, **kw)
        except StoreError as e:
            self.listener.show_error(str(e))
            return None

    def branch(self) -> list[Message]:
        return self.store.branch(self.current_cid) if self.current_cid is not None else []

    def rows(self) -> list[tuple[Message, int, int]]:
        """The current branch as (message, its index among its siblings, how many siblings)."""
        if self.current_cid is None:
            return []
        versions = self.store.versions(self.current_cid)
        return [(m, *versions[m.id]) for m in self.branch()]

    def last_message(self) -> Message | None:
        """The branch's last message (its leaf: one read, however long the conversation)."""
        if self.current_cid is None:
            return None
        leaf = self.store.conversation(self.current_cid).leaf_id
        return None if leaf is None else self.store.message(leaf)

    def can_regenerate(self) -> bool:
        """A reply can be run again, or run at all for a user message left without one (a crash right
        after Send)."""
        last = self.last_message()
        return not self.generating and last is not None and last.role in ("assistant", "user")

    def can_continue(self) -> bool:
        last = self.last_message()
        return self.can_regenerate() and last.role == "assistant" and last.status in CONTINUABLE

    # --- conversations -------------------------------------------------------------------------
    def new_conversation(self) -> bool:
        if self.generating:
            return False
        conv = self.guard(self.store.new_conversation, "New chat", self.settings.conversation_part())
        if conv is None:
            return False
        self.current_cid = conv.id
        return True

    def switch_branch(self, mid: int, delta: int) -> bool:
        """Show the sibling `delta` away from message `mid` (‹ ›), down to that branch's newest leaf."""
        if self.generating:
            return False
        sibs = self.store.siblings(self.store.message(mid))
        i = next(k for k, s in enumerate(sibs) if s.id == mid) + delta
        if not 0 <= i < len(sibs):
            return False
        self.guard(self.store.set_leaf, self.current_cid, self.store.deepest_leaf(sibs[i].id))
        return True

    def reveal(self, mid: int) -> bool:
        """Show a branch that holds message `mid` (a search's match on another branch), down to that
        branch's newest leaf; False when the branch shown holds it already."""
        if self.current_cid is None or any(m.id == mid for m in self.branch()):
            return False
        self.guard(self.store.set_leaf, self.current_cid, self.store.deepest_leaf(mid))
        return True

    def select_message(self, mid: int) -> ReplyStats | None:
        """The stats of a reply (live, or from its stored trace) become the panel's."""
        self.selected_mid = mid
        st = self.stats_by_message.get(mid)
        if st is None:
            m = self.store.message(mid)
            if m.trace:
                st = self.stats_by_message[mid] = ReplyStats.from_record(m.trace, m.status)
        if st is not None:
            self.stats = st
        return st

    def follow_shown(self, mid: int | None) -> bool:
        """The panel describes the reply on screen: `mid`, the last reply of the branch shown (None: it has
        none), unless the reply streaming now is one of the branch's messages. Its own figures (live, or
        stored with it), or none at all ("No reply yet"); never another reply's. True when that changed
        what the panel shows."""
        if self.streaming_mid is not None and self.streaming_mid == mid:
            return False
        if mid is not None and mid == self.selected_mid and self.stats is self.stats_by_message.get(mid):
            return False
        if mid is not None and self.select_message(mid) is not None:
            return True
        changed = self.stats.status != "idle" or self.selected_mid != mid
        self.selected_mid, self.stats = mid, ReplyStats()  # a reply with no figures (an import), or no reply
        return changed

    # --- requests ------------------------------------------------------------------------------
    def settings_for(self, cid: int | None = None) -> Settings:
        """The app's settings with the conversation's own system prompt and sampling over them."""
        cid = self.current_cid if cid is None else cid
        own = self.store.conversation(cid).settings if cid is not None else None
        return self.settings.with_conversation(own)

    def messages(self, upto: list[Message], cid: int | None = None) -> list[dict]:
        """What the model sees: the conversation's system prompt, then the messages of the branch up to here."""
        prompt = self.settings_for(cid).system_prompt
        system = [{"role": "system", "content": prompt}] if prompt else []
        return system + [{"role": m.role, "content": m.content} for m in upto]

    def request(self, messages: list[dict], arrival: float, cid: int | None = None, **kw) -> Request:
        s = self.settings_for(cid)
        top = max(0, min(MAX_TOP_LOGPROBS, s.token_alternatives))
        return Request(messages=messages, sampling=s.sampling(), max_new_tokens=s.max_new_tokens, arrival=arrival,
                       logprobs=True, top_logprobs=top, overflow=s.policy, **kw)  # fmt: skip

    def label(self, cid: int, upto: list[Message]) -> str:
        """A name for a prompt in the prefix store's picture: the conversation's title, and the branch
        (‹2/3›) of the deepest edited message on the way, if any."""
        title = self.store.conversation(cid).title
        mark = branch_mark(self.store.versions(cid), upto)
        return f"{title} {mark}" if mark else title

    def messages_until(self, mid: int) -> list[Message]:
        """The current branch from the root to message `mid`, included."""
        path = self.branch()
        return path[: next(i for i, m in enumerate(path) if m.id == mid) + 1]

    # --- what a person does --------------------------------------------------------------------
    def send(self, text: str, arrival: float) -> int | None:
        """A new user message on the current branch (a new conversation if none); returns its id, whose
        reply the caller then runs (`reply`)."""
        text = text.strip()
        if not text or self.generating:
            return None
        if self.current_cid is None:
            conv = self.guard(self.store.new_conversation, title_from(text), self.settings.conversation_part())
            if conv is None:
                return None
            self.current_cid = conv.id
        else:
            conv = self.store.conversation(self.current_cid)
            if conv.title == "New chat":
                self.guard(self.store.rename, conv.id, title_from(text))
        user = self.guard(self.store.add_message, self.current_cid, conv.leaf_id, "user", text)
        return None if user is None else user.id

    def edit(self, mid: int, text: str) -> int | None:
        """An edit makes a sibling branch. Returns the new user message's id when its reply must be
        regenerated (through prefix reuse), else None."""
        if self.generating:
            return None
        old = self.store.message(mid)
        new = self.guard(self.store.add_message, self.current_cid, old.parent_id, old.role, text)
        if new is None:
            return None
        self._edit = (new.id, first_difference(old.content, text))
        return new.id if old.role == "user" else None

    def regenerate_target(self) -> int | None:
        """The user message whose reply Regenerate runs (again)."""
        if not self.can_regenerate():
            return None
        last = self.last_message()
        return last.id if last.role == "user" else last.parent_id

    def continue_target(self) -> tuple[int, int | None] | None:
        """(the user message, the reply to extend) for Continue; a reply that stopped before its first
        token has nothing to extend, so it is answered afresh."""
        if not self.can_continue():
            return None
        last = self.last_message()
        return last.parent_id, (last.id if last.content else None)

    def stop(self) -> None:
        self.client.stop()

    def fork_target(self, mid: int, index: int, token: dict | None) -> Fork | None:
        """A fork of reply `mid` at its token `index`: the new branch keeps the tokens before it and goes on
        with `token` (one of that step's alternatives) or, None, a token drawn again there."""
        if self.generating:
            return None
        m = self.store.message(mid)
        steps = (m.trace or {}).get("tokens") if isinstance(m.trace, dict) else None
        if m.role != "assistant" or not isinstance(steps, list) or not 0 <= index < len(steps):
            return None
        return Fork(mid, index, token)

    def start(self, parent_id: int, arrival: float, continue_mid: int | None = None, fork: Fork | None = None):
        """Claim the one reply slot at once and return the coroutine that streams the reply to message
        `parent_id` (or extends reply `continue_mid`); None when a reply is already running, so that
        two clicks in one event-loop turn start one reply. The reply stays in this conversation
        whatever the person opens while it streams."""
        if self.generating:
            return None
        self.generating = True
        return self._run(self.current_cid, self.messages_until(parent_id), parent_id, arrival, continue_mid, fork)

    async def reply(self, parent_id: int, arrival: float, continue_mid: int | None = None) -> None:
        """start() and wait for the reply to end."""
        run = self.start(parent_id, arrival, continue_mid)
        if run is not None:
            await run

    async def _run(self, cid, upto, parent_id, arrival, continue_mid, fork=None) -> None:
        try:
            await self._reply(cid, upto, parent_id, arrival, continue_mid, fork)
        finally:
            self.generating = False
            self.streaming_mid = None

    async def _reply(self, cid: int, upto: list[Message], parent_id: int, arrival: float, continue_mid, fork=None):
        carried: list[dict] = []  # a fork's tokens before it (and the token it forks with)
        if fork is not None:
            req, prefix, carried = self._fork_request(cid, upto, arrival, fork)
            old_tokens = len(carried)
        elif continue_mid is not None:
            base = self.store.message(continue_mid)
            prefix, old_tokens = base.content, base.token_count or 0
            req = self.request(
                self.messages(upto, cid) + [{"role": "assistant", "content": prefix}],
                arrival,
                cid,
                continue_final_message=True,
                add_generation_prompt=False,
                label=self.label(cid, upto),
            )
        else:
            prefix, old_tokens = "", 0
            req = self.request(self.messages(upto, cid), arrival, cid, label=self.label(cid, upto))
        assistant = self.store.add_message(cid, parent_id, "assistant", prefix, status="streaming")
        self.streaming_mid = assistant.id
        self.stream_text = prefix
        stats = self.stats = self.stats_by_message[assistant.id] = ReplyStats(
            arrival=arrival, status="prefill", made_by=made_by(self.engine_facts), steps=carried
        )  # its own: the panel may show another reply meanwhile (another conversation opened)
        self.selected_mid = assistant.id
        title = self.store.conversation(cid).title
        self.cache_map.start(req.messages or [], len(req.reply_ids), f"the reply to “{title}”, message {len(upto) + 1}")
        self.listener.transcript_changed()
        highlight, self._edit = self._edit, None
        text, saved, last_save, final = prefix, prefix, self.clock(), None
        async for batch in self.client.stream(req):
            first = False
            for ev in batch:
                if isinstance(ev, Accounting):
                    self._count_tokens(upto, ev)
                    continue
                if isinstance(ev, PrefillStarted) and ev.reply_prefix and fork is not None and text == prefix:
                    text = self._forked_prefix(ev.reply_prefix, carried, fork)  # the engine's own decode of it
                    prefix = saved = text
                text += stats.apply(ev)
                self.cache_map.apply(ev)
                first = first or (isinstance(ev, Token) and ev.index == 1)
                if isinstance(ev, (Finished, Failed)):
                    final = ev
                    self.store_state = (ev.cache or {}).get("store", self.store_state)
            self.stream_text = text
            # The first text at once (a crash in the first interval must not lose it), then every interval.
            if final is None and text != saved and (saved == prefix or self.clock() - last_save >= SAVE_EVERY_S):
                saved = text
                self.guard(self.store.update_message, assistant.id, content=text, token_count=old_tokens + stats.tokens)
                last_save = self.clock()
            if first:
                self.listener.first_token()  # drawn at once, not at the next refresh tick
            self.listener.reply_progressed()
        if final is None:  # the stream ended without a last event: the worker went away
            final = Failed("the engine stopped before the reply ended", "EngineError", {})
            stats.apply(final)
        status = STATUS_BY_REASON.get(final.reason, "failed") if isinstance(final, Finished) else "failed"
        if isinstance(final, Finished):
            text = prefix + final.text
        record = {
            "on_screen_ms": stats.on_screen_ms,
            "status": status,
            "reason": getattr(final, "reason", None),
            "trace": final.trace,
            "reuse": stats.reuse,
            "cache": {k: v for k, v in (final.cache or {}).items() if k != "store"},  # the store's picture is now's
            "error": stats.error,
            "made_by": stats.made_by,
            "tokens": stats.steps,
            "tokens_reported": stats.steps_reported,
            "left_out": left_out(req.messages or (), upto, stats.reuse),
        }
        self.guard(
            self.store.update_message,
            assistant.id,
            content=text,
            status=status,
            token_count=old_tokens + stats.tokens,
            trace=record,
        )
        if isinstance(final, Failed):
            self.listener.show_error(f"The reply failed: {final.error}")
        self.stream_text = text
        self.generating, self.streaming_mid = False, None
        self.listener.transcript_changed()
        mark = None
        reuse = stats.reuse or {}
        if highlight and reuse.get("first_invalidated_position") is not None:
            width = len((reuse.get("new_token") or {}).get("text", "").strip()) or 1
            mark = (highlight[0], highlight[1], highlight[1] + width)  # (message, first, end character)
        self.listener.reply_finished(final, mark)

    def _fork_request(self, cid: int, upto: list[Message], arrival: float, fork: Fork):
        """(the request, the reply's text so far, its tokens so far) of a fork. A local engine is given the
        token ids, so that every position before the fork is reused and the fork's token alone computed; a
        remote one, which takes only messages, the text to continue."""
        steps = self.store.message(fork.mid).trace["tokens"]
        kept = [dict(s) for s in steps[: fork.index]]
        carried = list(kept)
        if fork.token is not None:
            at = steps[fork.index]
            top = at.get("top") or []
            place = next((k for k, a in enumerate(top) if a.get("token_id") == fork.token.get("token_id")), None)
            carried.append({
                "shown": str(fork.token.get("text", "")), "token_id": fork.token.get("token_id", -1),
                "text": str(fork.token.get("text", "")), "logprob": fork.token.get("logprob"),
                "sampled_logprob": fork.token.get("sampled_logprob"), "entropy": at.get("entropy"),
                "sampled_entropy": at.get("sampled_entropy"), "rank": None if place is None else place + 1,
                "top": top, "forked": True,
            })  # fmt: skip
        ids = [s.get("token_id", -1) for s in carried]
        prefix = "".join(str(s.get("shown", "")) for s in carried)
        remote = (self.engine_facts or {}).get("backend") == "remote" or any(type(i) is not int or i < 0 for i in ids)
        label = self.label(cid, upto)
        if remote:
            messages = self.messages(upto, cid) + [{"role": "assistant", "content": prefix}]
            req = self.request(messages, arrival, cid, continue_final_message=True, add_generation_prompt=False,
                               label=label)  # fmt: skip
        else:
            req = self.request(self.messages(upto, cid), arrival, cid, reply_ids=tuple(ids), label=label)
        return req, prefix, carried

    @staticmethod
    def _forked_prefix(decoded: str, carried: list[dict], fork: Fork) -> str:
        """The fork's text as the engine decodes its tokens; the forked token shows what it adds to it."""
        if fork.token is not None and carried:
            before = "".join(str(s.get("shown", "")) for s in carried[:-1])
            if decoded.startswith(before):
                carried[-1]["shown"] = decoded[len(before) :]
        return decoded

    def _count_tokens(self, upto: list[Message], acc: Accounting) -> None:
        """Each message's token count, for the transcript (only those not counted yet)."""
        self.summary = acc.summary
        n_sys = 1 if self.settings_for(upto[0].conversation_id if upto else None).system_prompt else 0
        for m, n in zip(upto, acc.message_tokens[n_sys : n_sys + len(upto)]):
            if m.token_count is None:
                self.guard(self.store.update_message, m.id, token_count=n)

    @property
    def streaming_stats(self) -> ReplyStats | None:
        """The figures of the reply streaming now (whichever the panel shows)."""
        return None if self.streaming_mid is None else self.stats_by_message.get(self.streaming_mid)

    def heading(self) -> str:
        """Which reply the panel describes, in words: its state, its conversation, its place in the branch
        and among its versions, and the engine and model that made it."""
        st, mid = self.stats, self.selected_mid
        if mid is None or st.status == "idle":
            return st.title
        conv = self.store.conversation(self.store.message(mid).conversation_id)
        where = f"“{conv.title}”"
        if self.store.kept(conv.id):  # its branch is read (a long one being read is not read again here)
            path = self.store.branch(conv.id)
            at = next((k for k, b in enumerate(path) if b.id == mid), None)
            if at is None:
                where += ", on another branch"
            else:
                mark = branch_mark(self.store.versions(conv.id), path[: at + 1])
                where += f", message {at + 1} of {len(path)}" + (f", branch {mark}" if mark else "")
        return f"{st.title}\n{where}\nby {model_words(st.made_by)}"

    def save_partial(self) -> None:
        """On close mid-reply: what streamed so far is kept, marked stopped."""
        if self.generating and self.streaming_mid is not None:
            self.client.stop()
            self.guard(
                self.store.update_message,
                self.streaming_mid,
                content=self.stream_text,
                status="stopped",
                token_count=self.streaming_stats.tokens,
            )
