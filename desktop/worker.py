"""The one worker that owns the engine, on its own QThread for the life of the app.

Requests go in through a queue; engine events come out as Qt signals carrying plain Python
values (no tensors cross the thread boundary). Token events are batched: one signal per
~100 ms (a little more often than the window's fastest redraw, 150 ms), not one per token. Stop sets a threading.Event the
engine checks between tokens and between prefill chunks.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import traceback

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot

from engine.errors import EngineError
from engine.events import Failed, Finished, PrefillDone, PrefillProgress, PrefillStarted, Token
from engine.trace import summarize

BATCH_SECONDS = 0.1


def event_to_dict(ev) -> dict:
    """An engine event as plain values for the GUI thread."""
    if isinstance(ev, Token):
        return {"type": "token", "index": ev.index, "token_id": ev.token_id, "text": ev.text, "time": ev.time,
                "cache_positions": ev.cache_positions}
    if isinstance(ev, PrefillStarted):
        return {"type": "prefill_started", "prompt_tokens": ev.prompt_tokens, "reuse": ev.reuse.to_dict()}
    if isinstance(ev, PrefillProgress):
        return {"type": "prefill_progress", "done": ev.done, "total": ev.total, "cache_positions": ev.cache_positions}
    if isinstance(ev, PrefillDone):
        return {"type": "prefill_done", "reused": ev.reused, "computed": ev.computed, "seconds": ev.seconds,
                "cache_positions": ev.cache_positions}
    if isinstance(ev, Finished):
        return {"type": "finished", "reason": ev.reason, "text": ev.text, "tail": ev.tail,
                "tokens": len(ev.token_ids), "trace": ev.trace, "cache": ev.cache, "reuse": ev.reuse.to_dict()}
    if isinstance(ev, Failed):
        return {"type": "failed", "error": ev.error, "kind": ev.kind, "trace": ev.trace}
    raise TypeError(type(ev))


@dataclasses.dataclass(frozen=True)
class LoadJob:
    path: str | None
    device: str | None
    dtype: str | None
    capacity: int | None
    weights: str = "none"
    kv: str = "none"
    group_size: int = 64


@dataclasses.dataclass(frozen=True)
class CompareJob:
    rid: int
    messages: list
    max_new_tokens: int


@dataclasses.dataclass(frozen=True)
class GenerateJob:
    rid: int
    request: object  # engine.session.Request


class EngineWorker(QObject):
    modelLoading = Signal(str)
    modelLoaded = Signal(dict)  # model facts + cache stats
    modelFailed = Signal(str)  # a message a person can read; the old model stays
    compared = Signal(int, dict)  # request id, the full vs quantized comparison
    events = Signal(int, list)  # request id, [event dicts]
    stopped = Signal()

    def __init__(self, batch_seconds: float = BATCH_SECONDS):
        super().__init__()
        self._jobs: queue.Queue = queue.Queue()
        self._cancel = threading.Event()
        self.batch_seconds = batch_seconds
        self.loaded = None
        self.session = None
        self._load_job: LoadJob | None = None
        self._other = None  # the other-precision model for comparisons, loaded on first use

    # --- called from the GUI thread -----------------------------------------------------
    def load(self, path, device=None, dtype=None, capacity=None, weights="none", kv="none", group_size=64) -> None:
        self._jobs.put(LoadJob(path, device, dtype, capacity, weights, kv, group_size))

    def compare(self, rid: int, messages: list, max_new_tokens: int) -> None:
        self._jobs.put(CompareJob(rid, messages, max_new_tokens))

    def generate(self, rid: int, request) -> None:
        self._jobs.put(GenerateJob(rid, request))

    def stop_generation(self) -> None:
        self._cancel.set()

    def shutdown(self) -> None:
        self._cancel.set()
        self._jobs.put(None)

    # --- the worker thread ----------------------------------------------------------------
    @Slot()
    def run(self) -> None:
        import torch

        from engine.loader import default_threads
        torch.set_num_threads(default_threads())  # per thread under OpenMP: set here, where the kernels run
        while True:
            job = self._jobs.get()
            if job is None:
                break
            try:
                if isinstance(job, LoadJob):
                    self._load(job)
                elif isinstance(job, CompareJob):
                    self._compare(job)
                else:
                    self._generate(job)
            except Exception as e:  # never let the worker die: report and go on
                traceback.print_exc()
                if isinstance(job, GenerateJob):
                    self.events.emit(job.rid, [{"type": "failed", "error": f"internal error: {e}",
                                                "kind": type(e).__name__, "trace": {}}])
                else:
                    self.modelFailed.emit(f"internal error while loading: {e}")
        self.stopped.emit()

    def _load(self, job: LoadJob) -> None:
        from engine.loader import load_model
        from engine.session import Session
        self.modelLoading.emit(str(job.path or "the bundled demo model"))
        try:
            loaded = load_model(job.path, device=job.device, dtype=job.dtype, weights=job.weights,
                                group_size=job.group_size)
            if self.session is None:
                self.session = Session(loaded, capacity=job.capacity, kv=job.kv)
            else:
                self.session.set_model(loaded, capacity=job.capacity, kv=job.kv)
            self._load_job, self._other = job, None
        except (EngineError, OSError, RuntimeError, MemoryError) as e:
            self.modelFailed.emit(str(e))
            return
        old, self.loaded = self.loaded, loaded
        del old
        self.modelLoaded.emit(self.facts())

    def _compare(self, job: CompareJob) -> None:
        """Rerun the prompt at the other precision: full if this one is quantized, else int8 weights and KV."""
        from engine.loader import load_model
        from engine.quality import compare
        lj = self._load_job
        quantized = self.loaded.quantization != "none" or self.session.kv != "none"
        try:
            if self._other is None:
                w = "none" if quantized else "int8"
                self._other = load_model(lj.path, device=lj.device, dtype=lj.dtype, weights=w,
                                         group_size=lj.group_size)
            full, quant = (self._other, self.loaded) if quantized else (self.loaded, self._other)
            kv = self.session.kv if quantized else "int8"
            result = compare(full, quant, kv, [job.messages], job.max_new_tokens)
            p = result["per_prompt"][0] if result["per_prompt"] else {}
            self.compared.emit(job.rid, {**p, "weights": quant.quantization, "kv": kv,
                                         "current_is_quantized": quantized})
        except (EngineError, RuntimeError, MemoryError, ValueError) as e:
            self.compared.emit(job.rid, {"error": str(e)})

    def facts(self) -> dict:
        f = self.loaded.facts()
        f.update(capacity=self.session.cache.capacity, cache=self.session.cache_stats(), kv_cache=self.session.kv,
                 kv_bytes_per_position=self.session.cache.bytes_per_position,
                 fingerprint=dict(self.loaded.fingerprint), name=self.loaded.name,
                 cache_dropped=self.session.pending_drop_reason)
        return f

    def _generate(self, job: GenerateJob) -> None:
        if self.session is None:
            self.events.emit(job.rid, [{"type": "failed", "error": "no model is loaded", "kind": "EngineError",
                                        "trace": {}}])
            return
        self._cancel.clear()
        batch: list[dict] = []
        last = time.monotonic()
        for ev in self.session.generate(job.request, self._cancel):
            d = event_to_dict(ev)
            if d["type"] in ("finished", "failed"):
                if job.request.messages is not None:  # each message's token count, for the transcript;
                    tok = self.session.loaded.tokenizer  # counted after the reply, so TTFT never pays for it
                    d["message_tokens"] = [len(tok.encode(m["content"])) for m in job.request.messages]
                d["summary"] = summarize(self.session.traces)
                d["cache"] = d.get("cache") or self.session.cache_stats()
            batch.append(d)
            now = time.monotonic()
            if d["type"] != "token" or now - last >= self.batch_seconds:
                self.events.emit(job.rid, batch)
                batch, last = [], now
        if batch:
            self.events.emit(job.rid, batch)


class WorkerThread:
    """Starts the worker on its QThread; `close()` stops a generation, ends the loop, joins the thread."""

    def __init__(self, worker: EngineWorker | None = None):
        self.worker = worker or EngineWorker()
        self.thread = QThread()
        self.thread.setObjectName("kvchat-engine")
        self.worker.moveToThread(self.thread)
        self.thread.started.connect(self.worker.run)
        # Direct: quit() from the worker thread itself, so close() never waits on the GUI's event queue.
        self.worker.stopped.connect(self.thread.quit, Qt.DirectConnection)
        self.thread.start()

    def close(self, timeout_ms: int = 30000) -> bool:
        if not self.thread.isRunning():
            return True
        self.worker.shutdown()
        return self.thread.wait(timeout_ms)
