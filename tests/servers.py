"""OpenAI-compatible servers started by tests on a free loopback port: kvchat's `engine serve` and,
where it is installed, llama-cpp-python's server. Each is a real process, stopped at the test's end."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine.tools.serve_bench import free_port, start_server

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class Server:
    url: str  # the API's base: http://127.0.0.1:PORT/v1
    process: subprocess.Popen
    log: Path

    @property
    def root(self) -> str:
        return self.url.removesuffix("/v1")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def start(command: list[str], log: Path, ready_path: str, port: int, timeout: float = 120.0) -> Server:
    """Start `command`, wait until GET ready_path answers 200 (or fail with the process's output)."""
    with open(log, "wb") as out:
        try:
            proc = start_server(command, f"http://127.0.0.1:{port}{ready_path}", timeout, cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)  # fmt: skip
        except RuntimeError as e:
            raise RuntimeError(f"{e}:\n{log.read_text(errors='replace')}") from None
    return Server(f"http://127.0.0.1:{port}/v1", proc, log)


def engine_serve(log_dir: Path, *args: str) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "engine", "serve", "--port", str(port), *args]
    return start(cmd, log_dir / f"serve-{port}.log", "/health", port)


def llama_cpp_serve(log_dir: Path, gguf: Path, *args: str) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    return start(cmd + list(args), log_dir / f"llama-cpp-{port}.log", "/v1/models", port)


