"""`python -m engine serve-bench --concurrency 1,2,4,8`: many requests at once through the engine's scheduler
(engine.batching), in this process. For each concurrency C, rounds of C requests submitted together (new
random prompts of the same length, replies run to --new-tokens past any stop token) on an engine running C at
once. Reported per row: the aggregate decode rate (tokens emitted while all C decode, over that window), its
ratio to concurrency 1 in the same run, each request's TPOT and TTFT (p50, p95; the queue included) and the
batch sizes its steps ran in.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import threading
from pathlib import Path

from .bench.machine import served_facts
from .bench.shapes import write_random_checkpoint


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def _round(engine, requests) -> list:
    """Submit every request at once; their RequestTraces when all have ended."""
    from ..events import Failed
    from ..scheduler import END

    done, failed = threading.Semaphore(0), []

    def sink(ev):
        if ev is END:
            done.release()
        elif isinstance(ev, Failed):
            failed.append(ev.error)

    tickets = [engine.submit(r, sink) for r in requests]
    for _ in tickets:
        done.acquire()
    if failed:
        raise SystemExit(f"error: {failed[0]}")
    return [t.trace for t in tickets]


def _decode_window(traces) -> tuple[int, float]:
    """Tokens emitted while every request decodes (after the last first token, up to the first last token)."""
    lo = max(t.token_times[0] for t in traces)
    hi = min(t.token_times[-1] for t in traces)
    n = sum(sum(lo < x <= hi for x in t.token_times) for t in traces)
    return n, hi - lo


def _arrival(engine, make, long_tokens: int) -> dict:
    """Two streams decoding, then a prompt of `long_tokens` arrives: their token gaps while it is prefilled
    (from its arrival to its first token) against their gaps before it came, p95 each."""
    from ..events import Token
    from ..scheduler import END

    done, seen = threading.Semaphore(0), threading.Event()
    counts = [0, 0]

    def sink_for(i):
        def sink(ev):
            if ev is END:
                done.release()
            elif isinstance(ev, Token) and i < 2:
                counts[i] += 1
                if min(counts) >= 12:
                    seen.set()

        return sink

    streams = [engine.submit(r, sink_for(i)) for i, r in enumerate(make(2))]
    seen.wait(300)
    newcomer = engine.submit(make(1, long_tokens)[0], sink_for(2))
    for _ in range(3):
        done.acquire()
    start, first = newcomer.trace.arrival, newcomer.trace.token_times[0]
    both = max(t.trace.token_times[0] for t in streams)  # "before": while both decode, neither prefilling
    before, during = [], []
    for t in streams:
        times = t.trace.token_times
        for a, b in zip(times, times[1:]):
            (during if start < b <= first else before if both <= a and b <= start else []).append((b - a) * 1000)
    p95_before, p95_during = _quantile(before, 0.95), _quantile(during, 0.95)
    return {"prompt_tokens": long_tokens, "gap_p95_ms_before": p95_before, "gap_p95_ms_during": p95_during,
            "ratio": round(p95_during / p95_before, 3) if p95_before and p95_during else None}  # fmt: skip


def run_concurrency(ns) -> int:

    from ..request import Request
    from ..scheduler import EngineThread
    from ..session import Session
    from ..trace import now
    from ..weights.loading import load_model

    levels = sorted({int(c) for c in ns.concurrency.split(",")} | {3})  # 3: the arrival row's two and one
    if not levels or levels[0] < 1:
        raise SystemExit("error: --concurrency takes counts of 1 or more, as 1,2,4,8")
    rnd = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(ns.model or write_random_checkpoint(Path(tmp) / ns.shape, ns.shape))
        # loaded on the engine's own thread, the only one whose OpenMP team runs the kernels (a second team
        # makes both slow: engine/SERVING.md, "What `engine serve` costs on loopback"); one engine for every row
        engine = EngineThread(parallel=max(levels))
        loaded = engine.call(lambda: load_model(path, weights=ns.weights)).result()
        vocab = loaded.config.vocab_size
        capacity = max(ns.prompt_tokens, 512) + ns.new_tokens + 8

        def requests(c: int, n: int | None = None):
            return [
                Request(prompt_ids=tuple(rnd.randrange(4, vocab) for _ in range(n or ns.prompt_tokens)),
                        max_new_tokens=ns.new_tokens, ignore_eos=True, arrival=now())
                for _ in range(c)
            ]  # fmt: skip

        rows, arrival = [], None
        engine.session = engine.call(lambda: Session(loaded, capacity=capacity, cache_budget=0)).result()
        for c in levels:
            engine.lanes.parallel = c  # nothing runs between rows
            _round(engine, requests(c))  # warm: every lane made, the step's scratch sized
            rates, tpots, ttfts, sizes = [], [], [], []
            for _ in range(ns.rounds):
                traces = _round(engine, requests(c))
                n, seconds = _decode_window(traces)
                rates.append(n / seconds if seconds > 0 else None)
                tpots += [t.tpot_ms for t in traces if t.tpot_ms is not None]
                ttfts += [t.ttft_ms for t in traces if t.ttft_ms is not None]
                sizes += [s for t in traces for s in t.batch_sizes]
            if c == 3:  # two streams and a newcomer: what its prefill does to their pace
                arrival = _arrival(engine, requests, 512)
            rate = statistics.median(r for r in rates if r) if any(rates) else None
            rows.append({
                "concurrency": c,
                "aggregate_decode_tok_s": round(rate, 2) if rate else None,
                "tpot_ms_p50": _quantile(tpots, 0.5), "tpot_ms_p95": _quantile(tpots, 0.95),
                "ttft_ms_p50": _quantile(ttfts, 0.5), "ttft_ms_p95": _quantile(ttfts, 0.95),
                "mean_batch": round(statistics.mean(sizes), 2) if sizes else None,
            })  # fmt: skip
        engine.close(30)
    base = rows[0]["aggregate_decode_tok_s"] if rows[0]["concurrency"] == 1 else None
    for r in rows:
        r["ratio_to_1"] = round(r["aggregate_decode_tok_s"] / base, 3) if base and r["aggregate_decode_tok_s"] else None
    report = {
        **served_facts(ns, loaded),
        "rounds": ns.rounds,
        "rows": rows,
        "arrival": arrival,
        "reference": {"engine": "llama.cpp", "error": "not run: the same-run parallel reference is not wired here"},
    }
    if ns.json:
        print(json.dumps(report, indent=2))
        return 0
    cpu = report["cpu"] or {}
    print(f"{report['model']} (weights {ns.weights}) on {report['device']} · {cpu.get('model', '')} · "
          f"{report['threads']} threads · {ns.prompt_tokens} prompt tokens, {ns.new_tokens} new, "
          f"{ns.rounds} rounds")  # fmt: skip
    print("concurrent  aggregate decode tok/s  × 1   TPOT p50/p95 ms   TTFT p50/p95 ms   mean batch")
    for r in rows:
        ratio = f"{r['ratio_to_1']:.2f}" if r["ratio_to_1"] else "—"
        print(f"{r['concurrency']:10d}  {r['aggregate_decode_tok_s'] or 0:22.1f}  {ratio:>4}   "
              f"{r['tpot_ms_p50']:6.1f} / {r['tpot_ms_p95']:6.1f}   {r['ttft_ms_p50']:7.1f} / {r['ttft_ms_p95']:7.1f}"
              f"   {r['mean_batch']}")  # fmt: skip
    a = report["arrival"]
    print(f"a {a['prompt_tokens']}-token prompt arriving beside two streams: their p95 gap "
          f"{a['gap_p95_ms_during']:.1f} ms while it is prefilled, {a['gap_p95_ms_before']:.1f} ms before "
          f"({a['ratio']}×)")  # fmt: skip
    return 0
