"""Where a request's K/V come from: the tiers behind one object — the working cache the model attends over,
the prefix store of what earlier requests' working cache held, and its disk tier — with the token ids each
holds, the fingerprint they are valid under, and reuse planning over all three.

For each prompt it keeps the longest prefix the working cache holds (never the prompt's last position: its
logits pick token 1), or copies in more from the store or the disk, and cuts the working cache where it stops
matching; before positions of the working cache are thrown away the store takes them. A change of weights,
dtype, tokenizer, rotary or attention settings, KV precision or device empties the cache and the store, and
the next report says why.
"""

from __future__ import annotations

import dataclasses

import torch

from . import trace as tracing
from .disk_store import DiskStore
from .events import ReuseReport
from .kv_cache import KVCache, make_cache, ring_slots
from .kv_pool import BlockPool, PagedKVCache, blocks_for
from .prefix_store import PrefixStore, common_prefix
from .request import Fitted

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


def fingerprint_change(old: dict | None, new: dict) -> str | None:
    """Why K/V cached under `old` are no longer valid under `new`, in words; None when they are."""
    if old is None or old == new:
        return None
    parts = []
    for k in (k for k in new if old.get(k) != new.get(k)):
        name, a, b = FINGERPRINT_NAMES.get(k, k), old.get(k), new.get(k)
        parts.append(f"{name} changed" if k in ("weights", "tokenizer") else f"{name} changed ({a} → {b})")
    return "cache dropped: " + ", ".join(parts)


def _joined(reason: str | None, note: str) -> str:
    return f"{reason}; {note}" if reason else note


