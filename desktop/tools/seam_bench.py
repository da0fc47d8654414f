"""`python -m desktop.tools.seam_bench`: does the app slow the engine down?

The same chat request runs through the real window (offscreen, styled as the app is) and on the
engine alone, and the report compares the decode rate the GUI thread received with the engine
alone's, plus the GUI event loop's lag (a timer on the GUI thread). desktop/README.md, "The seam",
says how the runs are paired and why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

TICK_MS = 10


def _prompt_text(n_words: int, vocab: int) -> str:
    """Words of the random checkpoint's word-level vocabulary ("t123"): one token each."""
    import random

    rnd = random.Random(1234)
    return " ".join(f"t{rnd.randrange(10, vocab)}" for _ in range(n_words))


_ALONE: dict = {}


def engine_alone(model: str, dtype: str, messages: list, new_tokens: int, threads: int) -> dict:
    """One request on the engine alone (in a child process, which keeps the model between calls)."""
    import torch

    torch.set_num_threads(threads)
    from engine.session import Request, Session
    from engine.weights.loading import load_model

    if (model, dtype) not in _ALONE:
        _ALONE[(model, dtype)] = load_model(model, dtype=dtype)
    session = Session(_ALONE[(model, dtype)])
    last = None
    for ev in session.generate(Request(messages=tuple(messages), max_new_tokens=new_tokens)):
        last = ev
    return last.trace


def _arrival_probe(arrivals: list, now):
    """A QObject whose slot records (time, tokens, GUI thread CPU time) as each batch of events reaches
    the GUI thread (Qt is imported here, not at the top: the engine-alone child process imports this
    module too)."""
    from PySide6.QtCore import QObject, Slot

    from engine.events import Token

    class ArrivalProbe(QObject):
        @Slot(object)
        def on_events(self, batch) -> None:
            arrivals.append((now(), sum(isinstance(e, Token) for e in batch.events), time.thread_time()))

    return ArrivalProbe()


