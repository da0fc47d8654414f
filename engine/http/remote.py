"""A session on a remote OpenAI-compatible server (kvchat's own `engine serve`, vLLM, SGLang,
llama-server, Ollama, LM Studio): the same `generate(request, cancel)` event stream as a local
Session, so the app's worker and the benchmark use either alike.

The reply streams over an async HTTP client (httpx) on a thread of its own; Stop cancels that task,
which closes the stream. What the events say is only what can be known from here: times are taken at
chunk arrival (client-side, the network included), reuse and server timings where the server reports
them (kvchat's `kvchat` object, `usage.prompt_tokens_details.cached_tokens`, llama.cpp's `timings`),
KV bytes from the model's config when a local copy of it names the sizes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import queue
import threading
from collections.abc import Iterator

from .. import trace as tracing
from ..events import WAITING, Failed, Finished, PrefillDone, PrefillStarted, ReuseReport, Token
from . import openai_chat as wire
from .openai_tools import StreamedCalls, wire_messages
from .remote_server import (
    CONNECT_TIMEOUT_S,
    LINE_BYTES,
    POLL_S,
    RemoteError,
    RemoteSpec,
    error_text,
    fetch_json,
    list_models,
    normalize_url,
    read_some,
    redirected,
    remote_facts,
    sse_events,
)

__all__ = ["CONNECT_TIMEOUT_S", "LINE_BYTES", "RemoteError", "RemoteSession", "RemoteSpec", "list_models"]


IO_POLL_S = 0.02  # beside other lanes, how long a reply waits for its server's next chunk before their turn


class RemoteSession:
    """Requests to one model on one server, one at a time, as engine events. The scheduler runs several at once on
    siblings (each a stream of its own), their replies read between the turns of the others (`steps`)."""

    remote = True  # its replies wait on I/O, not on decode steps (engine.batching turns every such lane)

    def __init__(self, spec: RemoteSpec, traces: list | None = None):
        self.spec = dataclasses.replace(spec, url=normalize_url(spec.url))
        self.traces: list[tracing.RequestTrace] = [] if traces is None else traces
        self.card: dict | None = None
        self._facts: dict | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvchat-remote", daemon=True)
        self._thread.start()
        self._client = None  # the httpx.AsyncClient, made on the loop's thread
        self._current = None  # the running request's future, for stop()

    def connect(self) -> dict:
        """Ask the server for its models and pick the one the spec names (else the first); its facts."""
        cards = list_models(self.spec)
        if not cards:
            raise RemoteError(f"{self.spec.url} lists no models")
        want = self.spec.model
        card = next((c for c in cards if c["id"] == want), None) if want else cards[0]
        if card is None:
            names = ", ".join(c["id"] for c in cards[:8])
            raise RemoteError(f"the server has no model {want!r} (it lists: {names})")
        try:
            facts = remote_facts(self.spec, card)
        except (TypeError, KeyError, AttributeError, ValueError) as e:
            why = f"{type(e).__name__}: {e}"
            raise RemoteError(f"the server's card for {card['id']!r} is not one kvchat can read ({why})") from None
        self.card, self._facts = card, facts
        return self.facts()

    def facts(self) -> dict:
        return dict(self._facts or {})

    def sibling(self) -> RemoteSession:
        """Another session on the same server and model, with a connection of its own and this one's traces: a
        second reply streaming beside this one's (a lane of engine.batching)."""
        other = RemoteSession(self.spec, self.traces)
        other.card, other._facts = self.card, self._facts
        return other

    def same_setup(self, other) -> bool:
        return isinstance(other, RemoteSession) and other.spec == self.spec and other.card == self.card

    @property
    def model_id(self) -> str:
        return self.card["id"] if self.card else self.spec.model

    def cached_positions(self, req) -> dict:
        """How much of a conversation kvchat's server holds cached now (`positions`, `cached`, `source`);
        other servers do not say, so neither does this."""
        if (self._facts or {}).get("server_kind") != "kvchat":
            return {"error": "not reported by this server"}
        url = self.spec.url.removesuffix("/v1") + "/kvchat/cached"
        body = {"model": self.model_id, "messages": wire_messages(req.messages or ())}  # images as data: URLs
        if req.overflow != "stop":
            body.update(overflow=req.overflow, max_tokens=req.max_new_tokens)
        try:
            got = fetch_json(self.spec, "POST", url, body)
        except RemoteError as e:
            return {"error": str(e)}
        return got if isinstance(got, dict) else {"error": "the server's answer is not an object"}

    def stop(self) -> None:
        """Stop the running reply now, from any thread: its stream is closed and it ends as cancelled."""
        future = self._current
        if future is not None:
            future.cancel()  # asyncio cancels the task on the loop's thread

    def close(self) -> None:
        async def shut():
            if self._client is not None:
                await self._client.aclose()

        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(shut(), self._loop).result(2)
            except Exception:  # closing: nothing left to tell anyone
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(2)

    # --- a request --------------------------------------------------------------------------------
    def body(self, req) -> dict:
        if req.messages is None:
            raise RemoteError("a remote engine takes chat messages, not raw prompts or token ids")
        if req.grammar is not None and req.grammar.kind == "lark":
            raise RemoteError("a Lark grammar needs the local engine: servers take a JSON schema or GBNF")
        return wire.chat_body(req, self.model_id, (self._facts or {}).get("server_kind") == "kvchat")

    async def _post(self, body: dict, out: queue.Queue) -> None:
        """On the loop's thread: stream the response's server-sent events into `out` as
        ("data", text, arrival time), then ("end",) — or ("error", message) / ("cancelled",). A line, an
        event and the whole reply are bounded (LINE_BYTES, EVENT_BYTES, RESPONSE_BYTES), and the server must
        finish an event within its timeout: bytes that trickle without ever making one do not keep it alive."""
        import httpx

        if self._client is None:
            t = httpx.Timeout(self.spec.timeout, connect=CONNECT_TIMEOUT_S)
            self._client = httpx.AsyncClient(base_url=self.spec.url, headers=self.spec.headers(), timeout=t)
        try:
            async with self._client.stream("POST", "/chat/completions", json=body) as r:
                said = redirected(r.status_code, r.headers, self.spec.url + "/chat/completions")
                if said or r.status_code >= 400:
                    out.put(("error", said or error_text(r.status_code, await read_some(r))))
                    return
                kind = r.headers.get("content-type", "").split(";")[0].strip().lower()
                if kind == "application/json":  # a server that ignored stream: true answers in one piece
                    out.put(("data", (await read_some(r)).decode("utf-8", "replace"), tracing.now()))
                elif kind != "text/event-stream":
                    out.put(("error", f"not an OpenAI-compatible server: it answered {kind or 'no content type'}"))
                    return
                else:
                    async for data in sse_events(r, self.spec.timeout):
                        out.put(("data", data, tracing.now()))
            out.put(("end",))
        except asyncio.CancelledError:
            out.put(("cancelled",))
            raise
        except httpx.TimeoutException:
            out.put(("error", f"the server sent nothing for {self.spec.timeout:.0f} s"))
        except RemoteError as e:
            out.put(("error", str(e)))
        except httpx.HTTPError as e:
            out.put(("error", f"the connection to {self.spec.url} failed: {type(e).__name__}: {e}"))
        except Exception as e:  # a stream that breaks any other way is still one failed reply
            out.put(("error", f"{type(e).__name__}: {e}"))

    def generate(self, req, cancel: threading.Event | None = None) -> Iterator:
        """The reply's events, waiting for each (a generation on its own)."""
        yield from (ev for ev in self.steps(req, cancel, poll=POLL_S) if ev is not WAITING)

    def steps(self, req, cancel: threading.Event | None = None, trace=None, poll: float = IO_POLL_S) -> Iterator:
        """The reply's events and, each time its server has sent nothing for `poll` seconds, WAITING: a scheduler
        then runs its other lanes (engine.batching). `trace`: the request's RequestTrace, when the scheduler made
        it (its queue wait began before this call)."""
        trace = trace if trace is not None else tracing.RequestTrace.of(req)
        self.traces.append(trace)
        cancel = cancel or threading.Event()
        try:
            body = self.body(req)
        except RemoteError as e:
            trace.status, trace.end, trace.error = "failed", tracing.now(), str(e)
            yield Failed(str(e), "RemoteError", self._summary(trace, None, 0))
            return
        out: queue.Queue = queue.Queue()
        trace.started = tracing.now()
        if cancel.is_set():  # stopped while it waited for its turn
            yield _Reply(self, req, trace).finish("cancelled")
            return
        future = self._current = asyncio.run_coroutine_threadsafe(self._post(body, out), self._loop)
        reply = _Reply(self, req, trace)
        while True:
            try:
                item = out.get(timeout=poll)
            except queue.Empty:
                if cancel.is_set() and not future.cancelled():
                    future.cancel()  # closes the stream, even while the server says nothing
                yield WAITING
                continue
            kind = item[0]
            if kind == "data":
                try:
                    yield from reply.chunk(item[1], item[2])
                except RemoteError as e:  # an error object, or garbage, in the stream: the reply ends there
                    future.cancel()
                    yield reply.fail(str(e))
                    return
                except (TypeError, KeyError, AttributeError, ValueError) as e:  # a chunk of the wrong shape
                    future.cancel()
                    yield reply.fail(f"the server sent a chunk kvchat cannot read ({type(e).__name__}: {e})")
                    return
                if reply.over:  # past the request's own cap: whatever the server does, the reply ends there
                    future.cancel()
                    reply.reason = reply.reason or "length"
                    yield reply.finish(None)
                    return
                if cancel.is_set():
                    future.cancel()
            elif kind == "cancelled" or (kind == "end" and cancel.is_set()):
                yield reply.finish("cancelled")
                return
            elif kind == "end":
                yield reply.finish(None)
                return
            else:
                yield reply.fail(item[1])
                return

    def _summary(self, trace: tracing.RequestTrace, server: dict | None, chunks: int) -> dict:
        return {**trace.summary(), "measured": "client", "server": server, "chunks": chunks}