class ScriptedServer:
    """An OpenAI-compatible server that behaves as told (`mode`), in this process on a thread: the
    remote servers that answer as vLLM does (`ok`: usage with cached tokens), stream slowly (`slow`),
    break off mid-reply (`drop`) or refuse (`error`) — what a real remote does on a bad day."""

    def __init__(
        self, model: str = "org/tiny-remote", mode: str = "ok", reply: str | None = None, delay: float = 0.002
    ):
        """`reply`: the text to stream (a few characters a chunk) instead of the default sentence, a chunk
        every `delay` seconds."""
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
        from starlette.routing import Route

        self.model, self.mode = model, mode
        self.requests: list[dict] = []
        self.streaming = 0  # replies streaming now: what its /metrics and /slots report
        self.disconnected = threading.Event()

        def chunk(delta: dict, finish=None, **extra) -> str:
            obj = {"id": "x", "object": "chat.completion.chunk", "model": self.model}
            obj["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
            return "data: " + json.dumps({**obj, **extra}) + "\n\n"

        async def models(_r):
            owner = "llamacpp" if self.mode == "llamacpp" else "vllm"
            return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": owner}]})

        async def chat(r):
            body = await r.json()
            self.requests.append(body)
            if self.mode == "error":
                return JSONResponse({"error": {"message": "the GPU fell over", "type": "server_error"}}, 500)
            words = ["Chengdu", " in", " three", " nights", ":", " pandas", ",", " hotpot", ",", " teahouses", "."]
            if reply is not None:
                words = [reply[i : i + 3] for i in range(0, len(reply), 3)]

            async def events():
                self.streaming += 1
                try:
                    yield chunk({"role": "assistant", "content": ""})
                    for i in range(400 if self.mode == "slow" else len(words)):
                        if self.mode == "drop" and i == 3:
                            raise ConnectionResetError("the server went away")
                        await asyncio.sleep(0.05 if self.mode == "slow" else delay)
                        yield chunk({"content": words[i % len(words)]})
                    if self.mode == "llamacpp":  # llama-server: timings on the last chunk, no usage
                        timings = {"cache_n": 30, "prompt_n": 10, "prompt_ms": 12.5, "predicted_n": 11,
                                   "draft_n": 8, "draft_n_accepted": 5}  # fmt: skip  # a server with a draft model
                        yield chunk({}, "stop", timings={**timings, "predicted_ms": 80.0})
                        yield "data: [DONE]\n\n"
                        return
                    yield chunk({}, "stop")
                    usage = {"prompt_tokens": 40, "completion_tokens": len(words), "total_tokens": 40 + len(words)}
                    usage["prompt_tokens_details"] = {"cached_tokens": 32}
                    yield "data: " + json.dumps({"id": "x", "choices": [], "usage": usage}) + "\n\n"
                    yield "data: [DONE]\n\n"
                except asyncio.CancelledError:
                    self.disconnected.set()
                    raise
                finally:
                    self.streaming -= 1

            return StreamingResponse(events(), media_type="text/event-stream")

        async def metrics(_r):  # vLLM's names (llama-server's under `llamacpp`), as each writes them
            if self.mode == "llamacpp":
                page = f"# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing {self.streaming}\n"
            else:
                page = (
                    "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                    "# TYPE vllm:num_requests_running gauge\n"
                    f'vllm:num_requests_running{{model_name="{self.model}"}} {self.streaming}.0\n'
                    "# TYPE vllm:num_requests_waiting gauge\n"
                    f'vllm:num_requests_waiting{{model_name="{self.model}"}} 0.0\n'
                    "# TYPE vllm:kv_cache_usage_perc gauge\n"
                    f'vllm:kv_cache_usage_perc{{model_name="{self.model}"}} {0.25 * self.streaming}\n'
                )
            return PlainTextResponse(page, media_type="text/plain; version=0.0.4")

        async def slots(_r):  # llama-server's, one slot busy per reply streaming, of two
            return JSONResponse(
                [
                    {
                        "id": i,
                        "n_ctx": 4096,
                        "is_processing": i < self.streaming,
                        "next_token": [{"n_decoded": 7 if i < self.streaming else 0}],
                    }
                    for i in range(2)
                ]
            )

        routes = [Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"]),
                  Route("/metrics", metrics)]  # fmt: skip
        if self.mode == "llamacpp":
            routes.append(Route("/slots", slots))
        app = Starlette(routes=routes)
        self.port, self._server, self._thread = serve_in_thread(app, "the scripted server")
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def stop(self) -> None:
        stop_thread_server(self._server, self._thread)


def serve_in_thread(app, what: str):
    """An ASGI app served by uvicorn on a free loopback port, on a thread of this process: (port, server, thread)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > end:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.01)
    return port, server, thread


def stop_thread_server(server, thread) -> None:
    server.should_exit = True
    thread.join(10)


class HostileServer:
    """A raw HTTP server on loopback that misbehaves byte by byte, as `mode` says (what a broken or hostile
    remote does, below what a web framework would let a test write):

    - `endless-line`: a stream whose `data:` line never ends
    - `huge-tokens`: a chunk that claims a billion tokens
    - `never-ends`: valid tokens without end, whatever max_tokens asked
    - `trickle-models`: /v1/models one byte every `trickle` seconds
    - `bad-card`: a kvchat model card whose numbers are text and whose cache is a string
    - `redirect`: every answer a 302 elsewhere
    - `html`: a 200 page of HTML where a stream should be
    """

    def __init__(self, mode: str, trickle: float = 0.5):
        self.mode, self.trickle = mode, trickle
        self.disconnected = threading.Event()
        self.sent = 0  # bytes written to clients
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._loop = asyncio.new_event_loop()
        started = threading.Event()

        async def serve():
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)
            started.set()

        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(serve(), self._loop)
        if not started.wait(10):
            raise RuntimeError("the hostile server did not start")

    async def _handle(self, reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ")[1].decode()
            length = next(
                (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0
            )
            if length:
                await reader.readexactly(length)
            await self._answer(path, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.disconnected.set()
        finally:
            writer.close()

    async def _write(self, writer, data: bytes):
        writer.write(data)
        await writer.drain()
        self.sent += len(data)

    async def _answer(self, path, writer):
        mode = self.mode
        if mode == "redirect":
            await self._write(
                writer, b"HTTP/1.1 302 Found\r\nLocation: http://elsewhere.example/v1\r\nContent-Length: 0\r\n\r\n"
            )
            return
        if path.endswith("/models"):
            card = {"id": "org/hostile", "object": "model", "owned_by": "vllm"}
            if mode == "bad-card":
                card["kvchat"] = {"name": 5, "capacity": "lots", "parameters": [1], "cache": "full", "kv_cache": "int8"}
            body = json.dumps({"object": "list", "data": [card, "not a card", {"id": 7}]}).encode()
            if mode == "trickle-models":
                await self._write(writer, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n")
                for b in body * 100:
                    await self._write(writer, bytes([b]))
                    await asyncio.sleep(self.trickle)
                return
            await self._write(
                writer,
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body),
            )
            return
        if mode == "html":
            page = b"<html><body>Welcome to the router's login page</body></html>"
            await self._write(
                writer,
                b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n%s" % (len(page), page),
            )
            return
        await self._write(writer, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")

        def chunk(content, **extra):
            obj = {"choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}], **extra}
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        if mode == "endless-line":
            await self._write(writer, b"data: ")
            while True:
                await self._write(writer, b"x" * 65536)
        elif mode == "huge-tokens":
            await self._write(writer, chunk("hi", kvchat={"tokens": 1_000_000_000}))
            await self._write(
                writer, b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n'
            )
        elif mode == "never-ends":
            while True:
                await self._write(writer, chunk(" word"))
                await asyncio.sleep(0.001)

    def stop(self) -> None:
        async def shut():
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
