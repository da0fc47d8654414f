"""A remote OpenAI-compatible server as kvchat reaches it: where it is (RemoteSpec), its small JSON answers
and its streams' server-sent events read with bounds on every line, event and reply, its model list, and the
facts kvchat can know of its model from here. engine.http.remote runs a chat session over it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import time
from pathlib import Path
from urllib.parse import urlsplit

from ..errors import EngineError
from . import openai_chat as wire

POLL_S = 0.5  # how often a reply whose server says nothing looks at its Stop flag (stop() acts at once)
CONNECT_TIMEOUT_S = 5.0  # a model list or a cache probe: the whole answer, not one read
# What one server may send before kvchat stops reading it (a hostile or broken server cannot grow the app).
LINE_BYTES = 1 << 20  # one line of a stream
EVENT_BYTES = 4 << 20  # one event of a stream (its data lines together), or a whole JSON answer
RESPONSE_BYTES = 256 << 20  # one streamed reply, all of it
# A model card's `owned_by` → the server that wrote it (only a label for the panel).
SERVERS = {
    "vllm": "vLLM",
    "sglang": "SGLang",
    "llamacpp": "llama-server",
    "library": "Ollama",
    "me": "llama-cpp-python",
    "organization_owner": "LM Studio",
    "system": "OpenAI",
    "openai": "OpenAI",
}


class RemoteError(EngineError):
    """The server is unreachable, refused the request, or broke off."""


def normalize_url(url: str) -> str:
    """The API's base URL as people paste it: `localhost:8000`, `http://host:8080/`, `…/v1`."""
    url = url.strip().rstrip("/")
    if not url:
        raise RemoteError("no server URL is set")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise RemoteError(f"not an http(s) URL: {url!r}")
    return url if parts.path not in ("", "/") else url + "/v1"


@dataclasses.dataclass(frozen=True)
class RemoteSpec:
    """Where the engine is: an OpenAI-compatible base URL, its API key, the model to ask for."""

    url: str
    api_key: str = ""
    model: str = ""  # "" : the first the server lists
    timeout: float = 300.0  # seconds without a byte before the server counts as gone (a long prefill)

    def describe(self) -> str:
        return f"{self.model or 'the server’s model'} at {self.url}"

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def error_text(status: int, body: bytes) -> str:
    """The server's own message from an error body (OpenAI's `error.message`, FastAPI's `detail`, text)."""
    text = body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        return f"the server answered {status}: {text[:300] or 'no message'}"
    err = obj.get("error") if isinstance(obj, dict) else None
    msg = err.get("message") if isinstance(err, dict) else err if isinstance(err, str) else None
    if msg is None and isinstance(obj, dict):
        msg = obj.get("detail") or obj.get("message")
    return f"the server answered {status}: {msg if isinstance(msg, str) else json.dumps(msg or obj)[:300]}"


def redirected(status: int, headers, url: str) -> str | None:
    """What to say when a server answers with a redirect (kvchat does not follow one: say where it points)."""
    if 300 <= status < 400:
        return f"{url} redirects ({status}) to {headers.get('location', 'nowhere')!r}: set that address instead"
    return None


