"""Continuous batching: several generations on the engine thread at once, each on a lane of its own — a session
with its own working cache beside the first session's prefix store, disk tier and traces — their decode steps
run together each turn, and prompts prefilled a forward at a time between those steps.

The policy (engine/SERVING.md, "Many requests at once"): a request takes a free lane in arrival order (the one
whose cache holds the longest prefix of its prompt), joins at the next turn and leaves when it ends. Each turn
runs first one decode step for every lane that waits on one (decode first), then one prefill forward of the
oldest lane still prefilling, of as many positions as take one decode turn's time while others decode (the
turn's token budget), so streams already running keep their pace while a long prompt arrives. Every lane's K/V
are blocks of one KV pool (engine.kv_pool): a request is admitted only while the pool has room for every block
it may need (its prompt and its reply at most) beside what the running ones may need, else it waits — no lane
is ever preempted, so none recomputes; a request waits for a lane, or the pool's room, in the engine's queue.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable

from . import trace as tracing
from .devices import free_on
from .events import WAITING, Failed, PrefillDone, PrefillProgress
from .generation import RowsWanted, StepWanted, step_all
from .kv_pool import BLOCK, blocks_for
from .model import FEW_POSITIONS
from .prefix_store import common_prefix
from .request import Request

POLICY = (
    "first come first served, decode first; a prompt beside streams decoding rides as rows of their decode step "
    "(as many as keep it within about 1.5 of its time), else a prefill forward a turn of at most one step's time; "
    "admitted while the KV pool has room for its blocks, else it waits (no preemption)"
)
MIN_TURN_POSITIONS = 1  # the least a turn's prefill forward takes while others decode
RIDE_FIRST = 2  # prompt positions a newcomer's first rows in the decode step carry (then measured: Lanes.rows)
LANE_SHARE = 0.5  # a new lane's cache may take at most this share of the memory free now; past it, requests wait


class Lane:
    """One sequence's place on the engine: its session (working cache, ids), and the generation running on it."""

    def __init__(self, index: int, session):
        self.index, self.session = index, session
        self.ticket = None  # the scheduler's Ticket running here (None: free)
        self.steps = None  # its generator (Session.steps)
        self.answer = None  # what to send it next (a StepWanted's logits)
        self.waiting: StepWanted | RowsWanted | None = None  # the decode step (or prompt rows) it waits on
        self.admitted = 0  # turn order: the lower, the older
        self.prefilled = 0  # prompt positions its prefill has computed so far
        self.blocks = 0  # the KV pool's blocks its request was admitted with (what it may hold at most)

    @property
    def free(self) -> bool:
        return self.ticket is None

    @property
    def io(self) -> bool:
        """Its session waits on I/O (a remote server's stream), or its request drafts (a speculative round runs in
        its generator between the others' steps), not only on decode steps: turned every turn."""
        return getattr(self.session, "remote", False) or (
            self.ticket is not None and bool(self.ticket.request.speculative)
        )


