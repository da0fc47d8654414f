"""`python -m engine serve-bench --concurrency 1,2,4,8`: many requests at once through the engine's scheduler
(engine.batching), in this process. For each concurrency C, rounds of C requests submitted together (new
random prompts of the same length, replies run to --new-tokens past any stop token) on an engine running C at
once. Reported per row: the aggregate decode rate (tokens emitted while all C decode, over that window), its
ratio to concurrency 1 in the same run, each request's TPOT and TTFT (p50, p95; the queue included), the
batch sizes its steps ran in, and the KV memory: the most the pool's blocks held at once, its buffers, and what
C caches of their own (a whole capacity each) would have taken. llama.cpp runs the same counts of sequences at
once in the same run (its batch API, a sequence id each, in a child process: a crash is a row with its error) on
the same weights: the GGUF file itself, or a random shape written as GGUF (F32; its own quantizer's Q8_0 or Q4_0
for int8 or int4 weights).
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


def _decode_window(times: list[list[float]]) -> tuple[int, float]:
    """Tokens emitted while every request decodes (after the last first token, up to the first last token), of
    each request's token times."""
    lo = max(t[0] for t in times)
    hi = min(t[-1] for t in times)
    n = sum(sum(lo < x <= hi for x in t) for t in times)
    return n, hi - lo


def _row(c: int, rates: list, tpots: list[float], ttfts: list[float]) -> dict:
    """One concurrency's row, either engine's: the median aggregate rate of its rounds, TPOT and TTFT quantiles."""
    rate = statistics.median(r for r in rates if r) if any(rates) else None
    return {"concurrency": c, "aggregate_decode_tok_s": round(rate, 2) if rate else None,
            "tpot_ms_p50": _quantile(tpots, 0.5), "tpot_ms_p95": _quantile(tpots, 0.95),
            "ttft_ms_p50": _quantile(ttfts, 0.5), "ttft_ms_p95": _quantile(ttfts, 0.95)}  # fmt: skip


LLAMA_TYPES = {"none": "F32", "int8": "Q8_0", "int4": "Q4_0"}  # kvchat's weights → the GGUF llama.cpp runs


def llama_rows(gguf: str, levels: list[int], prompt_tokens: int, new_tokens: int, rounds: int, vocab: int,
               threads: int) -> list[dict]:  # fmt: skip
    """llama.cpp with C sequences at once for each C of `levels` (LlamaCpp.parallel), measured as kvchat's rows
    are: rounds of C new random prompts together, the aggregate over the window all C decode."""
    from .llamacpp import LlamaCpp

    rnd = random.Random(1)
    lc = LlamaCpp(Path(gguf), n_ctx=max(levels) * (prompt_tokens + new_tokens + 8), threads=threads,
                  sequences=max(levels))  # fmt: skip
    rows = []
    try:
        for c in levels:

            def prompts(c=c) -> list[list[int]]:
                return [[rnd.randrange(4, vocab) for _ in range(prompt_tokens)] for _ in range(c)]

            lc.parallel(prompts(), 8)  # warm
            rates, tpots, ttfts = [], [], []
            for _ in range(rounds):
                start, times = lc.parallel(prompts(), new_tokens)
                n, seconds = _decode_window(times)
                rates.append(n / seconds if seconds > 0 else None)
                tpots += [(b - a) * 1000 for t in times for a, b in zip(t, t[1:])]
                ttfts += [(t[0] - start) * 1000 for t in times]
            rows.append(_row(c, rates, tpots, ttfts))
    finally:
        lc.close()
    return rows


def reference(ns, path: str, levels: list[int], vocab: int, threads: int, tmp: Path) -> dict:
    """llama.cpp's rows on the same weights, in a child process; {"error": ...} when it cannot run or dies."""
    from .bench.isolation import run_isolated

    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return {"engine": "llama.cpp", "error": f"not run: llama-cpp-python is not installed ({e})"}
    if path.endswith(".gguf"):
        gguf = path
    else:
        from .gguf_export import quantize_gguf, write_gguf

        gguf = str(write_gguf(path, tmp / "f32.gguf"))
        kind = LLAMA_TYPES[ns.weights]
        if kind != "F32":
            gguf = str(quantize_gguf(Path(gguf), tmp / f"{kind}.gguf", kind, threads))
    args = (gguf, levels, ns.prompt_tokens, ns.new_tokens, ns.rounds, vocab, threads)
    rows = run_isolated(llama_rows, args)
    out = {"engine": "llama.cpp", "gguf": Path(gguf).name, "sequences": "a sequence id each, one batch a step"}
    return {**out, **rows} if isinstance(rows, dict) else {**out, "rows": rows}


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


