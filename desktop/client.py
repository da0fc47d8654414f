"""The engine as an async stream of events on the qasync loop: `async for event in client.stream(request)`.

The same interface a remote backend could serve later; the controller does not know a thread
is behind it.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

from PySide6.QtCore import QObject, Slot

from .worker import EngineWorker


class EngineClient(QObject):
    def __init__(self, worker: EngineWorker):
        super().__init__()
        self.worker = worker
        self._ids = itertools.count(1)
        self._streams: dict[int, asyncio.Queue] = {}
        worker.events.connect(self._on_events)

    @Slot(int, list)
    def _on_events(self, rid: int, batch: list) -> None:
        q = self._streams.get(rid)
        if q is not None:
            q.put_nowait(batch)

    async def stream(self, request) -> AsyncIterator[list[dict]]:
        """Yields batches of event dicts until the request finishes or fails."""
        rid = next(self._ids)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = q
        self.worker.generate(rid, request)
        try:
            while True:
                batch = await q.get()
                yield batch
                if any(e["type"] in ("finished", "failed") for e in batch):
                    return
        finally:
            self._streams.pop(rid, None)

    def stop(self) -> None:
        self.worker.stop_generation()