class App:
    """The real window, styled as the app styles it, on the qasync loop, offscreen, with a lag probe: a
    timer on the GUI thread."""

    def __init__(
        self,
        model: str,
        dtype: str,
        new_tokens: int,
        data: Path,
        tick_ms: int,
        batch_seconds: float | None = None,
        refresh_ms: int | None = None,
    ):
        import qasync
        from PySide6.QtCore import QTimer
        from PySide6.QtWidgets import QApplication

        from engine.spec import LoadSpec
        from engine.trace import now

        from .. import pacing
        from ..app import tune_process
        from ..client import EngineClient
        from ..core.settings import Settings
        from ..settings_dialog import open_settings
        from ..style import apply_style
        from ..window import MainWindow
        from ..worker import BATCH_SECONDS, EngineWorker

        if refresh_ms:  # a fixed redraw interval instead of the app's adaptive one (the trade-off's other points)
            pacing.REFRESH_MS = pacing.STEADY_REFRESH_MS = pacing.SLOWEST_REFRESH_MS = refresh_ms

        self.now, self.tick_ms = now, tick_ms
        os.environ["KVCHAT_DATA_DIR"] = str(data)
        Settings(model=LoadSpec(path=model, dtype=dtype), max_new_tokens=new_tokens, temperature=0.0).save(
            open_settings(data)
        )
        self.app = QApplication.instance() or QApplication([])
        apply_style(self.app)  # as the app runs: the style sheet is a good part of painting's cost
        self.loop = qasync.QEventLoop(self.app, already_running=False)
        asyncio.set_event_loop(self.loop)

        class HoldingWorker(EngineWorker):  # `hold`: every token kept until the reply ends (the engine alone)
            hold = False

            def due(self, token, waited):
                return not self.hold and super().due(token, waited)

        self.worker = HoldingWorker(batch_seconds or BATCH_SECONDS)
        self.window = MainWindow(data, EngineClient(self.worker))
        self.window.show()
        tune_process(self.window)  # as the app does
        self.ready, self.finished, self.arrivals, self.ticks = [], [], [], []
        self.wake = asyncio.Event()
        self.window.modelReady.connect(lambda facts: (self.ready.append(facts), self.wake.set()))
        self.window.replyFinished.connect(lambda final: (self.finished.append(final), self.wake.set()))
        # A QObject's slot, so that it runs on the GUI thread: a plain lambda connected to the worker's
        # signal would run on the worker thread, at emission, and time nothing of the GUI.
        self.probe = _arrival_probe(self.arrivals, now)
        self.window.client.events.connect(self.probe.on_events)
        self.updates: list[float] = []  # when the streaming text on screen changed
        self._shown: str | None = None
        draw = self.window.pacer.draw

        def timed_draw(panel=False):  # the window's redraw (something changed), timed when it puts new text on screen
            draw(panel)
            chat = self.window.chat
            if chat.streaming_mid is not None and chat.stream_text != self._shown:
                self._shown = chat.stream_text
                self.updates.append(now())

        self.window.pacer.draw = timed_draw
        self.timer = QTimer()
        self.timer.setInterval(tick_ms)
        self.timer.timeout.connect(lambda: self.ticks.append(now()))
        self._wait(lambda: self.ready, 300)
        if self.ready[0].get("error"):
            raise RuntimeError(self.ready[0]["error"])

    def _wait(self, pred, timeout):  # woken by the signals, not by polling (no load of its own)
        async def wait():
            end = self.now() + timeout
            while not pred():
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), max(0.001, end - self.now()))
                except asyncio.TimeoutError:
                    raise TimeoutError("the app did not answer in time") from None

        self.loop.run_until_complete(wait())

    def reply(self, text: str, probe: bool = True, quiet: bool = False) -> dict:
        """Type `text` into a new conversation, send it, wait for the whole reply (with the lag probe's
        timer running, or not). `quiet`: the engine alone inside the app — the worker holds the tokens
        back until the reply ends, so nothing reaches the GUI while it decodes."""
        self.worker.hold = quiet  # read by the worker between tokens; no reply is running now
        try:
            return self._reply(text, probe, quiet)
        finally:
            self.worker.hold = False

    def _reply(self, text: str, probe: bool, quiet: bool) -> dict:
        now = self.now
        self.window.new_conversation()
        self.finished.clear()
        self.arrivals.clear()
        self.ticks.clear()
        self.updates.clear()
        self._shown = None
        self.window.composer.setPlainText(text)
        if probe:
            self.timer.start()
        t_send, cpu_send = now(), time.thread_time()
        self.window.send()
        self._wait(lambda: self.finished, 600)
        t_done, cpu_done = now(), time.thread_time()
        self.timer.stop()
        final = self.finished[0]
        if not hasattr(final, "text"):  # engine.events.Failed
            raise RuntimeError(final.error)
        token_batches = [(t, n, c) for t, n, c in self.arrivals if n]
        body = self.window.transcript.views[-1].shown_body
        shown_pieces = [type(w).__name__ for w in getattr(body, "widgets", [])]
        if quiet:
            return {"trace": final.trace, "batches": len(token_batches)}
        if len(token_batches) < 2:
            raise RuntimeError(
                "the whole reply reached the GUI in one batch: no rate to measure "
                "(ask for more --new-tokens or a shorter --batch-ms)"
            )
        first_t, first_n, first_cpu = token_batches[0]
        last_t, _, last_cpu = token_batches[-1]
        total = sum(n for _, n, _ in token_batches)
        gaps = [b - a for a, b in zip(self.ticks, self.ticks[1:]) if a >= t_send]
        lag_ms = sorted(max(0.0, g * 1000 - self.tick_ms) for g in gaps)
        stats = self.window.chat.stats
        shown, ttft = stats.on_screen_ms, final.trace.get("ttft_ms")
        updates = [t for t in self.updates if first_t <= t <= last_t]
        intervals = sorted(1000 * (b - a) for a, b in zip(updates, updates[1:]))
        return {
            "token1_on_screen_after_engine_ms": None if shown is None or ttft is None else shown - ttft,
            "update_intervals_ms": intervals,
            "updates_per_s": (len(updates) - 1) / (updates[-1] - updates[0]) if len(updates) > 1 else None,
            "trace": final.trace,
            "pieces": shown_pieces,  # the reply's widgets at the end: MarkdownLabel, CodeBlock, ThinkBlock
            "tokens_received": total,
            "batches": len(token_batches),
            "gui_decode_tok_s": (total - first_n) / (last_t - first_t) if last_t > first_t else None,
            "max_lag_ms": lag_ms[-1] if lag_ms else None,
            "p95_lag_ms": lag_ms[int(0.95 * (len(lag_ms) - 1))] if lag_ms else None,
            "ticks": len(gaps),
            "gui_thread_busy": (cpu_done - cpu_send) / (t_done - t_send),
            "gui_thread_busy_decoding": (last_cpu - first_cpu) / (last_t - first_t) if last_t > first_t else None,
        }

    def close(self) -> None:
        self.window.close()
        self.loop.run_until_complete(asyncio.sleep(0.05))


def _q(values, q: float):
    """The q-quantile (nearest rank) of the values that are not None; None when there are none."""
    v = sorted(x for x in values if x is not None)
    return round(v[min(len(v) - 1, int(q * (len(v) - 1) + 0.5))], 2) if v else None


