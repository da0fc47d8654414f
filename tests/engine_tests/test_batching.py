"""Many requests at once (engine.batching): each request's tokens equal its run alone whatever runs beside it,
streams overlap (decode steps shared, prompts prefilled between them), a request that leaves frees its lane,
and `engine serve --parallel 4` answers 16 concurrent streams of the official client, each as it would alone."""

import threading
import time

import httpx
import pytest
import torch

from engine.events import Finished, Token
from engine.scheduler import END, EngineThread
from engine.session import Request, Session
from engine.weights.loading import load_model

PROMPTS = [f"Trip {i}: plan {i + 1} nights in Chengdu on {300 + 50 * i} yuan." for i in range(16)]


def _request(i: int, **kw) -> Request:
    sampling = kw.pop("sampling", None)
    extra = {"sampling": sampling} if sampling is not None else {}
    return Request(messages=[{"role": "user", "content": PROMPTS[i]}], max_new_tokens=kw.pop("n", 6 + 3 * (i % 5)),
                   ignore_eos=True, **extra, **kw)  # fmt: skip


@pytest.fixture(scope="module")
def loaded():
    return load_model(None)


def _alone(loaded, requests) -> list[Finished]:
    """Each request on a fresh session of its own, one after another."""
    return [list(Session(loaded).generate(r))[-1] for r in requests]


def _together(engine: EngineThread, requests) -> tuple[list[list], list]:
    """Every request submitted at once; (the events of each, their tickets), when all have ended."""
    events = [[] for _ in requests]
    done = threading.Semaphore(0)

    def sink_for(i):
        def sink(ev):
            if ev is END:
                done.release()
            else:
                events[i].append(ev)

        return sink

    tickets = [engine.submit(r, sink_for(i)) for i, r in enumerate(requests)]
    for _ in requests:
        assert done.acquire(timeout=120)
    return events, tickets


def _first_cancelled_at_5(engine: EngineThread, requests) -> tuple[list[list], list]:
    """Every request submitted at once, the first cancelled at its 5th token (on the engine thread, between two
    steps: a client that goes away mid-batch); (the events of each, their tickets), when all have ended."""
    events, tickets = [[] for _ in requests], []
    done = threading.Semaphore(0)

    def sink_for(i):
        def sink(ev):
            if ev is END:
                done.release()
                return
            events[i].append(ev)
            if i == 0 and isinstance(ev, Token) and ev.index == 5:
                tickets[0].cancel()

        return sink

    for i, r in enumerate(requests):
        tickets.append(engine.submit(r, sink_for(i)))
    for _ in requests:
        assert done.acquire(timeout=120)
    return events, tickets


def test_each_request_equals_its_run_alone_and_their_decode_steps_are_shared(loaded):
    """Eight requests of different prompts and lengths through an engine running 4 at once: each one's tokens
    and text equal its run alone, its steps ran beside others (batch sizes above 1, at most 4), at most 4
    lanes were made, and a lane's second request reuses what the prefix store holds."""
    requests = [_request(i, n=40 + 3 * i) for i in range(8)]  # long enough to overlap while prompts come in
    alone = _alone(loaded, requests)
    engine = EngineThread(parallel=4)
    engine.session = engine.call(Session, loaded).result()
    events, tickets = _together(engine, requests)
    for i, evs in enumerate(events):
        fin = evs[-1]
        assert isinstance(fin, Finished) and fin.reason == "max_new_tokens", fin
        assert fin.trace["policy"] and fin.trace["prefill_chunks"] >= 1
        assert fin.token_ids == alone[i].token_ids and fin.text == alone[i].text, i
        assert [e.token_id for e in evs if isinstance(e, Token)] == list(fin.token_ids)
        sizes = fin.trace["batch_sizes"]
        assert len(sizes) == len(fin.token_ids) - 1 and max(sizes) <= 4  # a step for each token after the first
    assert max(max(t.trace.batch_sizes) for t in tickets) == 4  # four ran side by side
    assert {t.trace.lane for t in tickets} == {0, 1, 2, 3} and len(engine.lanes.lanes) == 4
    assert engine.pending == 0 and not engine.lanes.busy
    engine.close(10)


