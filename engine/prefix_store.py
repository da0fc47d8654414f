"""The prefix store: K/V of earlier prompts kept in a tree over blocks of token ids, shared across
conversations and branches, bounded by a byte budget with least-recently-used eviction of leaves.

K/V at a position depend only on the token ids up to it (causal attention), so a path of blocks
from the root is valid for any prompt that starts with those ids, whichever conversation it came
from: reuse is by tokens, never by a conversation id. A common prefix (a system prompt) is one
path, stored once. Any node's first j positions may be reused, so a match is exact to the token.
The store keeps what the working cache would otherwise throw away (session.py decides when). Where the working
cache is a sequence of the KV pool (engine.kv_pool), a stored block is that pool block itself, held by reference:
keeping a prefix and bringing it back copy nothing, and a prefix several sequences run on is held once. When the
pool needs room, the blocks only the store holds are given back as copies of the store's own (`give_back`).
Elsewhere (a sliding layer's ring) the store keeps copies and copies them back.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

import torch

from .devices import free_on
from .kv_pool import BLOCK as POOL_BLOCK
from .kv_pool import BlockPool

BLOCK = 16  # positions per stored block (vLLM's default block size)
BUDGET_SHARE = 0.25  # the default budget: this share of the memory free when the session starts


HEAD_TOKENS = 12  # a segment's first ids in the tree's picture: the text it starts with


@dataclasses.dataclass(eq=False)
class Node:
    """`tokens` (BLOCK ids, fewer only in a leaf) and their K/V: a block of the KV pool `pool` held by reference
    (`block`), or one tensor per cache buffer, each [L, B, H_kv, len(tokens), w] (w: d, d/2 packed int4 codes, or 1
    for a scale); a sliding layer's ring part holds positions from `whole_from` on (zeros before), or is None when
    taken after they all slid out of it."""

    tokens: tuple[int, ...]
    tensors: tuple[torch.Tensor, ...]
    parent: Node | None
    start: int  # the position of tokens[0]
    nbytes: int
    whole_from: int = 0  # the first position whose every buffer is held (a ring's parts start later, or not at all)
    children: dict = dataclasses.field(default_factory=dict)  # tokens -> Node
    last_used: int = 0
    label: str | None = None  # who put it here last (a conversation's title): display only
    block: int | None = None  # its K/V as a block of `pool`, held by reference (tensors empty)
    pool: BlockPool | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def parts(self, a: int, b: int) -> tuple[torch.Tensor | None, ...]:
        """Its positions start+a..start+b-1 as tensors per cache buffer, [L, B, H_kv, b-a, w] (views of its copies,
        or copies of its pool block)."""
        if self.block is not None:
            return self.pool.read_block(self.block, a, b)
        return tuple(None if t is None else t[:, :, :, a:b] for t in self.tensors)


@dataclasses.dataclass(frozen=True)
class Match:
    """The longest stored prefix of a prompt: `length` positions along `path` (the last node possibly
    only in part)."""

    length: int
    path: tuple[Node, ...]


def default_budget(device) -> int:
    """BUDGET_SHARE of the memory free now: the GPU's on CUDA, the machine's available RAM elsewhere."""
    free = free_on(device)
    return int((4 * 2**30 if free is None else free) * BUDGET_SHARE)  # 4 GiB where the OS does not say


def common_prefix(a, b) -> int:
    """How many leading token ids two sequences share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class PrefixStore:
    """Blocks of K/V in a tree keyed by token ids. The working cache's buffers define the layout:
    `cache.buffers()` are tensors [L, B, H_kv, C, w] with positions on dimension 3."""

    def __init__(self, budget: int, block: int = BLOCK):
        if budget < 0:
            raise ValueError("the prefix store's budget cannot be negative")
        self.budget, self.block = budget, block
        self.root = Node((), (), None, 0, 0)
        self.bytes = 0
        self.nodes = 0
        self.evictions = 0  # nodes evicted to stay within the budget
        self.evicted_positions = 0
        self.dropped: str | None = None  # why everything was dropped last (a change of weights, dtype, ...)
        self._clock = itertools.count(1)

    # --- reading -------------------------------------------------------------------------------
    def match(self, ids, touch: bool = True) -> Match:
        """The longest prefix of `ids` whose K/V are stored; `touch` marks its nodes as just used."""
        node, pos, path = self.root, 0, []
        while pos < len(ids):
            piece = tuple(ids[pos : pos + self.block])
            child = node.children.get(piece)
            if child is not None and len(child.tokens) == len(piece):
                path.append(child)
                node, pos = child, pos + len(piece)
                continue
            best, n = None, 0  # no whole block: the child that shares most of this piece
            for c in node.children.values():
                k = common_prefix(c.tokens, piece)
                if k > n:
                    best, n = c, k
            if best is not None:
                path.append(best)
                pos += n
            break
        if touch:
            stamp = next(self._clock)
            for n_ in path:
                n_.last_used = stamp
        return Match(pos, tuple(path))

    def copy_into(self, cache, match: Match, start: int, end: int) -> tuple[int, int]:
        """Bring the stored K/V of positions start..end-1 (within `match`) into the working cache: a pool block the
        cache can hold whole as its next block is shared by reference, anything else copied. Returns (bytes
        copied, positions shared by reference)."""
        copied = shared = 0
        for node in match.path:
            lo, hi = max(start, node.start), min(end, node.end)
            if lo >= hi:
                continue
            if (
                node.block is not None
                and getattr(cache, "pool", None) is node.pool
                and lo == node.start == len(cache.table) * POOL_BLOCK
            ):  # the cache's next block: the stored one itself
                cache.adopt(node.block)
                shared += hi - lo
                continue
            pieces = node.parts(lo - node.start, hi - node.start)
            cache.give(lo, hi, pieces)
            copied += sum(t.numel() * t.element_size() for t in pieces if t is not None)
        return copied, shared

    @staticmethod
    def whole(match: Match, start: int, end: int) -> bool:
        """Whether the match's blocks hold every buffer's values at positions start..end-1 (a sliding layer's ring
        part lacks the positions that had slid out of it when the block was stored)."""
        return all(
            node.whole_from <= max(start, node.start)
            for node in match.path
            if max(start, node.start) < min(end, node.end)
        )

    # --- writing -------------------------------------------------------------------------------
    def insert(self, ids, cache, label: str | None = None, pinned: tuple[Node, ...] = ()) -> int:
        """Keep the K/V of `ids` (the working cache's positions 0..len(ids)-1), copying only the
        blocks not stored yet; then evict to the budget, sparing `pinned` (a prefix about to be
        copied out). Returns the bytes added."""
        if self.budget == 0 or not ids:
            return 0
        stamp = next(self._clock)
        node, pos, added = self.root, 0, 0
        while pos < len(ids):
            piece = tuple(ids[pos : pos + self.block])
            child = node.children.get(piece)
            if (
                child is None
                and len(piece) < self.block
                and any(c.tokens[: len(piece)] == piece for c in node.children.values())
            ):
                break  # a partial tail already held by a longer stored block
            if child is None:
                for other in [c for c in node.children.values() if len(c.tokens) < len(piece)]:
                    if piece[: len(other.tokens)] == other.tokens and not other.children:
                        self._remove(other)  # a shorter tail this block supersedes
                if self._by_reference(cache, pos):  # the pool block itself, one more holder of it
                    block = cache.table[pos // POOL_BLOCK]
                    cache.pool.ref(block)
                    nbytes = len(piece) * cache.bytes_per_position
                    child = Node(piece, (), node, pos, nbytes, pos, block=block, pool=cache.pool)
                else:
                    tensors = cache.take(pos, pos + len(piece))
                    nbytes = _nbytes(tensors)
                    child = Node(piece, tensors, node, pos, nbytes, cache.held_from(pos, pos + len(piece)))
                node.children[piece] = child
                self.bytes += nbytes
                self.nodes += 1
                added += nbytes
            elif child.whole_from > pos and cache.held_from(pos, pos + len(child.tokens)) < child.whole_from:
                tensors = cache.take(pos, pos + len(child.tokens))  # more of a ring's part than the block holds
                child.tensors, child.whole_from = tensors, cache.held_from(pos, pos + len(child.tokens))
                grown = _nbytes(tensors) - child.nbytes
                child.nbytes += grown
                self.bytes += grown
                added += grown
            child.last_used = stamp
            node, pos = child, pos + len(piece)
        if node is not self.root:
            node.label = label if label is not None else node.label
        self.evict(pinned)
        return added

    def _by_reference(self, cache, pos: int) -> bool:
        """Whether the store holds the cache's block at `pos` by reference: a pool's sequence, blocks the store's."""
        return getattr(cache, "pool", None) is not None and self.block == POOL_BLOCK and pos % POOL_BLOCK == 0

    def _remove(self, node: Node) -> None:
        del node.parent.children[node.tokens]
        self.bytes -= node.nbytes
        self.nodes -= 1
        if node.block is not None:
            node.pool.release(node.block)
            node.block = None

    # --- the KV pool's blocks ------------------------------------------------------------------
    def give_back(self, pool: BlockPool, n: int) -> int:
        """Up to n blocks of `pool` that only the store holds, least recently used first, given back to the pool:
        the store keeps a copy of each (its budget counts the same bytes). Returns how many were given back."""
        alone = [x for x in self._walk() if x.pool is pool and x.block is not None and not pool.shared(x.block)]
        given = 0
        for node in heapq.nsmallest(n, alone, key=lambda x: x.last_used):
            node.tensors = pool.read_block(node.block, 0, len(node.tokens))
            pool.release(node.block)
            node.block, node.pool = None, None
            given += 1
        return given

    def evict(self, pinned: tuple[Node, ...] = ()) -> None:
        """Drop least-recently-used leaves until the store fits its budget (a parent left without
        children becomes a leaf in its turn); `pinned` nodes stay, even over the budget."""
        if self.bytes <= self.budget:
            return
        spared = {id(n) for n in pinned}
        heap = [(n.last_used, id(n), n) for n in self._leaves() if id(n) not in spared]
        heapq.heapify(heap)
        while self.bytes > self.budget and heap:
            _, _, leaf = heapq.heappop(heap)
            self._remove(leaf)
            self.evictions += 1
            self.evicted_positions += len(leaf.tokens)
            parent = leaf.parent
            if parent is not self.root and not parent.children and id(parent) not in spared:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))

    def clear(self, reason: str | None = None) -> str | None:
        """Drop everything (a change of weights, dtype, tokenizer, rotary or KV precision, or a reset);
        returns and keeps what was dropped and why (None when the store was empty)."""
        what = None
        if self.nodes:
            what = f"{self.prefixes} stored prefixes ({self.bytes:,} B) dropped"
            self.dropped = f"{what}: {reason}" if reason else what
        for n in self._walk():
            if n.block is not None:
                n.pool.release(n.block)
                n.block = None
        self.root.children.clear()
        self.bytes = self.nodes = 0
        return what

    def set_budget(self, budget: int) -> None:
        self.budget = budget
        self.evict()

    # --- what the panel shows ----------------------------------------------------------------
    def _walk(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _leaves(self):
        return [n for n in self._walk() if not n.children]

    @property
    def prefixes(self) -> int:
        """How many distinct prefixes are stored: the tree's leaves."""
        return len(self._leaves())

    def tree(self, reused: Match | None = None, working: tuple[list[int], str | None, int] | None = None,
             disk=None) -> list[dict]:  # fmt: skip
        """The tree as nested segments (chains of single children merged): each with `label`, `start`,
        `end` (positions), `head` (its first HEAD_TOKENS ids: where it parts from its siblings), `bytes`,
        `reused` (positions of it the last request took from the store), `working` (held only by the
        working cache), `disk` (positions of it also on disk: `disk` is the disk tier's chain step, from
        step(None, ids)) and `children`. `working` = (ids, label, positions of them on disk) adds the working
        cache's positions past what the store holds."""
        used = {id(n): min(n.end, reused.length) - n.start for n in reused.path} if reused else {}

        segments: dict[int, dict] = {}

        def seg(n: Node, h, reachable: bool) -> dict:
            s = {"label": n.label, "start": n.start, "end": n.end, "bytes": n.nbytes, "reused": used.get(id(n), 0)}
            s["head"] = n.tokens[:HEAD_TOKENS]
            held = False
            if disk is not None and reachable:  # past a block not on disk, nothing further down is there
                h, held = disk(h, n.tokens)
            s["disk"] = len(n.tokens) if held else 0
            s["working"], s["children"] = False, [seg(c, h, held) for c in n.children.values()]
            segments[id(n)] = s
            return s

        top = [seg(c, None, True) for c in self.root.children.values()]
        if working and working[0]:
            ids, label, on_disk = working
            m = self.match(ids, touch=False)
            level = top
            for n in m.path:  # find the segment list under the last node the working cache shares whole
                if m.length < n.end:
                    break
                level = segments[id(n)]["children"]
            if m.length < len(ids):
                level.append(
                    {"label": label, "start": m.length, "end": len(ids), "bytes": None, "reused": 0, "working": True}
                    | {"children": [], "head": tuple(ids[m.length : m.length + HEAD_TOKENS])}
                    | {"disk": max(0, on_disk - m.length)}
                )
        return [_merge(s) for s in top]

    def stats(self) -> dict:
        return {
            "bytes": self.bytes,
            "by_reference": sum(n.nbytes for n in self._walk() if n.block is not None),  # of them, pool blocks
            "budget": self.budget,
            "prefixes": self.prefixes,
            "nodes": self.nodes,
            "block": self.block,
            "evictions": self.evictions,
            "evicted_positions": self.evicted_positions,
            "dropped": self.dropped,
        }


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _merge(s: dict) -> dict:
    """Merge a segment with its only child (same kind), so a conversation is one row, not one per block."""
    while len(s["children"]) == 1 and s["children"][0]["working"] == s["working"]:
        c = s["children"][0]
        s = {
            "label": c["label"] or s["label"],
            "start": s["start"],
            "head": s["head"],
            "end": c["end"],
            "bytes": None if s["bytes"] is None else s["bytes"] + (c["bytes"] or 0),
            "reused": s["reused"] + c["reused"],
            "disk": s.get("disk", 0) + c.get("disk", 0),
            "working": s["working"],
            "children": c["children"],
        }
    s["children"] = [_merge(c) for c in s["children"]]
    return s