def _report(ns, threads: int, own: list, alone: list, inside: list, probed: list) -> dict:
    med = statistics.median

    def paired(num, den):  # the median of the ratios of runs done back to back
        return round(med(n / d for n, d in zip(num, den)), 3)

    own_r = [t["decode_tok_s"] for t in own]
    alone_r = [r["trace"]["decode_tok_s"] for r in alone]
    gui_r = [r["gui_decode_tok_s"] for r in inside]
    probe_r = [r["gui_decode_tok_s"] for r in probed]
    return {
        "model": ns.model or f"random {ns.shape}",
        "shape": ns.shape,
        "dtype": ns.dtype,
        "threads": threads,
        "prompt_tokens": own[0]["prompt_tokens"],
        "new_tokens": ns.new_tokens,
        "repeats": ns.repeats,
        "engine_alone_decode_tok_s": round(med(alone_r), 3),
        "engine_in_app_decode_tok_s": round(med(r["trace"]["decode_tok_s"] for r in inside), 3),
        "gui_received_decode_tok_s": round(med(gui_r), 3),
        "gui_vs_engine_alone": paired(gui_r, alone_r),
        "gui_vs_engine_alone_of_medians": round(med(gui_r) / med(alone_r), 3),
        "gui_received_with_lag_probe_decode_tok_s": round(med(probe_r), 3),
        "gui_with_lag_probe_vs_engine_alone": paired(probe_r, alone_r),
        "engine_own_process_decode_tok_s": round(med(own_r), 3),
        "gui_vs_engine_own_process": paired(gui_r, own_r),
        "engine_alone_vs_own_process": paired(alone_r, own_r),
        "runs": [
            {"own_process": o, "alone": a, "gui": round(g, 3), "gui_with_lag_probe": round(p, 3)}
            for o, a, g, p in zip(own_r, alone_r, gui_r, probe_r)
        ],
        "tokens_received": inside[0]["tokens_received"],
        "reply_pieces": inside[0]["pieces"],
        "signal_batches": inside[0]["batches"],
        "signal_batches_alone": max(r["batches"] for r in alone),  # 1: every token at the end
        "event_loop_max_lag_ms": round(max(r["max_lag_ms"] for r in probed), 2),
        "event_loop_p95_lag_ms": round(med(r["p95_lag_ms"] for r in probed), 2),
        "timer_ticks": sum(r["ticks"] for r in probed),
        "token1_on_screen_after_engine_ms_p50": _q([r["token1_on_screen_after_engine_ms"] for r in inside], 0.5),
        "token1_on_screen_after_engine_ms_max": _q([r["token1_on_screen_after_engine_ms"] for r in inside], 1.0),
        "update_interval_ms_p50": _q([i for r in inside for i in r["update_intervals_ms"]], 0.5),
        "update_interval_ms_p95": _q([i for r in inside for i in r["update_intervals_ms"]], 0.95),
        "updates_per_s": _q([r["updates_per_s"] for r in inside], 0.5),
        "refresh_ms": ns.refresh_ms or "adaptive",
        "gui_thread_busy": round(med(r["gui_thread_busy"] for r in inside), 3),
        "gui_thread_busy_decoding": round(med(r["gui_thread_busy_decoding"] for r in inside), 3),
        "gui_thread_busy_decoding_with_lag_probe": round(med(r["gui_thread_busy_decoding"] for r in probed), 3),
    }