def test_seeded_sampling_does_not_depend_on_its_batch_mates(loaded):
    from engine.sampling import SamplingParams

    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
    requests = [_request(i, sampling=sampling, n=10) for i in range(5)]
    alone = _alone(loaded, requests)
    engine = EngineThread(parallel=3)
    engine.session = engine.call(Session, loaded).result()
    events, _ = _together(engine, requests)
    assert [evs[-1].token_ids for evs in events] == [f.token_ids for f in alone]
    engine.close(10)


def test_a_long_prompt_is_prefilled_between_the_steps_of_streams_already_running(loaded):
    """Decode first: a 600-position prompt arriving while two streams run is prefilled a chunk a turn, and the
    streams go on between its chunks (their tokens keep coming while it prefills)."""
    engine = EngineThread(parallel=3)
    engine.session = engine.call(Session, loaded, None, 64).result()  # chunks of 64 positions
    long = Request(messages=[{"role": "user", "content": " ".join(["budget"] * 600)}], max_new_tokens=2)
    order = []
    done = threading.Semaphore(0)

    def sink_for(name):
        def sink(ev):
            if ev is END:
                done.release()
            elif type(ev).__name__ in ("Token", "PrefillProgress"):
                order.append((name, type(ev).__name__))

        return sink

    for name in ("a", "b"):
        engine.submit(_request(0 if name == "a" else 1, n=400), sink_for(name))
    engine.submit(long, sink_for("long"))
    for _ in range(3):
        assert done.acquire(timeout=120)
    ends = min(max(k for k, (name, _) in enumerate(order) if name == s) for s in ("a", "b"))  # both still run
    chunks = [k for k, (name, kind) in enumerate(order[:ends]) if name == "long" and kind == "PrefillProgress"]
    assert len(chunks) >= 5
    for a, b in zip(chunks, chunks[1:]):  # between any two of its forwards, both streams made a token
        assert {"a", "b"} <= {name for name, kind in order[a:b] if kind == "Token"}
    engine.close(10)


def test_a_newcomers_prompt_rides_as_rows_of_the_running_streams_decode_steps(loaded, monkeypatch):
    """Where the kernels' batched step runs, a prompt arriving while two streams decode is computed a few positions
    at a time as rows of their decode steps (one call, the weights read once for all): every step that carries them
    also carries both streams' tokens, the rows grow while the step stays within its time, and every request's
    tokens equal its run alone."""
    from engine.model import FEW_POSITIONS, Transformer

    if loaded.model.decode_step is None or not loaded.model.decode_step.batches:
        pytest.skip("no batched kernel step here")
    spans, real = [], Transformer.forward_spans

    def recorded(self, given):
        spans.append([len(tokens) for tokens, _ in given])
        return real(self, given)

    monkeypatch.setattr(Transformer, "forward_spans", recorded)
    requests = [_request(0, n=60), _request(1, n=60), _request(2, n=4)]
    alone = _alone(loaded, requests)
    engine = EngineThread(parallel=3)
    engine.session = engine.call(Session, loaded).result()
    events = [[] for _ in requests]
    done = threading.Semaphore(0)

    def sink_for(i):
        return lambda ev: done.release() if ev is END else events[i].append(ev)

    for i in (0, 1):
        engine.submit(requests[i], sink_for(i))
    while min(sum(isinstance(e, Token) for e in events[i]) for i in (0, 1)) < 3:  # both decoding before it comes
        time.sleep(0.005)
    spans.clear()
    engine.submit(requests[2], sink_for(2))
    for _ in requests:
        assert done.acquire(timeout=120)
    engine.close(10)
    riding = [s for s in spans if any(n > 1 for n in s)]
    assert riding and all(len(s) == 3 for s in riding)  # each with both streams' decode rows
    assert max(n for s in riding for n in s) > 2 and max(n for s in riding for n in s) <= FEW_POSITIONS
    assert [e[-1].token_ids for e in events] == [a.token_ids for a in alone]


