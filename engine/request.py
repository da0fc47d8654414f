"""A request and what fitting it to the cache means: the Request record, its prompt as token ids, the
overflow policies that leave whole turns out of a conversation too long for the cache, and the capacity
check. Plain functions over a tokenizer and a capacity: no cache, no model."""

from __future__ import annotations

import dataclasses

from .errors import CapacityError, EngineError
from .grammar import Grammar
from .sampling import SamplingParams
from .tokenizer import ChatPrompt

OVERFLOW_POLICIES = {
    "stop": "stop at the limit",
    "drop-oldest": "drop the oldest messages",
    "truncate-middle": "truncate the middle",
}  # what a request does with a prompt longer than the cache allows: refuse it, or leave messages out


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation. `messages` (rendered with the chat template) or `prompt` (raw text)."""

    messages: tuple[dict, ...] | list[dict] | None = None
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None  # already tokenized (e.g. "continue this reply")
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 256
    stop_strings: tuple[str, ...] = ()
    stop_on_capacity: bool = False  # False: refuse a request that may not fit; True: stop when full
    arrival: float | None = None  # on trace.now; None = when generate() is called
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # extend the last (assistant) message instead of starting a new one
    label: str | None = None  # a name for the prompt in the prefix store's picture (a conversation's title)
    ignore_eos: bool = False  # run to max_new_tokens past stop tokens (benchmarks; vLLM's ignore_eos)
    logprobs: bool = False  # each Token carries what the model weighed at its step (engine.logprobs)
    top_logprobs: int = 5  # with logprobs: the alternatives per step (0: none)
    reply_ids: tuple[int, ...] = ()  # tokens the reply starts with, after the prompt (a fork from a token)
    overflow: str = "stop"  # a prompt too long for the cache: refused (stop), or messages left out (OVERFLOW_POLICIES)
    share_prompt: bool = False  # once prefilled, its prompt's K/V go to the prefix store for requests beside it
    speculative: str | None = None  # drafts: "int4" (the model itself in int4), "lookup" (n-grams of the context),
    # or a model file or folder with the model's tokenizer (engine.speculative); None: none
    draft_tokens: int = 4  # tokens drafted a round at most (fewer while drafts are rejected)
    grammar: Grammar | None = None  # what the reply must parse as: a JSON schema, any JSON object, Lark, GBNF
    tools: tuple = ()  # the functions the model may call (engine.tool_calls.Tool), shown through its template
    tool_choice: str = "none"  # none | auto | required | a function's name (engine.tool_calls.read_choice)
    parallel_tool_calls: bool = True  # with a call required: one call, or one or more


def choice_requests(req: Request, n: int) -> list[Request]:
    """The requests of `n` choices of one prompt (a server's `n`, the app's Alternatives ×N): choice i seeded with
    seed + i (unseeded: each draws its own), the first sharing its prefill with the others through the prefix
    store (the others are sent once it is prefilled, and copy the prompt from there)."""
    seed = req.sampling.seed
    out = []
    for i in range(n):
        sampling = req.sampling if seed is None else dataclasses.replace(req.sampling, seed=seed + i)
        out.append(dataclasses.replace(req, sampling=sampling, share_prompt=n > 1 and i == 0))
    return out


@dataclasses.dataclass(frozen=True)
class Fitted:
    """A request's prompt as it will run: the template's rendering (`chat`), the reply's forced start after it
    (`ids` is both), the messages the overflow policy left out and the prompt positions that went with them."""

    chat: ChatPrompt
    ids: list[int]
    dropped: tuple[int, ...] = ()
    dropped_positions: int = 0

    def note(self, overflow: str) -> str | None:
        """What was left out, in words, for the reuse report's reason."""
        if not (self.dropped or self.dropped_positions):
            return None
        what = f"{len(self.dropped)} messages" if self.dropped else "tokens"
        return f"{what} ({self.dropped_positions} positions) left out to fit the cache: {OVERFLOW_POLICIES[overflow]}"


def positions_needed(prompt: int, max_new_tokens: int) -> int:
    """The cache positions a request needs: its prompt and its reply but the last output token, which is
    never consumed (the capacity check's rule, and the app's context meter's)."""
    return prompt + max_new_tokens - 1


def turns(messages: list[dict]) -> list[list[int]]:
    """The non-system messages as turns (a user message and what follows it until the next), by index."""
    out: list[list[int]] = []
    for i, m in enumerate(messages):
        if m.get("role") == "system":
            continue
        if m.get("role") == "user" or not out:
            out.append([])
        out[-1].append(i)
    return out


