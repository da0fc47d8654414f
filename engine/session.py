"""A chat session: one model, its KV tiers (engine.kv_tiers) and generation as a stream of events.

For each request the session fits the prompt to the cache (engine.request), has the tiers plan and bring in
what K/V they hold of it, prefills the rest in chunks and decodes (engine.generation). Every request reports
what it reused, from where, and what it threw away; its trace is kept for the session's summary.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import torch

from . import trace as tracing
from .devices import dtype_name
from .disk_store import DiskStore
from .drafters import open_drafter
from .errors import CapacityError, EngineError
from .events import Failed, Finished, PrefillDone, PrefillProgress, PrefillStarted, ReuseReport
from .generation import PREFILL_CHUNK, Decoder, RowsWanted, alone, decode, prefill, prefill_chunk_for, warm_up
from .grammar import Guide
from .image_prompt import PromptImages
from .kv_cache import DEFAULT_CAPACITY, KVCache
from .kv_pool import BlockPool
from .kv_tiers import FINGERPRINT_NAMES, KVTiers, fingerprint_change
from .logprobs import check_top_logprobs
from .prefix_store import PrefixStore, default_budget
from .quant import PRECISIONS
from .request import OVERFLOW_POLICIES, Fitted, Request, check_capacity, fit, positions_needed, render, turns
from .speculative import check_tokens, speculate
from .state_cache import HybridCache
from .tool_calls import call_grammar, marker_token, offered_format, parse_calls, template_format
from .weights.loading import LoadedModel, load_model

__all__ = [
    "FINGERPRINT_NAMES",
    "OVERFLOW_POLICIES",
    "PREFILL_CHUNK",
    "Request",
    "Session",
    "fingerprint_change",
    "positions_needed",
    "prefill_chunk_for",
    "turns",
]


def state_facts(cache) -> dict | None:
    """A hybrid's state layers' state, for the panel: their count, the convolution's channels and K − 1, the bytes
    (the same at any length), and their snapshots' spacing and bytes a position; a Mamba-2 layer's also its scan's
    state values (H_m · P · N, in float32 as its convolution inputs are), a gated DeltaNet's its matrix's (H_v · d_k ·
    d_v); None for a cache of K/V alone."""
    if not isinstance(cache, HybridCache):
        return None
    hidden, width = cache.state_shape
    out = {"layers": len(cache.conv), "hidden": hidden, "width": width, "bytes": cache.state_bytes,
           "every": cache.resume_every, "snapshot_bytes_per_position": cache.snapshot_bytes_per_position}  # fmt: skip
    if cache.scans:
        out.update(kind=cache.kind, scan=math.prod(cache.ssm_shape), value_bytes=cache.state.element_size())
    return out


class Session:
    def __init__(
        self,
        loaded: LoadedModel,
        capacity: int | None = None,
        prefill_chunk: int | None = None,
        kv: str = "none",
        cache_budget: int | None = None,
        disk: DiskStore | None = None,
        store: PrefixStore | None = None,
        traces: list | None = None,
        pool: BlockPool | None = None,
        draft_models: dict | None = None,
    ):
        self.prefill_chunk = prefill_chunk  # None: prefill_chunk_for the model's dtype
        # The prefix store's bytes; None: a share of the memory free now; 0: no store.
        budget = 0 if store is not None else default_budget(loaded.device) if cache_budget is None else cache_budget
        self.tiers = KVTiers(budget, disk, store, pool)
        self.kv = kv  # KV cache precision: none (the model dtype) | int8 | int4
        self.capacity_setting = capacity
        self.traces: list[tracing.RequestTrace] = [] if traces is None else traces
        self.turn_budget = None  # the scheduler's prompt positions for a prefill forward now (None: the chunk)
        self.turn_rows = None  # the scheduler's prompt positions to ride as rows of its batched step (None: none)
        self._drafter = None  # (kind, the model it drafts for, the drafter) of speculative requests
        self.draft_models = {} if draft_models is None else draft_models  # (path, weights, options) -> (for, draft)
        self.loaded: LoadedModel | None = None
        self._decoder: Decoder | None = None
        self.set_model(loaded, capacity)

    def sibling(self) -> Session:
        """Another session on this one's model, capacity, precision and chunk, with a working cache of its own
        over this one's KV pool, prefix store, disk tier and traces: a sequence of its own beside this one's (a lane
        of engine.batching), whose blocks a prompt they share is held in once."""
        return Session(self.loaded, self.capacity_setting, self.prefill_chunk, self.kv, disk=self.tiers.disk_tier,
                       store=self.store, traces=self.traces, pool=self.pool,
                       draft_models=self.draft_models)  # fmt: skip

    def same_setup(self, other: Session) -> bool:
        """Whether `other` runs this session's model, capacity, KV precision and chunk over its store and disk
        tier (a sibling made before a change of them is made again)."""
        same = (self.loaded, self.store, self.tiers.disk_tier, self.pool)
        if any(a is not b for a, b in zip(same, (other.loaded, other.store, other.tiers.disk_tier, other.pool))):
            return False
        return (self.capacity_setting, self.kv, self.prefill_chunk) == (other.capacity_setting, other.kv,
                                                                        other.prefill_chunk)  # fmt: skip

    # --- model and cache ------------------------------------------------------------
    def set_model(self, loaded: LoadedModel, capacity: int | None = None, kv: str | None = None) -> None:
        """Use another model (or dtype/device/precision): the next request reports the cache dropped and why.
        `capacity` None or 0 is the model's default (never the capacity asked before: that was a setting)."""
        asked = capacity or None
        capacity = asked or min(loaded.config.max_position_embeddings, DEFAULT_CAPACITY)
        if capacity < 2:
            raise EngineError("KV capacity must be at least 2 positions")
        kv = kv or self.kv
        if kv not in PRECISIONS:
            raise EngineError(f"KV precision {kv!r} is not supported (supported: {', '.join(PRECISIONS)})")
        self.tiers.set_model(loaded, capacity, kv, self.prefill_chunk or prefill_chunk_for(loaded.dtype))
        self._decoder = Decoder(loaded, self.tiers.cache)  # a captured step belongs to one model and one cache
        self.release_drafter()
        if any(held[0] is not loaded for held in getattr(self, "draft_models", {}).values()):
            self.draft_models.clear()  # drafts for another model
        self.loaded, self.capacity_setting, self.kv = loaded, asked, kv
        self.warm_up_ms: float | None = None

    def warm_up(self) -> float:
        """Run the model once off any request (generation.warm_up): the first request's TTFT is then its own."""
        self.warm_up_ms = warm_up(self.loaded, self.kv)
        return self.warm_up_ms

    @property
    def cache(self) -> KVCache:
        return self.tiers.cache

    @property
    def pool(self) -> BlockPool | None:
        """The KV pool the working cache's blocks come from (None: a sliding-window cache of its own)."""
        return self.tiers.pool

    @property
    def ids(self) -> list[int]:
        """Token ids whose K/V are in the working cache; len(ids) == cache.length."""
        return self.tiers.ids

    @property
    def store(self) -> PrefixStore:
        return self.tiers.store

    @property
    def label(self) -> str | None:
        return self.tiers.label

    @property
    def disk(self) -> DiskStore | None:
        return self.tiers.disk

    @property
    def disk_fingerprint(self) -> dict:
        return self.tiers.disk_fingerprint

    @property
    def pending_drop_reason(self) -> str | None:
        return self.tiers.pending_drop_reason

    @property
    def graph_error(self) -> str | None:
        """Why decode stays eager on CUDA, if it does."""
        return self._decoder.error

    @property
    def decode_path(self) -> str:
        return self._decoder.path

    def reset(self) -> None:
        """Empty the cache and the prefix store (a person's /reset); the next request prefills from scratch."""
        self.tiers.reset()

    def set_disk(self, disk: DiskStore | None) -> None:
        self.tiers.set_disk(disk)

    def flush(self, timeout: float = 30.0) -> bool:
        return self.tiers.flush(timeout)

    def set_cache_budget(self, budget: int | None) -> None:
        """The prefix store's budget in bytes (None: the default share of free memory); evicts to fit."""
        self.tiers.store.set_budget(default_budget(self.loaded.device) if budget is None else budget)

    def cache_stats(self) -> dict:
        return self.tiers.stats()

    def facts(self) -> dict:
        """The model's facts with this session's cache: capacity, precision, bytes per position, stats."""
        c = self.cache
        kinds = c.kinds()
        return {
            **self.loaded.facts(self.kv),
            "capacity": c.capacity,
            "kv_bytes_per_position": c.bytes_per_position,
            "kv_allocated_bytes": c.full_bytes,  # at its capacity (a pool's sequence: its blocks then)
            "kv_pool": None if self.pool is None else self.pool.stats(),
            # a sliding-window cache: the layers of each kind and the positions each keeps at most (None: one kind);
            # a hybrid's: its attention layers (its others keep a state: `state`)
            "kv_layer_kinds": [
                {k: d[k] for k in ("kind", "layers", "window", "slots")} for d in kinds if "state_bytes" not in d
            ]  # fmt: skip
            if kinds is not None
            else None,
            "state": state_facts(c),
            "cache": self.cache_stats(),
            "fingerprint": dict(self.loaded.fingerprint),
            "cache_dropped": self.pending_drop_reason,
            "warm_up_ms": self.warm_up_ms,
            # the format its chat template teaches tool calls in (engine.tool_calls); None: it takes no tools
            "tool_format": getattr(template_format(self.loaded.tokenizer.chat_template_source), "name", None),
        }

    # --- the request against this cache -------------------------------------------------
    def tokenize(self, req: Request) -> list[int]:
        """The prompt's token ids, the reply's forced start (`reply_ids`) after them."""
        return render(self.loaded.tokenizer, req).ids + list(req.reply_ids)

    def fit(self, req: Request) -> Fitted:
        return fit(self.loaded.tokenizer, req, self.cache.capacity)

    def check_capacity(self, prompt_len: int, req: Request) -> None:
        check_capacity(prompt_len, req, self.cache.capacity)

    def plan_reuse(self, prompt: list[int]) -> ReuseReport:
        return self.tiers.plan(prompt)

    def cached_positions(self, req: Request, fitted: Fitted | None = None) -> dict:
        """How much of a request's prompt is cached now, without running it: `positions` of the prompt,
        `cached` (the longest prefix held), `source` (working | store | disk | none). For a conversation
        shown again before anything is sent. Under an overflow policy, the prompt it would send: `dropped_messages`
        and `dropped_positions` say what it leaves out (a prompt that cannot fit even so: `error`, and `refused`: Send
        would be refused, not merely unanswered). `fitted`: the request already fitted by a session of this one's
        setup (a sibling lane's: the same prompt, not tokenized again)."""
        try:
            fitted = fitted or self.fit(req)
        except CapacityError as e:
            return {"error": str(e), "refused": True}
        out = self.tiers.held(fitted.ids, self._prefill_rates())
        if fitted.dropped_positions:
            out.update(dropped_messages=list(fitted.dropped), dropped_positions=fitted.dropped_positions)
        return out

    def _prefill_rates(self) -> list[float]:
        """This session's prefill rates of requests that computed 64 positions or more."""
        measured = (t.summary().get("prefill_tok_s") for t in self.traces if (t.computed or 0) >= 64)
        return [r for r in measured if r]

    # --- generation -------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, req: Request, cancel: threading.Event | None = None) -> Iterator:
        """The request's events, its decode steps run one by one as they come (a generation on its own)."""
        yield from alone(self.steps(req, cancel))

    @torch.inference_mode()
    def steps(self, req: Request, cancel: threading.Event | None = None, trace=None, fitted: Fitted | None = None):
        """The request's events and, between them, a StepWanted for each decode step, to be sent its logits: what
        a scheduler running many sequences' steps together drives (engine.batching). `trace`: the request's
        RequestTrace, when the scheduler made it (its queue wait began before this call); `fitted`: its prompt as
        the scheduler fitted it to admit it (a session of this one's setup), not fitted again."""
        if trace is None:
            trace = tracing.RequestTrace.of(req)
        trace.started = tracing.now()
        self.traces.append(trace)
        cancel = cancel or threading.Event()
        try:
            yield from self._generate(req, cancel, trace, fitted)
        except (EngineError, ValueError, RuntimeError, MemoryError) as e:
            trace.status, trace.end, trace.error = "failed", tracing.now(), str(e)
            if isinstance(e, RuntimeError) and "out of memory" in str(e).lower():
                trace.error = f"out of memory: {e}"
            yield Failed(trace.error, type(e).__name__, trace.summary(), self.cache_stats())

    def _generate(self, req: Request, cancel: threading.Event, trace: tracing.RequestTrace, fitted: Fitted | None):
        loaded, tiers = self.loaded, self.tiers
        fitted = fitted or self.fit(req)
        prompt = fitted.ids
        trace.tokenized = tracing.now()
        if not prompt:
            raise EngineError("the prompt is empty")
        self.check_capacity(len(prompt), req)
        check_top_logprobs(req.top_logprobs)
        calling = offered_format(loaded.tokenizer, req, loaded.name)  # the family's format, where tools are offered
        grammar = req.grammar
        if calling is not None and req.tool_choice not in ("none", "auto"):  # a call must come: in its schema
            grammar = call_grammar(calling, req.tools, req.tool_choice, req.parallel_tool_calls,
                                   marker_token(loaded.tokenizer, calling), loaded.tokenizer.harmony)  # fmt: skip
        guide = None
        if grammar is not None:  # compiled before anything is computed: a grammar that does not says why
            guide = Guide(grammar, loaded.tokenizer, loaded.config.vocab_size,
                          overlap=torch.device(loaded.device).type != "cpu")  # fmt: skip
        pictures = None
        if fitted.chat.images:  # the images' encoder runs as the prefill meets their first uncached position
            pictures = PromptImages(loaded.vision, loaded.tokenizer.images, fitted.chat.images, prompt)
        elif min(prompt) < 0:  # an image's ids without the image (a prompt given as ids): nothing to compute them from
            raise EngineError("the prompt holds an image's positions but not the image; send the messages instead")
        drafter = None
        # drafts are refused before anything is computed (a draft that cannot draft says why); none with images
        if req.speculative and guide is None and pictures is None:
            check_tokens(req.draft_tokens)
            t0 = tracing.now()
            drafter = self.drafter(req.speculative)
            trace.draft_load_ms = round((tracing.now() - t0) * 1000.0, 3)
        reuse = tiers.prepare(prompt, req.label, fitted, req.overflow)
        trace.prompt_tokens, trace.reused, trace.computed = len(prompt), reuse.reused, reuse.computed
        stream = loaded.tokenizer.stream(req.reply_ids)  # a forced start: the reply's text goes on from it
        yield PrefillStarted(len(prompt), reuse, tuple(prompt), stream.text, fitted.chat.spans, trace.lane)

        trace.prefill_start = tracing.now()
        full = self.prefill_chunk or prefill_chunk_for(loaded.dtype)
        budget = self.turn_budget
        chunk = (lambda: min(full, budget() or full)) if budget is not None else full
        logits = None  # [1, 1, V]: the prompt's last position's, which select token 1
        todo = prompt[reuse.reused :]
        pieces = prefill(loaded.model, tiers.cache, tiers.ids, todo, chunk, loaded.device, pictures, self.turn_rows)
        answer = None
        while True:
            try:
                item = pieces.send(answer)
            except StopIteration:
                break
            answer = None
            if isinstance(item, RowsWanted):  # the positions ride in the scheduler's next batched step
                answer = yield item
                continue
            done, last = item
            if last is not None:  # (None: an encoder layer of an image ran, no position yet)
                logits = last
                trace.prefill_chunks += 1
            if done < reuse.computed:
                yield PrefillProgress(done, reuse.computed, tiers.cache.length)
                if cancel.is_set():
                    return (yield from self._finish(trace, "cancelled", [], stream, reuse))
        trace.prefill_end = tracing.now()
        if pictures is not None:
            trace.vision_ms = round(pictures.seconds * 1000, 3)
            trace.images = {"images": len(fitted.chat.images), "positions": sum(t < 0 for t in prompt),
                            "encoded": pictures.encoded, "encoder_ms": trace.vision_ms}  # fmt: skip
        if req.share_prompt:  # the n choices of one request: the others copy this prefill from the store
            self.store.insert(tiers.ids, tiers.cache, req.label)
        yield PrefillDone(reuse.reused, reuse.computed, trace.prefill_end - trace.prefill_start, tiers.cache.length)

        args = (req, logits, self._decoder, tiers.ids, loaded.tokenizer, stream, trace, cancel)
        if drafter is not None:
            reply = yield from speculate(*args, drafter, req.draft_tokens)
        else:
            reply = yield from decode(*args, guide)
        if guide is not None:
            trace.grammar = guide.summary(reply.masks)
        calls = None
        if calling is not None:  # the calls read back out of the reply, in its own format (control tokens kept)
            calls = parse_calls(calling, loaded.tokenizer.decode(reply.out, skip_special_tokens=False))
        yield from self._finish(trace, reply.reason, reply.out, stream, reuse, req.stop_strings, reply.steps,
                                reply.drafts if drafter is not None else (), reply.masks, calls)  # fmt: skip

    def drafter(self, kind: str):
        """The drafter for speculative requests of `kind` (engine.drafters.open_drafter), made once and kept while
        the model stays: an int4 copy or a draft model is loaded on its first request, on this (the engine's)
        thread."""
        if self._drafter is not None and self._drafter[0] == kind and self._drafter[1] is self.loaded:
            return self._drafter[2]
        self.release_drafter()
        loaded = self.loaded

        def load(path, weights, **options):  # one draft model for every lane of this model (each its own cache)
            key = (str(path), weights, tuple(sorted(options.items())))
            held = self.draft_models.get(key)
            if held is None or held[0] is not loaded:
                held = (loaded, load_model(path, str(loaded.device), dtype_name(loaded.dtype), weights, **options))
                self.draft_models[key] = held
            return held[1]

        made = open_drafter(kind, loaded, self.cache.capacity, load)
        self._drafter = (kind, loaded, made)
        return made

    def release_drafter(self) -> None:
        if self._drafter is not None:
            self._drafter[2].release()
            self._drafter = None

    def _finish(self, trace, reason, out, stream, reuse, stop_strings=(), steps=(), drafts=(), masks=(), calls=None):
        tail = stream.finish()
        text = stream.new_text
        tool_calls = ()
        if calls is not None:  # a request that offered tools: its content is the text before any calls, trimmed
            text, tool_calls = calls[0].strip(), tuple(calls[1])
        if reason == "stop_string" and any(s in text for s in stop_strings):  # the reply ends before the stop string
            text = text[: min(text.find(s) for s in stop_strings if s in text)]
        trace.end = tracing.now()
        trace.status = "cancelled" if reason == "cancelled" else "finished"
        summary = trace.summary()
        self.tiers.save(summary.get("prefill_tok_s"), trace.computed)
        yield Finished(reason, text, tuple(out), summary, self.cache_stats(), reuse, tail, tuple(steps), tuple(drafts),
                       tuple(masks), tool_calls)  # fmt: skip