def test_riding_rows_keep_to_the_step_time_of_the_batch_they_ride_in():
    """The rows' reference is the decode step's recent time at the number of lanes decoding now: a step of eight
    lanes with rows, under 1.4 of the eight-lane step, doubles the rows though it took far longer than a two-lane
    step did (one reference for all sizes would halve them to one as the batch grew); past 1.8 of it, halves. With
    no time at this many lanes yet (requests that came together), a prompt rides with all the rows a step takes."""
    from engine.batching import Lane, Lanes
    from engine.generation import StepWanted
    from engine.model import FEW_POSITIONS

    lanes = Lanes(lambda: None, 8, lambda ticket: None)
    lanes.lanes = [Lane(i, None) for i in range(8)]
    for lane in lanes.lanes[:2]:
        lane.waiting = StepWanted(None, 0)
    lanes.step_times = {2: 0.010, 8: 0.030}
    assert lanes.step_seconds == 0.010
    for lane in lanes.lanes:
        lane.waiting = StepWanted(None, 0)
    assert lanes.step_seconds == 0.030
    ride = lanes.ride
    lanes._adjust_rows(0.040)  # 1.33 of the eight-lane step (4 of the two-lane one)
    assert lanes.ride == 2 * ride
    lanes._adjust_rows(0.060)  # 2.0 of it
    assert lanes.ride == ride
    assert lanes.rows() == ride
    lanes.step_times = {}
    lanes._adjust_rows(0.5)  # nothing measured at this size yet: left as it is
    assert lanes.ride == ride and lanes.rows() == FEW_POSITIONS  # and no reason to hold a prompt back


def test_a_cancelled_request_frees_its_lane_and_the_others_go_on(loaded):
    requests = [_request(i, n=40) for i in range(3)]
    alone = _alone(loaded, requests)
    engine = EngineThread(parallel=2)
    engine.session = engine.call(Session, loaded).result()
    events, tickets = _first_cancelled_at_5(engine, requests)
    assert events[0][-1].reason == "cancelled" and len(events[0][-1].token_ids) <= 6
    assert events[1][-1].token_ids == alone[1].token_ids and events[2][-1].token_ids == alone[2].token_ids
    assert tickets[2].trace.lane == 0  # the third took the lane the cancelled one freed
    assert engine.pending == 0
    engine.close(10)


