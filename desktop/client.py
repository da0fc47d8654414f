"""The engine as the window sees it: replies as an async stream of event batches on the qasync loop
(`async for batch in client.stream(request)`), loads, probes and comparisons as requests whose answers
come back as signals, and the loaded model's token text. The window talks to this and the chat
controller only; the worker and the engine thread stay behind it."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from PySide6.QtCore import QObject, Slot

from engine.events import Failed, Finished

from .worker import EngineWorker, EventBatch


class EngineClient(QObject):
    def __init__(self, worker: EngineWorker | None = None):
        super().__init__()
        self.worker = worker or EngineWorker()
        self._ids = itertools.count(1)
        self._streams: dict[int, asyncio.Queue] = {}
        self._rids: dict[int, int] = {}  # id() of a request streaming → its request id (stop one reply)
        w = self.worker
        self.events = w.events
        self.modelLoading, self.modelLoadProgress, self.modelLoaded = w.modelLoading, w.modelLoadProgress, w.modelLoaded
        self.modelFailed, self.compared, self.probed = w.modelFailed, w.compared, w.probed
        w.events.connect(self._on_events)

    @Slot(object)
    def _on_events(self, batch: EventBatch) -> None:
        q = self._streams.get(batch.rid)
        if q is not None:
            q.put_nowait(batch.events)

    async def stream(self, request) -> AsyncIterator[tuple]:
        """Yields tuples of engine events until the request finishes or fails."""
        rid = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid], self._rids[id(request)] = q, rid
        self.worker.generate(rid, request)
        try:
            while True:
                events = await q.get()
                yield events
                if any(isinstance(e, (Finished, Failed)) for e in events):
                    return
        finally:
            self._streams.pop(rid, None)
            self._rids.pop(id(request), None)

    def stop(self, request=None) -> None:
        """Stop the reply to `request` (None: every reply) at its next token."""
        if request is None:
            self.worker.stop_generation()
        elif id(request) in self._rids:
            self.worker.stop_generation(self._rids[id(request)])

    def server_load(self) -> dict | None:
        """A remote server's own report of what it runs (EngineWorker.server_load)."""
        return self.worker.server_load()

    def in_flight(self) -> list[dict]:
        """The local engine's requests running now (EngineWorker.in_flight)."""
        return self.worker.in_flight()

    def kv_pool(self) -> dict | None:
        """The local engine's KV pool under them (EngineWorker.kv_pool)."""
        return self.worker.kv_pool()

    def load(self, spec) -> None:
        """A LoadSpec or a RemoteSpec: modelLoading, then modelLoaded or modelFailed."""
        self.worker.load(spec)

    def probe(self, cid: int, messages: list, draft: str, max_new_tokens: int, overflow: str, asked=None,
              tools: tuple = (), draft_images: tuple = ()) -> None:  # fmt: skip
        self.worker.probe(cid, messages, draft, max_new_tokens, overflow, asked, tools, draft_images)

    def compare(self, rid: int, messages: list, max_new_tokens: int) -> None:
        self.worker.compare(rid, messages, max_new_tokens)

    def token_text(self, ids: list) -> str:
        """Token ids as text, special tokens kept ("" without a local model)."""
        return self.worker.token_text(ids)

    def count_tokens(self, text: str) -> int | None:
        """Tokens in `text` by the local model's tokenizer; None on a remote engine."""
        loaded = self.worker.loaded
        return None if loaded is None else len(loaded.tokenizer.encode_text(text))

    def close(self, timeout_ms: int | None = None) -> bool:
        """Stop, end the engine thread, wait: False when it is still inside a call it cannot leave."""
        return self.worker.close() if timeout_ms is None else self.worker.close(timeout_ms)

    @property
    def running(self) -> bool:
        return self.worker.engine.running
