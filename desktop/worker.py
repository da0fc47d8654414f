"""The worker: the app's side of the engine thread (engine.scheduler), as Qt signals.

Loads, probes, comparisons and replies are queued on the one engine thread; what they give comes back
through signals, the engine's own frozen event records in batches (one signal per BATCH_SECONDS while
tokens stream, at once for token 1 and every other event); no tensor crosses to the GUI thread. Stop
cancels the reply at its next token, and any reply still waiting in the queue.
"""

from __future__ import annotations

import dataclasses
import time
import traceback

from PySide6.QtCore import QObject, Signal

from engine.errors import EngineError
from engine.events import Failed, Finished, Token
from engine.http.remote import RemoteSession, RemoteSpec
from engine.http.server_load import LoadWatch, server_load
from engine.images import ImageError
from engine.scheduler import END, EngineThread
from engine.spec import LoadSpec
from engine.trace import summarize

from .core.replies import Accounting

BATCH_SECONDS = 0.05  # tokens are sent to the GUI thread at most this often
CLOSE_WAIT_MS = 3000  # how long closing waits for the engine thread to finish what it is in
CACHE_ONLY = ("capacity", "kv", "cache_budget", "disk_cache", "disk_budget")  # settings that keep the weights
APP_PARALLEL = 4  # replies that stream at once (engine serve's default): more wait in the engine's queue


@dataclasses.dataclass(frozen=True)
class EventBatch:
    """Engine events of one request, in order, as they cross to the GUI thread."""

    rid: int
    events: tuple


