"""The engine as an async stream of event batches on the qasync loop: `async for batch in
client.stream(request)`. The chat controller does not know a thread is behind it."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from PySide6.QtCore import QObject, Slot

from engine.events import Failed, Finished

from .worker import EngineWorker, EventBatch


class EngineClient(QObject):
    def __init__(self, worker: EngineWorker):
        super().__init__()
        self.worker = worker
        self._ids = itertools.count(1)
        self._streams: dict[int, asyncio.Queue] = {}
        worker.events.connect(self._on_events)

    @Slot(object)
    def _on_events(self, batch: EventBatch) -> None:
        q = self._streams.get(batch.rid)
        if q is not None:
            q.put_nowait(batch.events)

    async def stream(self, request) -> AsyncIterator[tuple]:
        """Yields tuples of engine events until the request finishes or fails."""
        rid = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        self.worker.generate(rid, request)
        try:
            while True:
                events = await q.get()
                yield events
                if any(isinstance(e, (Finished, Failed)) for e in events):
                    return
        finally:
            self._streams.pop(rid, None)

    def stop(self) -> None:
        self.worker.stop_generation()
