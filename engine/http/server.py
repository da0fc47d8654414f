"""`python -m engine serve`: the engine behind the OpenAI HTTP API (Starlette on uvicorn), so that any
OpenAI client — and kvchat's own remote backend — can use it.

Requests run on one engine thread, up to `--parallel` at once (engine.batching: a lane each, over one
prefix store), their decode steps together; a bounded queue waits behind them and answers 429 when full.
Every reply carries the engine's own report (reuse, trace, cache, store) as an extra `kvchat` object; a
client that goes away cancels its generation at the next token. Bad input is an OpenAI-style error object,
never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import sys
import time
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import EngineError
from ..events import Failed, Finished, PrefillStarted, Token
from ..request import Request
from ..session import Session
from ..weights.loading import LoadedModel
from . import openai_chat as wire
from .metrics import CONTENT_TYPE as METRICS_TYPE
from .openai_chat import ApiError, chunk, completion, failure, parse_chat, reply_logprobs, report, sse
from .service import Busy, EngineService, Job

MAX_TOKENS_PER_CHUNK = 32  # tokens already made that one streamed chunk may carry
END = object()  # the end of a job's events, when it was taken while gathering tokens
# What one client may send or hold (a slow or hostile client cannot tie the server up or grow it).
BODY_BYTES = 16 << 20  # a request's body
BODY_SECONDS = 30.0  # to send it, once its head has come
HEAD_SECONDS = 10.0  # to send a request's head (line and headers) after connecting
MAX_CONNECTIONS = 64  # open at once; past it uvicorn answers 503
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


async def _watch_disconnect(http: HttpRequest, job: Job) -> None:
    """Cancel the job when the client goes away (whatever the response is doing meanwhile)."""
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            job.stop()
            return


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


async def _read_body(http: HttpRequest) -> bytes:
    """The request's body, at most BODY_BYTES, sent within BODY_SECONDS."""

    async def read() -> bytes:
        got = bytearray()
        async for piece in http.stream():
            got += piece
            if len(got) > BODY_BYTES:
                raise ApiError(413, f"the request body is over {BODY_BYTES >> 20} MiB")
        return bytes(got)

    try:
        return await asyncio.wait_for(read(), BODY_SECONDS)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {BODY_SECONDS:g} s") from None


