"""A chat session: one KV cache, the token ids whose K/V it holds, and generation as a stream of events.

For each request the session reuses the longest prefix of the prompt whose K/V it holds (never
the prompt's last position: its logits pick token 1) — in the working cache, or in the prefix
store, which keeps what earlier requests' working cache held and is copied back in — cuts the
working cache there, prefills the rest in chunks and decodes. Before positions of the working cache
are thrown away the store takes them. Every request reports what it reused, from where, and what it
threw away. A change of weights, dtype, tokenizer, rotary or attention settings, KV precision or
device empties the cache and the store, and the report says why.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import torch

from . import trace as tracing
from .backends.cuda_graph import GraphDecoder, graphs_wanted
from .disk_store import DiskStore
from .errors import CapacityError, EngineError
from .events import Failed, Finished, PrefillDone, PrefillProgress, PrefillStarted, ReuseReport, Token
from .kv_cache import DEFAULT_CAPACITY, KVCache, make_cache
from .logprobs import check_top_logprobs, step_logprobs
from .prefix_store import PrefixStore, common_prefix, default_budget
from .quant import PRECISIONS
from .sampling import SamplingParams, draw
from .tokenizer import ChatPrompt
from .weights.loading import LoadedModel

OVERFLOW_POLICIES = {
    "stop": "stop at the limit",
    "drop-oldest": "drop the oldest messages",
    "truncate-middle": "truncate the middle",
}  # what a request does with a prompt longer than the cache allows: refuse it, or leave messages out


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation. `messages` (rendered with the chat template) or `prompt` (raw text)."""

    messages: tuple[dict, ...] | list[dict] | None = None
    prompt: str | None = None
    prompt_ids: tuple[int, ...] | None = None  # already tokenized (e.g. "continue this reply")
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 256
    stop_strings: tuple[str, ...] = ()
    stop_on_capacity: bool = False  # False: refuse a request that may not fit; True: stop when full
    arrival: float | None = None  # on trace.now; None = when generate() is called
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # extend the last (assistant) message instead of starting a new one
    label: str | None = None  # a name for the prompt in the prefix store's picture (a conversation's title)
    ignore_eos: bool = False  # run to max_new_tokens past stop tokens (benchmarks; vLLM's ignore_eos)
    logprobs: bool = False  # each Token carries what the model weighed at its step (engine.logprobs)
    top_logprobs: int = 5  # with logprobs: the alternatives per step (0: none)
    reply_ids: tuple[int, ...] = ()  # tokens the reply starts with, after the prompt (a fork from a token)
    overflow: str = "stop"  # a prompt too long for the cache: refused (stop), or messages left out (OVERFLOW_POLICIES)


def positions_needed(prompt: int, max_new_tokens: int) -> int:
    """The cache positions a request needs: its prompt and its reply but the last output token, which is
    never consumed (the capacity check's rule, and the app's context meter's)."""
    return prompt + max_new_tokens - 1


FINGERPRINT_NAMES = {
    "weights": "the weights",
    "dtype": "dtype",
    "quantization": "weight precision",
    "activations": "activations",
    "tokenizer": "the tokenizer",
    "rope": "rotary embedding",
    "attention": "attention",
    "device": "device",
    "kv_cache": "KV cache precision",
}  # a fingerprint's keys as a person reads them in the reason a cache was dropped


def turns(messages: list[dict]) -> list[list[int]]:
    """The non-system messages as turns (a user message and what follows it until the next), by index."""
    out: list[list[int]] = []
    for i, m in enumerate(messages):
        if m.get("role") == "system":
            continue
        if m.get("role") == "user" or not out:
            out.append([])
        out[-1].append(i)
    return out


def overflow_orders(policy: str, messages: list[dict]) -> list[list[int]]:
    """The messages a policy may leave out, in the order it leaves them out, as whole turns; never the system
    prompt nor the last turn. drop-oldest: the oldest turns first; truncate-middle: the turns after the first
    one, oldest first, and the first turn last (where a conversation usually states what it is about)."""
    ts = turns(messages)[:-1]
    if policy == "drop-oldest":
        return ts
    if policy == "truncate-middle":
        return ts[1:] + ts[:1]
    return []


