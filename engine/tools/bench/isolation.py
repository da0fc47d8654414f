"""Each row in a child process of its own: its peak memory is its own, and a reference that crashes or hangs
becomes a row with its error (the signal, or the timeout) while the run goes on."""

from __future__ import annotations

import multiprocessing as mp
import queue as queues
import signal
import time

ROW_TIMEOUT_S = 1800  # a row that has not reported by then is stopped and reported as timed out


def _isolated(target, args: tuple, queue) -> None:
    try:
        queue.put(("ok", target(*args)))
    except BaseException as e:  # report, don't leave the parent waiting
        queue.put(("error", f"{type(e).__name__}: {e}"))


def run_isolated(target, args: tuple = (), timeout: float = ROW_TIMEOUT_S):
    """target(*args) in a fresh child process: its value, or {"error": ...} when it raised, died (a
    crash in native code: the exit code or signal is named) or ran past `timeout` seconds (stopped)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_isolated, args=(target, args, q), daemon=True)
    p.start()
    end = time.monotonic() + timeout
    outcome = None
    try:
        while outcome is None:
            try:
                outcome = q.get(timeout=0.5)
            except queues.Empty:
                if not p.is_alive():  # it may have reported just before it ended
                    try:
                        outcome = q.get(timeout=1.0)
                    except queues.Empty:
                        outcome = ("error", f"the child process died ({_exit_reason(p.exitcode)})")
                elif time.monotonic() > end:
                    outcome = ("error", f"timed out after {timeout:g} s: stopped")
    finally:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
    kind, value = outcome
    return value if kind == "ok" else {"error": value}


def _exit_reason(code: int | None) -> str:
    if code is None:
        return "no exit code"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