def build_app(
    service: EngineService,
    api_key: str | None = None,
    max_new_tokens: int | None = None,
    loopback: bool = True,
    overflow: str = "stop",
) -> Starlette:
    """The ASGI application over one EngineService. `loopback`: served on this machine only, so a request
    must name this machine as its Host and come from no other web page's Origin (a page in a browser, or
    a DNS name rebound to 127.0.0.1, cannot reach it). `overflow`: the policy of a request that names none."""
    names = {service.model_id, str(service.loaded.path), service.loaded.name}
    default_new = max_new_tokens or service.session.cache.capacity

    async def models(_http: HttpRequest):
        return JSONResponse({"object": "list", "data": [service.model_card()]})

    async def stats(_http: HttpRequest):
        return JSONResponse(service.stats())

    async def read_chat(http: HttpRequest) -> tuple[dict, Request, dict]:
        """The body parsed as a chat request: (body, request, response options)."""
        raw = await _read_body(http)
        try:
            body = json.loads(raw, parse_constant=_no_constant)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None
        return body, *parse_chat(body, default_new, overflow)

    async def cached(http: HttpRequest):
        """How many positions of a conversation's prompt are cached now (the app's probe on opening one)."""
        try:
            _, req, _ = await read_chat(http)
            probe = Request(messages=req.messages, add_generation_prompt=False, overflow=req.overflow,
                            max_new_tokens=req.max_new_tokens, stop_on_capacity=req.stop_on_capacity)  # fmt: skip
            seen = await service.cached_positions(probe)
        except ApiError as e:
            return e.response()
        except EngineError as e:
            return ApiError(400, str(e)).response()
        return JSONResponse(seen)

    async def metrics(_http: HttpRequest):
        """Prometheus' text format, under vLLM's names (engine/http/metrics.py)."""
        return Response(service.metrics.text(), media_type=METRICS_TYPE)

    async def health(_http: HttpRequest):
        return JSONResponse({"status": "ok", "model": service.model_id})

    async def chat(http: HttpRequest):
        try:
            body, req, opts = await read_chat(http)
            if body.get("model") not in names:
                raise ApiError(
                    404,
                    f"the model {body.get('model')!r} does not exist; this server has {service.model_id!r}",
                    code="model_not_found",
                    param="model",
                )
            job = service.submit(req)
        except ApiError as e:
            return e.response()
        except Busy as e:
            msg = f"the server is busy: {service.pending} requests running or waiting; retry in {e.retry_after} s"
            return ApiError(429, msg, "rate_limit_error").response({"Retry-After": str(e.retry_after)})
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        watcher = asyncio.create_task(_watch_disconnect(http, job))
        first_event = asyncio.ensure_future(job.events.get())  # PrefillStarted, or Failed before any output
        await asyncio.wait({first_event, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not first_event.done():  # the client left while queued: its job is cancelled (the engine skips it)
            first_event.cancel()
            return Response(status_code=499)  # read by no one; the handler and its connection are free now
        first = first_event.result()
        if not isinstance(first, PrefillStarted):
            watcher.cancel()
            if first is not None:  # None: the scheduler's END already, nothing more comes
                await _drain(job)
            if isinstance(first, Failed):
                return failure(first).response()
            return ApiError(500, "the engine ended the request without a reply", "server_error").response()
        meta = {"id": rid, "created": int(time.time()), "model": service.model_id}
        if opts["stream"]:
            return StreamingResponse(
                _stream(job, first, meta, opts["usage"], watcher),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _complete(job, first, meta, watcher)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        service.close()

    return Starlette(
        routes=[
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/kvchat/stats", stats, methods=["GET"]),
            Route("/kvchat/cached", cached, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        middleware=[Middleware(_Errors), Middleware(_Guard, loopback=loopback, api_key=api_key)],
        exception_handlers={HTTPException: _http_error},
        lifespan=lifespan,
    )


async def _http_error(_http: HttpRequest, e: HTTPException) -> JSONResponse:
    """Starlette's own refusals (an unknown path, a wrong method) as error objects too."""
    message = {404: "no such endpoint", 405: "method not allowed here"}.get(e.status_code, str(e.detail))
    return ApiError(e.status_code, f"{message}: {_http.method} {_http.url.path}", code=None).response()


def _host_name(value: str) -> str:
    """The host of a Host header or an Origin's authority, without its port ("[::1]:8000" → "::1")."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class _Guard:
    """What a request must be before the routes see it: a body no larger than BODY_BYTES (by its declared
    length); on loopback, a Host that names this machine and no web page's Origin but this machine's; and
    anywhere, no page of another origin posting a body that is not JSON (the kind a browser sends across
    origins without asking first: JSON needs the asking, which this server never answers); and with an API key,
    that key on every route but /health."""

    def __init__(self, app, loopback: bool, api_key: str | None = None):
        self.app, self.loopback, self.api_key = app, loopback, api_key

    def refusal(self, scope) -> ApiError | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        length = headers.get("content-length", "0")
        if not length.isdigit():
            return ApiError(400, "Content-Length is not a number")
        if int(length) > BODY_BYTES:
            return ApiError(413, f"the request body is over {BODY_BYTES >> 20} MiB")
        host, origin = _host_name(headers.get("host", "")), headers.get("origin")
        if self.loopback and host not in LOOPBACK_NAMES:
            return ApiError(403, "this server answers only requests addressed to localhost", "permission_error")
        if origin is not None:
            page = _host_name(origin.split("://", 1)[-1])
            json_body = headers.get("content-type", "").split(";")[0].strip() == "application/json"
            if (self.loopback and page not in LOOPBACK_NAMES) or (not json_body and page != host):
                return ApiError(403, f"requests from other web pages ({origin}) are refused", "permission_error")
        if self.api_key is not None and scope.get("path") != "/health":
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                return ApiError(401, "a valid API key is needed: Authorization: Bearer KEY", "authentication_error",
                                code="invalid_api_key")  # fmt: skip
        return None

    async def __call__(self, scope, receive, send):
        refused = self.refusal(scope) if scope["type"] == "http" else None
        if refused is not None:
            await refused.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _Errors:
    """Anything unforeseen is a 500 error object, never a traceback (unknown paths: _http_error)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        started = False

        async def tracked(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as e:
            if scope["type"] != "http" or started:
                raise
            await ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error").response()(
                scope, receive, send
            )


async def _drain(job: Job) -> None:
    while await job.events.get() is not None:
        pass


async def _complete(job: Job, first: PrefillStarted, meta: dict, watcher: asyncio.Task) -> JSONResponse:
    try:
        last = None
        while (ev := await job.events.get()) is not None:
            if isinstance(ev, (Finished, Failed)):
                last = ev
    finally:
        watcher.cancel()
    if isinstance(last, Failed) or last is None:
        return failure(last or Failed("no reply", "InternalError", {})).response()
    return JSONResponse(completion(meta, job.request, last, first.prompt_tokens))


async def _stream(job: Job, first: PrefillStarted, meta: dict, include_usage: bool, watcher: asyncio.Task):
    """Server-sent events in OpenAI's chunk format; the first chunk carries the reuse report, the last one
    the whole kvchat report; `[DONE]` ends it. A client gone cancels the job."""

    def delta(d: dict, finish=None, logprobs=None, **extra) -> str:
        return sse(chunk(meta, d, finish, logprobs, **extra))

    done = False
    try:
        started = {wire.PROMPT_TOKENS: first.prompt_tokens, wire.REUSE: first.reuse.to_dict()}
        yield delta({"role": "assistant", "content": ""}, kvchat=started)
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
                weighed = reply_logprobs(job.request, [t.logprobs for t in made], [t.token_id for t in made])
                if text or n > 1 or weighed:
                    extra = {wire.EXTENSION: {wire.TOKENS: n}} if n > 1 else {}
                    yield delta({"content": text}, logprobs=weighed, **extra)
                if held is END:
                    break
            elif isinstance(ev, Finished):
                usage, extension = report(ev, first.prompt_tokens)
                if ev.tail:
                    yield delta({"content": ev.tail})
                finish = wire.FINISH_REASONS.get(ev.reason, "stop")
                if include_usage:
                    yield delta({}, finish)
                    yield sse({**meta, "object": "chat.completion.chunk", "choices": [], "usage": usage,
                               wire.EXTENSION: extension})  # fmt: skip
                else:
                    yield delta({}, finish, kvchat=extension)
            elif isinstance(ev, Failed):
                error = failure(ev)
                yield sse({"error": {"message": error.message, "type": error.type, "code": error.code}})
        else:
            done = True
        if held is END:
            done = True
        yield "data: [DONE]\n\n"
    finally:
        if not done:  # the client went away: the response was cancelled or closed mid-stream
            job.stop()
        watcher.cancel()


def serve(ns, load: Callable[[], tuple[LoadedModel, Session]]) -> int:
    """Load (on the engine thread) and serve with the options of `python -m engine serve` until interrupted."""
    import uvicorn

    loopback = _host_name(ns.host) in LOOPBACK_NAMES
    if not loopback and not ns.api_key:
        print(
            f"warning: serving on {ns.host} without --api-key: anyone who can reach this machine can run the model",
            file=sys.stderr,
            flush=True,
        )
    service = EngineService(load, ns.served_model_name, queue_size=ns.queue_size, parallel=ns.parallel)
    loaded, session, model_id = service.loaded, service.session, service.model_id
    app = build_app(
        service, api_key=ns.api_key, max_new_tokens=ns.max_new_tokens, loopback=loopback, overflow=ns.overflow
    )
    print(
        f"kvchat serving {model_id!r} ({loaded.device}, capacity {session.cache.capacity}, "
        f"{ns.parallel} at once) on "
        f"http://{ns.host}:{ns.port}/v1" + (" (API key required)" if ns.api_key else ""),
        flush=True,
    )
    uvicorn.run(
        app,
        host=ns.host,
        port=ns.port,
        log_level=ns.log_level,
        timeout_graceful_shutdown=2,
        http=_head_timed_protocol(),
        limit_concurrency=MAX_CONNECTIONS,
    )
    return 0


def _head_timed_protocol():
    """uvicorn's HTTP/1.1 protocol with a deadline for a request's head: a client that connects and sends
    its headers a byte at a time (slowloris) is closed after HEAD_SECONDS instead of held."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimed(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self.head_timer = self.loop.call_later(HEAD_SECONDS, self.head_late)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and self.head_timer is not None:  # a head has come
                self.head_timer.cancel()
                self.head_timer = None

        def head_late(self) -> None:
            if self.cycle is None:
                self.transport.close()

        def connection_lost(self, exc) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
            super().connection_lost(exc)

    return HeadTimed
