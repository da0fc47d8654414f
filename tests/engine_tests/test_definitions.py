"""The reference chapter's numbers, exactly: cached positions, KV bytes, request timing."""

import pytest
import torch

from engine.events import Finished, PrefillDone, Token
from engine.kv_cache import KVCache, payload_bytes
from engine.session import Request, Session
from engine.spec import parse_bytes
from engine.trace import RequestTrace, summarize
from engine.weights.loading import load_model


def test_table_30_1_bytes_for_8_9_10_positions():
    cache = KVCache(num_layers=2, num_kv_heads=2, head_dim=4, capacity=16, dtype=torch.float16, device="cpu")
    k = torch.zeros(1, 2, 8, 4, dtype=torch.float16)
    got = []
    for t in [8, 1, 1]:
        for layer in range(2):
            cache.write(layer, cache.length, k[:, :, :t], k[:, :, :t])
        cache.length += t
        got.append((cache.positions, cache.payload_bytes))
    assert got == [(8, 512), (9, 576), (10, 640)]
    assert cache.bytes_per_position == 64
    assert cache.allocated_bytes == 2 * 2 * 2 * 16 * 4 * 2  # the whole capacity, not the length


def test_example_30_3_and_exercise_3():
    # the chapter's 384 MiB and 768 MiB, as a person writes them (engine.spec.parse_bytes: binary units)
    assert payload_bytes(num_layers=24, positions=4096, num_kv_heads=8, head_dim=128, bytes_per_value=2) == parse_bytes(
        "384MiB"
    )
    # four KV heads, four requests of 4,096 positions: T becomes the sum of lengths
    assert payload_bytes(24, 4 * 4096, 4, 128, 2) == parse_bytes("768MiB") == 805_306_368


def _run(session, req):
    events = list(session.generate(req))
    assert isinstance(events[-1], Finished), events[-1]
    return events


def test_eight_position_prefill_then_token_1_consumed(llama_dir):
    loaded = load_model(llama_dir, device="cpu", dtype="float32")
    session = Session(loaded, capacity=64)
    prompt = tuple(range(10, 18))  # 8 positions
    events = _run(session, Request(prompt_ids=prompt, max_new_tokens=2))
    done = next(e for e in events if isinstance(e, PrefillDone))
    tokens = [e for e in events if isinstance(e, Token)]
    assert done.cache_positions == 8  # prefill: 8 cached, token 1 selectable
    assert tokens[0].cache_positions == 8  # token 1 emitted, not yet consumed
    assert tokens[1].cache_positions == 9  # consuming token 1 made 9
    assert events[-1].cache["positions"] == 9  # the last output token is never consumed


def test_exercise_2_ten_positions(llama_dir):
    loaded = load_model(llama_dir, device="cpu", dtype="float32")
    session = Session(loaded, capacity=64)
    events = _run(session, Request(prompt_ids=tuple(range(10, 20)), max_new_tokens=2))
    tokens = [e for e in events if isinstance(e, Token)]
    assert [tokens[0].cache_positions, tokens[1].cache_positions] == [10, 11]


def _trace(arrival, prefill_start, times):
    t = RequestTrace(
        arrival=arrival / 1000,
        started=arrival / 1000,
        tokenized=prefill_start / 1000,
        prefill_start=prefill_start / 1000,
        prefill_end=prefill_start / 1000,
    )
    t.token_times = [x / 1000 for x in times]
    t.end = times[-1] / 1000 if times else None
    return t


def test_example_30_2_trace():
    t = _trace(0, 30, [150, 190, 235, 270])
    assert t.ttft_ms == 150
    assert t.gaps_ms == [40, 45, 35]
    assert t.tpot_ms == 40
    assert t.decode_tok_s == 25
    assert t.e2e_ms == 270
    assert t.mean_ms_per_token_incl_wait == 67.5
    assert t.ttft_parts_ms["ttft_queue_ms"] == 0 and t.ttft_parts_ms["ttft_tokenize_ms"] == 30
    parts = t.ttft_parts_ms
    assert sum(parts.values()) == pytest.approx(t.ttft_ms)


def test_exercise_1_trace():
    t = _trace(10, 10, [110, 160, 220])
    assert (t.ttft_ms, t.gaps_ms, t.tpot_ms, t.e2e_ms) == (100, [50, 60], 55, 210)


def test_one_token_has_no_tpot():
    t = _trace(0, 0, [150])
    assert t.ttft_ms == 150
    assert t.tpot_ms is None and t.decode_tok_s is None  # missing, not zero
    assert t.mean_ms_per_token_incl_wait == 150


def test_failed_request_is_counted_not_dropped(llama_dir):
    loaded = load_model(llama_dir, device="cpu", dtype="float32")
    session = Session(loaded, capacity=16)
    _run(session, Request(prompt_ids=(5, 6, 7), max_new_tokens=3))
    failed = list(session.generate(Request(prompt_ids=tuple(range(5, 25)), max_new_tokens=3)))
    assert type(failed[-1]).__name__ == "Failed"
    s = summarize(session.traces)
    assert s["requests"] == 2 and s["failed"] == 1 and s["finished"] == 1
    assert s["median_ttft_ms"] == session.traces[0].ttft_ms  # the failed one has no TTFT to add


def test_real_request_trace_parts_add_up(llama_dir):
    from engine.trace import now

    loaded = load_model(llama_dir, device="cpu", dtype="float32")
    session = Session(loaded, capacity=64)
    arrival = now()
    events = _run(session, Request(prompt="Hello world", max_new_tokens=5, arrival=arrival))
    tr = session.traces[-1]
    t = events[-1].trace
    assert t["ttft_ms"] == pytest.approx(
        sum(
            v
            for k, v in t.items()
            if k in ("ttft_queue_ms", "ttft_tokenize_ms", "ttft_prefill_ms", "ttft_first_token_ms")
        ),
        abs=1e-3,
    )
    assert tr.token_times[0] - arrival == pytest.approx(t["ttft_ms"] / 1000)
    assert t["prefill_tok_s"] == pytest.approx(tr.computed / (t["prefill_ms"] / 1000), rel=1e-3)
