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
import dataclasses
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
from ..events import PrefillStarted
from ..request import Request, choice_requests
from ..session import Session
from ..tool_calls import marker_token, offered_format
from ..weights.loading import LoadedModel
from . import answers
from .image_urls import fetch_image
from .metrics import CONTENT_TYPE as METRICS_TYPE
from .openai_chat import ApiError, parse_chat
from .service import Busy, EngineService

# What one client may send or hold (a slow or hostile client cannot tie the server up or grow it).
BODY_BYTES = 16 << 20  # a request's body
BODY_SECONDS = 30.0  # to send it, once its head has come
HEAD_SECONDS = 10.0  # to send a request's head (line and headers) after connecting
MAX_CONNECTIONS = 64  # open at once; past it uvicorn answers 503
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


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
    drafting: dict | None = None,
    image_urls: bool = False,
) -> Starlette:
    """The ASGI application over one EngineService. `loopback`: served on this machine only, so a request
    must name this machine as its Host and come from no other web page's Origin (a page in a browser, or
    a DNS name rebound to 127.0.0.1, cannot reach it). `overflow`: the policy of a request that names none.
    `drafting`: every request's speculative decoding (Request.speculative, draft_tokens), None: none. `image_urls`:
    http(s) image URLs in a request are fetched (engine.http.image_urls), else refused (data: URLs always taken)."""
    fetch = fetch_image if image_urls else None
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
        # in a thread: its images are decoded (and with image_urls fetched) without holding up the event loop
        req, opts = await asyncio.to_thread(parse_chat, body, default_new, overflow, fetch)
        if drafting and drafting.get("speculative"):
            req = dataclasses.replace(req, **drafting)
        return body, req, opts

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
            calls = _call_format(service, req)
            choices = choice_requests(req, opts["n"])
            if len(choices) > 1 and service.pending + len(choices) > service.engine.parallel + service.queue_size:
                raise Busy(max(1, len(choices)))
            job = service.submit(choices[0])
        except ApiError as e:
            return e.response()
        except Busy as e:
            return answers.busy(service, e)
        rid = f"chatcmpl-{secrets.token_hex(12)}"
        jobs = [job]
        watcher = asyncio.create_task(answers.watch_disconnect(http, jobs))
        first = await answers.first_event(job, watcher)
        if first is None and not watcher.done():  # the engine's END already: nothing more comes
            watcher.cancel()
            return answers.refused(first)
        if first is None:  # the client left while queued: its job is cancelled (the engine skips it)
            return Response(status_code=499)  # read by no one; the handler and its connection are free now
        if not isinstance(first, PrefillStarted):
            watcher.cancel()
            await answers.drain(job)
            return answers.refused(first)
        firsts = [first]
        if len(choices) > 1:  # the others, once the first's prefill is in the prefix store
            more = await answers.start_others(service, jobs, choices[1:], watcher)
            if more is None:
                return Response(status_code=499)
            if not isinstance(more, list):
                watcher.cancel()
                return more
            firsts += more
        meta = {"id": rid, "created": int(time.time()), "model": service.model_id}
        if opts["stream"]:
            return StreamingResponse(
                answers.stream(jobs, firsts, meta, opts["usage"], watcher, calls),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await answers.complete(jobs, firsts, meta, watcher)

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
    service = EngineService(
        load, ns.served_model_name, queue_size=ns.queue_size, parallel=ns.parallel, kv_pool=ns.kv_pool
    )
    loaded, session, model_id = service.loaded, service.session, service.model_id
    drafting = {"speculative": ns.speculative, "draft_tokens": ns.draft_tokens} if ns.speculative else None
    if drafting:  # the draft made (an int4 copy, a draft model loaded) before the first request: refused at once
        try:
            service.engine.call(service.session.drafter, ns.speculative).result()
        except EngineError as e:
            service.close()
            print(f"error: --speculative {ns.speculative}: {e}", file=sys.stderr)
            return 2
    app = build_app(
        service,
        api_key=ns.api_key,
        max_new_tokens=ns.max_new_tokens,
        loopback=loopback,
        overflow=ns.overflow,
        drafting=drafting,
        image_urls=ns.allow_image_urls,
    )
    print(
        f"kvchat serving {model_id!r} ({loaded.device}, capacity {session.cache.capacity}, "
        f"{ns.parallel} at once, a KV pool of {ns.kv_pool or ns.parallel * session.cache.capacity:,} positions) on "
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


def _call_format(service, req: Request):
    """(the format the model writes calls in, its marker's control token) where the request offers tools; a 400
    where the model's chat template takes none."""
    tok = service.loaded.tokenizer
    try:
        fmt = offered_format(tok, req, service.model_id)
    except EngineError as e:
        raise ApiError(400, str(e), param="tools") from None
    return None if fmt is None else (fmt, marker_token(tok, fmt))