def test_engine_serve_parallel_4_answers_16_concurrent_streams_each_as_alone(serve, loaded):
    """The official `openai` client, 16 streams at once against `engine serve --parallel 4 --queue-size 12`:
    each stream's text equals the request's run alone in this process; their reports say they ran 4 at a time."""
    openai = pytest.importorskip("openai")
    server = serve("--parallel", "4", "--queue-size", "12")
    api = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    alone = _alone(loaded, [_request(i, n=40 + i) for i in range(16)])
    texts, reports = [None] * 16, [None] * 16

    def run(i):
        req = _request(i, n=40 + i)
        stream = api.chat.completions.create(
            model="kvchat-demo", messages=list(req.messages), max_tokens=req.max_new_tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        parts = []
        for ch in stream:
            if ch.choices and ch.choices[0].delta.content:
                parts.append(ch.choices[0].delta.content)
            extra = (ch.model_extra or {}).get("kvchat")
            if extra:
                reports[i] = extra
        texts[i] = "".join(parts)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert texts == [f.text for f in alone]
    sizes = [max(r["trace"]["batch_sizes"] or [1]) for r in reports]
    assert max(sizes) == 4 and all(s <= 4 for s in sizes)
    stats = httpx.get(server.root + "/kvchat/stats").json()
    assert stats["summary"]["finished"] == 16 and stats["queue"]["parallel"] == 4 and stats["queue"]["running"] == 0
    waited = [r["trace"]["ttft_queue_ms"] for r in reports]
    assert max(waited) > 5 * min(waited)  # the last four waited behind the first twelve: TTFT says so
    _metrics_count_what_was_sent(server, reports, [40 + i for i in range(16)])


def _metrics_count_what_was_sent(server, reports, lengths):
    """/metrics in Prometheus' text format, read by prometheus-client's own parser, under vLLM's names: its
    counts are what the requests' reports say (prompt positions, reused ones, tokens, requests)."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server.root + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
    prompt = sum(rep["prompt_tokens"] for rep in reports)
    assert samples["vllm:prefix_cache_queries_total"] == samples["vllm:prompt_tokens_total"] == prompt
    assert samples["vllm:prefix_cache_hits_total"] == sum(rep["reuse"]["reused"] for rep in reports)
    assert samples["vllm:generation_tokens_total"] == sum(lengths)
    assert samples["vllm:e2e_request_latency_seconds_count"] == samples["vllm:time_to_first_token_seconds_count"] == 16
    assert samples["vllm:inter_token_latency_seconds_count"] == sum(lengths) - 16
    assert samples["vllm:num_requests_running"] == samples["vllm:num_requests_waiting"] == 0
    assert samples["vllm:num_preemptions_total"] == 0 and samples["kvchat:lanes"] == 4
    computed = sum(rep["reuse"]["computed"] for rep in reports)  # each turn's positions: prefill and decode
    assert samples["vllm:iteration_tokens_total_sum"] == computed + sum(lengths) - 16
    held = samples["kvchat:kv_cache_payload_bytes"]
    assert 0 < held <= samples["kvchat:kv_cache_allocated_bytes"] and 0 < samples["vllm:kv_cache_usage_perc"] < 1


def test_a_stream_that_disconnects_mid_batch_frees_its_lane(serve):
    server = serve("--parallel", "2", "--queue-size", "0")
    body = {"model": "kvchat-demo", "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 1500,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=60) as long:
        lines = (line for line in long.iter_lines() if line)
        assert next(lines).startswith("data:")
        with httpx.stream("POST", server.url + "/chat/completions", json=body, timeout=60) as gone:
            assert next(line for line in gone.iter_lines() if line).startswith("data:")  # both lanes busy now
        end = time.monotonic() + 20  # the second client left: its lane comes free
        while httpx.get(server.root + "/kvchat/stats").json()["queue"]["running"] != 1:
            assert time.monotonic() < end
            time.sleep(0.05)
        short = dict(body, max_tokens=3, stream=False)
        r = httpx.post(server.url + "/chat/completions", json=short, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert next(lines).startswith("data:")  # the first stream goes on


def test_serve_bench_concurrency_reports_each_level_and_the_arrival_of_a_long_prompt():
    """`python -m engine serve-bench --concurrency 1,2`: a row per level (its aggregate decode rate, its ratio to
    one, TPOT and TTFT quantiles, the batch its steps ran in) and the arrival probe's gaps, as JSON."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "engine", "serve-bench", "--concurrency", "1,2", "--shape", "tiny", "--prompt-tokens",
         "16", "--new-tokens", "40", "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    rows = {r["concurrency"]: r for r in report["rows"]}
    assert set(rows) == {1, 2, 3} and rows[1]["ratio_to_1"] == 1.0 and rows[1]["mean_batch"] == 1
    assert rows[2]["mean_batch"] > 1 and rows[2]["tpot_ms_p50"] <= rows[2]["tpot_ms_p95"]
    a = report["arrival"]
    assert a["prompt_tokens"] == 512 and a["gap_p95_ms_during"] > 0 and a["gap_p95_ms_before"] > 0
    ref = report["reference"]
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        assert ref["error"].startswith("not run: llama-cpp-python is not installed")  # not run, and said
    else:  # the same counts of sequences at once on llama.cpp, the same weights written as GGUF
        assert [r["concurrency"] for r in ref["rows"]] == [1, 2, 3] and all(r["aggregate_decode_tok_s"] for r in
                                                                            ref["rows"])  # fmt: skip
        assert rows[2]["vs_llama_cpp"] and rows[2]["llama_cpp_tok_s"] == ref["rows"][1]["aggregate_decode_tok_s"]


def test_n_choices_share_one_prefill_and_each_equals_its_seed_alone(serve, loaded):
    """`n` > 1 through the official client, whole and streamed: one prefill (the first choice's, put into the
    prefix store; the others copy it and compute at most a block of positions), each choice sampled with the
    request's seed plus its index and equal to that request alone, usage counting the prompt once."""
    openai = pytest.importorskip("openai")
    from engine.sampling import SamplingParams

    server = serve("--parallel", "4")
    api = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": " ".join(PROMPTS[:6])}]  # a prompt of several store blocks
    ask = dict(model="kvchat-demo", messages=messages, max_tokens=12, temperature=0.9, top_p=0.95, seed=7,
               extra_body={"ignore_eos": True})  # fmt: skip
    alone = _alone(loaded, [Request(messages=messages, max_new_tokens=12, ignore_eos=True,
                                    sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i))
                            for i in range(3)])  # fmt: skip

    r = api.chat.completions.create(n=3, **ask)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [f.text for f in alone]
    prompt, reports = r.usage.prompt_tokens, r.model_extra["kvchat"]["choices"]
    block = reports[0]["store"]["block"]
    assert prompt > 2 * block and reports[0]["reuse"]["computed"] == prompt  # the one prefill
    for rep in reports[1:]:
        assert rep["reuse"]["source"] == "store" and rep["reuse"]["computed"] <= block  # copied, not computed
    assert r.usage.completion_tokens == 36 and r.usage.total_tokens == prompt + 36

    parts, usage = {}, None
    for ch in api.chat.completions.create(n=2, stream=True, stream_options={"include_usage": True}, **ask):
        for c in ch.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
        usage = ch.usage or usage
    assert parts == {0: alone[0].text, 1: alone[1].text} and usage.completion_tokens == 24

    bad = httpx.post(server.url + "/chat/completions", json={**ask, "n": 17, "extra_body": None})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"