def overflow_orders(policy: str, messages: list[dict]) -> list[list[int]]:
    """The messages a policy may leave out, in the order it leaves them out, as whole turns; never the system
    prompt nor the last turn. drop-oldest: the oldest turns first; truncate-middle: the turns after the first
    one, oldest first, and the first turn last (where a conversation usually states what it is about)."""
    ts = turns(messages)[:-1]
    if policy == "drop-oldest":
        return ts
    if policy == "truncate-middle":
        return ts[1:] + ts[:1]
    return []


def render(tok, req: Request) -> ChatPrompt:
    """The prompt's ids and, for messages, where each message's text lies among them."""
    if req.prompt_ids is not None:
        return ChatPrompt(list(req.prompt_ids), ())
    if req.messages is not None:
        offered = [t.to_dict() for t in req.tools] if req.tools and req.tool_choice != "none" else None
        return tok.chat_prompt(
            list(req.messages),
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            **({"tools": offered} if offered else {}),
        )
    if req.prompt is not None:
        return ChatPrompt(tok.encode(req.prompt, add_special_tokens=True), ())
    raise EngineError("a request needs messages or a prompt")


def room(req: Request, capacity: int) -> int:
    """The reply's positions a prompt must leave free: all of max_new_tokens, or, for a request that stops
    when the cache is full, up to a quarter of the capacity."""
    return req.max_new_tokens if not req.stop_on_capacity else min(req.max_new_tokens, max(1, capacity // 4))


def fit(tok, req: Request, capacity: int) -> Fitted:
    """The prompt the request's overflow policy makes of a conversation too long for the cache, with the
    indices of the messages it left out and the prompt positions that went with them: as few whole turns
    as it takes (a binary search over how many; each try rendered and tokenized), never the system prompt
    nor the last turn. A raw prompt loses tokens instead (the oldest, or the middle). Unchanged when it
    fits or the policy is stop (check_capacity then refuses what does not fit)."""
    if req.overflow not in OVERFLOW_POLICIES:
        raise EngineError(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, not {req.overflow!r}")
    chat = render(tok, req)
    cap, free, forced = capacity, room(req, capacity), list(req.reply_ids)

    def fitted(c: ChatPrompt, dropped=(), positions=0) -> Fitted:
        return Fitted(c, c.ids + forced, tuple(dropped), positions)

    def fits(c: ChatPrompt) -> bool:
        return len(c.ids) + len(forced) + free - 1 <= cap

    if req.overflow == "stop" or fits(chat):
        return fitted(chat)
    if req.messages is None:  # a raw prompt: the oldest tokens, or the middle ones
        keep = cap - free + 1 - len(forced)
        if keep < 1:
            raise CapacityError(f"max new tokens ({req.max_new_tokens}) leaves no room for a prompt in {cap}")
        ids = chat.ids
        head = 0 if req.overflow == "drop-oldest" else keep // 2
        return fitted(ChatPrompt(ids[:head] + ids[len(ids) - (keep - head) :], ()), (), len(ids) - keep)
    order = overflow_orders(req.overflow, list(req.messages))

    def without(j: int) -> tuple[ChatPrompt, tuple[int, ...]]:
        gone = {i for turn in order[:j] for i in turn}
        kept = tuple(m for i, m in enumerate(req.messages) if i not in gone)
        return render(tok, dataclasses.replace(req, messages=kept)), tuple(sorted(gone))

    best = without(len(order)) if order else (chat, ())
    if not fits(best[0]):
        need = positions_needed(len(best[0].ids) + len(forced), free)
        raise CapacityError(
            f"even with only the system prompt and the last turn the request needs {need} cache positions "
            f"but the capacity is {cap}; shorten the last message, lower max new tokens or raise the capacity"
        )
    lo, hi = 1, len(order)
    while lo < hi:
        mid = (lo + hi) // 2
        tried = without(mid)
        if fits(tried[0]):
            hi, best = mid, tried
        else:
            lo = mid + 1
    return fitted(best[0], best[1], len(chat.ids) - len(best[0].ids))


def check_capacity(prompt_len: int, req: Request, capacity: int) -> None:
    """Refuse what cannot run: no new tokens, a prompt over the capacity, or (unless the request stops when the
    cache is full) a prompt and reply that may not fit."""
    if req.max_new_tokens < 1:
        raise EngineError("max_new_tokens must be at least 1")
    cap = capacity
    if prompt_len > cap:
        raise CapacityError(
            f"the prompt has {prompt_len} tokens but the KV cache holds only {cap} positions; "
            "shorten the conversation or raise the capacity"
        )
    need = positions_needed(prompt_len, req.max_new_tokens)
    if need > cap and not req.stop_on_capacity:
        raise CapacityError(
            f"the prompt has {prompt_len} tokens; with up to {req.max_new_tokens} new tokens "
            f"it needs {need} cache positions but the capacity is {cap}; lower max new "
            "tokens, shorten the conversation or raise the capacity"
        )
