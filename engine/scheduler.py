"""The engine thread: the one place requests are scheduled.

One thread owns the engine (its session, its kernels' OpenMP team) for its whole life. Work reaches it
through one queue, in arrival order: calls (a load, a probe, a comparison) and generations, whose events
go to the submitter's sink as they are made. Each generation has a Ticket whose cancel flag the engine
checks between prefill chunks and between tokens. Up to `parallel` generations run at once, each on a lane
of its own, their decode steps together each turn (engine.batching); a call waits until none runs, unless
it only reads (`barrier=False`: it runs between turns). The desktop worker and `engine serve` both schedule
through this class; nothing else starts an engine thread.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
import traceback
from collections.abc import Callable

from . import trace as tracing
from .batching import Lanes
from .events import Failed

END = None  # what a sink receives after a generation's last event


class Ticket:
    """One generation on its way through the engine thread: its cancel flag and its times (trace.now)."""

    def __init__(self, request, sink: Callable[[object], None], skip_if_cancelled: bool = False):
        self.request, self.sink, self.skip_if_cancelled = request, sink, skip_if_cancelled
        self.cancel_event = threading.Event()
        self.cancelled_at: float | None = None  # when cancel() was first called
        self.started: float | None = None  # when the engine took it (monotonic seconds)
        self.ended: float | None = None
        self.trace = None  # its RequestTrace, once the engine took it
        self.fitted = None  # (the session, its Fitted prompt): what admitting it measured, for the run to reuse
        self.blocks: int | None = None  # the KV pool's blocks it needs at most (engine.batching)
        self.pool_refused: float | None = None  # when it was first held back for the pool's room (trace.now)

    def cancel(self) -> None:
        """Stop at the engine's next check (between prefill chunks, between tokens), or before it starts."""
        if not self.cancel_event.is_set():
            self.cancelled_at = tracing.now()
            self.cancel_event.set()

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    @property
    def seconds(self) -> float | None:
        return None if self.started is None or self.ended is None else self.ended - self.started


class _Call:
    def __init__(self, fn: Callable, args: tuple, barrier: bool = True):
        self.fn, self.args, self.barrier = fn, args, barrier
        self.future: concurrent.futures.Future = concurrent.futures.Future()


_STOP = object()  # close(): end the loop once nothing runs


class EngineThread:
    """The engine's thread and its queue. `session` is what generations run on; only work on this thread
    (a call or a generation) replaces it. `at_exit(session)` runs on the thread after the last job."""

    def __init__(self, name: str = "kvchat-engine", at_exit: Callable[[object], None] | None = None, parallel: int = 1):
        self.session = None  # a Session or a RemoteSession: anything with steps(request, cancel, trace)
        self.lanes = Lanes(lambda: self.session, parallel, self._ended)
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._open: list[Ticket] = []  # generations submitted and not ended
        self._pending = 0  # jobs submitted and not ended, calls included
        self._at_exit = at_exit
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- from any thread -------------------------------------------------------------------
    def call(self, fn: Callable, *args, barrier: bool = True) -> concurrent.futures.Future:
        """Run `fn(*args)` on the engine thread after what is queued, once no generation runs (`barrier` False:
        between two turns of those running, for what only reads); its result or exception in the future."""
        job = _Call(fn, args, barrier)
        self._put(job)
        return job.future

    def submit(self, request, sink: Callable[[object], None], skip_if_cancelled: bool = False) -> Ticket:
        """Queue a generation: on the engine thread, each of its events goes to `sink` (called there), then END.
        A request cancelled before it starts still runs to its first check (a reply that says it was stopped),
        or, with `skip_if_cancelled`, sends only END (its client is gone)."""
        ticket = Ticket(request, sink, skip_if_cancelled)
        with self._lock:
            self._open.append(ticket)
        self._put(ticket)
        return ticket

    def cancel_all(self) -> None:
        """Cancel every generation running or waiting."""
        with self._lock:
            open_ = list(self._open)
        for t in open_:
            t.cancel()

    @property
    def pending(self) -> int:
        """Jobs queued or running."""
        return self._pending

    @property
    def waiting(self) -> int:
        """Jobs queued behind the lanes (calls included): pending, less those running on a lane."""
        return max(0, self._pending - self.lanes.running)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float | None = None) -> bool:
        """Cancel every generation, end the loop after the jobs queued, wait up to `timeout` seconds: False when
        the thread is still inside a call it cannot leave (a model load, a read from disk)."""
        self.cancel_all()
        self._jobs.put(_STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _put(self, job) -> None:
        with self._lock:
            self._pending += 1
        self._jobs.put(job)

    @property
    def parallel(self) -> int:
        return self.lanes.parallel

    # --- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        import torch

        from .devices import default_threads

        torch.set_num_threads(default_threads())  # per thread under OpenMP: set where the kernels run
        held = None  # the next job, taken from the queue, waiting for a lane or for the lanes to empty
        while True:
            busy = self.lanes.busy
            if held is None:
                try:
                    held = self._jobs.get(block=not busy)
                except queue.Empty:
                    held = None
            if held is _STOP and not busy:
                break
            if isinstance(held, Ticket) and self.lanes.can_admit(held):
                job, held = held, None
                self._admit(job)
                continue
            if isinstance(held, _Call) and (not busy or not held.barrier):
                job, held = held, None
                try:
                    self._call(job)
                finally:
                    with self._lock:
                        self._pending -= 1
                continue
            if busy:
                try:
                    self.lanes.turn()
                except BaseException:  # never let the thread die: each lane's own failures are its request's
                    traceback.print_exc()
        try:
            if self._at_exit is not None:
                self._at_exit(self.session)
        except Exception:
            traceback.print_exc()

    @staticmethod
    def _call(job: _Call) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(job.fn(*job.args))
        except BaseException as e:  # whatever native code raises: the caller hears of it, the thread goes on
            job.future.set_exception(e)

    def _admit(self, ticket: Ticket) -> None:
        try:
            self.lanes.admit(ticket)
        except BaseException as e:  # a lane that cannot be made (out of memory): this request fails, not the thread
            traceback.print_exc()
            ticket.sink(Failed(f"internal error: {type(e).__name__}: {e}", "InternalError", {}))
            self._ended(ticket)

    def _ended(self, ticket: Ticket) -> None:
        """A generation's end: its END sent, its count gone."""
        if ticket.ended is None:
            ticket.ended = time.monotonic()
        with self._lock:
            if ticket in self._open:
                self._open.remove(ticket)
            self._pending -= 1
        try:
            ticket.sink(END)
        except Exception:
            traceback.print_exc()
