"""The engine behind `engine serve`: one engine thread (engine.scheduler) running up to `parallel` requests at
once, a bounded queue behind them (Busy past it), each request's events brought to the event loop (a Job), and
the figures the server reports (its stats, its Prometheus metrics)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

from .. import trace as tracing
from ..batching import POLICY
from ..events import Failed, Finished, PrefillDone
from ..request import Request
from ..scheduler import EngineThread, Ticket
from ..session import Session
from ..weights.loading import LoadedModel
from . import openai_chat as wire
from .metrics import ServeMetrics

QUEUE_SIZE = 8  # requests that may wait behind the running ones before the server answers 429
PARALLEL = 4  # requests that run at once (engine serve --parallel)


class Busy(Exception):
    def __init__(self, retry_after: int):
        self.retry_after = retry_after


class Job:
    """One request on its way through the engine thread: its events arrive on the event loop's queue, then None."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request, self.loop = request, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.ticket: Ticket | None = None
        self.prefilled = asyncio.Event()  # set once its prefill is done (or it ended before): n choices wait on it

    def put(self, ev) -> None:  # from the engine thread
        self.loop.call_soon_threadsafe(self.events.put_nowait, ev)

    def stop(self) -> None:
        self.ticket.cancel()


class EngineService:
    """The engine thread (engine.scheduler) and its session: up to `parallel` requests run at once, taking lanes
    in arrival order, and `queue_size` more may wait behind them."""

    def __init__(
        self,
        load: Callable[[], tuple[LoadedModel, Session]],
        model_id: str | None = None,
        queue_size: int = QUEUE_SIZE,
        parallel: int = PARALLEL,
        kv_pool: int | None = None,
    ):
        """`load()` gives the model and its session; it runs on the engine thread, so that thread is the
        only one whose OpenMP team ever runs the kernels (a second team makes both slow: engine/SERVING.md,
        "What `engine serve` costs on loopback")."""
        self.engine = EngineThread(parallel=parallel)
        self.engine.lanes.pool_positions = kv_pool  # None: parallel × capacity
        self.loaded, self.session = self.engine.call(load).result()
        self.engine.session = self.session
        self.engine.call(self.session.warm_up).result()  # the first request's TTFT is its own (on this thread too)
        self.model_id, self.queue_size = model_id or self.loaded.name, queue_size
        self.created = int(time.time())
        self.metrics = ServeMetrics(self.model_id, self.engine.lanes, lambda: self.engine.waiting)
        self.engine.lanes.on_turn = self.metrics.turn
        self.last_cancel: dict | None = None  # how fast the last cancelled request stopped
        self.durations: list[float] = []  # seconds of recent requests, for Retry-After

    @property
    def pending(self) -> int:
        """Requests running or waiting."""
        return self.engine.pending

    def submit(self, request: Request) -> Job:
        pending = self.pending
        if pending >= self.engine.parallel + self.queue_size:
            mean = sum(self.durations[-8:]) / len(self.durations[-8:]) if self.durations else 1.0
            raise Busy(max(1, math.ceil(mean * pending)))
        job = Job(request, asyncio.get_running_loop())

        def sink(ev) -> None:  # on the engine thread
            ticket = job.ticket
            if ev is None:  # the scheduler's END
                self.metrics.observe(ticket.trace)
                self.durations.append(ticket.seconds or 0.0)
                del self.durations[:-32]
            elif isinstance(ev, Finished) and ev.reason == "cancelled" and ticket.cancelled_at is not None:
                times = ticket.trace.token_times
                self.last_cancel = {
                    "tokens_after_cancel": sum(t > ticket.cancelled_at for t in times),
                    "ms_to_stop": round((tracing.now() - ticket.cancelled_at) * 1000.0, 3),
                }
            job.put(ev)
            if ev is None or isinstance(ev, (PrefillDone, Finished, Failed)):
                job.loop.call_soon_threadsafe(job.prefilled.set)

        job.ticket = self.engine.submit(request, sink, skip_if_cancelled=True)
        return job

    async def cached_positions(self, request: Request) -> dict:
        """How much of a prompt is cached now, asked on the engine thread (the session is its alone)."""
        return await asyncio.wrap_future(self.engine.call(self.session.cached_positions, request, barrier=False))

    def model_card(self) -> dict:
        facts = self.session.facts()
        facts["cache"] = {k: v for k, v in facts["cache"].items() if k != "store"}
        return {
            "id": self.model_id,
            "object": "model",
            "created": self.created,
            "owned_by": "kvchat",
            "max_model_len": self.session.cache.capacity,
            wire.EXTENSION: facts,
        }

    def stats(self) -> dict:
        return {
            "summary": tracing.summarize(self.session.traces),
            "cache": self.session.cache_stats(),
            "queue": {
                "pending": self.pending,
                "size": self.queue_size,
                "parallel": self.engine.parallel,
                "running": self.engine.lanes.running,
                "policy": POLICY,
                "waiting": self.engine.waiting,
                "memory_waits": self.engine.lanes.memory_waits,
                "pool_waits": self.engine.lanes.pool_waits,
            },  # fmt: skip
            "requests": self.engine.lanes.in_flight(),
            "pool": self.engine.lanes.pool_stats(),
            "last_cancel": self.last_cancel,
        }

    def close(self) -> None:
        self.engine.close(timeout=2.0)
