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
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        self.model, self.mode = model, mode
        self.requests: list[dict] = []
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
                try:
                    yield chunk({"role": "assistant", "content": ""})
                    for i in range(400 if self.mode == "slow" else len(words)):
                        if self.mode == "drop" and i == 3:
                            raise ConnectionResetError("the server went away")
                        await asyncio.sleep(0.05 if self.mode == "slow" else delay)
                        yield chunk({"content": words[i % len(words)]})
                    if self.mode == "llamacpp":  # llama-server: timings on the last chunk, no usage
                        timings = {"cache_n": 30, "prompt_n": 10, "prompt_ms": 12.5, "predicted_n": 11}
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

            return StreamingResponse(events(), media_type="text/event-stream")

        app = Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="critical"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        end = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > end:
                raise RuntimeError("the scripted server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
