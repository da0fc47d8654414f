"""The MCP servers' sessions, on a thread and event loop of their own (the official `mcp` SDK's Client): a server is
started the first time a conversation needs its tools and kept while the app runs; a call has a time limit, its
result is bounded and read as untrusted text, and a server that crashes or hangs is an error for that call — the
chat goes on, and the server is started again at its next use. The window's loop awaits these from its own."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import threading

from engine.tool_calls import NAME, Tool

from .tool_servers import ToolServer, tool_key

CONNECT_S = 20.0  # to start a server and agree on the protocol
CALL_S = 60.0  # a call's answer
LIST_S = 20.0
CLOSE_S = 6.0  # for the sessions to end as asked when the host closes, before they are cancelled
ENDED_S = 2.0  # after a call's connection closed, the wait for the server's end (its status and last words)
MAX_RESULT = 32_000  # characters of a result the model reads (and the transcript keeps)
MAX_TOOLS_PER_SERVER = 128
MAX_DESCRIPTION = 2_000  # characters of a tool's description shown to the model


class ToolError(Exception):
    """A server that could not be started, listed or called: what happened, in words a person reads."""


@dataclasses.dataclass(frozen=True)
class ServerTool:
    """A tool a server offers: its server, its name, its description, its arguments' JSON schema."""

    server: str
    tool: Tool

    @property
    def key(self) -> str:
        return tool_key(self.server, self.tool.name)


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """A call's result as the model and the transcript take it: its text (cut at MAX_RESULT characters), the
    size the server sent, whether it was cut, whether the tool said it failed, and how long it took."""

    text: str
    size: int  # bytes the server's result held (its text parts)
    cut: bool = False
    error: bool = False
    seconds: float = 0.0


class ToolHost:
    """The configured servers' sessions; every method is a coroutine for the caller's loop."""

    def __init__(self, servers: dict[str, ToolServer], call_s: float | None = None, connect_s: float | None = None):
        self.servers, self.call_s, self.connect_s = servers, call_s or CALL_S, connect_s or CONNECT_S
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvchat-mcp", daemon=True)
        self._thread.start()
        self._live: dict[str, _Live] = {}  # server name → its session, while it runs (touched on the host loop)

    # --- what the app calls (from its own loop) ---------------------------------------------------------------
    async def tools(self, server: str) -> list[ServerTool]:
        """The tools `server` offers (starting it if it is not running)."""
        return await self._run(self._tools(server))

    async def call(self, server: str, name: str, arguments: str) -> ToolResult:
        """Call `name` on `server` with `arguments` (JSON text of an object); a ToolResult, error=True where the
        call failed (the server's own error, a timeout, a crash), so the reply goes on from what happened."""
        try:
            args = json.loads(arguments or "{}")
        except (ValueError, RecursionError):
            return _failed(f"the arguments are not JSON: {arguments[:200]}")
        if not isinstance(args, dict):
            return _failed("the arguments are not a JSON object")
        return await self._run(self._call(server, name, args))

    def submit_tools(self, server: str):
        """tools(), for a caller with no event loop of its own: a concurrent.futures.Future of the list."""
        return asyncio.run_coroutine_threadsafe(self._tools(server), self._loop)

    def close(self) -> None:
        """Stop every server (their processes end) and the thread."""
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    async def _run(self, coro):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    # --- on the host's loop -----------------------------------------------------------------------------------
    async def _session(self, server: str) -> _Live:
        live = self._live.get(server)
        if live is not None and not live.done.is_set():
            return live
        config = self.servers.get(server)
        if config is None:
            raise ToolError(f"no server named {server!r} is configured")
        live = self._live[server] = _Live(config)
        live.task = asyncio.ensure_future(live.run())
        try:
            await asyncio.wait_for(asyncio.shield(live.ready), self.connect_s)
        except asyncio.TimeoutError:
            live.task.cancel()  # its handshake may never end: the transport stops the process on the way out
            raise ToolError(f"{server} did not start within {self.connect_s:g} s") from None
        return live

    async def _tools(self, server: str) -> list[ServerTool]:
        live = await self._session(server)
        try:
            listed = await asyncio.wait_for(live.ask(lambda c: c.list_tools()), LIST_S)
        except asyncio.TimeoutError:
            raise ToolError(f"{server} did not list its tools within {LIST_S:g} s") from None
        out = []
        for t in listed.tools[:MAX_TOOLS_PER_SERVER]:
            schema = t.input_schema if isinstance(t.input_schema, dict) else {"type": "object"}
            if NAME.match(t.name):
                desc = (t.description or "")[:MAX_DESCRIPTION]
                out.append(ServerTool(server, Tool(t.name, desc, schema)))
        return out

    async def _call(self, server: str, name: str, args: dict) -> ToolResult:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            live = await self._session(server)
            result = await asyncio.wait_for(live.ask(lambda c: c.call_tool(name, args)), self.call_s)
        except asyncio.TimeoutError:
            return _failed(f"{server} did not answer within {self.call_s:g} s", loop.time() - t0)
        except ToolError as e:
            return _failed(str(e), loop.time() - t0)
        except Exception as e:  # the server's own error, or its end: said, and the chat goes on
            from mcp_types import CONNECTION_CLOSED

            from .mcp_stdio import CUT_CODE, CUT_KEY

            data = getattr(e, "data", None)
            if getattr(e, "code", None) == CUT_CODE and isinstance(data, dict):  # a result over the size read
                return _cut(str(data.get("text", "")), int(data.get(CUT_KEY, 0)), loop.time() - t0)
            why = f"{server}: {_words(e) or type(e).__name__}"
            last = self._live.get(server)
            if last is not None and getattr(e, "code", None) == CONNECTION_CLOSED:  # its end and last words say more
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(last.done.wait(), ENDED_S)
                why = last.ended() if last.done.is_set() else why
            return _failed(why, loop.time() - t0)
        return _result(result, loop.time() - t0)

    async def _close(self) -> None:
        tasks = [live.task for live in self._live.values() if live.task is not None]
        for live in self._live.values():
            live.stop()
        _, left = await asyncio.wait(tasks, timeout=CLOSE_S) if tasks else (None, ())
        for task in left:  # a session still in its handshake, or a server that will not stop: cancelled
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)