class Lanes:
    """Up to `parallel` lanes over the engine's session (`session()`: lane 0's, whatever it is now), made when
    a request finds every lane busy; `ended(ticket)` is told when a generation ends (its END is sent)."""

    def __init__(self, session: Callable[[], object], parallel: int, ended: Callable[[object], None]):
        if parallel < 1:
            raise ValueError("parallel must be at least 1")
        self.session, self.parallel, self.ended = session, parallel, ended
        self.lanes: list[Lane] = []
        self._admitted = 0
        self.on_turn: Callable[[int], None] | None = None  # told the positions each turn computed (the metrics)
        self.step_times: dict[int, float] = {}  # a decode turn's time recently, by how many lanes it decoded
        self.turn_positions = MIN_TURN_POSITIONS  # a prefill forward's positions while others decode (budget)
        self.too_slow: int | None = None  # the fewest positions a forward took too long with, while others decode
        self.ride = RIDE_FIRST  # prompt positions riding as rows of the decode step (prefill beside decode)
        self.memory_waits = 0  # times a request waited for a lane because a new one's cache would not fit
        self.pool_waits = 0  # times a request waited for the KV pool's room (its blocks beside the running ones')
        self.pool_positions: int | None = None  # the KV pool's size in positions (None: parallel × capacity)
        self._short = False  # the last can_admit found no room for a new lane (counted once a wait)

    @property
    def busy(self) -> bool:
        return any(not lane.free for lane in self.lanes)

    @property
    def running(self) -> int:
        return sum(not lane.free for lane in self.lanes)

    def can_admit(self, ticket) -> bool:
        """Whether `ticket`'s request can start now. Over a KV pool: while the pool has room for the blocks it may
        need beside those the running requests may need (_pool_room), else it waits (counted in pool_waits). A
        lane's cache of its own (a sliding-window model): a lane free, or room for another — a new lane's working
        cache within LANE_SHARE of the memory free now: past it the request waits for a lane to free (counted in
        memory_waits), never a cache the machine cannot hold."""
        if self.running >= self.parallel:
            return False
        main = self.session()
        if getattr(main, "pool", None) is not None:
            return self._pool_room(main, ticket)
        if not self.lanes or any(lane.free for lane in self.lanes):
            self._short = False
            return True
        fits = self._new_lane_fits()
        if not fits and not self._short:
            self.memory_waits += 1
        self._short = not fits
        return fits

    def size_pool(self, main) -> None:
        """The KV pool's limit: pool_positions, or a whole capacity for each of `parallel` sequences; the idle lanes
        lend it their caches' blocks back when it is full."""
        per = blocks_for(main.cache.capacity)
        main.pool.limit = max(per, blocks_for(self.pool_positions) if self.pool_positions else self.parallel * per)
        main.pool.lend(self)

    def give_back(self, pool, n: int) -> int:
        """The pool is full: the idle lanes' working caches go to the prefix store (by reference) and are emptied,
        the least recently admitted first, until the store has given back n blocks (or every idle cache is parked).
        A lane's next request then finds its conversation in the store. How many blocks came free."""
        before = pool.free_blocks
        idle = [lane for lane in self.lanes if lane.free and getattr(lane.session, "pool", None) is pool]
        idle.sort(key=lambda x: x.admitted)
        for lane in idle:
            if not lane.session.ids:
                continue
            lane.session.tiers.park()
            lane.session.store.give_back(pool, n)
            if pool.free_blocks - before >= n:
                break
        return pool.free_blocks - before

    def blocks_needed(self, main, ticket) -> int:
        """The pool's blocks a request may hold at most: its prompt and its reply, within the capacity (a prompt
        that cannot be fitted needs none: it fails at its start, with its reason). Measured once a request."""
        if ticket.fitted is None or ticket.fitted[0] is not main:
            try:
                ticket.fitted = (main, main.fit(ticket.request))
            except Exception:  # it fails where it runs, with its reason
                ticket.fitted = (main, None)
        fitted = ticket.fitted[1]
        if fitted is None:
            return 0
        return blocks_for(min(main.cache.capacity, len(fitted.ids) + ticket.request.max_new_tokens))

    def _pool_room(self, main, ticket) -> bool:
        """Room in the pool for `ticket` beside the running requests' blocks (each counted whole, shared or not:
        none can run out); the first request runs whatever the pool says (a prompt it cannot hold fails alone)."""
        self.size_pool(main)
        ticket.blocks = self.blocks_needed(main, ticket)
        promised = sum(lane.blocks for lane in self.lanes if not lane.free)
        fits = self.running == 0 or promised + ticket.blocks <= main.pool.room()
        if not fits and ticket.pool_refused is None:
            ticket.pool_refused = tracing.now()
            self.pool_waits += 1
        return fits

    def _new_lane_fits(self) -> bool:
        main = self.session()
        cache = getattr(main, "cache", None)
        if cache is None:  # a remote server's session: a connection, no cache here
            return True
        free = free_on(main.loaded.device)
        return free is None or cache.allocated_bytes <= LANE_SHARE * free

    def admit(self, ticket) -> None:
        """Start `ticket` on a free lane (there is one: can_admit)."""
        ticket.started = time.monotonic()
        main = self.session()
        if ticket.cancelled and ticket.skip_if_cancelled:  # its client is gone: nothing to run
            return self._end(ticket)
        if main is None:
            ticket.sink(Failed("no model is loaded", "EngineError", {}))
            return self._end(ticket)
        lane = self._lane_for(main, ticket.request)
        trace = tracing.RequestTrace.of(ticket.request)
        trace.lane, trace.policy = lane.index, POLICY
        if ticket.pool_refused is not None:
            trace.pool_wait_ms = round((tracing.now() - ticket.pool_refused) * 1000.0, 3)
        trace.kv_blocks_promised = ticket.blocks
        ticket.trace = trace
        fitted = ticket.fitted[1] if ticket.fitted and lane.session.same_setup(ticket.fitted[0]) else None
        more = {"fitted": fitted} if fitted is not None else {}  # the prompt fitted at admission, not again
        gen = lane.session.steps(ticket.request, ticket.cancel_event, trace, **more)  # what raises fails it alone
        lane.session.turn_budget = self.budget
        lane.session.turn_rows = self.rows
        self._admitted += 1
        lane.ticket, lane.steps, lane.answer, lane.waiting, lane.admitted = ticket, gen, None, None, self._admitted
        lane.prefilled, lane.blocks = 0, ticket.blocks or 0

    def budget(self) -> int | None:
        """Prompt positions for the next prefill forward: None (the whole chunk) while no other lane decodes,
        else the turn's budget, kept at about one decode turn's time (_adjust), so a running stream's token gap
        at most doubles while a prompt arrives."""
        if not self._decoding():
            self.too_slow = None  # the next streams' steps may cost otherwise: measured again
            return None
        return self.turn_positions

    def rows(self) -> int | None:
        """Prompt positions to ride as rows of the next decode step (a prefill beside streams decoding, where the
        backend's batched step takes them): None while no other lane decodes; else as many as keep that step
        within about 1.5 of its time without them (_adjust_rows) — all the step takes (FEW_POSITIONS) while that
        time is not known at this many lanes (requests that came together: nothing to hold the prompt back for)."""
        if not self._decoding():
            return None
        return self.ride if self.step_seconds is not None else FEW_POSITIONS

    def _decoding(self) -> bool:
        return any(isinstance(lane.waiting, StepWanted) for lane in self.lanes)

    @property
    def step_seconds(self) -> float | None:
        """A decode turn's recent time at the number of lanes decoding now (None before one was measured): the
        reference the prefill budget and the riding rows keep to. By batch size, since a step of 8 lanes costs
        more than one of 2: a newcomer's rows held to the 2-lane step's time beside 8 lanes would shrink to one."""
        return self.step_times.get(sum(isinstance(lane.waiting, StepWanted) for lane in self.lanes))

    def _adjust_rows(self, seconds: float) -> None:
        """After a decode step that carried prompt rows: twice the rows while it took under 1.4 of a step without
        them, half past 1.8 (at least one), at most the few a forward runs as rows."""
        if self.step_seconds is None:
            return
        if seconds < 1.4 * self.step_seconds:
            self.ride = min(self.ride * 2, FEW_POSITIONS)
        elif seconds > 1.8 * self.step_seconds:
            self.ride = max(1, self.ride // 2)

    def _adjust(self, positions: int, seconds: float) -> None:
        """After a prefill forward of the budget's size beside decoding lanes: twice the positions when it took
        well under a decode turn, half when it took more (what a forward of k positions costs is not k times
        one position's: it is measured, not modelled — a few positions' forward reads the weights as decode does,
        a longer one as prefill does). A size found too slow is not tried again while the same streams decode, so
        the budget settles below it instead of stretching every other gap."""
        if self.step_seconds is None or positions < self.turn_positions:
            return
        if seconds > self.step_seconds:
            self.too_slow = positions if self.too_slow is None else min(self.too_slow, positions)
            self.turn_positions = max(MIN_TURN_POSITIONS, self.turn_positions // 2)
        elif seconds < 0.7 * self.step_seconds and (self.too_slow is None or 2 * self.turn_positions < self.too_slow):
            self.turn_positions = min(self.turn_positions * 2, 4096)

    @staticmethod
    def _recent(old: float | None, new: float) -> float:
        return new if old is None else 0.5 * old + 0.5 * new

    def _lane_for(self, main, request: Request) -> Lane:
        """The free lane whose working cache holds the longest prefix of the request's prompt, or a new lane when
        none is free. Lane 0 runs the engine's session itself; another lane made before a change of model or
        cache is made again when it is chosen."""
        if not self.lanes:
            self.lanes.append(Lane(0, main))
        if self.lanes[0].free and self.lanes[0].session is not main:
            _retire(self.lanes[0].session)
            self.lanes[0].session = main
        free = [lane for lane in self.lanes if lane.free]
        if not free:
            lane = Lane(len(self.lanes), main.sibling())
            self.lanes.append(lane)
            return lane
        lane = free[0]
        if len(free) > 1 and not getattr(main, "remote", False):  # a remote server's cache is its own
            try:
                prompt = main.fit(request).ids
            except Exception:  # it fails where it runs, with its reason
                prompt = []
            current = [x for x in free if x.session is main or main.same_setup(x.session)]
            lane = max(current or free, key=lambda x: common_prefix(x.session.ids, prompt) if x in current else -1)
        if lane.session is not main and not main.same_setup(lane.session):
            _retire(lane.session)
            lane.session = main.sibling()
        return lane

    def turn(self) -> None:
        """One decode step for every lane waiting on one, then one prefill chunk of the oldest lane prefilling
        (lanes just admitted start here)."""
        riding = [lane for lane in self.lanes if isinstance(lane.waiting, RowsWanted)]
        decoding = [lane for lane in self.lanes if isinstance(lane.waiting, StepWanted)]
        computed = len(decoding)
        if decoding or riding:
            began = time.perf_counter()
            try:
                logits = step_all([lane.waiting for lane in decoding + riding])
                took = time.perf_counter() - began
                if riding:
                    self._adjust_rows(took)
                elif decoding:
                    self.step_times[len(decoding)] = self._recent(self.step_times.get(len(decoding)), took)
            except BaseException as e:  # the step fails for all of them: each hears why
                for lane in decoding + riding:
                    self._fail(lane, e)
                decoding, riding, computed = [], [], 0
            for lane, out in zip(decoding, logits[: len(decoding)] if decoding else ()):
                lane.ticket.trace.batch_sizes.append(len(decoding))  # its decode batch (riding rows apart)
                lane.answer, lane.waiting = out, None
                self._advance(lane)
            for lane, out in zip(riding, logits[len(decoding) :] if riding else ()):
                lane.answer, lane.waiting = out, None
                computed += self._advance(lane)  # its progress told; its next rows asked for the next step
        for lane in [lane for lane in self.lanes if not lane.free and lane.io and lane.waiting is None]:
            self._advance(lane)  # to its server's next chunk, or through its next speculative round
        prefilling = [lane for lane in self.lanes if not lane.free and lane.waiting is None and not lane.io]
        if prefilling:
            beside = self._decoding()  # its forward took the turn's budget
            began = time.perf_counter()
            positions = self._advance(min(prefilling, key=lambda lane: lane.admitted))
            if beside and positions > 0:
                self._adjust(positions, time.perf_counter() - began)
            computed += positions
        if computed and self.on_turn is not None:
            self.on_turn(computed)

    def in_flight(self) -> list[dict]:
        """Every request running on a lane now, for a Requests view (`/kvchat/stats`): its lane, how long it
        waited for it, its prefill's progress, its tokens, the K/V its lane's cache holds for it (each lane's
        own payload, 2·L·T·H_kv·d·b as the cache counts it, scales and sliding windows included: summed over
        lanes, the KV formula with Σ T) and the batch size of its last decode step. Read from another thread
        between turns: a snapshot, not a lock."""
        out = []
        for lane in list(self.lanes):
            ticket = lane.ticket
            trace = getattr(ticket, "trace", None)
            cache = getattr(lane.session, "cache", None)  # a remote server's session holds none here
            if ticket is None or trace is None or cache is None:
                continue
            computed = trace.computed or 0
            out.append({
                "lane": lane.index,
                "label": ticket.request.label,
                "state": "decoding" if trace.token_times else "prefilling",
                "queue_ms": None if trace.started is None else round((trace.started - trace.arrival) * 1000, 3),
                "prompt_positions": trace.prompt_tokens,
                "prefill": {"done": min(lane.prefilled, computed), "of": computed, "reused": trace.reused},
                "tokens": len(trace.token_times),
                "cache_positions": cache.length,
                "shared_positions": cache.shared_positions,
                "kv_payload_bytes": cache.payload_bytes,
                "kv_allocated_bytes": cache.allocated_bytes,
                "batch_size": trace.batch_sizes[-1] if trace.batch_sizes else None,
                "pool_wait_ms": trace.pool_wait_ms,
            })  # fmt: skip
        return out

    def pool_stats(self, running: bool = True) -> dict | None:
        """The KV pool under the running requests (every lane's cache with `running` False), None without a pool (a
        remote server's lanes, a sliding-window model's caches of their own): its blocks (held, shared, free, its
        limit), and their positions summed (ΣT) and counted once where a block is shared (`distinct_positions`:
        the payload is these × bytes per position, `held_bytes` the blocks they lie in). A snapshot read between
        turns."""
        main = self.session()
        pool = getattr(main, "pool", None)
        if pool is None:
            return None
        used: dict[int, int] = {}  # block -> the positions of it the running requests use
        total = 0
        for lane in list(self.lanes):
            cache = getattr(lane.session, "cache", None)
            if (running and lane.ticket is None) or getattr(cache, "pool", None) is not pool:
                continue
            total += cache.length
            for i, b in enumerate(cache.table[: blocks_for(cache.length)]):
                used[b] = max(used.get(b, 0), min(BLOCK, cache.length - i * BLOCK))
        distinct = sum(used.values())
        return {
            **pool.stats(),
            "positions": total,
            "distinct_positions": distinct,
            "shared_positions": total - distinct,
            "payload_bytes": distinct * pool.bytes_per_position,
            "held_bytes": len(used) * pool.block_bytes,
            "waits": self.pool_waits,
        }

    def cached_positions(self, req: Request) -> dict:
        """How much of a request's prompt is cached now (Session.cached_positions) on the lane that would run
        it: the one whose working cache holds the most of it (_lane_for's choice among free lanes)."""
        main = self.session()
        if getattr(main, "remote", False):  # a remote server's session: its own answer
            return main.cached_positions(req)
        others = [lane.session for lane in self.lanes if lane.session is not main and main.same_setup(lane.session)]
        if not others:
            return main.cached_positions(req)
        try:
            fitted = main.fit(req)  # once: the lanes share the model, capacity and template
        except Exception:  # refused, or failing: the engine's session answers with its reason
            return main.cached_positions(req)
        answers = [s.cached_positions(req, fitted) for s in (main, *others)]
        return max(answers, key=lambda a: a.get("cached", 0))

    def cancel_all(self) -> None:
        for lane in self.lanes:
            if lane.ticket is not None:
                lane.ticket.cancel()

    def _advance(self, lane: Lane) -> int:
        """Run the lane's generation to its next decode step, its next prefill chunk, or its end; its events to
        its sink. The prompt positions it computed on the way."""
        before = lane.prefilled
        while True:
            try:
                item = lane.steps.send(lane.answer)
            except StopIteration:
                self._release(lane)
                return lane.prefilled - before
            except BaseException as e:  # never let the thread die, whatever native code raises: report, go on
                self._fail(lane, e)
                return 0
            lane.answer = None
            if item is WAITING:  # its server has sent nothing new: the other lanes' turn
                return 0
            if isinstance(item, (StepWanted, RowsWanted)):  # computed in the next turn's batched step
                lane.waiting = item
                return lane.prefilled - before
            if isinstance(item, (PrefillProgress, PrefillDone)):
                lane.prefilled = item.done if isinstance(item, PrefillProgress) else item.computed
            try:
                lane.ticket.sink(item)
            except BaseException as e:
                self._fail(lane, e)
                return 0
            if isinstance(item, PrefillProgress):  # a chunk done: the others' turn
                return lane.prefilled - before

    def _fail(self, lane: Lane, e: BaseException) -> None:
        traceback.print_exception(e)
        try:
            lane.ticket.sink(Failed(f"internal error: {type(e).__name__}: {e}", "InternalError", {}))
        except Exception:
            traceback.print_exc()
        if lane.steps is not None:
            lane.steps.close()
        self._release(lane)

    def _release(self, lane: Lane) -> None:
        ticket = lane.ticket
        lane.ticket, lane.steps, lane.answer, lane.waiting = None, None, None, None
        self._end(ticket)

    def _end(self, ticket) -> None:
        ticket.ended = time.monotonic()
        self.ended(ticket)


def _retire(session) -> None:
    """A lane's session made before a change of model or cache, replaced: its working cache's blocks go back to
    their pool (one it may share with the sessions made since, after a change of capacity alone)."""
    cache = getattr(session, "cache", None)
    if cache is not None:
        cache.release()
