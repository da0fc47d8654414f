"""The context map's content, without Qt: what each position of the KV cache holds after the last request
(or during it), where that request got it — kept from the working cache, taken from the prefix store,
computed now, decoded now — what it threw away, and which message each position belongs to.

It is filled from the streaming request's own engine events (the reuse report, prefill progress, tokens), so
the map describes the cache as it is now; its caption names the request that left it so.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import Counter
from collections.abc import Callable

from engine.events import Failed, Finished, PrefillDone, PrefillProgress, PrefillStarted, Token
from engine.images import image_runs

from .panel_words import state_layers

ORIGINS = {
    "kept": "kept from the working cache",
    "copied": "taken from the prefix store",
    "disk": "read from the disk tier",
    "computed": "computed now (prefill)",
    "generated": "decoded now (the reply)",
    "pending": "to be computed (prefill under way)",
    "invalidated": "thrown away (invalidated, not refilled)",
    "rejected": "thrown away: drafted, rejected by the model (its last round)",
    "empty": "free",
}  # where a position's K/V came from in the last request, in words
ROLES = {
    "system": "system prompt",
    "user": "your message",
    "assistant": "an earlier reply",
    "reply": "this reply",
    "template": "the template's own tokens",
    "call": "a tool call (as the template writes it)",
    "tool": "a tool's result",
    "image": "an image (the vision encoder's rows)",
}  # whose text a position holds
REMOTE = "a remote server's cache is its own: not reported by this server"
ROLE_OF = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}  # a message's role, mapped


@dataclasses.dataclass
class CacheMap:
    """The cache's positions after (or during) the last request: their origin and their message."""

    capacity: int = 0
    length: int = 0  # positions the cache holds now
    prompt: int = 0  # the request's prompt positions (a fork's kept reply tokens included)
    reply_from: int = 0  # where the reply's own positions start (a fork's kept tokens are the reply's)
    kept: int = 0  # [0, kept): kept from the working cache
    reused: int = 0  # [kept, reused): taken from the prefix store, or read from its disk tier
    reused_from: str = "copied"  # which of the two
    computed_to: int = 0  # [reused, computed_to): computed so far by the prefill
    held_before: int = 0  # the working cache's length before the request: [length, held_before) was thrown away
    first_invalidated: int | None = None
    changed: tuple[str, str] | None = None  # (cached, new) token text at the first invalidated position
    ids: list = dataclasses.field(default_factory=list)  # token id at each position (prompt, then the reply's)
    old_ids: list = dataclasses.field(default_factory=list)  # what the cache held before (for thrown-away ones)
    spans: tuple = ()  # each request message's own text as positions [first, end)
    messages: tuple = ()  # (role, text) of each request message
    caption: str = "empty: nothing cached yet"  # which request left the cache so
    running: bool = False
    forced: int = 0  # the running request's reply starts with this many given tokens (a fork)
    rejected: int = 0  # [length, length + rejected): drafted positions the last round wrote and threw away
    next_caption: str = ""  # the caption once the running request's prefill starts
    images: dict = dataclasses.field(default_factory=dict)  # an image's key -> (its number, its words)
    reported: bool = True  # False: a remote server, whose cache is its own
    snapshot_every: int = 0  # a hybrid's: its state layers' state kept every this many positions (0: no state)
    state_layers: str = "convolution layers"  # a hybrid's state layers in words
    version: int = 0  # bumped on every change: the view redraws only then

    # --- filled by the chat controller ---------------------------------------------------------------
    def start(self, messages: list[dict], forced: int, caption: str) -> None:
        """A request is about to run over `messages`; its reply starts with `forced` tokens (a fork)."""
        self.messages = tuple(("call" if m.get("tool_calls") else ROLE_OF.get(m.get("role"), "template"),
                               str(m.get("content") or "")) for m in messages)  # fmt: skip
        self.forced, self.next_caption = forced, caption
        pictures = [im for m in messages for im in (m.get("images") or ())]
        self.images = {im.key: (n + 1, im.describe()) for n, im in enumerate(pictures)} | {
            k: v for k, v in self.images.items() if k not in {im.key for im in pictures}
        }  # the images the cache may still hold from before are named too
        self.version += 1

    def apply(self, ev) -> None:
        """Take one of the streaming request's engine events."""
        if isinstance(ev, PrefillStarted):
            r = ev.reuse
            self.reported = bool(ev.prompt_token_ids) and r.source not in ("unknown", "server")
            self.old_ids = self.ids
            self.ids = list(ev.prompt_token_ids)
            self.prompt, self.spans = ev.prompt_tokens, tuple(ev.message_spans)
            self.reply_from = self.prompt - self.forced
            self.kept, self.reused = r.reused - r.copied_positions, r.reused
            self.reused_from = "disk" if r.source == "disk" else "copied"
            self.computed_to = self.length = r.reused
            first = r.first_invalidated_position
            self.first_invalidated = first
            self.held_before = (first if first is not None else self.kept) + r.invalidated
            ct, nt = r.cached_token, r.new_token
            self.changed = (ct["text"], nt["text"]) if ct and nt else None
            self.caption = f"Filling for {self.next_caption}" if self.reported else REMOTE
            self.running = True
        elif isinstance(ev, PrefillProgress):
            self.computed_to, self.length = self.reused + ev.done, ev.cache_positions
        elif isinstance(ev, PrefillDone):
            self.computed_to, self.length = self.prompt, ev.cache_positions
        elif isinstance(ev, Token):
            self.ids.append(ev.token_id)
            if ev.cache_positions is not None:
                self.length = ev.cache_positions
            self.rejected = ev.rejected  # for the step that held them: the next token's round writes there
        elif isinstance(ev, (Finished, Failed)):
            self.running = False
            if self.reported:
                self.caption = f"As left by {self.next_caption}" + (" (it failed)" if isinstance(ev, Failed) else "")
            positions = (ev.cache or {}).get("positions")
            if isinstance(positions, int):  # a remote server may not say
                self.length = positions
        else:
            return
        self.version += 1

    def loaded(self, facts: dict) -> None:
        """A model was loaded or a server connected: a cache left as it was keeps its map; an emptied one
        shows what it held as thrown away, with the reason."""
        self.version += 1
        self.capacity = facts.get("capacity") or 0
        self.snapshot_every = (facts.get("state") or {}).get("every") or 0
        self.state_layers = state_layers(facts.get("state") or {})
        if facts.get("backend") == "remote":
            self.reported, self.caption = False, REMOTE
            return
        positions = (facts.get("cache") or {}).get("positions", 0)
        if self.reported and positions == self.length and positions <= self.capacity:
            return  # the same cache (the weights and its settings kept)
        gone = self.length if self.reported else 0
        fresh = CacheMap(capacity=self.capacity, version=self.version, old_ids=self.ids[:gone], held_before=gone,
                         snapshot_every=self.snapshot_every, state_layers=self.state_layers)  # fmt: skip
        fresh.first_invalidated = 0 if gone else None
        dropped = facts.get("cache_dropped")
        fresh.caption = f"for the next request: {dropped}" if dropped else "empty: nothing cached yet"
        self.__dict__.update(fresh.__dict__)

    # --- read by the view -------------------------------------------------------------------------
    @property
    def filled(self) -> int:
        """Positions the cache holds, or the running request's prompt while its prefill fills them."""
        return max(self.length, self.prompt if self.running else 0)

    @property
    def extent(self) -> int:
        """Positions the map has anything to say about (the capacity, or more when a request ran past it)."""
        return max(self.capacity, self.filled, self.held_before, self.filled + self.rejected)

    def origins(self) -> list[tuple[int, int, str]]:
        """The positions as runs [start, end) of one origin, in order, over the extent."""
        live = self.filled
        runs = [
            (0, self.kept, "kept"),
            (self.kept, self.reused, self.reused_from),
            (self.reused, self.computed_to, "computed"),
            (self.computed_to, self.prompt, "pending"),
            (self.prompt, self.length, "generated"),
        ]
        out = [(a, min(b, live), o) for a, b, o in runs if min(b, live) > a]
        gone = live + self.rejected if self.running else live
        if gone > live:
            out.append((live, gone, "rejected"))
        if self.held_before > gone:
            out.append((gone, self.held_before, "invalidated"))
        end = max(gone, self.held_before)
        if self.extent > end:
            out.append((end, self.extent, "empty"))
        return out

    def roles(self) -> list[tuple[int, int, str]]:
        """Runs [start, end) of one role over the positions the cache holds (or the request is filling)."""
        out, pos, before = [], 0, None
        for (a, b), (role, _) in zip(self.spans, self.messages):
            if a > pos:  # the template's tokens; after a reply's text, its calls as the template writes them
                out.append((pos, a, "call" if before == "call" else "template"))
            if b > a:
                out.append((a, b, role))
            pos, before = max(pos, b), role
        top = self.filled
        if self.reply_from > pos:
            out.append((pos, self.reply_from, "template"))  # the generation prompt (or a raw prompt's text)
        pos = max(pos, self.reply_from)
        if top > pos:
            out.append((pos, top, "reply"))
        out = _overlaid(out, [(a, b, "image") for a, b, _ in image_runs(self.ids[:top])])
        return [(a, min(b, top), r) for a, b, r in out if min(b, top) > a]

    def image_at(self, start: int, end: int) -> str | None:
        """The images whose positions lie in [start, end), in words: which, how many of their positions, how big."""
        held = [(a, b, key) for a, b, key in image_runs(self.ids[: self.filled]) if a < end and b > start]
        if not held:
            return None
        counts: Counter = Counter()
        for a, b, key in held:
            counts[key] += min(b, end) - max(a, start)
        words = []
        for key, k in counts.items():
            n, what = self.images.get(key, (None, "an image"))
            total = sum(b - a for a, b, other in image_runs(self.ids[: self.filled]) if other == key)
            words.append(f"{'Image ' + str(n) if n else 'An image'}: {what}, {k:,} of its {total:,} positions here")
        return "\n".join(words)

    def cells(self, per: int) -> list[tuple[str, str | None]]:
        """(origin, role) of each cell of `per` positions: the most positions' (ties: the earlier run's)."""
        n = -(-self.extent // per) if per else 0
        origins, roles = _majority(self.origins(), per, n), _majority(self.roles(), per, n)
        return [(o or "empty", r) for o, r in zip(origins, roles)]

    def message_at(self, p: int) -> int | None:
        """The index of the request message whose turn position `p` is in (its header or its text)."""
        ends = [b for _, b in self.spans]
        m = bisect.bisect_right(ends, p)
        return m if m < len(self.spans) and p < self.filled else None

    def describe(self, start: int, end: int, name: Callable[[list], str] | None = None) -> str:
        """Positions [start, end) in words: the text they hold, their message, where they came from."""
        end = min(end, self.extent)
        if end <= start:
            return ""
        where = f"Position {start:,}" if end - start == 1 else f"Positions {start:,}–{end - 1:,}"
        lines = [where]
        origins = _counts(self.origins(), start, end)
        thrown = origins.get("invalidated", 0) == end - start
        ids = self.old_ids[start:end] if thrown else self.ids[start : min(end, self.filled)]
        if name is not None and ids:
            text = name(list(ids))
            lines[0] += f": “{text}”" + ("  (what it held)" if thrown else "")
        m = self.message_at(start)
        roles = _counts(self.roles(), start, end)
        pictures = self.image_at(start, end)
        if pictures:
            lines.append(pictures)
        if m is not None and m < len(self.messages):
            role, content = self.messages[m]
            excerpt = " ".join(content.split())[:48]
            lines.append(f"Message {m + 1} of {len(self.messages)} ({ROLES.get(role, role)}): “{excerpt}”")
        elif "reply" in roles:
            lines.append("The reply this request made")
        if roles.get("template"):
            lines.append(f"{roles['template']:,} of the template's own tokens (turn markers, generation prompt)")
        lines.append(" · ".join(f"{ORIGINS[o]}: {k:,}" if end - start > 1 else ORIGINS[o] for o, k in origins.items()))
        every = self.snapshot_every
        snaps = [p for p in range(start - start % every + every, end + 1, every) if p <= self.filled] if every else []
        if snaps:  # a hybrid's state after these positions kept: an edit after them goes back no further
            at = ", ".join(f"{p - 1:,}" for p in snaps[:4]) + (", …" if len(snaps) > 4 else "")
            lines.append(f"The {self.state_layers}' state is kept after position {at} (each snapshot covers every "
                         f"position before it; an edit goes back to the last one before it)")  # fmt: skip
        fi = self.first_invalidated
        if fi is not None and start <= fi < end:
            change = f": {self.changed[0]!r} → {self.changed[1]!r}" if self.changed else ""
            lines.append(f"The first invalidated position ({fi:,}): the cache was cut here{change}")
        return "\n".join(lines)


def _overlaid(runs: list, over: list) -> list:
    """Runs [a, b, v] in order with the runs of `over` laid on top (an image's positions inside a message)."""
    if not over:
        return runs
    out = []
    for a, b, v in runs:
        pos = a
        for c, d, w in over:
            if d <= pos or c >= b:
                continue
            if c > pos:
                out.append((pos, c, v))
            out.append((max(c, pos), min(d, b), w))
            pos = min(d, b)
        if b > pos:
            out.append((pos, b, v))
    return out


def _majority(runs, per: int, n: int) -> list[str | None]:
    """The value covering the most positions of each cell of `per` positions, from runs in order."""
    out: list[str | None] = [None] * n
    best = [0] * n
    for a, b, v in runs:
        c = a // per
        while c < n and c * per < b:
            k = min(b, (c + 1) * per) - max(a, c * per)
            if k > best[c]:
                best[c], out[c] = k, v
            c += 1
    return out


def _counts(runs, start: int, end: int) -> dict[str, int]:
    """How many of positions [start, end) each run's value covers, in run order."""
    got: Counter = Counter()
    for a, b, v in runs:
        k = min(b, end) - max(a, start)
        if k > 0:
            got[v] += k
    return dict(got)


def cell_size(extent: int, columns: int, max_rows: int) -> int:
    """Positions a cell holds: the smallest power of two that fits `extent` positions in the grid."""
    per = 1
    while -(-extent // per) > columns * max_rows:
        per *= 2
    return per