def _run(coro):
    """Run a coroutine to its end from any thread, one with a running event loop (the GUI's) included."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def fetch(spec: RemoteSpec, method: str, url: str, body=None, seconds: float = CONNECT_TIMEOUT_S) -> bytes:
    """One small answer, whole within `seconds` (a server that trickles a byte at a time is cut off at the
    deadline, not kept alive by each byte) and at most EVENT_BYTES; its bytes (an error status raises)."""
    import httpx

    async def ask():
        async with httpx.AsyncClient(headers=spec.headers(), timeout=seconds) as client:
            async with client.stream(method, url, json=body) as r:
                said = redirected(r.status_code, r.headers, url)
                if said:
                    raise RemoteError(said)
                got = await read_some(r)
                if r.status_code >= 400:
                    raise RemoteError(error_text(r.status_code, got))
                return got

    try:
        return _run(asyncio.wait_for(ask(), seconds))
    except (asyncio.TimeoutError, httpx.TimeoutException):
        raise RemoteError(f"{url} did not answer within {seconds:g} s") from None
    except httpx.HTTPError as e:
        raise RemoteError(f"cannot reach {url}: {type(e).__name__}: {e}") from None


def fetch_json(spec: RemoteSpec, method: str, url: str, body=None, seconds: float = CONNECT_TIMEOUT_S):
    """One small JSON answer (fetch's bounds); the decoded JSON."""
    got = fetch(spec, method, url, body, seconds)
    try:
        return json.loads(got)
    except (ValueError, RecursionError):
        raise RemoteError(f"{url} did not answer with JSON") from None


def list_models(spec: RemoteSpec, timeout: float = CONNECT_TIMEOUT_S) -> list[dict]:
    """GET /v1/models: the server's model cards (kvchat's carry the model's facts under `kvchat`)."""
    url = normalize_url(spec.url)
    data = fetch_json(spec, "GET", url + "/models", seconds=timeout)
    data = data.get("data") if isinstance(data, dict) else None
    if not isinstance(data, list):
        raise RemoteError(f"{url}/models did not answer with an OpenAI model list")
    return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


def config_kv_bytes(model_id: str, hub: Path | None = None) -> dict | None:
    """KV bytes per position from the model's config.json, when the local Hugging Face cache holds the
    repository the id names (vLLM and SGLang serve by repository id): 2·L·H_kv·d·b at its dtype."""
    from ..weights.catalog import roots

    hub = hub or roots()["hf-cache"][0]
    snaps = hub / f"models--{model_id.replace('/', '--')}" / "snapshots"
    configs = sorted(snaps.glob("*/config.json"), key=lambda p: p.stat().st_mtime) if snaps.is_dir() else []
    if not configs:
        return None
    try:
        raw = json.loads(configs[-1].read_text(encoding="utf-8"))
        raw = raw.get("text_config", raw)
        layers, heads = int(raw["num_hidden_layers"]), int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    width = 4 if "32" in dtype else 2
    return {
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "bytes_per_value": width,
        "dtype": dtype,
        "kv_bytes_per_position": 2 * layers * kv_heads * head_dim * width,
        "architecture": (raw.get("architectures") or [None])[0],
    }


def remote_facts(spec: RemoteSpec, card: dict) -> dict:
    """The panel's facts for a remote model: kvchat's own when its server sends them, else what the
    card and a local config tell (the rest None: not reported by this server)."""
    url = normalize_url(spec.url)
    mine = card.get(wire.EXTENSION)
    if isinstance(mine, dict):
        facts = dict(mine)
        cache = facts.get("cache")
        facts["cache"] = {**(cache if isinstance(cache, dict) else {}), "positions": 0}
        facts["server_kind"] = "kvchat"
        facts["name"] = facts["name"] if isinstance(facts.get("name"), str) else card["id"]
    else:
        meta = card.get("meta") if isinstance(card.get("meta"), dict) else {}  # llama-server's
        facts = {
            "name": card["id"],
            "architecture": None,
            "parameters": meta.get("n_params"),
            "dtype": None,
            "capacity": card.get("max_model_len") or meta.get("n_ctx_train"),
            "kv_bytes_per_position": None,
            "kv_cache": "none",
            "cache": {"positions": 0, "allocated_bytes": None},
            "server_kind": SERVERS.get(card.get("owned_by"), card.get("owned_by") or "unknown"),
        }
        known = config_kv_bytes(card["id"])
        if known:
            facts.update(known, kv_source="the model's config.json in the local Hugging Face cache")
    facts.update(backend="remote", server=url, model_id=card["id"], device=f"remote · {url}")
    for key in ("parameters", "capacity", "kv_bytes_per_position"):  # numbers the panel computes with, or None
        if not isinstance(facts.get(key), int) or isinstance(facts.get(key), bool) or facts[key] < 0:
            facts[key] = None
    facts["server_kind"] = str(facts["server_kind"])
    if facts["name"] == card["id"] and card["id"].startswith("/"):  # llama-cpp-python names a model by its path
        facts["name"] = Path(card["id"]).name
    return facts


async def read_some(r) -> bytes:
    """A response's body, at most EVENT_BYTES of it (an error page, a JSON answer)."""
    got = bytearray()
    async for piece in r.aiter_bytes():
        got += piece
        if len(got) > EVENT_BYTES:
            raise RemoteError(f"the server sent more than {EVENT_BYTES >> 20} MiB in one answer")
    return bytes(got)


async def sse_events(r, seconds: float):
    """The data of each server-sent event, as text, within the limits: a line longer than LINE_BYTES, an
    event past EVENT_BYTES, a reply past RESPONSE_BYTES or no whole event for `seconds` ends the stream
    with the reason."""
    buf, data, size, total = bytearray(), [], 0, 0
    last = time.monotonic()
    async for piece in r.aiter_bytes():
        total += len(piece)
        if total > RESPONSE_BYTES:
            raise RemoteError(f"the server sent more than {RESPONSE_BYTES >> 20} MiB for one reply")
        buf += piece
        while (i := buf.find(b"\n")) >= 0:
            line = bytes(buf[:i]).rstrip(b"\r").decode("utf-8", "replace")
            del buf[: i + 1]
            if line.startswith("data:"):
                data.append(line[5:].removeprefix(" "))
                size += len(data[-1])
                if size > EVENT_BYTES:
                    raise RemoteError(f"the server sent an event longer than {EVENT_BYTES >> 20} MiB")
            elif not line and data:
                yield "\n".join(data)
                data, size, last = [], 0, time.monotonic()
        if len(buf) > LINE_BYTES:
            raise RemoteError(f"the server sent a line longer than {LINE_BYTES >> 20} MiB")
        if time.monotonic() - last > seconds:
            raise RemoteError(f"the server sent no whole event for {seconds:.0f} s")
    if data:
        yield "\n".join(data)