def test_kvchat_stats_lists_the_requests_in_flight_with_their_share_of_the_kv_cache(serve):
    """Three long streams against `--parallel 2`: /kvchat/stats lists the two running (lane, state, prefill,
    tokens, their lane's K/V: payload = positions × bytes per position, summed over requests) and one waiting;
    none once all have ended."""
    server = serve("--parallel", "2")
    per = httpx.get(server.url + "/models").json()["data"][0]["kvchat"]["kv_bytes_per_position"]
    body = {"model": "kvchat-demo", "max_tokens": 1500, "temperature": 0, "ignore_eos": True, "stream": True}

    def run(i):
        msgs = [{"role": "user", "content": PROMPTS[i]}]
        with httpx.stream("POST", server.url + "/chat/completions", json={**body, "messages": msgs}, timeout=120) as r:
            for _ in r.iter_lines():
                pass

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    seen = None
    end = time.monotonic() + 60
    while time.monotonic() < end and seen is None:
        stats = httpx.get(server.root + "/kvchat/stats").json()
        running = [r for r in stats["requests"] if r["state"] == "decoding" and r["tokens"] > 1]  # a step run
        if len(running) == 2 and stats["queue"]["waiting"] == 1:
            seen = stats
        time.sleep(0.01)
    for t in threads:
        t.join(120)
    assert seen is not None, "never saw two requests decoding and one waiting"
    reqs = seen["requests"]
    assert sorted(r["lane"] for r in reqs) == [0, 1] and all(r["batch_size"] in (1, 2) for r in reqs)
    for r in reqs:
        assert r["prefill"]["done"] == r["prefill"]["of"] and r["prompt_positions"] > 0 and r["queue_ms"] >= 0
        assert r["kv_payload_bytes"] == r["cache_positions"] * per <= r["kv_allocated_bytes"]
    assert httpx.get(server.root + "/kvchat/stats").json()["requests"] == []