class EngineWorker(QObject):
    """Owns the engine thread for the life of the app; its signals are emitted there and queued to the GUI."""

    modelLoading = Signal(str)
    modelLoadProgress = Signal(float, str)  # fraction of the weights read, the file's or folder's name
    modelLoaded = Signal(dict)  # the session's facts: model, cache, precision
    modelFailed = Signal(str)  # a message a person can read; the old model stays
    compared = Signal(int, dict)  # request id, the full vs quantized comparison
    probed = Signal(int, dict)  # conversation id, how much of it is cached
    events = Signal(object)  # an EventBatch
    stopped = Signal()

    def __init__(self, batch_seconds: float = BATCH_SECONDS, parallel: int = APP_PARALLEL):
        super().__init__()
        self.batch_seconds = batch_seconds
        self._latest_probe = None  # the one probe worth answering
        self._conversation_seen: tuple[list, dict] | None = None  # the last conversation probed, and its answer
        self.loaded = None  # the local model (engine thread's; the GUI reads only the facts it was sent)
        self._spec: LoadSpec | RemoteSpec | None = None
        self._other = None  # the other-precision model for comparisons, loaded on first use
        self._load_watch = None  # a remote server's load reports (LoadWatch), while one is in use
        self._tickets: dict[int, object] = {}  # request id → its engine Ticket, until its END
        self.engine = EngineThread(at_exit=self._at_exit, parallel=parallel)

    @property
    def session(self):
        return self.engine.session

    @property
    def remote(self) -> bool:
        return isinstance(self.engine.session, RemoteSession)

    # --- called from the GUI thread -----------------------------------------------------
    def load(self, spec: LoadSpec | RemoteSpec) -> None:
        """A local model to load, or a remote server to use."""
        self._queue(self._load, spec, on_error=self.modelFailed.emit)

    def compare(self, rid: int, messages: list, max_new_tokens: int) -> None:
        on_error = lambda e: self.compared.emit(rid, {"error": e})
        self._queue(self._compare, rid, messages, max_new_tokens, on_error=on_error)

    def probe(
        self,
        cid: int,
        messages: list,
        draft: str = "",
        max_new_tokens: int = 256,
        overflow: str = "stop",
        asked=None,
        tools: tuple = (),
        draft_images: tuple = (),
    ) -> None:
        """Ask how many positions of a conversation are cached, before anything is sent, and how many the
        next Send of `draft` would prompt with (only the latest question is answered: switching through
        long conversations does not queue their tokenizing ahead of a reply). The answer carries `asked`
        back as its "asked" (which question it answers); `tools`: those the conversation offers (in its prompt);
        `draft_images`: the draft's images (engine.images.Image), counted with it."""
        job = (cid, messages, draft, max_new_tokens, overflow, asked, tools, draft_images)
        self._latest_probe = job
        on_error = lambda e: self.probed.emit(cid, {"error": e, "asked": asked})
        self._queue(self._probe, job, on_error=on_error, barrier=False)  # it only reads: between streams' turns

    def generate(self, rid: int, request) -> None:
        self._tickets[rid] = self.engine.submit(request, self._sink(rid, request))

    def stop_generation(self, rid: int | None = None) -> None:
        """Stop reply `rid` (None: every reply) at its next token, also one still waiting for a lane or a load; a
        remote reply's stream is closed within a poll of its lane (remote.IO_POLL_S), every one at once for None."""
        ticket = self._tickets.get(rid)
        if rid is None:
            self.engine.cancel_all()
            for session in self._remote_sessions():
                session.stop()  # closes its stream at once, whether or not the server is sending
        elif ticket is not None:
            ticket.cancel()

    def _remote_sessions(self) -> list:
        """The remote engine's sessions: the engine's and its lanes' (a stream each)."""
        sessions = [self.engine.session] + [lane.session for lane in list(self.engine.lanes.lanes)]
        unique = {id(s): s for s in sessions if isinstance(s, RemoteSession)}
        return list(unique.values())

    def _close_remote(self) -> None:
        for session in self._remote_sessions():
            session.close()

    def server_load(self) -> dict | None:
        """A remote server's own report of the requests it runs (engine.http.server_load: kvchat's stats,
        llama.cpp's slots, /metrics), refreshed off this thread; None on a local engine or before the first."""
        watch = self._load_watch if self.remote else None
        return None if watch is None else watch.latest()

    def in_flight(self) -> list[dict]:
        """The local engine's requests running now, each lane's (engine.batching.Lanes.in_flight: a snapshot read
        between turns); none on a remote engine."""
        return [] if self.remote else self.engine.lanes.in_flight()

    def kv_pool(self) -> dict | None:
        """The local engine's KV pool under the requests running now (Lanes.pool_stats), None on a remote engine."""
        return None if self.remote else self.engine.lanes.pool_stats()

    def close(self, timeout_ms: int = CLOSE_WAIT_MS) -> bool:
        """Stop a reply, end the engine thread after its queue, wait a little: False when it is still inside a
        call it cannot leave (a model load, a read from disk); the app then ends without it (app.main)."""
        for session in self._remote_sessions():
            session.stop()
        return self.engine.close(timeout_ms / 1000)

    # --- on the engine thread -------------------------------------------------------------
    def _queue(self, fn, *args, on_error, barrier: bool = True) -> None:
        def guarded():
            try:
                fn(*args)
            except BaseException as e:  # whatever native code raises: report it, the thread goes on
                traceback.print_exc()
                on_error(f"internal error: {type(e).__name__}: {e}")

        self.engine.call(guarded, barrier=barrier)

    def _at_exit(self, session) -> None:
        if isinstance(session, RemoteSession):
            self._close_remote()
        elif session is not None:
            session.flush(CLOSE_WAIT_MS / 1000 / 2)  # the disk tier's last blocks, within half the close's wait
        self.stopped.emit()

    def _sink(self, rid: int, request):
        """Where a reply's events go on the engine thread: batched into `events`, token 1 at once."""
        batch: list = []
        last = time.monotonic()

        def sink(ev) -> None:
            nonlocal batch, last
            self._conversation_seen = None  # a reply changes what is cached
            if ev is END:
                self._tickets.pop(rid, None)
                if batch:
                    self.events.emit(EventBatch(rid, tuple(batch)))
                    batch = []
                return
            batch.append(ev)
            if isinstance(ev, (Finished, Failed)):
                batch.append(self._accounting(request))
            now = time.monotonic()
            if not isinstance(ev, Token) or self.due(ev, now - last):
                self.events.emit(EventBatch(rid, tuple(batch)))
                batch, last = [], now

        return sink

    def due(self, token: Token, waited: float) -> bool:
        """Whether a token's batch crosses now: token 1 at once (the person waits for it), later ones every
        batch_seconds."""
        return token.index == 1 or waited >= self.batch_seconds

    def _release(self) -> None:
        """Let the current engine go: a remote session's connection, a local model's memory."""
        session = self.engine.session
        if isinstance(session, RemoteSession):
            self._close_remote()
        elif session is not None:
            session.flush(5.0)  # the disk tier's queued blocks, before the model goes
        self.engine.lanes.lanes.clear()  # no reply runs (a load waits for them): the lanes are made again
        self.engine.session = self.loaded = self._other = self._spec = None

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
        self.engine.session, self._spec = remote, spec
        kind = facts.get("server_kind", "unknown")
        self._load_watch = LoadWatch(lambda: server_load(remote.spec, kind))
        self.modelLoaded.emit(facts)

    def _load(self, spec: LoadSpec | RemoteSpec) -> None:
        """Load what `spec` names; when only the cache's settings changed (capacity, KV precision, the
        prefix store's budget) the weights already loaded are kept."""
        from engine.session import Session

        self._conversation_seen = None
        if isinstance(spec, RemoteSpec):
            return self._connect(spec)
        self.modelLoading.emit(spec.describe())
        old = self._spec if isinstance(self._spec, LoadSpec) else None
        same_weights = old is not None and all(
            getattr(spec, f.name) == getattr(old, f.name) for f in dataclasses.fields(spec) if f.name not in CACHE_ONLY
        )
        try:
            loaded = self.loaded if same_weights else spec.load(self.modelLoadProgress.emit)
            if self.remote:
                self._release()
            session = self.engine.session
            if session is None:
                self.engine.session = session = Session(
                    loaded, capacity=spec.capacity, kv=spec.kv, cache_budget=spec.cache_budget, disk=spec.disk()
                )
            else:
                session.set_model(loaded, capacity=spec.capacity, kv=spec.kv)
                session.set_cache_budget(spec.cache_budget)
                if old is None or (spec.disk_cache, spec.disk_budget) != (old.disk_cache, old.disk_budget):
                    session.set_disk(spec.disk())
            self._spec, self._other = spec, (self._other if same_weights else None)
            session.warm_up()  # every load (set_model above): the first request's TTFT is then its own
        except (EngineError, OSError, RuntimeError, MemoryError) as e:
            self.modelFailed.emit(str(e))
            return
        previous, self.loaded = self.loaded, loaded
        del previous
        self.modelLoaded.emit(session.facts())

    def _probe(self, job: tuple) -> None:
        from engine.session import Request

        cid, messages, draft, max_new_tokens, overflow, asked, tools, draft_images = job
        draft_message = {"role": "user", "content": draft} | ({"images": draft_images} if draft_images else {})
        offered = {"tools": tools, "tool_choice": "auto"} if tools else {}
        session = self.engine.session
        if session is None or job is not self._latest_probe:
            return
        ask = self.engine.lanes.cached_positions  # the lane that would run it (the engine's session's, or another's)
        try:
            last = self._conversation_seen
            if last is not None and last[0] == (messages, tools):  # only the draft changed (typing): asked already
                seen = last[1]
            elif messages:  # the conversation as stored (a remote server is asked with the generation prompt)
                seen = ask(Request(messages=messages, add_generation_prompt=self.remote, **offered))
                self._conversation_seen = None if "error" in seen else ((messages, tools), seen)  # an error: again
            else:
                seen = {"positions": 0, "cached": 0, "source": "none"}
            if "error" not in seen:  # what Send would prompt with: the conversation, the draft, the prompt for a reply
                try:
                    sent = ask(Request(messages=[*messages, draft_message], max_new_tokens=max_new_tokens,
                                       overflow=overflow, **offered))  # fmt: skip
                except ImageError as e:  # images this model cannot take: Send refuses them, the draft kept
                    sent = {"error": str(e), "refused": True, "images": True}
                seen = {**seen, "next_positions": sent.get("positions"), "next_overflow": overflow}
                if sent.get("dropped_messages"):
                    seen.update(
                        next_dropped=len(sent["dropped_messages"]), next_dropped_positions=sent["dropped_positions"]
                    )
                if sent.get("refused"):  # too long even with turns left out (not: a server that does not say)
                    seen["next_error"] = sent["error"]
                    seen["next_error_images"] = bool(sent.get("images"))  # or: its images cannot be taken
        except (EngineError, ValueError) as e:
            seen = {"error": str(e)}
        self.probed.emit(cid, {**seen, "asked": asked})

    def _compare(self, rid: int, messages: list, max_new_tokens: int) -> None:
        """Rerun the prompt at the other precision: full if this one is quantized, else int8 weights and KV."""
        from engine.compare import compare

        self._conversation_seen = None
        if self.loaded is None:
            self.compared.emit(rid, {"error": "comparing precisions needs a local model"})
            return
        session = self.engine.session
        quantized = self.loaded.quantization != "none" or session.kv != "none"
        try:
            if self._other is None:
                self._other = dataclasses.replace(self._spec, weights="none" if quantized else "int8").load()
            full, quant = (self._other, self.loaded) if quantized else (self.loaded, self._other)
            kv = session.kv if quantized else "int8"
            result = compare(full, quant, kv, [messages], max_new_tokens)
            p = result["per_prompt"][0] if result["per_prompt"] else {}
            self.compared.emit(rid, {**p, "weights": quant.quantization, "kv": kv, "current_is_quantized": quantized})
        except (EngineError, RuntimeError, MemoryError, ValueError) as e:
            self.compared.emit(rid, {"error": str(e)})

    def _accounting(self, request) -> Accounting:
        """Each message's token count and the session's summary, after the reply's last event."""
        session = self.engine.session
        if self.remote:  # no tokenizer here: the server counts only the whole prompt
            return Accounting((), summarize(session.traces))
        tok = session.loaded.tokenizer
        counts = tuple(len(tok.encode_text(m["content"])) for m in request.messages or ())
        return Accounting(counts, summarize(session.traces))

    def token_text(self, ids: list) -> str:
        """Token ids as text with the loaded model's tokenizer, special tokens kept (the context map's names;
        `tokenizers` decodes from any thread)."""
        loaded = self.loaded
        return "" if loaded is None else loaded.tokenizer.decode(ids, skip_special_tokens=False)
