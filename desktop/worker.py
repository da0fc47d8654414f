"""The one worker that owns the engine, on its own QThread for the life of the app.

Requests go in through a queue; the engine's own frozen event records come out through a
Signal(object), batched (one signal per BATCH_SECONDS while tokens stream, at once for every
other event); no tensor crosses the thread boundary. Stop sets a threading.Event the engine checks
between tokens and between prefill chunks.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
import traceback

from PySide6.QtCore import QObject, Qt, QThread, Signal, Slot

from engine.errors import EngineError
from engine.events import Failed, Finished, Token
from engine.http.remote import RemoteSession, RemoteSpec
from engine.spec import LoadSpec
from engine.trace import summarize

from .chat import Accounting

BATCH_SECONDS = 0.05  # tokens are sent to the GUI thread at most this often
CLOSE_WAIT_MS = 3000  # how long closing waits for the worker to finish what it is in


@dataclasses.dataclass(frozen=True)
class EventBatch:
    """Engine events of one request, in order, as they cross to the GUI thread."""

    rid: int
    events: tuple


@dataclasses.dataclass(frozen=True)
class CompareJob:
    rid: int
    messages: list
    max_new_tokens: int


@dataclasses.dataclass(frozen=True)
class ProbeJob:
    cid: int
    messages: list
    draft: str = ""  # the message box's text: what the next Send would add
    max_new_tokens: int = 256  # the next Send's: with the overflow policy, what it leaves out
    overflow: str = "stop"


@dataclasses.dataclass(frozen=True)
class GenerateJob:
    rid: int
    request: object  # engine.session.Request
    cancel: threading.Event  # set by Stop, also while the job still waits in the queue


class EngineWorker(QObject):
    modelLoading = Signal(str)
    modelLoadProgress = Signal(float, str)  # fraction of the weights read, the file's or folder's name
    modelLoaded = Signal(dict)  # the session's facts: model, cache, precision
    modelFailed = Signal(str)  # a message a person can read; the old model stays
    compared = Signal(int, dict)  # request id, the full vs quantized comparison
    probed = Signal(int, dict)  # conversation id, how much of it is cached
    events = Signal(object)  # an EventBatch
    stopped = Signal()

    def __init__(self, batch_seconds: float = BATCH_SECONDS):
        super().__init__()
        self._jobs: queue.Queue = queue.Queue()
        self._waiting: dict[int, threading.Event] = {}  # cancel flags of the generate jobs not yet ended
        self._latest_probe = None  # the one probe worth answering
        self._conversation_seen: tuple[list, dict] | None = None  # the last conversation probed, and its answer
        self.batch_seconds = batch_seconds
        self.hold_tokens = False  # keep every token until the reply ends (the seam benchmark's engine alone)
        self.loaded = None
        self.session = None
        self._spec: LoadSpec | None = None
        self._other = None  # the other-precision model for comparisons, loaded on first use

    # --- called from the GUI thread -----------------------------------------------------
    def load(self, spec: LoadSpec | RemoteSpec) -> None:
        """A local model to load, or a remote server to use."""
        self._jobs.put(spec)

    def compare(self, rid: int, messages: list, max_new_tokens: int) -> None:
        self._jobs.put(CompareJob(rid, messages, max_new_tokens))

    def probe(
        self, cid: int, messages: list, draft: str = "", max_new_tokens: int = 256, overflow: str = "stop"
    ) -> None:
        """Ask how many positions of a conversation are cached, before anything is sent, and how many the
        next Send of `draft` would prompt with (only the latest question is answered: switching through
        long conversations does not queue their tokenizing ahead of a reply)."""
        self._latest_probe = ProbeJob(cid, messages, draft, max_new_tokens, overflow)
        self._jobs.put(self._latest_probe)

    def generate(self, rid: int, request) -> None:
        job = GenerateJob(rid, request, threading.Event())
        self._waiting[rid] = job.cancel
        self._jobs.put(job)

    def stop_generation(self) -> None:
        """Stop the running reply at its next token, and any reply still waiting behind a load."""
        for cancel in list(self._waiting.values()):
            cancel.set()
        if self.remote:
            self.session.stop()  # closes the stream at once, whether or not the server is sending

    def shutdown(self) -> None:
        self.stop_generation()
        self._jobs.put(None)

    def token_text(self, ids: list) -> str:
        """Token ids as text with the loaded model's tokenizer, special tokens kept (the context map's names;
        called from the GUI thread: the tokenizer is only read, and `tokenizers` is thread-safe)."""
        loaded = self.loaded
        return "" if loaded is None else loaded.tokenizer.decode(ids, skip_special_tokens=False)

    # --- the worker thread ----------------------------------------------------------------
    @Slot()
    def run(self) -> None:
        import torch

        from engine.devices import default_threads

        torch.set_num_threads(default_threads())  # per thread under OpenMP: set here, where the kernels run
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if not isinstance(job, ProbeJob):  # a load, a reply or a comparison may change what is cached
                self._conversation_seen = None
            try:
                if isinstance(job, (LoadSpec, RemoteSpec)):
                    self._load(job)
                elif isinstance(job, CompareJob):
                    self._compare(job)
                elif isinstance(job, ProbeJob):
                    self._probe(job)
                else:
                    self._generate(job)
            except BaseException as e:  # never let the worker die, whatever native code raises: report, go on
                traceback.print_exc()
                error = f"internal error: {type(e).__name__}: {e}"
                if isinstance(job, GenerateJob):
                    self.events.emit(EventBatch(job.rid, (Failed(error, type(e).__name__, {}),)))
                elif isinstance(job, CompareJob):
                    self.compared.emit(job.rid, {"error": error})
                elif isinstance(job, ProbeJob):
                    self.probed.emit(job.cid, {"error": error})
                else:
                    self.modelFailed.emit(error)
            finally:
                if isinstance(job, GenerateJob):
                    self._waiting.pop(job.rid, None)
        if self.remote:
            self.session.close()
        elif self.session is not None:
            self.session.flush(CLOSE_WAIT_MS / 1000 / 2)  # the disk tier's last blocks, within half the close's wait
        self.stopped.emit()

    def _connect(self, spec: RemoteSpec) -> None:
        """Use a remote OpenAI-compatible server instead of a local model (the local one is let go)."""
        self.modelLoading.emit(spec.describe())
        remote = RemoteSession(spec)
        try:
            facts = remote.connect()
        except EngineError as e:
            remote.close()
            self.modelFailed.emit(str(e))
            return
        self._release()
        self.session, self._spec = remote, spec
        self.modelLoaded.emit(facts)

    def _release(self) -> None:
        """Let the current engine go: a remote session's connection, a local model's memory."""
        if isinstance(self.session, RemoteSession):
            self.session.close()
        elif self.session is not None:
            self.session.flush(5.0)  # the disk tier's queued blocks, before the model goes
        self.session = self.loaded = self._other = self._spec = None

    @property
    def remote(self) -> bool:
        return isinstance(self.session, RemoteSession)

    def _load(self, spec: LoadSpec | RemoteSpec) -> None:
        """Load what `spec` names; when only the cache's settings changed (capacity, KV precision, the
        prefix store's budget) the weights already loaded are kept."""
        from engine.session import Session

        if isinstance(spec, RemoteSpec):
            return self._connect(spec)
        self.modelLoading.emit(spec.describe())
        cache_only = ("capacity", "kv", "cache_budget", "disk_cache", "disk_budget")
        same_weights = isinstance(self._spec, LoadSpec) and all(
            getattr(spec, f.name) == getattr(self._spec, f.name)
            for f in dataclasses.fields(spec)
            if f.name not in cache_only
        )
        try:
            loaded = self.loaded if same_weights else spec.load(self.modelLoadProgress.emit)
            if self.remote:
                self._release()
            same_disk = isinstance(self._spec, LoadSpec) and (spec.disk_cache, spec.disk_budget) == (
                self._spec.disk_cache,
                self._spec.disk_budget,
            )
            if self.session is None:
                self.session = Session(
                    loaded, capacity=spec.capacity, kv=spec.kv, cache_budget=spec.cache_budget, disk=spec.disk()
                )
            else:
                self.session.set_model(loaded, capacity=spec.capacity, kv=spec.kv)
                self.session.set_cache_budget(spec.cache_budget)
                if not same_disk:
                    self.session.set_disk(spec.disk())
            self._spec, self._other = spec, (self._other if same_weights else None)
        except (EngineError, OSError, RuntimeError, MemoryError) as e:
            self.modelFailed.emit(str(e))
            return
        old, self.loaded = self.loaded, loaded
        del old
        self.modelLoaded.emit(self.session.facts())

    def _probe(self, job: ProbeJob) -> None:
        from engine.session import Request

        if self.session is None or job is not self._latest_probe:
            return
        ask = self.session.cached_positions
        nothing = {"positions": 0, "cached": 0, "source": "none"}
        try:
            last = self._conversation_seen
            if last is not None and last[0] == job.messages:  # only the draft changed (typing): asked already
                seen = last[1]
            elif job.messages:  # the conversation as stored (a remote server is asked with the generation prompt)
                seen = ask(Request(messages=job.messages, add_generation_prompt=self.remote))
                self._conversation_seen = None if "error" in seen else (job.messages, seen)  # an error is asked again
            else:
                seen = nothing
            if "error" not in seen:  # what Send would prompt with: the conversation, the draft, the prompt for a reply
                messages = [*job.messages, {"role": "user", "content": job.draft}]
                sent = ask(Request(messages=messages, max_new_tokens=job.max_new_tokens, overflow=job.overflow))
                seen = {**seen, "next_positions": sent.get("positions"), "next_overflow": job.overflow}
                if sent.get("dropped_messages"):
                    seen.update(
                        next_dropped=len(sent["dropped_messages"]), next_dropped_positions=sent["dropped_positions"]
                    )
                if "error" in sent:  # too long even with turns left out
                    seen["next_error"] = sent["error"]
        except (EngineError, ValueError) as e:
            seen = {"error": str(e)}
        self.probed.emit(job.cid, seen)

    def _compare(self, job: CompareJob) -> None:
        """Rerun the prompt at the other precision: full if this one is quantized, else int8 weights and KV."""
        from engine.compare import compare

        if self.loaded is None:
            self.compared.emit(job.rid, {"error": "comparing precisions needs a local model"})
            return
        quantized = self.loaded.quantization != "none" or self.session.kv != "none"
        try:
            if self._other is None:
                other = dataclasses.replace(self._spec, weights="none" if quantized else "int8")
                self._other = other.load()
            full, quant = (self._other, self.loaded) if quantized else (self.loaded, self._other)
            kv = self.session.kv if quantized else "int8"
            result = compare(full, quant, kv, [job.messages], job.max_new_tokens)
            p = result["per_prompt"][0] if result["per_prompt"] else {}
            self.compared.emit(
                job.rid, {**p, "weights": quant.quantization, "kv": kv, "current_is_quantized": quantized}
            )
        except (EngineError, RuntimeError, MemoryError, ValueError) as e:
            self.compared.emit(job.rid, {"error": str(e)})

    def _generate(self, job: GenerateJob) -> None:
        if self.session is None:
            self.events.emit(EventBatch(job.rid, (Failed("no model is loaded", "EngineError", {}),)))
            return
        batch: list = []
        last = time.monotonic()
        for ev in self.session.generate(job.request, job.cancel):
            batch.append(ev)
            if isinstance(ev, (Finished, Failed)):
                batch.append(self._accounting(job.request))
            now = time.monotonic()
            # Token 1 goes at once (the person waits for it); later tokens at most every batch_seconds.
            due = isinstance(ev, Token) and not self.hold_tokens and (ev.index == 1 or now - last >= self.batch_seconds)
            if not isinstance(ev, Token) or due:
                self.events.emit(EventBatch(job.rid, tuple(batch)))
                batch, last = [], now
        if batch:
            self.events.emit(EventBatch(job.rid, tuple(batch)))

    def _accounting(self, request) -> Accounting:
        """Each message's token count and the session's summary, after the reply's last event."""
        if self.remote:  # no tokenizer here: the server counts only the whole prompt
            return Accounting((), summarize(self.session.traces))
        tok = self.session.loaded.tokenizer
        counts = tuple(len(tok.encode_text(m["content"])) for m in request.messages or ())
        return Accounting(counts, summarize(self.session.traces))


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

    def close(self, timeout_ms: int = CLOSE_WAIT_MS) -> bool:
        """Ask the worker to end and wait for it a little: False when it is still inside a call it cannot
        leave (a model load, a read from disk); the app then ends without it (app.main)."""
        if not self.thread.isRunning():
            return True
        self.worker.shutdown()
        return self.thread.wait(timeout_ms)
