"""What a remote server says about the requests it runs now, in one shape for the app's Requests view: kvchat's
own `/kvchat/stats` (every request: its state, queue wait, prefill, tokens, K/V bytes, batch), llama.cpp's
`/slots` (each slot: processing or idle, its tokens and context), and the Prometheus `/metrics` of vLLM, SGLang
and llama.cpp (how many run and wait, the KV cache's use). Every answer is bounded in size and time
(remote_server.fetch) and read as untrusted: a field of the wrong type is left out, never trusted.
"""

from __future__ import annotations

import json
import threading
import time

from .remote_server import RemoteError, RemoteSpec, fetch, normalize_url

LOAD_TIMEOUT_S = 2.0  # a load report is asked for at the panel's pace: a slow server is skipped, not waited for
MAX_ROWS = 64  # requests or slots listed, at most
# Prometheus names → (field, how several samples add up): vLLM's, SGLang's and llama.cpp's own.
METRICS = {
    "vllm:num_requests_running": ("running", sum),
    "vllm:num_requests_waiting": ("waiting", sum),
    "vllm:kv_cache_usage_perc": ("kv_usage", max),
    "vllm:gpu_cache_usage_perc": ("kv_usage", max),  # vLLM before 0.10
    "vllm:num_preemptions": ("preemptions", sum),
    "sglang:num_running_reqs": ("running", sum),
    "sglang:num_queue_reqs": ("waiting", sum),
    "sglang:token_usage": ("kv_usage", max),
    "llamacpp:requests_processing": ("running", sum),
    "llamacpp:requests_deferred": ("waiting", sum),
    "llamacpp:kv_cache_usage_ratio": ("kv_usage", max),
}


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _num(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def kvchat_load(stats: dict) -> dict:
    """`/kvchat/stats`: its queue and its requests in flight, each field checked."""
    queue = stats.get("queue") if isinstance(stats.get("queue"), dict) else {}
    rows = []
    for r in (stats.get("requests") if isinstance(stats.get("requests"), list) else [])[:MAX_ROWS]:
        if not isinstance(r, dict):
            continue
        prefill = r.get("prefill") if isinstance(r.get("prefill"), dict) else {}
        label = r.get("label")
        rows.append({
            "label": str(label)[:200] if isinstance(label, str) else f"lane {_int(r.get('lane'))}",
            "state": r.get("state") if r.get("state") in ("prefilling", "decoding") else "running",
            "queue_ms": _num(r.get("queue_ms")), "tokens": _int(r.get("tokens")),
            "prefill": (_int(prefill.get("done")), _int(prefill.get("of"))),
            "cache_positions": _int(r.get("cache_positions")),
            "kv_payload_bytes": _int(r.get("kv_payload_bytes")), "batch_size": _int(r.get("batch_size")),
        })  # fmt: skip
    return {"source": "/kvchat/stats", "running": _int(queue.get("running")), "waiting": _int(queue.get("waiting")),
            "parallel": _int(queue.get("parallel")), "requests": rows}  # fmt: skip


def slots_load(slots: list) -> dict:
    """llama.cpp's `/slots`: a row a slot (its id, processing or idle, tokens decoded, its context)."""
    rows = []
    for s in slots[:MAX_ROWS]:
        if not isinstance(s, dict):
            continue
        nxt = s.get("next_token")
        nxt = nxt[0] if isinstance(nxt, list) and nxt and isinstance(nxt[0], dict) else nxt
        decoded = _int(nxt.get("n_decoded")) if isinstance(nxt, dict) else None
        busy = s.get("is_processing")
        busy = bool(busy) if isinstance(busy, bool) else _int(s.get("state")) == 1  # older servers: state 1
        rows.append({"label": f"slot {_int(s.get('id'))}", "state": "running" if busy else "idle",
                     "tokens": decoded, "context": _int(s.get("n_ctx"))})  # fmt: skip
    running = sum(r["state"] == "running" for r in rows)
    return {"source": "/slots", "running": running, "parallel": len(rows), "waiting": None, "requests": rows}


def metrics_load(text: str) -> dict:
    """A Prometheus `/metrics` page: the counts of METRICS it has (parsed by prometheus-client)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                field = METRICS.get(sample.name) or METRICS.get(sample.name.removesuffix("_total"))
                if field is not None:
                    found.setdefault(field[0], []).append((field[1], sample.value))
    except (ValueError, TypeError, IndexError) as e:
        raise RemoteError(f"its /metrics is not Prometheus' text format ({type(e).__name__}: {e})") from None
    out: dict = {"source": "/metrics", "requests": []}
    for name, values in found.items():
        total = values[0][0](v for _, v in values)
        out[name] = round(total, 4) if name == "kv_usage" else int(total)
    return out


def server_load(spec: RemoteSpec, kind: str) -> dict:
    """What the server runs now, as it says it (`source`: the route read), or `error`: kvchat's stats, else
    llama.cpp's slots (where the server has them on), else /metrics."""
    root = normalize_url(spec.url).removesuffix("/v1")
    tried = []
    routes = ["/kvchat/stats"] if kind == "kvchat" else (["/slots", "/metrics"] if kind == "llama-server" else
                                                        ["/metrics"])  # fmt: skip
    for route in routes:
        try:
            body = fetch(spec, "GET", root + route, seconds=LOAD_TIMEOUT_S)
            if route == "/metrics":
                return metrics_load(body.decode("utf-8", "replace"))
            data = json.loads(body)
            if route == "/slots" and isinstance(data, list):
                return slots_load(data)
            if route == "/kvchat/stats" and isinstance(data, dict):
                return kvchat_load(data)
            tried.append(f"{route}: not the answer kvchat reads")
        except (RemoteError, ValueError, RecursionError) as e:
            tried.append(f"{route}: {e}")
    return {"error": "; ".join(tried) or "not reported by this server", "requests": []}


class LoadWatch:
    """A server's load report kept fresh off the caller's thread: `latest()` answers at once with the last report
    (None before the first) and asks again on a thread of its own when it is older than `every` seconds."""

    def __init__(self, ask, every: float = 1.0):
        self.ask, self.every = ask, every
        self.report: dict | None = None
        self.at = float("-inf")  # when the last question was sent (time.monotonic)
        self._lock = threading.Lock()
        self._asking = False

    def latest(self) -> dict | None:
        with self._lock:
            due = not self._asking and time.monotonic() - self.at >= self.every
            if due:
                self._asking, self.at = True, time.monotonic()
        if due:
            threading.Thread(target=self._refresh, name="kvchat-server-load", daemon=True).start()
        return self.report

    def _refresh(self) -> None:
        try:
            report = self.ask()
        except Exception as e:  # whatever the server or the parser did: a report that says so
            report = {"error": f"{type(e).__name__}: {e}", "requests": []}
        with self._lock:
            self.report, self._asking = report, False