def main(argv=None) -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    ap = argparse.ArgumentParser(prog="python -m desktop.tools.seam_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2-135m", help="a random-weight shape from `python -m engine bench`")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument(
        "--model", default=None, help="a model folder or GGUF file instead of a random-weight shape (with --prompt)"
    )
    ap.add_argument(
        "--prompt",
        default=None,
        help="the message sent (default: --prompt-tokens random words of the shape's vocabulary)",
    )
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tick-ms", type=int, default=TICK_MS, help="the lag probe's timer interval")
    ap.add_argument(
        "--batch-ms", type=float, default=None, help="the worker's signal batching interval (default: the app's)"
    )
    ap.add_argument(
        "--refresh-ms", type=int, default=None, help="a fixed redraw interval (default: the app's adaptive one)"
    )
    ap.add_argument("--repeats", type=int, default=7, help="alternating runs, alone and through the app")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args(argv)
    from engine.devices import default_threads
    from engine.tools.bench.shapes import SHAPES, write_random_checkpoint

    if ns.shape not in SHAPES:
        print(f"error: unknown shape {ns.shape!r} (choose from {', '.join(SHAPES)})", file=sys.stderr)
        return 2
    if ns.model and not Path(ns.model).expanduser().exists():
        print(f"error: no model at {ns.model}", file=sys.stderr)
        return 2
    threads = ns.threads or default_threads()
    with tempfile.TemporaryDirectory(prefix="kvchat-seam-") as tmp:
        # The checkpoint and the engine-alone runs happen in a child process: this process's main
        # thread must not run torch, as in the app (an OpenMP pool left on the main thread slows
        # the worker thread's kernels on a small machine). Runs alternate, alone then app, so that
        # the machine's drift hits both; the headline is the median of the paired ratios.
        model = str(Path(ns.model).expanduser().resolve()) if ns.model else str(Path(tmp) / ns.shape)
        text = ns.prompt or _prompt_text(ns.prompt_tokens, SHAPES[ns.shape]["vocab_size"])
        # own: the engine alone in its own process; alone: the same loaded model on the app's worker
        # thread with nothing sent to the GUI until the reply ends; inside: the app; probed: the app
        # with the lag probe.
        own, alone, inside, probed = [], [], [], []
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            if not ns.model:
                pool.submit(write_random_checkpoint, Path(model), ns.shape).result()
            os.environ["KVCHAT_THREADS"] = str(threads)
            app = App(
                model,
                ns.dtype,
                ns.new_tokens,
                Path(tmp) / "data",
                ns.tick_ms,
                ns.batch_ms / 1000 if ns.batch_ms else None,
                ns.refresh_ms,
            )
            try:
                for _ in range(ns.repeats):
                    own.append(
                        pool.submit(
                            engine_alone, model, ns.dtype, [{"role": "user", "content": text}], ns.new_tokens, threads
                        ).result()
                    )
                    alone.append(app.reply(text, probe=False, quiet=True))
                    inside.append(app.reply(text, probe=False))
                    probed.append(app.reply(text, probe=True))
            finally:
                app.close()
    report = _report(ns, threads, own, alone, inside, probed)
    if ns.json:
        print(json.dumps(report))
        return 0
    print(
        f"{report['model']} · {ns.dtype} · {threads} threads · prompt {report['prompt_tokens']} · "
        f"new {ns.new_tokens} · medians of {ns.repeats} alternating runs"
    )
    kinds = report["reply_pieces"]
    print(
        f"the reply on screen    {len(kinds)} pieces: "
        + ", ".join(f"{kinds.count(k)} {k}" for k in sorted(set(kinds)))
        + f" · {report['tokens_received']} tokens"
    )
    print(
        f"engine alone           {report['engine_alone_decode_tok_s']:8.2f} tok/s "
        "(the app's model and worker thread, nothing sent to the GUI until the end)"
    )
    print(f"engine inside the app  {report['engine_in_app_decode_tok_s']:8.2f} tok/s")
    print(
        f"received by the GUI    {report['gui_received_decode_tok_s']:8.2f} tok/s "
        f"in {report['signal_batches']} signal batches"
    )
    print(
        f"GUI / engine alone     {100 * report['gui_vs_engine_alone']:.1f}% (median of the paired runs; target ≥ 95%), "
        f"{100 * report['gui_vs_engine_alone_of_medians']:.1f}% as a ratio of the medians"
    )
    print(
        f"  with the lag probe   {report['gui_received_with_lag_probe_decode_tok_s']:8.2f} tok/s "
        f"({100 * report['gui_with_lag_probe_vs_engine_alone']:.1f}%)"
    )
    print(
        f"engine in its own process {report['engine_own_process_decode_tok_s']:5.2f} tok/s: GUI / it "
        f"{100 * report['gui_vs_engine_own_process']:.1f}%, the engine alone in the app / it "
        f"{100 * report['engine_alone_vs_own_process']:.1f}% (a second process: other memory, same work)"
    )
    print(
        f"on screen              token 1 painted {report['token1_on_screen_after_engine_ms_p50']} ms after the engine "
        f"made it (p50; max {report['token1_on_screen_after_engine_ms_max']} ms); text updated every "
        f"{report['update_interval_ms_p50']} ms (p50; p95 {report['update_interval_ms_p95']} ms), "
        f"{report['updates_per_s']} updates/s (redraw interval: {report['refresh_ms']})"
    )
    print(
        f"GUI event-loop lag     max {report['event_loop_max_lag_ms']} ms, p95 {report['event_loop_p95_lag_ms']} ms "
        f"over {report['timer_ticks']} ticks of {ns.tick_ms} ms (target ≤ 50 ms)"
    )
    print(
        "runs (own process, alone, GUI, GUI with the probe tok/s): "
        + ", ".join(
            f"{r['own_process']:.1f}/{r['alone']:.1f}/{r['gui']:.1f}/{r['gui_with_lag_probe']:.1f}"
            for r in report["runs"]
        )
    )
    print(
        f"GUI thread busy        {100 * report['gui_thread_busy']:.1f}% of one core from send to the last token, "
        f"{100 * report['gui_thread_busy_decoding']:.1f}% while tokens streamed "
        f"({100 * report['gui_thread_busy_decoding_with_lag_probe']:.1f}% with the lag probe)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
