"""The records a generation yields. Small, immutable, plain values: safe to hand to another thread."""

from __future__ import annotations

import dataclasses

from .grammar import MaskStep
from .logprobs import StepLogprobs


@dataclasses.dataclass(frozen=True)
class ReuseReport:
    """What happened to the cache for one request.

    reused: prompt positions whose K/V were kept; computed: prompt positions prefilled;
    invalidated: positions of the working cache thrown away; first_invalidated_position: where the
    working cache was cut (None when nothing was thrown away), with the cached and the new token there.
    source: where the reused positions came from (working: the working cache; store: the prefix
    store; disk: the disk tier; none); stored_prefix: the prompt positions the store held; copied_positions:
    the positions brought in from the store or the disk, of which shared_positions were taken by reference (the
    KV pool's blocks themselves: nothing copied); copied_bytes and copy_ms: the bytes the rest took to copy, and
    the time it all took; stashed_bytes and stash_ms: what the store took of the working cache before it was cut
    (kept, not lost: by reference, or copied), and the time that took. dropped_positions and
    dropped_messages: what the request's overflow policy left out of a prompt too long for the cache.
    """

    reused: int
    computed: int
    invalidated: int
    first_invalidated_position: int | None
    cached_token: dict | None  # {"id": int, "text": str}
    new_token: dict | None
    reason: str | None
    source: str = "none"
    stored_prefix: int = 0
    copied_positions: int = 0
    copied_bytes: int = 0
    shared_positions: int = 0
    copy_ms: float | None = None
    stashed_bytes: int = 0
    stash_ms: float | None = None
    dropped_positions: int = 0  # positions of the prompt left out to fit the cache (the request's overflow policy)
    dropped_messages: tuple[int, ...] = ()  # which of the request's messages were left out (their indices)
    overflow: str = "stop"  # the policy the request asked for
    slid_out: int = 0  # prompt positions the cache matched but could not keep: gone from a sliding layer's window

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class PrefillStarted:
    prompt_tokens: int
    reuse: ReuseReport
    prompt_token_ids: tuple[int, ...]
    reply_prefix: str = ""  # the text of the request's reply_ids: the reply starts with it
    message_spans: tuple[tuple[int, int], ...] = ()  # each request message's own text as positions [first, end)
    lane: int | None = None  # which of the engine's lanes runs it (engine.batching): whose working cache it fills


@dataclasses.dataclass(frozen=True)
class PrefillProgress:
    done: int  # prompt positions computed so far (of `total`)
    total: int
    cache_positions: int


@dataclasses.dataclass(frozen=True)
class PrefillDone:
    reused: int
    computed: int
    seconds: float
    cache_positions: int


@dataclasses.dataclass(frozen=True)
class Waiting:
    """A generation waiting on I/O (a remote server's next chunk): the scheduler runs the other lanes meanwhile
    (engine.batching). Never sent to a sink."""


WAITING = Waiting()


@dataclasses.dataclass(frozen=True)
class Token:
    index: int  # 1-based: token 1 is the first output token
    token_id: int
    text: str  # the text delta; never splits a UTF-8 character
    time: float  # emission time on trace.now
    cache_positions: int | None  # consumed positions when this token was emitted (it is not); None: not known
    logprobs: StepLogprobs | None = None  # what the model weighed at this step; None: not asked for
    draft: str = ""  # speculative decoding: "accepted" (drafted, and the target agreed), "corrected" (the target's
    # own where it rejected a draft), "target" (its own, nothing drafted there); "" without drafts
    rejected: int = 0  # drafted positions its round wrote and threw away: cache_positions.. onwards, rolled back
    grammar: MaskStep | None = None  # what the request's grammar allowed at this step (engine.grammar); None: none


@dataclasses.dataclass(frozen=True)
class Finished:
    reason: str  # eos | stop_string | max_new_tokens | capacity | cancelled
    text: str
    token_ids: tuple[int, ...]
    trace: dict
    cache: dict
    reuse: ReuseReport
    tail: str = ""  # text the streamed deltas had not yet shown (a character cut at the end)
    logprobs: tuple[StepLogprobs, ...] = ()  # each output token's, when the request asked for them
    drafts: tuple[str, ...] = ()  # each output token's part in speculative decoding (Token.draft); () without
    grammar: tuple[MaskStep, ...] = ()  # each output token's MaskStep (Token.grammar); () without a grammar
    tool_calls: tuple = ()  # the calls the reply made (engine.tool_calls.ToolCall); `text` is then what came before


@dataclasses.dataclass(frozen=True)
class Failed:
    error: str
    kind: str  # the exception's class name: CapacityError, TemplateError, ...
    trace: dict
    cache: dict | None = None  # the cache after the failure (what it still holds)


Event = PrefillStarted | PrefillProgress | PrefillDone | Token | Finished | Failed


@dataclasses.dataclass(frozen=True)
class StopReason:
    """How one of the engine's stop reasons is told: the reply's status in the app, its words in a reply's
    footer, and OpenAI's finish_reason on the wire (None: OpenAI has none for a stopped reply)."""

    status: str
    words: str
    finish: str | None


STOP_REASONS = {
    "eos": StopReason("complete", "stop token", "stop"),
    "stop_string": StopReason("complete", "stop string", "stop"),
    "max_new_tokens": StopReason("length", "token limit", "length"),
    "capacity": StopReason("length", "cache full", "length"),
    "cancelled": StopReason("stopped", "stopped", None),
    "grammar": StopReason("complete", "the grammar's end", "stop"),  # nothing may follow what it has parsed
}  # every reason a Finished event may carry