def test_a_lane_the_memory_cannot_hold_is_not_made_the_request_waits(tmp_path, monkeypatch):
    """A sliding-window model's lanes keep caches of their own (rings, outside the pool): a second lane's cache past
    the share of the memory free now is not made — the request waits for the first lane to free (counted), runs
    there, and equals its run alone; with room, a lane of its own."""
    import engine.batching as batching
    import engine.kv_cache as kv_cache
    from checkpoints import FAMILY_CASES, make_checkpoint

    monkeypatch.setattr(kv_cache, "RING_SPARE", 8)
    opts = dict(FAMILY_CASES["gemma3"])
    windowed = load_model(make_checkpoint(tmp_path, opts.pop("family"), **opts), device="cpu", dtype="float32")
    requests = [Request(prompt_ids=tuple(range(5 + i, 40 + i)), max_new_tokens=30, ignore_eos=True) for i in range(3)]
    alone = [list(Session(windowed, prefill_chunk=8).generate(r))[-1] for r in requests]
    monkeypatch.setattr(batching, "LANE_SHARE", 0.0)  # no room for a second cache
    engine = EngineThread(parallel=4)
    engine.session = engine.call(Session, windowed, None, 8).result()
    assert engine.session.pool is None and engine.session.cache.windowed
    events, tickets = _together(engine, requests)
    assert [evs[-1].token_ids for evs in events] == [a.token_ids for a in alone]
    assert {t.trace.lane for t in tickets} == {0} and len(engine.lanes.lanes) == 1  # one after another
    assert all(max(t.trace.batch_sizes) == 1 for t in tickets)
    assert engine.lanes.memory_waits == 2 and tickets[2].trace.started >= tickets[1].trace.end  # in turn
    monkeypatch.setattr(batching, "LANE_SHARE", 0.5)
    events, tickets = _together(engine, requests[:2])
    assert {t.trace.lane for t in tickets} == {0, 1} and engine.lanes.memory_waits == 2
    engine.close(10)


def test_a_full_kv_pool_makes_a_request_wait_and_every_request_still_equals_its_run_alone(loaded):
    """A pool with room for two requests' blocks (their prompts and replies at most): of three sent at once, the
    third waits for the pool (counted, its wait in its trace) while two run beside each other, and starts once one
    has ended and given its blocks back; each equals its run alone, and the pool never held more than its limit."""
    requests = [_request(i, n=40) for i in range(3)]
    alone = _alone(loaded, requests)
    engine = EngineThread(parallel=4)
    engine.session = engine.call(Session, loaded, 64, None, "none", 0).result()  # no store: blocks are the pool's
    assert max(len(engine.session.fit(r).ids) + r.max_new_tokens for r in requests) in range(49, 65)  # 4 blocks
    engine.lanes.pool_positions = 2 * 64  # room for two at once, not three
    events, tickets = _together(engine, requests)
    for evs, a in zip(events, alone):
        assert evs[-1].token_ids == a.token_ids and evs[-1].text == a.text
    late = max(tickets, key=lambda t: t.trace.started)
    assert engine.lanes.pool_waits == 1 and late.trace.pool_wait_ms > 0
    assert late.trace.started >= min(t.trace.end for t in tickets if t is not late)  # after one gave its blocks back
    assert max(max(t.trace.batch_sizes) for t in tickets) == 2  # two ran side by side, never three
    assert "KV pool" in late.trace.policy and late.trace.kv_blocks_promised > 0
    pool = engine.session.pool
    assert pool.peak_held <= pool.limit == engine.lanes.pool_positions // 16
    engine.close(10)


def test_the_probe_answers_from_the_lane_holding_the_conversation_and_fits_it_once(loaded, monkeypatch):
    """After two requests ran side by side, a conversation's probe says what the lane that holds it keeps (the one
    the next request would take), and renders and tokenizes the conversation once for all the lanes."""
    requests = [_request(i, n=20) for i in range(2)]
    engine = EngineThread(parallel=2)
    engine.session = engine.call(lambda: Session(loaded, cache_budget=0)).result()  # no store: the lanes' own caches
    events, tickets = _together(engine, requests)
    assert {t.trace.lane for t in tickets} == {0, 1}
    second = [*requests[1].messages, {"role": "assistant", "content": events[1][-1].text}]
    fits = []
    real = Session.fit
    monkeypatch.setattr(Session, "fit", lambda self, req: fits.append(self) or real(self, req))
    seen = engine.call(engine.lanes.cached_positions, Request(messages=second, add_generation_prompt=False)).result()
    lane = engine.lanes.lanes[tickets[1].trace.lane].session
    assert len(fits) == 1 and seen["source"] == "working" and seen["cached"] >= len(lane.ids) - 1 > 20
    engine.close(10)