class _Live:
    """One running server: a task holds its Client open until it is stopped or the server ends; calls run beside
    each other on it (one that hangs holds up no other)."""

    def __init__(self, config: ToolServer):
        from .mcp_stdio import ServerProcess  # the SDK (0.7 s to import) only once a server is needed

        self.config, self.process = config, ServerProcess()
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self.done = asyncio.Event()
        self.stopping = asyncio.Event()
        self.client = None
        self.task: asyncio.Future | None = None
        self.error: BaseException | None = None

    async def run(self) -> None:
        from mcp import Client

        try:
            async with Client(self._transport(), read_timeout_seconds=CALL_S * 2) as client:
                self.client = client
                self.ready.set_result(True)
                waits = {asyncio.ensure_future(self.stopping.wait()), asyncio.ensure_future(self.process.closed.wait())}
                _, left = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)  # stopped, or it ended
                for w in left:
                    w.cancel()
        except BaseException as e:  # the server ended or never started; its calls fail with the reason
            self.error = e
        finally:
            self.client = None
            self.done.set()
            if not self.ready.done():
                self.ready.set_exception(ToolError(self.ended()))

    def _transport(self):
        if self.config.url:
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            http = httpx2.AsyncClient(headers=dict(self.config.headers), timeout=httpx2.Timeout(30, read=CALL_S))
            return streamable_http_client(self.config.url, http_client=http)
        from .mcp_stdio import stdio_transport

        return stdio_transport(self.config, self.process)

    async def ask(self, fn):
        """`fn(client)`, or ToolError where the server ends first (a cancelled wait cancels the request)."""
        if self.client is None:
            raise ToolError(self.ended())
        work = asyncio.ensure_future(fn(self.client))
        ended = asyncio.ensure_future(self.done.wait())
        try:
            await asyncio.wait({work, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not work.done():
                work.cancel()
        if work.cancelled():
            raise ToolError(self.ended())
        return work.result()

    def ended(self) -> str:
        """Why the server is not running, in a line."""
        name = self.config.name
        if isinstance(self.error, FileNotFoundError):
            return f"{name}: its command was not found ({self.config.command})"
        code = self.process.returncode
        words = self.process.last_words() or _words(self.error)
        said = f" — {words}" if words else ""
        if code is not None and code != 0:
            return f"{name} exited with status {code}{said}"
        return f"{name} stopped{said}"

    def stop(self) -> None:
        self.stopping.set()


def _words(e: BaseException | None) -> str:
    """An exception's message (the first of a group's), in a line."""
    while e is not None and getattr(e, "exceptions", None):  # an exception group
        e = e.exceptions[0]
    return "" if e is None else str(e).strip().splitlines()[0][:300] if str(e).strip() else ""


def _failed(text: str, seconds: float = 0.0) -> ToolResult:
    return ToolResult(text, len(text.encode()), error=True, seconds=seconds)


def _result(result, seconds: float) -> ToolResult:
    """A CallToolResult as text: its text parts joined; other parts named (never loaded); the structured content
    where there is no text; cut at MAX_RESULT characters."""
    parts, size = [], 0
    for c in result.content or ():
        kind = getattr(c, "type", "")
        if kind == "text":
            parts.append(c.text)
            size += len(c.text.encode())
        else:
            mime = getattr(c, "mime_type", None) or getattr(c, "mimeType", None) or ""
            parts.append(f"[{kind} {mime}: not shown]".replace("  ", " "))
    if not parts and result.structured_content is not None:
        text = json.dumps(result.structured_content, ensure_ascii=False)
        parts, size = [text], len(text.encode())
    text = "\n".join(parts)
    if len(text) > MAX_RESULT:
        return _cut(text, size, seconds, bool(result.is_error))
    return ToolResult(text, size, error=bool(result.is_error), seconds=seconds)


def _cut(text: str, size: int, seconds: float, error: bool = False) -> ToolResult:
    """A result over MAX_RESULT characters (or over what the transport reads): its start, and a line saying so."""
    kept = min(len(text), MAX_RESULT)
    note = f"\n[cut: the result was {size:,} bytes; its first {kept:,} characters kept]"
    return ToolResult(text[:MAX_RESULT] + note, size, cut=True, error=error, seconds=seconds)
