"""The KV pool: every sequence's K/V in blocks of BLOCK positions taken from one pool per model, as vLLM keeps
them. A sequence holds a table of blocks (`PagedKVCache`); a block several holders share — two sequences on one
system prompt, the n alternatives of one prompt, the prefix store — is held once, counted by reference, and
copied only when one holder writes into it (copy on write). The pool grows by doubling up to its limit, each
growth only while it fits in half the memory free now; past that, its lenders give blocks back — the prefix
store those only it holds (keeping copies of its own), the scheduler its idle lanes' caches (into the store) —
and a sequence that still finds none gets `PoolFull`. The scheduler admits a request only while the blocks it
may need are sure to be there (`room`), so a running one never meets it.
"""

from __future__ import annotations

import heapq
from typing import Protocol

import torch

from .devices import free_on
from .errors import EngineError
from .kv_cache import _layers_cache
from .quant import dequantize, pack_int4, quantize, unpack_int4

BLOCK = 16  # positions a block holds: the prefix store's block and the kernels' KV_BLOCK
FIRST_BLOCKS = 64  # a pool's first allocation (1,024 positions); it doubles from there
GROWTH_SHARE = 0.5  # a growth may take at most this share of the memory free now


class PoolFull(EngineError):
    """No block is free, the pool cannot grow and none of its lenders has one to give back."""


class Lender(Protocol):
    """A holder of blocks that can give them back when the pool needs room (the prefix store; the scheduler's
    idle lanes)."""

    def give_back(self, pool: BlockPool, n: int) -> int:
        """Give back up to n blocks of `pool` (at least one where it holds any it can spare); how many."""