class _Reply:
    """One streaming reply's state: chunks in, engine events out."""

    def __init__(self, session: RemoteSession, req, trace: tracing.RequestTrace):
        self.session, self.req, self.trace = session, req, trace
        self.text = ""
        self.reason: str | None = None  # OpenAI's finish_reason
        self.usage: dict | None = None
        self.timings: dict | None = None  # llama.cpp's
        self.report: dict | None = None  # kvchat's
        self.prompt_tokens: int | None = None
        self.started = False
        self.reuse_seen: ReuseReport | None = None
        self.chunks = 0
        self.over = False  # the server sent text past the request's max_new_tokens
        self.steps: list = []  # each token's StepLogprobs, where the server reports them
        self.calls = StreamedCalls()  # the tool calls it streams

    def chunk(self, data: str, t: float) -> Iterator:
        if data.strip() == "[DONE]":
            return
        try:
            obj = json.loads(data)
        except ValueError:
            raise RemoteError(f"the server sent an event that is not JSON: {data[:200]!r}") from None
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            err = obj["error"]
            raise _StreamError(err.get("message") if isinstance(err, dict) else str(err))
        mine = obj.get(wire.EXTENSION)
        if isinstance(mine, dict):
            if wire.REUSE in mine and wire.TRACE not in mine and not self.started:  # the first chunk: the reuse report
                self.prompt_tokens = mine.get(wire.PROMPT_TOKENS)
                yield from self._start(wire.reuse_from(mine[wire.REUSE]))
            elif wire.TRACE in mine:
                self.report = mine
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        if isinstance(obj.get("timings"), dict):
            self.timings = obj["timings"]
        choices = obj.get("choices") or ()
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta") or choice.get("message") or {}
            content = delta.get("content") if isinstance(delta, dict) else None
            if isinstance(delta, dict) and delta.get("tool_calls"):
                self.calls.add(delta["tool_calls"])
            if isinstance(choice.get("finish_reason"), str):
                self.reason = choice["finish_reason"]
            weighed = choice.get("logprobs") if isinstance(choice.get("logprobs"), dict) else {}
            if isinstance(weighed.get("content"), list):
                self.steps += [s for s in map(wire.step_from, weighed["content"]) if s is not None]
            if isinstance(content, str) and content and self.tokens >= self.req.max_new_tokens:
                self.over = True  # more text than max_tokens allows: not taken
                return
            if isinstance(content, str) and content:
                if not self.started:
                    yield from self._start(None)
                if self.trace.prefill_end is None:  # token 1: the server's prefill ended before it
                    self.trace.prefill_end = t
                    r = self.reuse_seen
                    yield PrefillDone(r.reused, r.computed, t - self.trace.started, self.prompt_tokens or 0)
                self.chunks += 1
                n = mine.get(wire.TOKENS, 1) if isinstance(mine, dict) else 1  # kvchat's: tokens in this chunk
                n = n if type(n) is int else 1  # at most a token per byte (and a few that write nothing)
                n = max(1, min(n, len(content.encode("utf-8", "replace")) + 16, self.req.max_new_tokens - self.tokens))
                self.trace.token_times.extend([t] * n)
                self.text += content
                k = self.tokens
                positions = self.prompt_tokens + k - 1 if self.prompt_tokens else None  # None: not reported
                yield Token(k, -1, content, t, positions)

    @property
    def tokens(self) -> int:
        return len(self.trace.token_times)

    def _start(self, reuse: ReuseReport | None) -> Iterator:
        """PrefillStarted as soon as the server says what it reuses (kvchat), else with token 1."""
        self.started = True
        self.trace.tokenized = self.trace.prefill_start = self.trace.started
        self.reuse_seen = reuse or ReuseReport(0, 0, 0, None, None, None, None, source="unknown")
        yield PrefillStarted(self.prompt_tokens or 0, self.reuse_seen, ())

    def finish(self, cancelled: str | None) -> Finished | Failed:
        if cancelled is None and self.reason is None:
            return self.fail("the server closed the stream before the reply ended")
        trace = self.trace
        trace.end = tracing.now()
        trace.status = "cancelled" if cancelled else "finished"
        reason = "cancelled" if cancelled else wire.STOP_REASONS_BY_FINISH.get(self.reason, "eos")
        if self.report and self.report.get(wire.TRACE, {}).get("status") == "cancelled":
            reason = "cancelled"
        usage = self.usage or self._usage_from_timings()
        prompt = usage.get("prompt_tokens") or self.prompt_tokens
        trace.prompt_tokens = prompt or 0
        reuse = self._reuse(prompt, usage)
        trace.reused, trace.computed = reuse.reused, reuse.computed
        steps = tuple(self.steps[: self.req.max_new_tokens])
        return Finished(reason, self.text, (), self._summary(usage), self._cache(prompt, usage), reuse, "", steps,
                        tool_calls=self.calls.result())  # fmt: skip

    def _usage_from_timings(self) -> dict:
        """llama-server sends `timings` instead of usage in a stream: cache_n cached + prompt_n computed
        prompt positions, predicted_n tokens."""
        t = self.timings or {}
        if not all(isinstance(t.get(k), int) for k in ("cache_n", "prompt_n", "predicted_n")):
            return {}
        details = {"cached_tokens": t["cache_n"], "from": "llama.cpp's timings: cache_n"}
        prompt = t["cache_n"] + t["prompt_n"]
        return {"prompt_tokens": prompt, "completion_tokens": t["predicted_n"], "prompt_tokens_details": details}

    def fail(self, error: str) -> Failed:
        """The reply breaks off: what streamed is kept by the caller; the failure says why."""
        trace = self.trace
        trace.status, trace.end, trace.error = "failed", tracing.now(), error
        return Failed(error, "RemoteError", self._summary(self.usage or {}))

    def _summary(self, usage: dict) -> dict:
        server = None
        if self.report:
            server = self.report.get(wire.TRACE)
        elif self.timings:
            server = {"llama.cpp timings": self.timings}
        summary = self.session._summary(self.trace, server, self.chunks)
        if usage.get("completion_tokens") is not None:
            summary["completion_tokens"] = usage["completion_tokens"]
        summary["speculative"] = self._drafts(server)
        return summary

    def _drafts(self, server: dict | None) -> dict | None:
        """The server's own drafting for this reply: a kvchat server's counts, or llama.cpp's `draft_n` and
        `draft_n_accepted` (checked: counts, accepted within drafted); None where it reports none."""
        mine = (server or {}).get("speculative") if isinstance(server, dict) else None
        if isinstance(mine, dict) and type(mine.get("drafted")) is int and type(mine.get("accepted")) is int:
            return {k: v for k, v in mine.items() if k not in ("speedup", "target_step_ms", "ms_per_token")}
        t = self.timings or {}
        n, ok = t.get("draft_n"), t.get("draft_n_accepted")
        if type(n) is not int or type(ok) is not int or not 0 <= ok <= n or n == 0:
            return None
        return {"draft": "the server's", "label": "the server's own draft (llama.cpp's draft_n)", "drafted": n,
                "accepted": ok, "acceptance": ok / n}  # fmt: skip

    def _reuse(self, prompt: int | None, usage: dict) -> ReuseReport:
        if self.report and wire.REUSE in self.report:
            return wire.reuse_from(self.report[wire.REUSE])
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens")
        how = details.get("from", "usage: cached_tokens")
        if cached is None or prompt is None:
            return ReuseReport(0, prompt or 0, 0, None, None, None, "this server does not report reuse", "unknown")
        return ReuseReport(cached, prompt - cached, 0, None, None, None, f"as the server reports it ({how})", "server")

    def _cache(self, prompt: int | None, usage: dict) -> dict:
        if self.report and wire.CACHE in self.report:
            return {**self.report[wire.CACHE], wire.STORE: self.report.get(wire.STORE)}
        done = usage.get("completion_tokens")
        positions = prompt + done - 1 if prompt is not None and done else prompt  # None: not reported
        per = (self.session._facts or {}).get("kv_bytes_per_position")
        return {
            "positions": positions,
            "capacity": (self.session._facts or {}).get("capacity"),
            "payload_bytes": positions * per if per and positions is not None else None,
            "allocated_bytes": None,
            "reported": prompt is not None,
        }


class _StreamError(RemoteError):
    """The server put an error object into the stream."""