def test_a_request_cancelled_mid_batch_gives_its_blocks_back_and_the_others_go_on(loaded):
    """Of three requests in a pool with room for two, the first is cancelled after a few tokens (its client gone):
    the one waiting for the pool starts once it has ended, the other runs on, each of the two equals its run alone,
    and no block is left held by anyone but the lanes' caches."""
    requests = [_request(i, n=40) for i in range(3)]
    alone = _alone(loaded, requests[1:])
    engine = EngineThread(parallel=4)
    engine.session = engine.call(Session, loaded, 64, None, "none", 0).result()  # no store: blocks are the lanes'
    engine.lanes.pool_positions = 2 * 64  # room for two at once
    events, tickets = _first_cancelled_at_5(engine, requests)
    assert events[0][-1].reason == "cancelled" and len(events[0][-1].token_ids) == 5
    assert [e[-1].token_ids for e in events[1:]] == [a.token_ids for a in alone]
    third = tickets[2].trace
    assert third.pool_wait_ms > 0 and third.started >= tickets[0].trace.end  # it ran in the cancelled one's room
    pool = engine.session.pool
    lanes_hold = sum(len(lane.session.cache.table) for lane in engine.lanes.lanes)
    assert pool.held == lanes_hold and pool.peak_held <= pool.limit == 8
    engine.close(10)


def test_a_full_pool_takes_an_idle_lanes_blocks_back(loaded):
    """Three short requests leave three lanes each holding their blocks; then two long ones need the whole pool: the
    third, idle lane's cache is given back (to the store, which has no room: freed), and both equal their runs
    alone."""
    short = [_request(i, n=8) for i in range(3)]
    long = [_request(i + 3, n=40) for i in range(2)]
    alone = _alone(loaded, long)
    engine = EngineThread(parallel=4)
    engine.session = engine.call(Session, loaded, 64, None, "none", 0).result()
    engine.lanes.pool_positions = 2 * 64  # 8 blocks: the long ones need 4 each
    _together(engine, short)
    pool = engine.session.pool
    idle = [lane for lane in engine.lanes.lanes if lane.session.ids]
    assert len(idle) == 3 and pool.held == 6  # 23 + 8 positions: 2 blocks each, held while idle
    events, _ = _together(engine, long)
    assert [e[-1].token_ids for e in events] == [a.token_ids for a in alone]
    assert pool.peak_held <= 8 and sum(1 for lane in engine.lanes.lanes if not lane.session.ids) >= 1  # one parked
    engine.close(10)


def test_three_choices_of_one_prompt_hold_its_blocks_once_and_the_kv_accounting_is_exact(loaded):
    """n = 3 choices of a 100-position prompt: the first prefills it and puts it in the store, the others take its
    blocks by reference. While all three decode, the pool holds the prompt's six whole blocks once: the payload of
    the three is 2·L·(ΣT − the positions shared)·H_kv·d·b, each request's own payload its positions × bytes per
    position, and every choice equals its run alone."""
    from engine.events import PrefillDone
    from engine.request import choice_requests

    prompt = tuple(range(300, 400))
    choices = choice_requests(Request(prompt_ids=prompt, max_new_tokens=12, ignore_eos=True), 3)
    alone = [list(Session(loaded).generate(r))[-1] for r in choices]
    engine = EngineThread(parallel=4)
    engine.session = engine.call(Session, loaded).result()
    seen, events, done = [], [[], [], []], threading.Semaphore(0)

    def sink_for(i):
        def sink(ev):
            if ev is END:
                done.release()
                return
            events[i].append(ev)
            if i == 0 and isinstance(ev, PrefillDone):
                for j in (1, 2):
                    engine.submit(choices[j], sink_for(j))
            tokens = [sum(isinstance(e, Token) for e in evs) for evs in events]
            if not seen and min(tokens) >= 3:  # on the engine thread: between two turns
                seen.append((engine.lanes.pool_stats(), engine.lanes.in_flight()))

        return sink

    engine.submit(choices[0], sink_for(0))
    for _ in range(3):
        assert done.acquire(timeout=120)
    assert [e[-1].token_ids for e in events] == [a.token_ids for a in alone]
    pool, rows = seen[0]
    per = engine.session.cache.bytes_per_position
    assert len(rows) == 3 and pool["positions"] == sum(r["cache_positions"] for r in rows)
    assert all(r["shared_positions"] == 96 and r["kv_payload_bytes"] == r["cache_positions"] * per for r in rows)
    assert pool["shared_positions"] == 2 * 96  # six whole blocks, held by all three: counted once, not three times
    assert pool["payload_bytes"] == (pool["positions"] - 2 * 96) * per
    assert pool["held_bytes"] == (6 + 3) * pool["block_bytes"]  # the shared six, and each one's own last block
    engine.close(10)


