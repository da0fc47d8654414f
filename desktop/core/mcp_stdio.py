"""An MCP server started as a command, spoken to over its stdin and stdout with every message bounded: the SDK's
own stdio transport joins each chunk onto the line so far (a 50 MB result took over a minute and 400 MB here), and
holds a line of any size. This one keeps a message up to MAX_MESSAGE and reads past a longer one keeping its start
(the call it answers gets an error holding that start and its size, which tool_host makes a cut result), and keeps
the server's last words on stderr to say why it stopped. The environment is the SDK's safe inherited one plus what
the person configured."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess

import anyio
import mcp_types as types
from mcp.client.stdio import get_default_environment
from mcp.shared.message import SessionMessage

MAX_MESSAGE = 8 * 1024 * 1024  # bytes of one message from a server; past it the rest is read and dropped
PREVIEW = 256 * 1024  # bytes kept from the start of a message over MAX_MESSAGE
STDERR_KEPT = 4096  # bytes of the server's stderr kept to say why it stopped
STOP_GRACE_S = 2.0  # after stdin closes, before the server is terminated (then killed)
CUT_KEY = "kvchat/cut_bytes"  # in a cut result's error data: the whole message's size (and "text", its start)
CUT_CODE = -32099  # the JSON-RPC error code of a result cut here (one of the server-error codes)
ID = re.compile(rb'"id"\s*:\s*("(?:[^"\\]|\\.){0,128}"|-?\d{1,20})')


class ServerProcess:
    """One started server: its stderr's tail and its exit status, for the error a person reads."""

    def __init__(self):
        self.stderr = bytearray()
        self.returncode: int | None = None
        self.closed = anyio.Event()  # its stdout ended: it exited, or will not say more
        self.stderr_done = anyio.Event()

    def last_words(self) -> str:
        lines = [ln for ln in self.stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
        return lines[-1][:300] if lines else ""


@contextlib.asynccontextmanager
async def stdio_transport(server, process_info: ServerProcess):
    """(read stream, write stream) of SessionMessages to `server` (tool_servers.ToolServer), started now and
    stopped (stdin closed, terminated, killed) when the block ends."""
    env = get_default_environment() | dict(server.env)
    process = await anyio.open_process(
        [server.command, *server.args],
        env=env,
        cwd=server.cwd or None,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=os.name == "posix",  # its own process group: stopping it stops what it started
    )
    into_reader, read_stream = anyio.create_memory_object_stream(0)
    write_stream, from_writer = anyio.create_memory_object_stream(0)
    calls: set = set()  # ids of tools/call requests not answered yet

    async def stdout_reader():
        async with into_reader:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
                async for message in _messages(process.stdout):
                    await into_reader.send(_parse(message, calls))
        with anyio.move_on_after(STOP_GRACE_S):  # its end: the status and last words that say why
            await process.wait()
            await process_info.stderr_done.wait()
        process_info.returncode = process.returncode
        process_info.closed.set()

    async def stderr_reader():
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, anyio.EndOfStream):
            async for chunk in process.stderr:
                process_info.stderr += chunk
                del process_info.stderr[:-STDERR_KEPT]
        process_info.stderr_done.set()

    async def stdin_writer():
        async with from_writer:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                async for sm in from_writer:
                    message = sm.message
                    if isinstance(message, types.JSONRPCRequest) and message.method == "tools/call":
                        calls.add(message.id)
                    data = message.model_dump_json(by_alias=True, exclude_unset=True)
                    await process.stdin.send((data + "\n").encode())

    async with anyio.create_task_group() as tg:
        tg.start_soon(stdout_reader)
        tg.start_soon(stderr_reader)
        tg.start_soon(stdin_writer)
        try:
            yield read_stream, write_stream
        finally:
            with anyio.CancelScope(shield=True):
                await _stop(process)
                process_info.returncode = process.returncode
            tg.cancel_scope.cancel()


async def _messages(stdout):
    """The server's newline-delimited messages as bytes; one over MAX_MESSAGE as (its start, its size)."""
    line: list[bytes] = []
    size = 0
    for_long: tuple[bytes, int] | None = None  # a message over the limit: its kept start, its size so far
    async for chunk in stdout:
        while chunk:
            end = chunk.find(b"\n")
            part, chunk = (chunk, b"") if end < 0 else (chunk[:end], chunk[end + 1 :])
            if for_long is not None:
                for_long = (for_long[0], for_long[1] + len(part))
            elif size + len(part) > MAX_MESSAGE:
                kept = b"".join(line) + part
                for_long = (kept[:PREVIEW], size + len(part))
                line, size = [], 0
            else:
                line.append(part)
                size += len(part)
            if end < 0:
                continue
            if for_long is not None:
                yield for_long
                for_long = None
            elif size:
                yield b"".join(line)
            line, size = [], 0


def _parse(message, calls: set):
    """A SessionMessage, or the error the session surfaces; a message over the limit answers its call, cut."""
    if isinstance(message, tuple):
        return _cut(*message, calls)
    try:
        parsed = types.jsonrpc_message_adapter.validate_json(message, by_name=False)
    except ValueError as e:
        return e
    if isinstance(parsed, (types.JSONRPCResponse, types.JSONRPCError)):
        calls.discard(parsed.id)
    return SessionMessage(parsed)


def _cut(start: bytes, size: int, calls: set):
    """The answer to the call a message over MAX_MESSAGE was for: the text its start holds, marked cut."""
    found = ID.search(start[:4096])
    rid = json.loads(found.group(1)) if found else None
    if rid not in calls:
        return ValueError(f"a message of {size:,} bytes from the server: over the {MAX_MESSAGE:,} kvchat reads")
    calls.discard(rid)
    text = _text_start(start.decode("utf-8", "ignore"))
    data = {CUT_KEY: size, "text": text}  # an error, so the SDK does not hold the cut text to the tool's schema
    error = types.ErrorData(code=CUT_CODE, message=f"a result of {size:,} bytes, cut", data=data)
    return SessionMessage(types.JSONRPCError(jsonrpc="2.0", id=rid, error=error))


def _text_start(start: str) -> str:
    """The first text content's characters in a message's start (its JSON string decoded up to the cut)."""
    at = re.search(r'"text"\s*:\s*"', start)
    if at is None:
        return ""
    body, i = start[at.end() :], 0
    while i < len(body) and body[i] != '"':  # to the string's end, or the cut
        i += 2 if body[i] == "\\" else 1
    body = re.sub(r"\\u[0-9a-fA-F]{0,3}$|\\$", "", body[: min(i, len(body))])  # an escape the cut split
    try:
        return json.loads(f'"{body}"')
    except ValueError:
        return body


async def _stop(process) -> None:
    """Close its stdin, wait STOP_GRACE_S, then terminate its process group, then kill it."""
    with contextlib.suppress(Exception):
        await process.stdin.aclose()
    with anyio.move_on_after(STOP_GRACE_S):
        await process.wait()
        return
    for sig in ("SIGTERM", "SIGKILL"):
        with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
            if os.name == "posix":
                import signal

                os.killpg(process.pid, getattr(signal, sig))
            else:
                process.terminate() if sig == "SIGTERM" else process.kill()
        with anyio.move_on_after(STOP_GRACE_S):
            await process.wait()
            return
