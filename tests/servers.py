"""OpenAI-compatible servers started by tests on a free loopback port: kvchat's `engine serve` and,
where it is installed, llama-cpp-python's server. Each is a real process, stopped at the test's end."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    out = open(log, "wb")
    proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}/v1", proc, log)
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{server.output()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"the server did not come up in {timeout:.0f} s:\n{server.output()}")


def engine_serve(log_dir: Path, *args: str) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "engine", "serve", "--port", str(port), *args]
    return start(cmd, log_dir / f"serve-{port}.log", "/health", port)


def llama_cpp_serve(log_dir: Path, gguf: Path, *args: str) -> Server:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    return start(cmd + list(args), log_dir / f"llama-cpp-{port}.log", "/v1/models", port)