class KVTiers:
    """The working cache, the prefix store and the disk tier of one session, and the ids the cache holds
    (len(ids) == cache.length)."""

    def __init__(self, budget: int, disk: DiskStore | None = None, store: PrefixStore | None = None,
                 pool: BlockPool | None = None):  # fmt: skip
        self.store = store if store is not None else PrefixStore(budget)  # given: shared with other sessions' tiers
        self.pool = pool  # the KV pool the working cache takes its blocks from (given: shared with other sessions')
        self._disk = disk  # the store's disk tier (blocks written after each request, read back on a return)
        self.cache: KVCache | None = None
        self.ids: list[int] = []  # token ids whose K/V are in the cache
        self.label: str | None = None  # the label of the request whose prompt the working cache holds
        self.tok = None  # the tokenizer: the reports' token texts, the store's picture
        self._kernels = "torch"  # the decode kernels that computed the positions (part of the disk's fingerprint)
        self._fingerprint: dict | None = None
        self._dropped: tuple[str, list[int]] | None = None  # (reason, ids) of a cache emptied by a change
        self._last_match = None  # what the last request took from the store (for the picture)

    # --- the model they hold K/V for ----------------------------------------------------------
    def set_model(self, loaded, capacity: int, kv: str, chunk: int) -> None:
        """K/V for another model (or dtype/device/precision/capacity): what no longer holds is dropped, with
        the reason kept for the next report; a cache of another size keeps its K/V in the store."""
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
        if self.cache is None or reason is not None:
            if self.cache is not None:
                self.cache.release()  # its blocks back to the pool (those the store took stay held there)
            self.cache = None  # free the old buffers before allocating the new
            if not self._pool_serves(loaded, kv) or fingerprint_change(self._fingerprint, fingerprint):
                self.pool = None
            if ring_slots(loaded.config, capacity, chunk) is not None or any(loaded.config.state_layers):
                # a sliding layer's ring, a hybrid's states: a cache of its own
                self.cache = make_cache(loaded.config, capacity, loaded.dtype, loaded.device, kv, chunk)
            else:
                if self.pool is None:
                    self.pool = BlockPool(loaded.config, loaded.dtype, loaded.device, kv)
                self.pool.limit = max(self.pool.limit or 0, blocks_for(capacity))  # one sequence at least
                self.pool.lend(self.store)
                self.cache = PagedKVCache(self.pool, capacity)
            self.ids = []
        k = loaded.kernels
        self._kernels = f"{k.isa}/{k.int_isa}/{k.variant}" if k is not None else "torch"
        self.tok, self._fingerprint = loaded.tokenizer, fingerprint

    def _pool_serves(self, loaded, kv: str) -> bool:
        """Whether the pool held holds K/V of this model's shape, dtype, device and precision."""
        p = self.pool
        return p is not None and (p.config, p.dtype, p.device, p.kv) == (loaded.config, loaded.dtype,
                                                                         torch.device(loaded.device), kv)  # fmt: skip

    @property
    def pending_drop_reason(self) -> str | None:
        """Why the cache was emptied by the last model change (reported with the next request)."""
        return self._dropped[0] if self._dropped else None

    def park(self) -> None:
        """The working cache's positions to the store (a pool's blocks by reference), the cache emptied: its blocks
        are the store's to keep or give back. The next request finds them there."""
        if self.ids and self.store.budget:
            self.store.insert(self.ids, self.cache, self.label)
        self.cache.truncate(0)
        self.ids = []

    def reset(self) -> None:
        """Empty the cache and the store; the next request prefills from scratch."""
        self.cache.truncate(0)
        self.ids = []
        self._dropped = None
        self.store.clear()
        self._last_match = None

    # --- the disk tier ------------------------------------------------------------------------
    @property
    def disk_fingerprint(self) -> dict:
        """What K/V on disk are valid under: the cache's fingerprint and the decode kernels that computed the
        reply's positions (another build rounds differently)."""
        return {**self._fingerprint, "kernels": self._kernels}

    @property
    def disk(self) -> DiskStore | None:
        """The disk tier where it serves this cache: not for a sliding-window cache (its files hold every layer's
        positions; a ring's are not all there)."""
        return None if self.cache.windowed else self._disk

    @property
    def disk_tier(self) -> DiskStore | None:
        """The disk tier set (`disk`: where it serves this cache)."""
        return self._disk

    def set_disk(self, disk: DiskStore | None) -> None:
        """Another disk tier (or none): what was queued for the old one is written first."""
        if self._disk is not None and self._disk is not disk:
            self._disk.flush(5.0)
        self._disk = disk

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait for the disk tier's writer (at exit): False when it had not finished in `timeout`."""
        return self._disk.flush(timeout) if self._disk is not None else True

    def save(self, prefill_tok_s: float | None, computed: int) -> None:
        """After a reply: its blocks copied (~1 ms a few blocks), written on the disk's own thread; the prefill
        rate kept beside them, for the cost of a later return."""
        if self.disk is None:
            return
        self.disk.save(self.ids, self.disk_fingerprint, self.cache, len(self.ids))
        if prefill_tok_s and computed >= 64:
            self.disk.note_prefill_rate(self.disk_fingerprint, prefill_tok_s)

    # --- what they hold ------------------------------------------------------------------------
    def stats(self) -> dict:
        s = self.cache.stats()
        s["bytes_per_position"] = self.cache.bytes_per_position
        on_disk = self.disk.chain(self.disk_fingerprint) if self.disk is not None else None
        held = self.disk.held(self.ids, self.disk_fingerprint) if self.disk is not None else 0
        s["store"] = {
            **self.store.stats(),
            "tree": self._tree_with_text(self.store.tree(self._last_match, (self.ids, self.label, held), on_disk)),
            "working_label": self.label,
        }
        if self.disk is not None:
            s["store"]["disk"] = self.disk.stats(self.disk_fingerprint)
        elif self._disk is not None:
            s["store"]["disk_off"] = "not for a sliding-window cache: its sliding layers keep only their last positions"
        return s

    def _tree_with_text(self, segments: list[dict]) -> list[dict]:
        """The store's tree with each segment's first ids as `text` (what it starts with, where it parts
        from its siblings), so that two prompts of the same title are told apart."""
        tok = self.tok
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

    def held(self, prompt: list[int], prefill_rates: list[float]) -> dict:
        """How much of `prompt` is held now, without running it: `cached` (the longest prefix held) and `source`
        (working | store | disk | none); for the disk, what returning costs against prefilling."""
        w = common_prefix(self.ids, prompt)
        m = self.store.match(prompt, touch=False).length
        source = "none" if max(w, m) == 0 else "working" if w >= m else "store"
        out = {"positions": len(prompt), "cached": max(w, m), "source": source}
        if self.disk is not None:
            d = self.disk.held(prompt, self.disk_fingerprint)
            if d > out["cached"]:
                out.update(cached=d, source="disk", **self._return_cost(prompt, max(w, m), d, prefill_rates))
        return out

    def _return_cost(self, prompt: list[int], near: int, on_disk: int, prefill_rates: list[float]) -> dict:
        """What returning to a prompt held on disk costs, both measured here: reading its positions past what
        memory holds (the disk's read rate so far, or one block read now) against prefilling them (this
        session's median prefill rate, or the one an earlier run measured; None before any of 64 positions)."""
        rate = self.disk.read_rate or self.disk.measure_read(prompt, self.disk_fingerprint)
        nbytes = (on_disk - near) * self.cache.bytes_per_position
        rates = sorted(prefill_rates) or [r for r in [self.disk.prefill_rate(self.disk_fingerprint)] if r]
        return {
            "disk_read_ms": None if not rate else round(nbytes / rate * 1000.0, 1),
            "prefill_ms": None if not rates else round((on_disk - near) / rates[len(rates) // 2] * 1000.0, 1),
        }

    # --- planning and bringing in a prompt's K/V ------------------------------------------------
    def prepare(self, prompt: list[int], label: str | None, fitted: Fitted, overflow: str) -> ReuseReport:
        """Everything before prefill: the store takes what the working cache is about to lose, the reuse is
        planned over the three tiers, the working cache is cut where it stops matching and what the store or
        the disk holds beyond that is copied in. `fitted`: what the overflow policy left out."""
        keep = self.keep(prompt)  # what the working cache keeps
        t0 = tracing.now()
        stashed = self._stash(prompt, keep)
        stash_ms = round((tracing.now() - t0) * 1000.0, 3) if stashed else None
        reuse = self.plan(prompt)
        note = fitted.note(overflow)
        reuse = dataclasses.replace(
            reuse,
            stashed_bytes=stashed,
            stash_ms=stash_ms,
            dropped_positions=fitted.dropped_positions,
            dropped_messages=fitted.dropped,
            reason=f"{note}; {reuse.reason}" if note and reuse.reason else note or reuse.reason,
            overflow=overflow,
        )
        self._dropped = None
        reuse = self._bring_in(prompt, reuse, keep)
        self.label = label
        return reuse

    def plan(self, prompt: list[int]) -> ReuseReport:
        """What this prompt may keep of the working cache (the common prefix, capped at len(prompt) - 1)
        and, where the store holds more, how much more it supplies (`source` "store"), or its disk tier
        (`source` "disk"; the disk is keyed by the fingerprint, so it serves after a change of model too)."""
        report = self._plan_working(prompt)
        match = self.store.match(prompt, touch=False) if self._dropped is None else None
        held = self._resumable(min(match.length, len(prompt) - 1)) if match else 0
        while held > report.reused and not self._store_resumes(match, held):
            held -= self.cache.resume_every  # a hybrid's block without its snapshot: the one before
        if held > report.reused and not self.store.whole(
            match, max(report.reused, self.cache.restore_needs(held)), held
        ):
            held = 0  # a sliding layer's window before `held` is not in the store (taken after it slid out)
        on_disk = min(self.disk.held(prompt, self.disk_fingerprint), len(prompt) - 1) if self.disk else 0
        on_disk = self._resumable(on_disk)
        source, more = "store", held
        if on_disk > max(held, report.reused):
            source, more = "disk", on_disk
        if more > report.reused:
            where = "taken from the prefix store" if source == "store" else "read from the disk tier"
            return dataclasses.replace(
                report,
                reused=more,
                computed=len(prompt) - more,
                reason=_joined(report.reason, f"positions {report.reused}–{more - 1} {where}"),
                source=source,
                stored_prefix=match.length if match else 0,
            )
        if self.disk is not None and report.reused < len(prompt) - 1:
            other = self.disk.other_fingerprint(prompt, self.disk_fingerprint)
            change = fingerprint_change(other, self.disk_fingerprint) if other else None
            if change:  # on disk, but computed under other settings: not used, and said why
                note = "on disk for other settings, not used: " + change.removeprefix("cache dropped: ")
                report = dataclasses.replace(report, reason=_joined(report.reason, note))
        if self._dropped is not None:
            return report
        return dataclasses.replace(
            report, source="none" if report.reused == 0 else "working", stored_prefix=match.length
        )

    def _plan_working(self, prompt: list[int]) -> ReuseReport:
        tok = self.tok
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
        reused = self.keep(prompt, lcp)
        invalidated = len(cached) - reused
        if invalidated == 0:
            return ReuseReport(reused, len(prompt) - reused, 0, None, None, None, None)
        if lcp == cut:
            reason = f"prompt differs from the cache at position {cut}"
        else:
            reason = f"position {cut} is the prompt's last: recomputed for the logits of token 1"
        if reused < cut and getattr(self.cache, "resume_every", 1) > 1:
            reason += (
                f"; positions {reused}–{cut - 1} recomputed too: the {len(self.cache.conv)} {self.cache.layer_words} "
                f"keep their state, and a snapshot of it every {self.cache.resume_every} positions; the last before "
                f"{cut} is at {reused}"
            )
        elif reused < cut:
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
            slid_out=cut - reused if self.cache.windowed else 0,
        )

    def keep(self, prompt: list[int], lcp: int | None = None) -> int:
        """What the working cache keeps of this prompt: the common prefix (`lcp`, when the caller has it), capped at
        len(prompt) − 1, or 0 where a sliding layer's ring no longer holds the window before that point
        (WindowedKVCache.resumable)."""
        keep = self._resumable(min(common_prefix(self.ids, prompt) if lcp is None else lcp, len(prompt) - 1))
        return keep if self.cache.resumable(keep) else 0

    def _resumable(self, n: int) -> int:
        """n, or the position before it the cache can go on from (a hybrid's last snapshot: HybridCache)."""
        return n - n % getattr(self.cache, "resume_every", 1)

    def _store_resumes(self, match, n: int) -> bool:
        """Whether the stored blocks bring a hybrid's state at n: the block that ends there carries its snapshot
        (the last of its tensors; a cache of K/V alone needs none)."""
        if getattr(self.cache, "snapshot_held", None) is None:
            return True
        node = next((node for node in match.path if node.end == n), None)
        return node is not None and bool(node.tensors) and node.tensors[-1] is not None

    def _held_back(self, got: int, keep: int) -> int:
        """Where positions brought in up to `got` stop short of a point the cache can go on from (a hybrid's
        snapshot, when a disk block came without its own): the last such point from `keep` on."""
        held = getattr(self.cache, "snapshot_held", None)
        got = self._resumable(got)
        while got > keep and held is not None and not held(got):
            got -= self.cache.resume_every
        return max(got, keep)

    def _stash(self, prompt: list[int], keep: int) -> int:
        """Before the working cache loses a block or more of positions to this prompt (it keeps `keep`),
        the store takes its whole content (only the blocks it lacks are copied); returns the bytes it added."""
        if len(self.ids) - keep < self.store.block:
            return 0  # a few positions (the end of the last reply): recomputing them costs less than keeping
        wanted = self.store.match(prompt)  # this prompt's stored prefix outlives the eviction the insert may need
        return self.store.insert(self.ids, self.cache, self.label, pinned=wanted.path)

    def _bring_in(self, prompt: list[int], reuse: ReuseReport, keep: int) -> ReuseReport:
        """Cut the working cache at `keep`, where it stops matching the prompt, and, when the store or its
        disk tier holds more of the prompt, bring those positions in (the store's pool blocks by reference, the
        rest copied); the report gains what was shared, the copy's bytes and the time (a disk block that does not
        read back whole is removed, and its positions computed)."""
        self.cache.truncate(keep)
        del self.ids[keep:]
        self._last_match = None
        if reuse.source == "disk":
            t0 = tracing.now()
            got, nbytes, why = self.disk.load(prompt, self.disk_fingerprint, self.cache, keep, reuse.reused)
            got = self._held_back(got, keep)
            self.cache.length = got
            self.ids.extend(prompt[keep:got])
            if why:  # the plan's words say what was read, not what was planned
                planned = f"positions {keep}–{reuse.reused - 1} read from the disk tier"
                read = f"positions {keep}–{got - 1} read from the disk tier" if got > keep else ""
                words = [w for w in (reuse.reason or "").split("; ") if w and w != planned]
                reason = "; ".join([*words, *([read] if read else []), why])
                reuse = dataclasses.replace(reuse, reused=got, computed=len(prompt) - got, reason=reason)
            copy_ms = round((tracing.now() - t0) * 1000.0, 3)
            self.store.evict()
            return dataclasses.replace(reuse, copied_positions=got - keep, copied_bytes=nbytes, copy_ms=copy_ms)
        if reuse.source != "store":
            self.store.evict()  # the budget, with nothing pinned now
            return reuse
        t0 = tracing.now()
        match = self.store.match(prompt)
        copied, shared = self.store.copy_into(self.cache, match, keep, reuse.reused)
        self.cache.length = reuse.reused  # positions keep..reused-1 now hold the stored K/V
        self.ids.extend(prompt[keep : reuse.reused])
        self._last_match = match
        self.store.evict()  # the budget again, now that the prefix is copied out
        copy_ms = round((tracing.now() - t0) * 1000.0, 3)
        n = reuse.reused - keep
        how = f"{shared:,} by reference, {n - shared:,} copied" if shared < n else f"all {n:,} by reference"
        planned = f"positions {keep}–{reuse.reused - 1} taken from the prefix store"
        reason = (reuse.reason or "").replace(planned, f"{planned} ({how})") if shared else reuse.reason
        return dataclasses.replace(reuse, copied_positions=n, copied_bytes=copied, shared_positions=shared,
                                   copy_ms=copy_ms, reason=reason)  # fmt: skip
