"""A chat request's answer, from its jobs' events: the whole completion, or the server-sent stream — for one
choice, or for `n` choices of one prompt. The n choices share one prefill: the first choice's request puts its
prompt's K/V into the prefix store once prefilled (Request.share_prompt), and the others are sent only then,
so that each copies that prompt from the store and computes only what the store's blocks do not cover (the
last block's positions). Each choice samples with its own seed (the request's seed plus its index), so a
seeded request answers the same whatever runs beside it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.responses import JSONResponse

from ..events import Failed, Finished, PrefillStarted, Token
from ..request import Request
from ..tool_calls import CallFilter
from . import openai_chat as wire
from .openai_chat import ApiError, choice_of, chunk, failure, finish_reason, reply_logprobs, report, sse
from .openai_tools import call_deltas
from .service import Busy, EngineService, Job

MAX_TOKENS_PER_CHUNK = 32  # tokens already made that one streamed chunk may carry
END = object()  # the end of a job's events, when it was taken while gathering tokens


async def watch_disconnect(http, jobs: list[Job]) -> None:
    """Cancel every job of the request when the client goes away (whatever the response is doing meanwhile);
    `jobs` may grow while it watches (the choices sent after the first's prefill)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            for job in jobs:
                job.stop()
            return


async def first_event(job: Job, watcher: asyncio.Task):
    """The job's first event (PrefillStarted, or Failed before any output); None when the client left first
    (the job is cancelled: the engine skips it) or the engine ended it without one."""
    got = asyncio.ensure_future(job.events.get())
    await asyncio.wait({got, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if not got.done():
        got.cancel()
        return None
    return got.result()


async def drain(job: Job) -> None:
    while await job.events.get() is not None:
        pass


def busy(service: EngineService, e: Busy) -> JSONResponse:
    """The 429 of a request the queue has no room for, with when to try again."""
    msg = f"the server is busy: {service.pending} requests running or waiting; retry in {e.retry_after} s"
    return ApiError(429, msg, "rate_limit_error").response({"Retry-After": str(e.retry_after)})


def refused(first) -> JSONResponse:
    """The answer to a job whose first event was not PrefillStarted."""
    if isinstance(first, Failed):
        return failure(first).response()
    return ApiError(500, "the engine ended the request without a reply", "server_error").response()


async def start_others(service: EngineService, jobs: list[Job], rest: list[Request], watcher: asyncio.Task):
    """Once the first choice's prefill is done (its prompt in the prefix store), send the other choices; each
    one's first event, or the answer that refuses the whole request (the jobs already sent are stopped)."""
    done = asyncio.ensure_future(jobs[0].prefilled.wait())
    await asyncio.wait({done, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if not done.done():
        done.cancel()
        return None
    firsts = []
    try:
        for req in rest:
            jobs.append(service.submit(req))
    except Busy as e:
        for job in jobs:
            job.stop()
        return busy(service, e)
    for job in jobs[1:]:
        first = await first_event(job, watcher)
        if not isinstance(first, PrefillStarted):
            for other in jobs:
                other.stop()
            return refused(first)
        firsts.append(first)
    return firsts


async def complete(jobs: list[Job], firsts: list[PrefillStarted], meta: dict, watcher: asyncio.Task) -> JSONResponse:
    """The whole completion: a choice per job; usage counts the prompt once and every choice's tokens."""
    try:
        lasts = []
        for job in jobs:
            last = None
            while (ev := await job.events.get()) is not None:
                if isinstance(ev, (Finished, Failed)):
                    last = ev
            lasts.append(last)
    finally:
        watcher.cancel()
    for last in lasts:
        if isinstance(last, Failed) or last is None:
            return failure(last or Failed("no reply", "InternalError", {})).response()
    prompt = firsts[0].prompt_tokens
    reports = [report(last, prompt) for last in lasts]
    choices = [choice_of(i, job.request, last) for i, (job, last) in enumerate(zip(jobs, lasts))]
    usage, extension = reports[0]
    if len(jobs) > 1:
        usage, extension = summed([u for u, _ in reports]), {"choices": [x for _, x in reports]}
    return JSONResponse({**meta, "object": "chat.completion", "choices": choices, "usage": usage,
                         wire.EXTENSION: extension})  # fmt: skip


def summed(usages: list[dict]) -> dict:
    """The usage of n choices of one prompt: the prompt once, every choice's completion tokens, the cached
    positions as the first choice found them."""
    prompt = usages[0]["prompt_tokens"]
    made = sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made,
            "prompt_tokens_details": usages[0]["prompt_tokens_details"]}  # fmt: skip


async def _choice(job: Job, first: PrefillStarted, meta: dict, index: int, include_usage: bool, out: dict,
                  calls=None):  # fmt: skip
    """One choice's chunks: its role, its text, its finish (with its kvchat report unless the usage chunk carries
    them); `out` gains its usage and report. The first chunk carries the reuse report."""

    def delta(d: dict, finish=None, logprobs=None, **extra) -> str:
        return sse(chunk(meta, d, finish, logprobs, index=index, **extra))

    started = {wire.PROMPT_TOKENS: first.prompt_tokens, wire.REUSE: first.reuse.to_dict()}
    yield delta({"role": "assistant", "content": ""}, kvchat=started)
    calls = CallFilter(*calls) if calls else None  # (format, marker token): a call's text is held back, not content
    sent = ""  # the content sent so far
    held = None  # an event taken while gathering tokens, to handle next
    while (ev := held or await job.events.get()) is not None:
        held = None
        if isinstance(ev, Token):
            # Tokens the engine made while the last chunk was being sent go out as one chunk (`kvchat.tokens`
            # says how many): when the engine outruns the network, per-chunk costs stop adding up per token.
            text, n, made = ev.text, 1, [ev]
            while n < MAX_TOKENS_PER_CHUNK and not job.events.empty():
                nxt = job.events.get_nowait()
                if not isinstance(nxt, Token):
                    held = nxt if nxt is not None else END
                    break
                text, n = text + nxt.text, n + 1
                made.append(nxt)
            if calls is not None:
                text = "".join(calls.feed(t.token_id, t.text) for t in made)
            sent += text
            weighed = reply_logprobs(job.request, [t.logprobs for t in made], [t.token_id for t in made],
                                     [t.grammar for t in made] if job.request.grammar is not None else ())  # fmt: skip
            if text or n > 1 or weighed:
                extra = {wire.EXTENSION: {wire.TOKENS: n}} if n > 1 else {}
                yield delta({"content": text}, logprobs=weighed, **extra)
            if held is END:
                out["ended"] = True
                return
        elif isinstance(ev, Finished):
            out["usage"], out["report"] = report(ev, first.prompt_tokens)
            rest = ev.tail
            if calls is not None:  # the content the filter held back, then the calls
                rest = ev.text[len(sent) :] if ev.text.startswith(sent) else ""
            if rest:
                yield delta({"content": rest})
            if ev.tool_calls:
                yield delta({"tool_calls": call_deltas(ev.tool_calls)})
            finish = finish_reason(ev)
            yield delta({}, finish) if include_usage else delta({}, finish, kvchat=out["report"])
        elif isinstance(ev, Failed):
            error = failure(ev)
            yield sse({"error": {"message": error.message, "type": error.type, "code": error.code}})
    out["ended"] = True


async def stream(jobs: list[Job], firsts: list[PrefillStarted], meta: dict, include_usage: bool,
                 watcher: asyncio.Task, calls=None) -> AsyncIterator[str]:  # fmt: skip
    """Server-sent events in OpenAI's chunk format, each chunk naming its choice; the last report(s) on the
    usage chunk when it is asked for; `[DONE]` ends it. A client gone cancels every job. `calls`: the format
    of the model's tool calls and its marker token, where the request offers tools."""
    outs = [{} for _ in jobs]
    parts = [_choice(job, first, meta, i, include_usage, out, calls) for i, (job, first, out) in
             enumerate(zip(jobs, firsts, outs))]  # fmt: skip
    try:
        if len(parts) == 1:
            async for line in parts[0]:
                yield line
        else:
            async for line in _merged(parts):
                yield line
        usages = [o["usage"] for o in outs if "usage" in o]
        if include_usage and len(usages) == len(jobs):
            usage = usages[0] if len(jobs) == 1 else summed(usages)
            extension = outs[0]["report"] if len(jobs) == 1 else {"choices": [o["report"] for o in outs]}
            yield sse({**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage,
                       wire.EXTENSION: extension})  # fmt: skip
        yield "data: [DONE]\n\n"
    finally:
        if not all(o.get("ended") for o in outs):  # the client went away: the response was cancelled or closed
            for job in jobs:
                job.stop()
        watcher.cancel()


async def _merged(parts: list) -> AsyncIterator[str]:
    """The choices' chunks as each comes (a choice's own order kept)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(part):
        try:
            async for line in part:
                await queue.put(line)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(p)) for p in parts]
    try:
        left = len(tasks)
        while left:
            line = await queue.get()
            if line is None:
                left -= 1
            else:
                yield line
    finally:
        for t in tasks:
            t.cancel()