def fingerprint_change(old: dict | None, new: dict) -> str | None:
    """Why K/V cached under `old` are no longer valid under `new`, in words; None when they are."""
    if old is None or old == new:
        return None
    parts = []
    for k in (k for k in new if old.get(k) != new.get(k)):
        name, a, b = FINGERPRINT_NAMES.get(k, k), old.get(k), new.get(k)
        parts.append(f"{name} changed" if k in ("weights", "tokenizer") else f"{name} changed ({a} → {b})")
    return "cache dropped: " + ", ".join(parts)


# Why 256 positions: engine/BENCHMARKS.md, "Decisions, and what was measured for them".
PREFILL_CHUNK = 256  # float32 positions per prefill step: progress and Stop act between steps


def prefill_chunk_for(dtype: torch.dtype) -> int:
    """Positions per prefill step: the activation bytes of PREFILL_CHUNK float32 positions, so a 16-bit
    model takes steps of 512 (its GEMMs run further below their speed on fewer rows)."""
    return PREFILL_CHUNK * 4 // dtype.itemsize


class Session:
    def __init__(
        self,
        loaded: LoadedModel,
        capacity: int | None = None,
        prefill_chunk: int | None = None,
        kv: str = "none",
        cache_budget: int | None = None,
        disk: DiskStore | None = None,
    ):
        self._disk = disk  # the prefix store's disk tier (blocks written after each request, read back on a return)
        self.prefill_chunk = prefill_chunk  # None: prefill_chunk_for the model's dtype
        # The prefix store's bytes; None: a share of the memory free now; 0: no store.
        self.store = PrefixStore(default_budget(loaded.device) if cache_budget is None else cache_budget)
        self.label: str | None = None  # the label of the request whose prompt the working cache holds
        self._last_match = None  # what the last request took from the store (for the picture)
        self.kv = kv  # KV cache precision: none (the model dtype) | int8 | int4
        self.capacity_setting = capacity
        self.traces: list[tracing.RequestTrace] = []
        self.loaded: LoadedModel | None = None
        self.cache: KVCache | None = None
        self.ids: list[int] = []  # token ids whose K/V are in the cache; len(ids) == cache.length
        self._fingerprint: dict | None = None
        self._dropped: tuple[str, list[int]] | None = None  # (reason, ids) of a cache emptied by a change
        self._graph: GraphDecoder | None = None  # the captured decode step for this cache (CUDA)
        self.graph_error: str | None = None  # why decode stays eager on CUDA, if it does
        self.set_model(loaded, capacity)

    # --- model and cache ------------------------------------------------------------
    def set_model(self, loaded: LoadedModel, capacity: int | None = None, kv: str | None = None) -> None:
        """Use another model (or dtype/device/precision): the next request reports the cache dropped and why."""
        capacity = capacity or self.capacity_setting or min(loaded.config.max_position_embeddings, DEFAULT_CAPACITY)
        if capacity < 2:
            raise EngineError("KV capacity must be at least 2 positions")
        kv = kv or self.kv
        if kv not in PRECISIONS:
            raise EngineError(f"KV precision {kv!r} is not supported (supported: {', '.join(PRECISIONS)})")
        fingerprint = {**loaded.fingerprint, "kv_cache": kv}
        reason = fingerprint_change(self._fingerprint, fingerprint)
        if reason is not None:
            store_dropped = self.store.clear(reason)  # stored K/V no longer match either
            self._last_match = None
            if self.ids or store_dropped:
                self._dropped = (f"{reason}; {store_dropped} too" if store_dropped else reason, list(self.ids))
        elif self.cache is not None and capacity != self.cache.capacity:
            reason = f"cache dropped: capacity changed ({self.cache.capacity} → {capacity})"
            if self.ids and self.store.budget:  # the same K/V in a cache of another size: the store keeps them
                self.store.insert(self.ids, self.cache, self.label)
            elif self.ids:
                self._dropped = (reason, list(self.ids))
        # Same weights, dtype, tokenizer, rotary/attention settings, device and capacity: the K/V stay valid.
        self._graph, self.graph_error = None, None  # a captured step belongs to one model object and one cache
        if self.cache is None or reason is not None:
            self.cache = None  # free the old buffers before allocating the new
            chunk = self.prefill_chunk or prefill_chunk_for(loaded.dtype)
            self.cache = make_cache(loaded.config, capacity, loaded.dtype, loaded.device, kv, chunk)
            self.ids = []
        self.loaded, self._fingerprint, self.capacity_setting, self.kv = loaded, fingerprint, capacity, kv

    @property
    def pending_drop_reason(self) -> str | None:
        """Why the cache was emptied by the last model change (reported with the next request)."""
        return self._dropped[0] if self._dropped else None

    def reset(self) -> None:
        """Empty the cache and the prefix store (a person's /reset); the next request prefills from scratch."""
        self.cache.truncate(0)
        self.ids = []
        self._dropped = None
        self.store.clear()
        self._last_match = None

    @property
    def disk_fingerprint(self) -> dict:
        """What K/V on disk are valid under: the cache's fingerprint and the decode kernels that computed the
        reply's positions (another build rounds differently)."""
        k = self.loaded.kernels
        return {**self._fingerprint, "kernels": f"{k.isa}/{k.int_isa}/{k.variant}" if k is not None else "torch"}

    def set_disk(self, disk: DiskStore | None) -> None:
        """Another disk tier (or none): what was queued for the old one is written first."""
        if self._disk is not None and self._disk is not disk:
            self._disk.flush(5.0)
        self._disk = disk

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for the disk tier's writer (at exit): False when it had not finished in `timeout`."""
        return self._disk.flush(timeout) if self._disk is not None else True

    @property
    def disk(self) -> DiskStore | None:
        """The disk tier where it serves this cache: not for a sliding-window cache (its files hold every layer's
        positions; a ring's are not all there)."""
        return None if hasattr(self.cache, "ring_mask") else self._disk

    def set_cache_budget(self, budget: int | None) -> None:
        """The prefix store's budget in bytes (None: the default share of free memory); evicts to fit."""
        self.store.set_budget(default_budget(self.loaded.device) if budget is None else budget)

    def cache_stats(self) -> dict:
        s = self.cache.stats()
        s["bytes_per_position"] = self.cache.bytes_per_position
        s["store"] = {
            **self.store.stats(),
            "tree": self._tree_with_text(self.store.tree(self._last_match, self._working(), self._on_disk())),
            "working_label": self.label,
        }
        if self.disk is not None:  # the store's disk tier
            s["store"]["disk"] = self.disk.stats(self.disk_fingerprint)
        elif self._disk is not None:
            s["store"]["disk_off"] = "not for a sliding-window cache: its sliding layers keep only their last positions"
        return s

    def _working(self) -> tuple[list[int], str | None, int]:
        """The working cache for the store's picture: its ids, its label, how many of its positions are on disk."""
        on_disk = self.disk.held(self.ids, self.disk_fingerprint) if self.disk is not None else 0
        return self.ids, self.label, on_disk

    def _on_disk(self):
        """The tree's check of which blocks are on disk too (None without a disk tier): a chained-hash step."""
        if self.disk is None:
            return None
        return self.disk.chain(self.disk_fingerprint)

    def _tree_with_text(self, segments: list[dict]) -> list[dict]:
        """The store's tree with each segment's first ids as `text` (what it starts with, where it parts
        from its siblings), so that two prompts of the same title are told apart."""
        tok = self.loaded.tokenizer
        for seg in segments:
            runs, run = [], []  # the text between the template's control tokens, a run each
            for i in [*seg.pop("head", ()), None]:
                if i is None or i in tok.control_ids:
                    text = tok.decode(run).strip() if run else ""
                    runs += [text] if text else []
                    run = []
                else:
                    run.append(i)
            seg["text"] = " ⏎ ".join(runs)  # "Hello there ⏎ assistant ⏎ Hello! Where"
            self._tree_with_text(seg["children"])
        return segments

    def cached_positions(self, req: Request) -> dict:
        """How much of a request's prompt is cached now, without running it: `positions` of the prompt,
        `cached` (the longest prefix held), `source` (working | store | none). For a conversation
        shown again before anything is sent. Under an overflow policy, the prompt it would send: `dropped_messages`
        and `dropped_positions` say what it leaves out (a prompt that cannot fit even so: `error`)."""
        try:
            chat, dropped, positions = self.fit(req)
        except CapacityError as e:
            return {"error": str(e)}
        prompt = chat.ids + list(req.reply_ids)
        w = common_prefix(self.ids, prompt)
        m = self.store.match(prompt, touch=False).length
        source = "none" if max(w, m) == 0 else "working" if w >= m else "store"
        out = {"positions": len(prompt), "cached": max(w, m), "source": source}
        if self.disk is not None:
            d = self.disk.held(prompt, self.disk_fingerprint)
            if d > out["cached"]:
                out.update(cached=d, source="disk", **self._return_cost(prompt, max(w, m), d))
        return {**out, "dropped_messages": list(dropped), "dropped_positions": positions} if positions else out

    def _return_cost(self, prompt: list[int], near: int, on_disk: int) -> dict:
        """What returning to a prompt held on disk costs, both measured here: reading its positions past what
        memory holds (the disk's read rate so far, or one block read now) against prefilling them (this
        session's median prefill rate, or the one an earlier run measured; None before any of 64 positions)."""
        rate = self.disk.read_rate or self.disk.measure_read(prompt, self.disk_fingerprint)
        nbytes = (on_disk - near) * self.cache.bytes_per_position
        measured = (t.summary().get("prefill_tok_s") for t in self.traces if (t.computed or 0) >= 64)
        rates = sorted(r for r in measured if r) or [r for r in [self.disk.prefill_rate(self.disk_fingerprint)] if r]
        return {
            "disk_read_ms": None if not rate else round(nbytes / rate * 1000.0, 1),
            "prefill_ms": None if not rates else round((on_disk - near) / rates[len(rates) // 2] * 1000.0, 1),
        }

    def facts(self) -> dict:
        """The model's facts with this session's cache: capacity, precision, bytes per position, stats."""
        c = self.cache
        return {
            **self.loaded.facts(self.kv),
            "capacity": c.capacity,
            "kv_bytes_per_position": c.bytes_per_position,
            "kv_allocated_bytes": c.allocated_bytes,
            # a sliding-window cache: the layers of each kind and the positions each keeps at most (None: one kind)
            "kv_layer_kinds": [{k: d[k] for k in ("kind", "layers", "window", "slots")} for d in c.kinds()]
            if hasattr(c, "kinds")
            else None,
            "cache": self.cache_stats(),
            "fingerprint": dict(self.loaded.fingerprint),
            "cache_dropped": self.pending_drop_reason,
        }

    # --- tokenizing and planning ------------------------------------------------------
    def tokenize(self, req: Request) -> list[int]:
        """The prompt's token ids, the reply's forced start (`reply_ids`) after them."""
        return self._prompt(req).ids + list(req.reply_ids)

    def _prompt(self, req: Request) -> ChatPrompt:
        """The prompt's ids and, for messages, where each message's text lies among them."""
        tok = self.loaded.tokenizer
        if req.prompt_ids is not None:
            return ChatPrompt(list(req.prompt_ids), ())
        if req.messages is not None:
            return tok.chat_prompt(
                list(req.messages),
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
            )
        if req.prompt is not None:
            return ChatPrompt(tok.encode(req.prompt, add_special_tokens=True), ())
        raise EngineError("a request needs messages or a prompt")

    def room(self, req: Request) -> int:
        """The reply's positions a prompt must leave free: all of max_new_tokens, or, for a request that stops
        when the cache is full, up to a quarter of the capacity."""
        cap = self.cache.capacity
        return req.max_new_tokens if not req.stop_on_capacity else min(req.max_new_tokens, max(1, cap // 4))

    def fit(self, req: Request) -> tuple[ChatPrompt, tuple[int, ...], int]:
        """The prompt the request's overflow policy makes of a conversation too long for the cache, with the
        indices of the messages it left out and the prompt positions that went with them: as few whole turns
        as it takes (a binary search over how many; each try rendered and tokenized), never the system prompt
        nor the last turn. A raw prompt loses tokens instead (the oldest, or the middle). Unchanged when it
        fits or the policy is stop (check_capacity then refuses what does not fit)."""
        if req.overflow not in OVERFLOW_POLICIES:
            raise EngineError(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, not {req.overflow!r}")
        chat = self._prompt(req)
        cap, room, forced = self.cache.capacity, self.room(req), len(req.reply_ids)

        def fits(c: ChatPrompt) -> bool:
            return len(c.ids) + forced + room - 1 <= cap

        if req.overflow == "stop" or fits(chat):
            return chat, (), 0
        if req.messages is None:  # a raw prompt: the oldest tokens, or the middle ones
            keep = cap - room + 1 - forced
            if keep < 1:
                raise CapacityError(f"max new tokens ({req.max_new_tokens}) leaves no room for a prompt in {cap}")
            ids = chat.ids
            head = 0 if req.overflow == "drop-oldest" else keep // 2
            return ChatPrompt(ids[:head] + ids[len(ids) - (keep - head) :], ()), (), len(ids) - keep
        order = overflow_orders(req.overflow, list(req.messages))

        def without(j: int) -> tuple[ChatPrompt, tuple[int, ...]]:
            gone = {i for turn in order[:j] for i in turn}
            kept = tuple(m for i, m in enumerate(req.messages) if i not in gone)
            return self._prompt(dataclasses.replace(req, messages=kept)), tuple(sorted(gone))

        best = without(len(order)) if order else (chat, ())
        if not fits(best[0]):
            need = positions_needed(len(best[0].ids) + forced, room)
            raise CapacityError(
                f"even with only the system prompt and the last turn the request needs {need} cache positions "
                f"but the capacity is {cap}; shorten the last message, lower max new tokens or raise the capacity"
            )
        lo, hi = 1, len(order)
        while lo < hi:
            mid = (lo + hi) // 2
            tried = without(mid)
            if fits(tried[0]):
                hi, best = mid, tried
            else:
                lo = mid + 1
        return best[0], best[1], len(chat.ids) - len(best[0].ids)

    def plan_reuse(self, prompt: list[int]) -> ReuseReport:
        """What this prompt may keep of the working cache (the common prefix, capped at len(prompt) - 1)
        and, where the store holds more, how much more it supplies (`source` "store"), or its disk tier
        (`source` "disk"; the disk is keyed by the fingerprint, so it serves after a change of model too)."""
        report = self._plan_working(prompt)
        match = self.store.match(prompt, touch=False) if self._dropped is None else None
        held = min(match.length, len(prompt) - 1) if match else 0
        if held > report.reused and not self.store.whole(
            match, max(report.reused, self.cache.restore_needs(held)), held
        ):
            held = 0  # a sliding layer's window before `held` is not in the store (taken after it slid out)
        on_disk = min(self.disk.held(prompt, self.disk_fingerprint), len(prompt) - 1) if self.disk else 0
        source, more = "store", held
        if on_disk > max(held, report.reused):
            source, more = "disk", on_disk
        if more > report.reused:
            where = "copied from the prefix store" if source == "store" else "read from the disk tier"
            note = f"positions {report.reused}–{more - 1} {where}"
            return dataclasses.replace(
                report,
                reused=more,
                computed=len(prompt) - more,
                reason=f"{report.reason}; {note}" if report.reason else note,
                source=source,
                stored_prefix=match.length if match else 0,
            )
        if self.disk is not None and report.reused < len(prompt) - 1:
            other = self.disk.other_fingerprint(prompt, self.disk_fingerprint)
            change = fingerprint_change(other, self.disk_fingerprint) if other else None
            if change:  # on disk, but computed under other settings: not used, and said why
                note = "on disk for other settings, not used: " + change.removeprefix("cache dropped: ")
                report = dataclasses.replace(report, reason=f"{report.reason}; {note}" if report.reason else note)
        if self._dropped is not None:
            return report
        return dataclasses.replace(
            report, source="none" if report.reused == 0 else "working", stored_prefix=match.length
        )

    def _plan_working(self, prompt: list[int]) -> ReuseReport:
        tok = self.loaded.tokenizer
        if self._dropped is not None:
            reason, old = self._dropped
            return ReuseReport(
                0,
                len(prompt),
                len(old),
                0,
                {"id": old[0], "text": tok.token_text(old[0])} if old else None,
                {"id": prompt[0], "text": tok.token_text(prompt[0])},
                reason,
            )
        cached = self.ids
        lcp = common_prefix(cached, prompt)
        cut = min(lcp, len(prompt) - 1)
        reused = self._keep(prompt, lcp)
        invalidated = len(cached) - reused
        if invalidated == 0:
            return ReuseReport(reused, len(prompt) - reused, 0, None, None, None, None)
        if lcp == cut:
            reason = f"prompt differs from the cache at position {cut}"
        else:
            reason = f"position {cut} is the prompt's last: recomputed for the logits of token 1"
        if reused < cut:
            c = self.cache
            reason += (
                f"; positions 0–{cut - 1} recomputed too: the {len(c.ring_layers)} sliding layers keep the last "
                f"{c.slots:,} of {len(cached):,} positions (window {c.window:,}), and going on from {cut} needs "
                f"{max(0, cut - c.window + 1):,}–{cut - 1}, which slid out"
            )
        return ReuseReport(
            reused,
            len(prompt) - reused,
            invalidated,
            cut,
            {"id": cached[cut], "text": tok.token_text(cached[cut])},
            {"id": prompt[cut], "text": tok.token_text(prompt[cut])},
            reason,
            slid_out=cut - reused,
        )

    def _keep(self, prompt: list[int], lcp: int | None = None) -> int:
        """What the working cache keeps of this prompt: the common prefix (`lcp`, when the caller has it), capped at
        len(prompt) − 1, or 0 where a sliding layer's ring no longer holds the window before that point
        (WindowedKVCache.resumable)."""
        keep = min(common_prefix(self.ids, prompt) if lcp is None else lcp, len(prompt) - 1)
        return keep if self.cache.resumable(keep) else 0

    def check_capacity(self, prompt_len: int, req: Request) -> None:
        if req.max_new_tokens < 1:
            raise EngineError("max_new_tokens must be at least 1")
        cap = self.cache.capacity
        if prompt_len > cap:
            raise CapacityError(
                f"the prompt has {prompt_len} tokens but the KV cache holds only {cap} positions; "
                "shorten the conversation or raise the capacity"
            )
        need = positions_needed(prompt_len, req.max_new_tokens)
        if need > cap and not req.stop_on_capacity:
            raise CapacityError(
                f"the prompt has {prompt_len} tokens; with up to {req.max_new_tokens} new tokens "
                f"it needs {need} cache positions but the capacity is {cap}; lower max new "
                "tokens, shorten the conversation or raise the capacity"
            )

    # --- generation -------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, req: Request, cancel: threading.Event | None = None) -> Iterator:
        trace = tracing.RequestTrace(arrival=req.arrival if req.arrival is not None else tracing.now())
        trace.started = tracing.now()
        self.traces.append(trace)
        cancel = cancel or threading.Event()
        try:
            yield from self._generate(req, cancel, trace)
        except (EngineError, ValueError, RuntimeError, MemoryError) as e:
            trace.status, trace.end, trace.error = "failed", tracing.now(), str(e)
            if isinstance(e, RuntimeError) and "out of memory" in str(e).lower():
                trace.error = f"out of memory: {e}"
            yield Failed(trace.error, type(e).__name__, trace.summary(), self.cache_stats())

    def _generate(self, req: Request, cancel: threading.Event, trace: tracing.RequestTrace):
        loaded, model, tok = self.loaded, self.loaded.model, self.loaded.tokenizer
        chat, dropped, dropped_positions = self.fit(req)
        prompt = chat.ids + list(req.reply_ids)
        trace.tokenized = tracing.now()
        if not prompt:
            raise EngineError("the prompt is empty")
        self.check_capacity(len(prompt), req)
        check_top_logprobs(req.top_logprobs)
        keep = self._keep(prompt)  # what the working cache keeps
        t0 = tracing.now()
        stashed = self._stash(prompt, keep)
        stash_ms = round((tracing.now() - t0) * 1000.0, 3) if stashed else None
        reuse = dataclasses.replace(self.plan_reuse(prompt), stashed_bytes=stashed, stash_ms=stash_ms)
        reason = reuse.reason
        if dropped or dropped_positions:
            what = f"{len(dropped)} messages" if dropped else "tokens"
            note = (
                f"{what} ({dropped_positions} positions) left out to fit the cache: {OVERFLOW_POLICIES[req.overflow]}"
            )
            reason = f"{note}; {reason}" if reason else note
        reuse = dataclasses.replace(
            reuse, dropped_positions=dropped_positions, dropped_messages=dropped, reason=reason, overflow=req.overflow
        )
        self._dropped = None
        reuse = self._bring_in(prompt, reuse, keep)
        trace.prompt_tokens, trace.reused, trace.computed = len(prompt), reuse.reused, reuse.computed
        self.label = req.label
        stream = tok.stream(req.reply_ids)  # a forced start: the reply's text goes on from it
        yield PrefillStarted(len(prompt), reuse, tuple(prompt), stream.text, chat.spans)

        # Prefill: the rest of the prompt, in chunks.
        trace.prefill_start = tracing.now()
        device = loaded.device
        logits = None
        pos = reuse.reused
        while pos < len(prompt):
            chunk = prompt[pos : pos + (self.prefill_chunk or prefill_chunk_for(loaded.dtype))]
            logits = model(torch.tensor([chunk], device=device), self.cache, last_only=True)  # [1, 1, V]
            self.ids.extend(chunk)
            pos += len(chunk)
            if pos < len(prompt):
                yield PrefillProgress(pos - reuse.reused, reuse.computed, self.cache.length)
                if cancel.is_set():
                    return (yield from self._finish(trace, "cancelled", [], stream, reuse))
        trace.prefill_end = tracing.now()
        yield PrefillDone(reuse.reused, reuse.computed, trace.prefill_end - trace.prefill_start, self.cache.length)

        # Decode: select token k from the last logits, then consume it to get logits for k+1.
        gen = None
        if not req.sampling.greedy:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(req.sampling.seed if req.sampling.seed is not None else torch.seed())
        use_penalty = req.sampling.repetition_penalty != 1.0
        out: list[int] = []
        steps = []  # each token's StepLogprobs, when asked for
        reason = "max_new_tokens"
        for k in range(1, req.max_new_tokens + 1):
            row = logits[0, -1].float().cpu() if gen is not None or use_penalty else logits[0, -1]
            seen = torch.tensor(self.ids, dtype=torch.long, device=row.device) if use_penalty else None
            token, drawn = draw(row, req.sampling, gen, seen)
            if token in tok.stop_ids and not req.ignore_eos:
                reason = "eos"
                break
            weighed = None
            if req.logprobs:
                greedy = req.sampling.greedy
                argmax = greedy and not use_penalty
                weighed = step_logprobs(row, drawn, token, req.top_logprobs, greedy, tok.token_text, argmax)
                steps.append(weighed)
            t = tracing.now()
            trace.token_times.append(t)
            out.append(token)
            delta = stream.push(token)
            yield Token(k, token, delta, t, self.cache.length, weighed)
            if req.stop_strings and any(s in stream.new_text for s in req.stop_strings):
                reason = "stop_string"
                break
            if k == req.max_new_tokens:
                break
            if cancel.is_set():
                reason = "cancelled"
                break
            if self.cache.length >= self.cache.capacity:
                reason = "capacity"
                break
            logits = self._decode_step(token)  # [1, 1, V]
            self.ids.append(token)
        yield from self._finish(trace, reason, out, stream, reuse, req.stop_strings, steps)

    def _stash(self, prompt: list[int], keep: int) -> int:
        """Before the working cache loses a block or more of positions to this prompt (it keeps `keep`),
        the store takes its whole content (only the blocks it lacks are copied); returns the bytes it added."""
        if len(self.ids) - keep < self.store.block:
            return 0  # a few positions (the end of the last reply): recomputing them costs less than keeping
        wanted = self.store.match(prompt)  # this prompt's stored prefix outlives the eviction the insert may need
        return self.store.insert(self.ids, self.cache, self.label, pinned=wanted.path)

    def _bring_in(self, prompt: list[int], reuse: ReuseReport, keep: int) -> ReuseReport:
        """Cut the working cache at `keep`, where it stops matching the prompt, and, when the store or its
        disk tier holds more of the prompt, copy those positions in; the report gains the copy's bytes and
        time (a disk block that does not read back whole is removed, and its positions computed)."""
        self.cache.truncate(keep)
        del self.ids[keep:]
        self._last_match = None
        if reuse.source == "disk":
            t0 = tracing.now()
            got, nbytes, why = self.disk.load(prompt, self.disk_fingerprint, self.cache, keep, reuse.reused)
            self.cache.length = got
            self.ids.extend(prompt[keep:got])
            if why:
                reuse = dataclasses.replace(
                    reuse, reused=got, computed=len(prompt) - got, reason=f"{reuse.reason}; {why}"
                )
            copy_ms = round((tracing.now() - t0) * 1000.0, 3)
            self.store.evict()
            return dataclasses.replace(reuse, copied_positions=got - keep, copied_bytes=nbytes, copy_ms=copy_ms)
        if reuse.source != "store":
            self.store.evict()  # the budget, with nothing pinned now
            return reuse
        t0 = tracing.now()
        match = self.store.match(prompt)
        copied = self.store.copy_into(self.cache, match, keep, reuse.reused)
        self.cache.length = reuse.reused  # positions keep..reused-1 now hold the stored K/V
        self.ids.extend(prompt[keep : reuse.reused])
        self._last_match = match
        self.store.evict()  # the budget again, now that the prefix is copied out
        copy_ms = round((tracing.now() - t0) * 1000.0, 3)
        return dataclasses.replace(reuse, copied_positions=reuse.reused - keep, copied_bytes=copied, copy_ms=copy_ms)

    def _decode_step(self, token: int) -> torch.Tensor:
        """Consume one token: through a CUDA graph where one works, else the eager forward."""
        loaded = self.loaded
        if self._graph is None and self.graph_error is None and graphs_wanted(loaded.device, self.cache):
            try:
                self._graph = GraphDecoder(loaded.model, self.cache)
            except Exception as e:  # capture unsupported here: stay eager, keep the reason
                self.graph_error = f"{type(e).__name__}: {e}"
        if self._graph is not None:
            try:
                return self._graph.step(token)
            except RuntimeError as e:
                self._graph, self.graph_error = None, str(e)
        return loaded.model(torch.tensor([[token]], device=loaded.device), self.cache, last_only=True)

    @property
    def decode_path(self) -> str:
        return "cuda-graph" if self._graph is not None else "eager"

    def _finish(self, trace, reason, out, stream, reuse, stop_strings=(), steps=()):
        tail = stream.finish()
        text = stream.new_text
        if reason == "stop_string":  # the reply ends before the stop string
            text = text[: min(text.find(s) for s in stop_strings if s in text)]
        trace.end = tracing.now()
        trace.status = "cancelled" if reason == "cancelled" else "finished"
        summary = trace.summary()
        if self.disk is not None:  # the reply's blocks copied (~1 ms a few blocks), written on the disk's own thread
            self.disk.save(self.ids, self.disk_fingerprint, self.cache, len(self.ids))
            if summary.get("prefill_tok_s") and trace.computed >= 64:
                self.disk.note_prefill_rate(self.disk_fingerprint, summary["prefill_tok_s"])
        yield Finished(reason, text, tuple(out), summary, self.cache_stats(), reuse, tail, tuple(steps))
