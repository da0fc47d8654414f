"""`python -m desktop.seam_bench`: does the app slow the engine down?

The same chat request runs twice in one process: once on the engine alone, once through the real
window (worker thread, batched signals, the throttled transcript and panel refresh, offscreen).
It reports decode tokens/s as the engine measured it alone, as the engine measured it inside the
app, and as the GUI thread received them, plus the GUI event loop's lag: a 10 ms timer on the
GUI thread records how late each tick fires while the reply streams (targets: GUI ≥ 95% of the
engine alone, lag ≤ 50 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

TICK_MS = 10


def _prompt_text(n_words: int, vocab: int) -> str:
    """Words of the random checkpoint's word-level vocabulary ("t123"): one token each."""
    import random
    rnd = random.Random(1234)
    return " ".join(f"t{rnd.randrange(10, vocab)}" for _ in range(n_words))


def engine_alone(model: str, dtype: str, messages: list, new_tokens: int) -> dict:
    from engine.loader import load_model
    from engine.session import Request, Session
    loaded = load_model(model, dtype=dtype)
    session = Session(loaded)
    last = None
    for ev in session.generate(Request(messages=tuple(messages), max_new_tokens=new_tokens)):
        last = ev
    return last.trace


def through_the_app(model: str, dtype: str, text: str, new_tokens: int, data: Path) -> dict:
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication
    import qasync

    from engine.trace import now

    from .settings import Settings, open_settings
    from .window import MainWindow

    os.environ["KVCHAT_DATA_DIR"] = str(data)
    Settings(model_dir=model, dtype=dtype, max_new_tokens=new_tokens, temperature=0.0).save(open_settings(data))
    app = QApplication.instance() or QApplication([])
    loop = qasync.QEventLoop(app, already_running=False)
    asyncio.set_event_loop(loop)
    window = MainWindow(data)
    window.show()
    ready, finished, arrivals, ticks = [], [], [], []
    window.modelReady.connect(ready.append)
    window.replyFinished.connect(finished.append)
    window.worker.events.connect(
        lambda rid, batch: arrivals.append((now(), sum(e["type"] == "token" for e in batch))))
    timer = QTimer()
    timer.setInterval(TICK_MS)
    timer.timeout.connect(lambda: ticks.append(now()))

    async def wait_for(pred, timeout):
        end = now() + timeout
        while not pred():
            if now() > end:
                raise TimeoutError("the app did not answer in time")
            await asyncio.sleep(0.005)

    try:
        loop.run_until_complete(wait_for(lambda: ready, 300))
        if ready[0].get("error"):
            raise RuntimeError(ready[0]["error"])
        window.composer.setPlainText(text)
        timer.start()
        t_send = now()
        window.send()
        loop.run_until_complete(wait_for(lambda: finished, 600))
        timer.stop()
    finally:
        window.close()
        loop.run_until_complete(asyncio.sleep(0.05))
    final = finished[0]
    if final["type"] != "finished":
        raise RuntimeError(final.get("error", "the reply failed"))
    token_batches = [(t, n) for t, n in arrivals if n]
    first_t, first_n = token_batches[0]
    last_t = token_batches[-1][0]
    total = sum(n for _, n in token_batches)
    gaps = [b - a for a, b in zip(ticks, ticks[1:]) if a >= t_send]
    lag_ms = [max(0.0, g * 1000 - TICK_MS) for g in gaps]
    lag_ms.sort()
    return {"trace": final["trace"], "tokens_received": total, "batches": len(token_batches),
            "gui_decode_tok_s": round((total - first_n) / (last_t - first_t), 3) if last_t > first_t else None,
            "max_lag_ms": round(lag_ms[-1], 2) if lag_ms else None,
            "p95_lag_ms": round(lag_ms[int(0.95 * (len(lag_ms) - 1))], 2) if lag_ms else None,
            "ticks": len(gaps)}


def main(argv=None) -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    ap = argparse.ArgumentParser(prog="python -m desktop.seam_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m", help="a random-weight shape from `python -m engine bench`")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args(argv)
    import torch

    from engine.bench import SHAPES, _default_threads, write_random_checkpoint
    if ns.shape not in SHAPES:
        print(f"error: unknown shape {ns.shape!r} (choose from {', '.join(SHAPES)})", file=sys.stderr)
        return 2
    threads = ns.threads or _default_threads()
    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="kvchat-seam-") as tmp:
        model = str(write_random_checkpoint(Path(tmp) / ns.shape, ns.shape))
        text = _prompt_text(ns.prompt_tokens, SHAPES[ns.shape]["vocab_size"])
        alone = engine_alone(model, ns.dtype, [{"role": "user", "content": text}], ns.new_tokens)
        app = through_the_app(model, ns.dtype, text, ns.new_tokens, Path(tmp) / "data")
    engine_tok_s = alone["decode_tok_s"]
    report = {"shape": ns.shape, "dtype": ns.dtype, "threads": threads, "prompt_tokens": alone["prompt_tokens"],
              "new_tokens": ns.new_tokens, "engine_alone_decode_tok_s": engine_tok_s,
              "engine_in_app_decode_tok_s": app["trace"]["decode_tok_s"],
              "gui_received_decode_tok_s": app["gui_decode_tok_s"],
              "gui_vs_engine_alone": round(app["gui_decode_tok_s"] / engine_tok_s, 3),
              "tokens_received": app["tokens_received"], "signal_batches": app["batches"],
              "event_loop_max_lag_ms": app["max_lag_ms"], "event_loop_p95_lag_ms": app["p95_lag_ms"],
              "timer_ticks": app["ticks"]}
    if ns.json:
        print(json.dumps(report))
        return 0
    print(f"{ns.shape} · {ns.dtype} · {threads} threads · prompt {report['prompt_tokens']} · new {ns.new_tokens}")
    print(f"engine alone           {engine_tok_s:8.2f} tok/s")
    print(f"engine inside the app  {report['engine_in_app_decode_tok_s']:8.2f} tok/s")
    print(f"received by the GUI    {report['gui_received_decode_tok_s']:8.2f} tok/s "
          f"({100 * report['gui_vs_engine_alone']:.1f}% of the engine alone; target ≥ 95%) "
          f"in {report['signal_batches']} signal batches")
    print(f"GUI event-loop lag     max {report['event_loop_max_lag_ms']} ms, p95 {report['event_loop_p95_lag_ms']} ms "
          f"over {report['timer_ticks']} ticks of {TICK_MS} ms (target ≤ 50 ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
