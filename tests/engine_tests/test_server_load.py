"""A remote server's load report, read as untrusted: kvchat's /kvchat/stats, llama.cpp's /slots and Prometheus
/metrics (vLLM's, SGLang's, llama.cpp's names) into one shape; a field of the wrong type is left out, a page that is
not Prometheus' format is an error that says so."""

import pytest

from engine.http.remote_server import RemoteError
from engine.http.server_load import LoadWatch, kvchat_load, metrics_load, slots_load


def test_kvchat_stats_keep_what_is_of_the_right_type():
    stats = {"queue": {"running": 2, "parallel": 4, "waiting": "many"},
             "requests": [{"lane": 0, "label": "Trip", "state": "decoding", "queue_ms": 3.5, "tokens": 12,
                           "prefill": {"done": 40, "of": 40}, "cache_positions": 52, "kv_payload_bytes": 1024,
                           "batch_size": 2},
                          {"lane": 1, "label": ["not", "text"], "state": "<script>", "tokens": -3, "prefill": 7},
                          "garbage"]}  # fmt: skip
    got = kvchat_load(stats)
    assert (got["running"], got["parallel"], got["waiting"]) == (2, 4, None)
    first, second = got["requests"]
    assert first == {"label": "Trip", "state": "decoding", "queue_ms": 3.5, "tokens": 12, "prefill": (40, 40),
                     "cache_positions": 52, "kv_payload_bytes": 1024, "batch_size": 2}  # fmt: skip
    assert second["label"] == "lane 1" and second["state"] == "running" and second["tokens"] is None
    assert second["prefill"] == (None, None)


def test_llama_server_slots_new_and_old():
    got = slots_load([{"id": 0, "n_ctx": 4096, "is_processing": True, "next_token": [{"n_decoded": 31}]},
                      {"id": 1, "n_ctx": 4096, "state": 0, "next_token": {"n_decoded": 0}}, 5])  # fmt: skip
    assert got["running"] == 1 and got["parallel"] == 2
    assert [(r["label"], r["state"], r["tokens"]) for r in got["requests"]] == [
        ("slot 0", "running", 31),
        ("slot 1", "idle", 0),
    ]


def test_metrics_of_vllm_sglang_and_llama_cpp():
    vllm = ('vllm:num_requests_running{model_name="m",engine="0"} 2.0\n'
            'vllm:num_requests_running{model_name="m",engine="1"} 1.0\n'
            'vllm:num_requests_waiting{model_name="m"} 4.0\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 0.375\n'
            "# TYPE vllm:num_preemptions counter\n"
            'vllm:num_preemptions_total{model_name="m"} 3.0\n')  # fmt: skip
    got = metrics_load(vllm)
    assert (got["running"], got["waiting"], got["kv_usage"], got["preemptions"]) == (3, 4, 0.375, 3)
    sglang = "sglang:num_running_reqs 5\nsglang:num_queue_reqs 0\nsglang:token_usage 0.5\n"
    assert metrics_load(sglang) | {"source": 0} == {"source": 0, "requests": [], "running": 5, "waiting": 0,
                                                    "kv_usage": 0.5}  # fmt: skip
    assert metrics_load("llamacpp:requests_processing 1\nllamacpp:requests_deferred 2\n")["waiting"] == 2
    assert metrics_load("other_metric 1\n") == {"source": "/metrics", "requests": []}
    with pytest.raises(RemoteError, match="not Prometheus"):
        metrics_load("<html>a login page</html>\n")


def test_the_watch_answers_at_once_and_asks_on_a_thread_of_its_own():
    import threading
    import time

    asked, gate = [], threading.Event()

    def ask():
        asked.append(threading.current_thread().name)
        gate.wait(5)
        return {"running": len(asked)}

    watch = LoadWatch(ask, every=0.0)
    assert watch.latest() is None  # nothing yet, and no wait
    assert watch.latest() is None and len(asked) <= 1  # one question at a time
    gate.set()
    end = time.monotonic() + 5
    while watch.report is None and time.monotonic() < end:
        time.sleep(0.01)
    assert watch.report == {"running": 1} and asked == ["kvchat-server-load"]
    broken = LoadWatch(lambda: 1 / 0, every=0.0)
    broken.latest()
    end = time.monotonic() + 5
    while broken.report is None and time.monotonic() < end:
        time.sleep(0.01)
    assert broken.report["error"].startswith("ZeroDivisionError")