def blocks_for(positions: int) -> int:
    """Blocks that hold `positions` positions."""
    return -(-positions // BLOCK)


class BlockPool:
    """K/V blocks of one model at one precision: each buffer [L, 1, H_kv, N·BLOCK, w] (the layout of a KVCache
    of N·BLOCK slots: K and V in the model dtype, or int8/int4 codes and their float32 scales), block b its slots
    b·BLOCK..(b+1)·BLOCK-1; a reference count per block; `limit` blocks at most (None: no limit)."""

    def __init__(self, config, dtype: torch.dtype, device, kv: str = "none", limit: int | None = None):
        self.config, self.dtype, self.device, self.kv = config, dtype, torch.device(device), kv
        self.limit = limit
        self.storage = _layers_cache(config.num_layers, config, 0, dtype, self.device, kv)  # [L, 1, H_kv, 0, w]
        self.refs: list[int] = []  # holders of each block (tables and store nodes); 0: free
        self._free: list[int] = []  # a heap: the lowest free block first, so a sequence's blocks tend to be in order
        self.lenders: list[Lender] = []  # asked in order for blocks back when the pool is full
        self.generation = 0  # grows by one at every growth (a captured CUDA graph holds the old addresses)
        self.growths = 0
        self.peak_held = 0

    # --- shape ------------------------------------------------------------------------------------
    @property
    def blocks(self) -> int:
        return len(self.refs)

    @property
    def slots(self) -> int:
        return self.blocks * BLOCK

    @property
    def quantized(self) -> bool:
        return self.storage.quantized

    @property
    def bytes_per_position(self) -> int:
        return self.storage.bytes_per_position

    @property
    def block_bytes(self) -> int:
        return BLOCK * self.bytes_per_position

    @property
    def allocated_bytes(self) -> int:
        """What the pool's buffers take: every block, held or free."""
        return self.storage.allocated_bytes

    @property
    def held(self) -> int:
        """Blocks held by anyone now."""
        return self.blocks - len(self._free)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every buffer, [L, 1, H_kv, slots, w] each: K (and its scales), then V (and its scales) as KVCache.buffers."""
        return self.storage.buffers()

    def parts(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The buffers that hold K, and those that hold V: (k,), (v,) or (codes, scales) each."""
        s = self.storage
        return ((s.k, s.k_scale), (s.v, s.v_scale)) if s.quantized else ((s.k,), (s.v,))

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """K or V [1, H_kv, T, d] as the pool stores it: itself, or its codes (packed for int4) and scales."""
        if not self.quantized:
            return (x,)
        codes, scales = quantize(x, self.kv, self.config.cache_width)  # [1, H_kv, T, d], [1, H_kv, T, 1]
        return (pack_int4(codes) if self.kv == "int4" else codes, scales)

    def decode(self, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """What encode stored, back to [1, H_kv, T, d] in the model dtype."""
        if not self.quantized:
            return parts[0]
        codes, scales = parts
        return dequantize(unpack_int4(codes) if self.kv == "int4" else codes, scales, self.dtype)

    # --- blocks -----------------------------------------------------------------------------------
    def alloc(self) -> int:
        """A free block, held once (growing the pool, or taking back the store's blocks, where none is free)."""
        if not self._free:
            self._make_room()
        b = heapq.heappop(self._free)
        self.refs[b] = 1
        self.peak_held = max(self.peak_held, self.held)
        return b

    def ref(self, b: int) -> None:
        """One more holder of block b."""
        if self.refs[b] <= 0:
            raise ValueError(f"block {b} is free: nothing holds it to share")
        self.refs[b] += 1

    def release(self, b: int) -> None:
        """One holder less of block b: free once none holds it."""
        if self.refs[b] <= 0:
            raise ValueError(f"block {b} is released more often than it was held")
        self.refs[b] -= 1
        if self.refs[b] == 0:
            heapq.heappush(self._free, b)

    def shared(self, b: int) -> bool:
        return self.refs[b] > 1

    def copy_block(self, src: int, dst: int) -> None:
        """Block dst takes block src's K/V, every layer and buffer."""
        a, b = src * BLOCK, dst * BLOCK
        for buf in self.buffers():
            buf[:, :, :, b : b + BLOCK].copy_(buf[:, :, :, a : a + BLOCK])

    def read_block(self, b: int, lo: int = 0, hi: int = BLOCK) -> tuple[torch.Tensor, ...]:
        """Copies of positions lo..hi-1 of block b, [L, 1, H_kv, hi-lo, w] per buffer (as KVCache.take gives)."""
        return tuple(buf[:, :, :, b * BLOCK + lo : b * BLOCK + hi].clone() for buf in self.buffers())

    def lend(self, lender: Lender) -> None:
        """Ask `lender` for blocks back, after those asked before, when the pool is full."""
        if not any(x is lender for x in self.lenders):
            self.lenders.append(lender)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def room(self) -> int:
        """The blocks sequences can hold at most now: the limit, or less where the memory free now stops a growth
        before it. Everything in it not held by a running sequence is free or a lender's to give back."""
        return self.blocks + self._growable()

    def _growable(self) -> int:
        """Blocks a growth could add now: to the limit, and while the whole new buffer (the old one is copied into
        it, then freed) takes at most GROWTH_SHARE of the memory free now."""
        room = (self.limit if self.limit is not None else 1 << 30) - self.blocks
        free = free_on(self.device)
        if free is not None:
            room = min(room, int(free * GROWTH_SHARE) // max(1, self.block_bytes) - self.blocks)
        return max(0, room)

    def _make_room(self) -> None:
        """At least one free block: a growth (doubling, at least FIRST_BLOCKS, up to what _growable allows), else
        the store's blocks taken back; PoolFull when neither frees one."""
        room = self._growable()
        if room > 0:
            self.grow(min(room, max(FIRST_BLOCKS, self.blocks)))
            return
        for lender in self.lenders:
            lender.give_back(self, max(1, self.blocks // 16))
            if self._free:
                return
        raise PoolFull(
            f"the KV pool is full: {self.held:,} of {self.blocks:,} blocks of {BLOCK} positions held"
            + (f" (its limit {self.limit:,})" if self.limit is not None and self.blocks >= self.limit else "")
        )

    def grow(self, more: int) -> None:
        """`more` blocks, free: every buffer copied into one that long (K/V keep their slots)."""
        old = self.storage
        new = _layers_cache(self.config.num_layers, self.config, self.slots + more * BLOCK, self.dtype, self.device,
                            self.kv)  # fmt: skip
        for a, b in zip(old.buffers(), new.buffers()):
            b[:, :, :, : self.slots].copy_(a)
        self.storage = new
        first = self.blocks
        self.refs.extend([0] * more)
        for b in range(first, first + more):
            heapq.heappush(self._free, b)
        self.generation += 1
        self.growths += 1

    def stats(self) -> dict:
        return {
            "block": BLOCK,
            "blocks": self.blocks,
            "held": self.held,
            "shared": sum(1 for r in self.refs if r > 1),
            "limit": self.limit,
            "peak_held": self.peak_held,
            "growths": self.growths,
            "allocated_bytes": self.allocated_bytes,
            "block_bytes": self.block_bytes,
        }


class PagedKVCache:
    """One sequence's K/V in a pool's blocks: `table[i]` the block of positions i·BLOCK..(i+1)·BLOCK-1, `length` the
    positions consumed, at most `capacity`. The interface of KVCache, so the model, the store and the disk tier
    read and write it as they do a cache of its own; allocated bytes are the blocks it holds.

    A write goes through `reserve(start, end)` first (the model's forward calls it before any layer writes):
    the blocks for those positions are made, and one shared with another holder is copied first, so no layer
    ever writes into a block another reads."""

    windowed = False
    batch = 1

    def __init__(self, pool: BlockPool, capacity: int):
        self.pool, self.capacity, self.length = pool, capacity, 0
        cfg = pool.config
        self.num_layers, self.num_kv_heads, self.head_dim = cfg.num_layers, cfg.cache_heads, cfg.cache_width
        self.table: list[int] = []
        self._table_tensor: torch.Tensor | None = None  # int32 [blocks] (CPU), for the kernels
        self._slots: torch.Tensor | None = None  # long [blocks · BLOCK] on the device: each position's slot
        self.slot_map: torch.Tensor | None = None  # long [capacity] on the device, for a static-shape step
        self._ordered: int | None = None  # how many of its first blocks lie in order in the pool
        self.copies_on_write = 0

    # --- what it is -------------------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        return self.pool.quantized

    @property
    def k(self) -> torch.Tensor:
        return self.pool.storage.k

    @property
    def v(self) -> torch.Tensor:
        return self.pool.storage.v

    @property
    def positions(self) -> int:
        return self.length

    @property
    def bytes_per_value(self) -> int:
        return self.pool.storage.bytes_per_value

    @property
    def bytes_per_position(self) -> int:
        return self.pool.bytes_per_position

    @property
    def payload_bytes(self) -> int:
        return self.length * self.bytes_per_position

    @property
    def allocated_bytes(self) -> int:
        """The blocks it holds (a block shared with others counted here too: the pool counts it once)."""
        return len(self.table) * self.pool.block_bytes

    @property
    def full_bytes(self) -> int:
        """What it takes at its capacity: the blocks that hold `capacity` positions."""
        return blocks_for(self.capacity) * self.pool.block_bytes

    @property
    def shared_positions(self) -> int:
        """Its positions in blocks another holder holds too (a sequence, or the prefix store)."""
        return sum(min(BLOCK, self.length - i * BLOCK) for i, b in enumerate(self.table[: blocks_for(self.length)])
                   if self.pool.shared(b))  # fmt: skip

    def kinds(self) -> None:
        return None

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The pool's buffers ([L, 1, H_kv, slots, w]): their layout, not this sequence's positions (take, give)."""
        return self.pool.buffers()

    def readable_by_kernels(self, dtype: torch.dtype) -> bool:
        return not self.quantized and self.k.dtype == dtype and self.k.is_cpu

    def kernel_table(self) -> torch.Tensor:
        """The table as the kernels read it: int32 [blocks] on the CPU."""
        if self._table_tensor is None:
            self._table_tensor = torch.tensor(self.table, dtype=torch.int32)
        return self._table_tensor

    def resumable(self, n: int) -> bool:
        return True

    def restore_needs(self, n: int) -> int:
        return n

    def held_from(self, a: int, b: int) -> int:
        return a

    # --- its blocks -------------------------------------------------------------------------------
    def _changed(self) -> None:
        self._table_tensor = self._slots = self._ordered = None
        if self.slot_map is not None:
            self._fill_slot_map()

    def reserve(self, start: int, end: int) -> None:
        """Make positions start..end-1 writable: their blocks held, and held by this sequence alone."""
        if end > self.capacity:
            raise ValueError(f"{end} positions exceed the cache capacity of {self.capacity}")
        changed = False
        for i in range(min(start // BLOCK, len(self.table)), blocks_for(end)):  # no gap: blocks in position order
            if i < len(self.table):
                old = self.table[i]
                if self.pool.shared(old):  # copy on write: the others keep the block as it is
                    new = self.pool.alloc()
                    self.pool.copy_block(old, new)
                    self.pool.release(old)
                    self.table[i], changed = new, True
                    self.copies_on_write += 1
            else:
                self.table.append(self.pool.alloc())
                changed = True
        if changed:
            self._changed()

    def adopt(self, block: int) -> None:
        """Hold `block` (a stored prefix's) as this sequence's next block of positions, by reference."""
        self.pool.ref(block)
        self.table.append(block)
        self._changed()

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on; blocks past it are given back to the pool."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length
        keep = blocks_for(length)
        if len(self.table) > keep:
            for b in self.table[keep:]:
                self.pool.release(b)
            del self.table[keep:]
            self._changed()

    def release(self) -> None:
        """Give every block back (the sequence is done with this cache)."""
        self.length = 0
        self.truncate(0)

    # --- positions to slots -----------------------------------------------------------------------
    def slots(self, a: int, b: int) -> torch.Tensor:
        """The slots of positions a..b-1, long [b-a] on the pool's device."""
        if self._slots is None:
            t = torch.tensor(self.table, dtype=torch.long)
            self._slots = (t[:, None] * BLOCK + torch.arange(BLOCK)).reshape(-1).to(self.pool.device)
        return self._slots[a:b]

    def _run(self, end: int) -> int | None:
        """The first slot of positions 0..end-1 where their blocks lie in order in the pool (a view serves), else
        None."""
        if self._ordered is None:
            t, n = self.table, 1
            while n < len(t) and t[n] == t[0] + n:
                n += 1
            self._ordered = n if t else 0
        if blocks_for(end) > self._ordered:
            return None
        return self.table[0] * BLOCK if self.table else 0

    # --- the KVCache interface --------------------------------------------------------------------
    def put(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([1, H_kv, T, d]) at positions start..start+T-1 (reserved)."""
        end = start + k.shape[2]
        if blocks_for(end) > len(self.table):
            raise ValueError(f"positions {start}–{end - 1} were not reserved in the pool")
        idx = self.slots(start, end)
        first = self._run(end) if end - start > 1 else None
        for parts, x in zip(self.pool.parts(), (k, v)):
            for buf, val in zip(parts, self.pool.encode(x)):
                if first is not None:
                    buf[layer, :, :, first + start : first + end] = val
                else:
                    buf[layer].index_copy_(2, idx, val)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of positions 0..end-1 of one layer in the model dtype, [1, H_kv, end, d] each: views where its
        blocks lie in order, else gathered."""
        first = self._run(end)
        out = []
        for parts in self.pool.parts():
            if first is not None:
                got = tuple(buf[layer, :, :, first : first + end] for buf in parts)
            else:
                idx = self.slots(0, end)
                got = tuple(buf[layer].index_select(2, idx) for buf in parts)
            out.append(self.pool.decode(got))
        return out[0], out[1]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.put(layer, start, k, v)
        return self.read(layer, start + k.shape[2])

    def take(self, a: int, b: int) -> tuple[torch.Tensor, ...]:
        """Copies of positions a..b-1 of every buffer, [L, 1, H_kv, b−a, w] each (as KVCache.take)."""
        idx = self.slots(a, b)
        return tuple(buf.index_select(3, idx) for buf in self.pool.buffers())

    def give(self, a: int, b: int, tensors) -> None:
        """Positions a..b-1 of every buffer from `tensors` (what take gave; None: a part not held, left)."""
        self.reserve(a, b)
        idx = self.slots(a, b)
        for buf, t in zip(self.pool.buffers(), tensors):
            if t is not None:
                buf.index_copy_(3, idx, t.to(buf.device))

    # --- a static-shape step (CUDA graphs) --------------------------------------------------------
    def _fill_slot_map(self) -> None:
        """slot_map [capacity]: each position's slot, slot 0 past the blocks held (masked by the step)."""
        n = len(self.table) * BLOCK
        self.slot_map[n:].zero_()
        if n:
            self.slot_map[:n].copy_(self.slots(0, n))

    def write_at(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Static-shape write of one position given as a device tensor [1]: returns K, V of every position up to
        the capacity [1, H_kv, C, d] (gathered through slot_map); the caller masks what lies beyond it."""
        if self.slot_map is None:
            self.slot_map = torch.zeros(self.capacity, dtype=torch.long, device=self.pool.device)
            self._fill_slot_map()
        slot = self.slot_map.index_select(0, pos)  # [1]
        out = []
        for parts, x in zip(self.pool.parts(), (k, v)):
            for buf, val in zip(parts, self.pool.encode(x)):
                buf[layer].index_copy_(2, slot, val)
            out.append(self.pool.decode(tuple(buf[layer].index_select(2, self.slot_map) for buf in parts)))
        return out[0], out[1]

    def stats(self) -> dict:
        return {
            "positions": self.length,
            "capacity": self.capacity,
            "payload_bytes": self.payload_bytes,
            "allocated_bytes": self.allocated_bytes,
            "blocks": len(self.table),
            "shared_positions": self.shared_positions,
            "pool": self.pool.stats(),
        }
