"""The replies streaming at once, without Qt: each one's conversation, message, text and figures, and the
context map of each engine lane (a reply fills its lane's working cache: two replies at once fill two).

The chat controller keeps them; the window draws the ones on screen and the Requests view lists them all.
"""

from __future__ import annotations

import dataclasses

from engine.request import Request

from .cache_map import CacheMap
from .replies import ReplyStats


@dataclasses.dataclass
class Stream:
    """A reply streaming now into message `mid` of conversation `cid`."""

    cid: int
    mid: int
    request: Request
    stats: ReplyStats
    title: str  # the conversation's, as the Requests view names it
    text: str = ""  # the reply's text so far
    lane: int | None = None  # the engine lane running it, once its prefill started (None: waiting, or remote)
    prefill_at: float | None = None  # when its prefill started (trace.now), for the Requests view's timeline
    alternative: tuple[int, int] | None = None  # (i, n): the i-th of n alternatives of one prompt
    released: bool = False  # its conversation's claim given back (it ended)
    calls: tuple = ()  # the tool calls it made that the tool loop runs (tool_turns), once it ended


class LaneMaps:
    """One context map per engine lane: what each lane's working cache holds, filled by the replies it ran.
    `shown` is the map of the reply the panel follows (the last one to start, or the one selected)."""

    def __init__(self):
        self.maps: dict[int, CacheMap] = {0: CacheMap()}
        self.shown: CacheMap = self.maps[0]

    def of(self, lane: int | None) -> CacheMap:
        lane = lane or 0
        if lane not in self.maps:  # a lane the engine made for a second reply at once: its cache starts empty
            self.maps[lane] = CacheMap(capacity=self.maps[0].capacity, reported=self.maps[0].reported)
        return self.maps[lane]

    def loaded(self, facts: dict) -> None:
        """A model loaded: lane 0's cache may be kept (CacheMap.loaded); the others are made again, empty."""
        first = self.maps[0]
        first.loaded(facts)
        self.maps, self.shown = {0: first}, first