@pytest.mark.parametrize("family,kv", [("llama", "none"), ("llama", "int8"), ("gemma2", "none"), ("gemma3", "none"),
                                       ("phi3", "none"), ("qwen3_moe", "none"), ("olmo2", "none"),
                                       ("gpt_oss", "none"), ("deepseek_v2", "none"),
                                       ("deepseek_v3", "int8"), ("lfm2", "none"),
                                       ("granitemoehybrid", "int8"), ("qwen3_next", "none")])  # fmt: skip
def test_torchs_batched_rows_give_each_sequence_its_step_alone(tmp_path, monkeypatch, family, kv):
    """Where kvchat's kernels do not run decode (a GPU; here a CPU without them), the scheduler's batched step is
    torch's products over B rows at once (engine.passes.rows): three sequences at different lengths (one
    of them past a sliding window, through its ring), each row's logits within 1e-4 of its own step alone, over
    ten steps, and the same greedy token."""
    import engine.backends.kernels as kernels
    import engine.kv_cache as kv_cache
    from checkpoints import FAMILY_CASES, make_checkpoint
    from engine import passes

    monkeypatch.setattr(kernels, "load", lambda: None)
    monkeypatch.setattr(kv_cache, "RING_SPARE", 8)
    opts = dict(FAMILY_CASES.get(family, {"family": family}))
    model = load_model(make_checkpoint(tmp_path, opts.pop("family"), **opts), device="cpu", dtype="float32")
    assert model.kernels is None
    from engine.generation import rows_together

    assert rows_together(model)
    rows, alone = (
        [Session(model, 64, 8, kv).cache for _ in range(3)],
        [Session(model, 64, 8, kv).cache for _ in range(3)],
    )
    for i, (a, b) in enumerate(zip(rows, alone)):
        prompt = torch.arange(5 + i, 5 + i + 9 + 7 * i)[None]  # 9, 16 and 23 positions
        model.model(prompt, a)
        model.model(prompt, b)
    tokens = [7, 8, 9]
    for _ in range(10):
        together = passes.rows(model.model, tokens, rows)  # [3, 1, V]
        each = [model.model(torch.tensor([[t]]), c, last_only=True) for t, c in zip(tokens, alone)]
        for b in range(3):
            scale = float(each[b].abs().max())
            assert float((together[b] - each[b][0]).abs().max()) <= 1e-4 * scale, (family, b)
            assert int(together[b, -1].argmax()) == int(each[b][0, -1].argmax())
        tokens = [int(together[b, -1].argmax()) for b in range(3)]
    assert [c.length for c in rows] == [c.length for c in alone] == [19, 26, 33]


def test_without_kernels_the_scheduler_batches_torchs_rows_and_each_request_equals_its_run_alone(monkeypatch):
    """The engine where the kernels cannot run decode (a GPU's path, here on the CPU): four requests at once decode
    in steps of up to four rows, and each one's greedy tokens equal its run alone."""
    import engine.backends.kernels as kernels

    monkeypatch.setattr(kernels, "load", lambda: None)
    model = load_model(None)
    requests = [_request(i, n=80) for i in range(4)]
    alone = _alone(model, requests)
    engine = EngineThread(parallel=4)
    engine.session = engine.call(Session, model).result()
    events, tickets = _together(engine, requests)
    assert [e[-1].token_ids for e in events] == [a.token_ids for a in alone]
    assert max(max(t.trace.batch_sizes) for t in tickets) == 4
    engine.close(10)