def _mib(n: int | None) -> str:
    return "—" if n is None else f"{n / 2**20:,.1f}"


def _memory(engine, c: int) -> dict:
    """The KV memory of a level: the most the pool's blocks held at once (lanes and store), the pool's buffers, and
    C working caches of a whole capacity each (what lanes of their own took before the pool)."""
    session = engine.session
    pool, cache = session.pool, session.cache
    whole = c * cache.full_bytes
    if pool is None:
        return {"kv_whole_caches_bytes": whole}
    return {"kv_held_peak_bytes": pool.peak_held * pool.block_bytes, "kv_pool_bytes": pool.allocated_bytes,
            "kv_whole_caches_bytes": whole}  # fmt: skip


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
        loaded = engine.call(lambda: load_model(path, weights=ns.weights, activations=ns.activations)).result()
        vocab = loaded.config.vocab_size
        capacity = ns.capacity or max(ns.prompt_tokens, 512) + ns.new_tokens + 8

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
            pool = engine.session.pool
            if pool is not None:
                pool.peak_held = pool.held
            rates, tpots, ttfts, sizes = [], [], [], []
            for _ in range(ns.rounds):
                traces = _round(engine, requests(c))
                n, seconds = _decode_window([t.token_times for t in traces])
                rates.append(n / seconds if seconds > 0 else None)
                tpots += [t.tpot_ms for t in traces if t.tpot_ms is not None]
                ttfts += [t.ttft_ms for t in traces if t.ttft_ms is not None]
                sizes += [s for t in traces for s in t.batch_sizes]
            if c == 3:  # two streams and a newcomer: what its prefill does to their pace
                arrival = _arrival(engine, requests, 512)
            mean = round(statistics.mean(sizes), 2) if sizes else None
            rows.append({**_row(c, rates, tpots, ttfts), "mean_batch": mean, **_memory(engine, c)})
        engine.close(30)
        from ..devices import default_threads

        ref = reference(ns, path, levels, vocab, default_threads(), Path(tmp))
    base = rows[0]["aggregate_decode_tok_s"] if rows[0]["concurrency"] == 1 else None
    theirs = {r["concurrency"]: r["aggregate_decode_tok_s"] for r in ref.get("rows", [])}
    for r in rows:
        mine = r["aggregate_decode_tok_s"]
        r["ratio_to_1"] = round(mine / base, 3) if base and mine else None
        r["llama_cpp_tok_s"] = theirs.get(r["concurrency"])
        r["vs_llama_cpp"] = round(mine / theirs[r["concurrency"]], 3) if mine and theirs.get(r["concurrency"]) else None
    report = {**served_facts(ns, loaded), "rounds": ns.rounds, "rows": rows, "arrival": arrival, "reference": ref}
    if ns.json:
        print(json.dumps(report, indent=2))
        return 0
    cpu = report["cpu"] or {}
    print(f"{report['model']} (weights {ns.weights}, activations {ns.activations}) on {report['device']} · "
          f"{cpu.get('model', '')} · "
          f"{report['threads']} threads · {ns.prompt_tokens} prompt tokens, {ns.new_tokens} new, "
          f"{ns.rounds} rounds")  # fmt: skip
    print(
        "concurrent  aggregate decode tok/s  × 1   TPOT p50/p95 ms   TTFT p50/p95 ms   mean batch"
        "   llama.cpp  kvchat/it   KV held at most / whole caches MiB"
    )
    for r in rows:
        ratio = f"{r['ratio_to_1']:.2f}" if r["ratio_to_1"] else "—"
        lc = f"{r['llama_cpp_tok_s']:9.1f}" if r["llama_cpp_tok_s"] else "        —"
        vs = f"{r['vs_llama_cpp']:.2f}" if r["vs_llama_cpp"] else "—"
        print(f"{r['concurrency']:10d}  {r['aggregate_decode_tok_s'] or 0:22.1f}  {ratio:>4}   "
              f"{r['tpot_ms_p50']:6.1f} / {r['tpot_ms_p95']:6.1f}   {r['ttft_ms_p50']:7.1f} / {r['ttft_ms_p95']:7.1f}"
              f"   {r['mean_batch']!s:>10}   {lc}  {vs}   {_mib(r.get('kv_held_peak_bytes'))} / "
              f"{_mib(r['kv_whole_caches_bytes'])}")  # fmt: skip
    if ref.get("error"):
        print(f"llama.cpp: {ref['error']}")
    a = report["arrival"]
    print(f"a {a['prompt_tokens']}-token prompt arriving beside two streams: their p95 gap "
          f"{a['gap_p95_ms_during']:.1f} ms while it is prefilled, {a['gap_p95_ms_before']:.1f} ms before "
          f"({a['ratio']}×)")  # fmt: skip
    return 0
