"""A preallocated KV cache with an explicit length: it never grows by concatenation. A model with sliding-window
layers gets `WindowedKVCache`: those layers keep a ring of the last W positions (and a spare), not the capacity."""

from __future__ import annotations

import torch

from .quant import BITS, check_mode, dequantize, pack_int4, quantize, unpack_int4
from .state_cache import HybridCache


def payload_bytes(num_layers: int, positions: int, num_kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
    """Ideal KV payload, 2 · L · T · H_kv · d · b (K and V). For several sequences pass the sum of lengths as T."""
    return 2 * num_layers * positions * num_kv_heads * head_dim * bytes_per_value


class KVCache:
    """K and V for every layer: [L, B, H_kv, capacity, d] each, plus `length`, the positions consumed.

    A position counts once a forward pass has consumed it: prefill of an 8-position prompt leaves
    length 8; consuming token 1 makes it 9.
    """

    quantized = False  # K/V held in the model dtype, as the attention kernels read them
    windowed = False  # every layer keeps every position (WindowedKVCache: sliding layers keep a ring)

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device,
        batch: int = 1,
    ):
        self._shape(num_layers, num_kv_heads, head_dim, capacity, batch)
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, C, d]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, C, d]

    def _shape(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, batch: int) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.capacity, self.batch, self.length = capacity, batch, 0

    def kinds(self) -> list[dict] | None:
        """The layers of each kind and the positions each keeps at most; None: one kind, every position."""
        return None

    @property
    def positions(self) -> int:
        return self.length

    @property
    def bytes_per_value(self) -> int:
        return self.k.element_size()

    @property
    def bytes_per_position(self) -> int:
        return payload_bytes(self.num_layers, 1, self.num_kv_heads, self.head_dim, self.bytes_per_value) * self.batch

    @property
    def payload_bytes(self) -> int:
        return payload_bytes(
            self.num_layers, self.length * self.batch, self.num_kv_heads, self.head_dim, self.bytes_per_value
        )

    @property
    def allocated_bytes(self) -> int:
        """What the buffers really take: the whole capacity, whatever the length."""
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    @property
    def full_bytes(self) -> int:
        """What it takes at its capacity: what it takes now, its buffers being the capacity's."""
        return self.allocated_bytes

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every tensor that holds a position, each [L, B, H_kv, C, w] (the prefix store copies these)."""
        return self.k, self.v

    def readable_by_kernels(self, dtype: torch.dtype) -> bool:
        """Whether a CPU kernel can attend over this cache in place: one sequence, K/V of `dtype` in memory."""
        return not self.quantized and self.batch == 1 and self.k.dtype == dtype and self.k.is_cpu

    shared_positions = 0  # a cache of its own shares no position (engine.kv_pool.PagedKVCache can)

    def kernel_table(self) -> None:
        """A cache of its own holds position j in slot j: no block table for the kernels."""
        return None

    def reserve(self, start: int, end: int) -> None:
        """Positions start..end-1 are writable: always, within the capacity (the model checks it)."""

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on; their slots are overwritten by later writes."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length

    def release(self) -> None:
        """Done with it: nothing to give back, its buffers are its own."""
        self.length = 0

    def resumable(self, n: int) -> bool:
        """Whether the cache can go on from position n exactly (always: every position is kept)."""
        return True

    def restore_needs(self, n: int) -> int:
        """The first position whose every buffer a copy into this cache must bring to go on from n (n: no more
        than the positions copied; a sliding layer's ring needs its window before n too)."""
        return n

    def take(self, a: int, b: int) -> tuple[torch.Tensor | None, ...]:
        """Copies of positions a..b-1 of every buffer ([L, B, H_kv, b−a, w] each) for the prefix store."""
        return tuple(buf[:, :, :, a:b].clone() for buf in self.buffers())

    def held_from(self, a: int, b: int) -> int:
        """The first of positions a..b-1 from which `take` gives every buffer's values (all of them here)."""
        return a

    def give(self, a: int, b: int, tensors) -> None:
        """Positions a..b-1 of every buffer from `tensors` (what take gave; None: a part not held, left)."""
        for buf, t in zip(self.buffers(), tensors):
            if t is not None:
                buf[:, :, :, a:b].copy_(t)

    def put(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([B, H_kv, T, d]) at slots start..start+T-1."""
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, H_kv, T, d]) at positions start..start+T-1; return views of positions 0..start+T-1."""
        self.put(layer, start, k, v)
        return self.read(layer, start + k.shape[2])

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of slots 0..end-1 of one layer, [B, H_kv, end, d] each (views)."""
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def write_at(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Static-shape write of one position given as a device tensor [1] (CUDA graphs): returns the
        whole buffers [B, H_kv, C, d]; the caller masks what lies beyond the position."""
        self.k[layer].index_copy_(2, pos, k)
        self.v[layer].index_copy_(2, pos, v)
        return self.k[layer], self.v[layer]

    def stats(self) -> dict:
        return {
            "positions": self.length,
            "capacity": self.capacity,
            "payload_bytes": self.payload_bytes,
            "allocated_bytes": self.allocated_bytes,
        }


class QuantKVCache(KVCache):
    """K and V stored as int8 or int4 codes, one float32 scale per (position, head) vector of d values.

    Writes quantize; reads dequantize positions 0..end to the model dtype. payload_bytes and
    allocated_bytes count the scales.
    """

    quantized = True

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device,
        mode: str,
        batch: int = 1,
    ):
        check_mode(mode)
        self.mode, self.dtype = mode, dtype
        self._shape(num_layers, num_kv_heads, head_dim, capacity, batch)
        width = head_dim // 2 if mode == "int4" else head_dim
        code_dtype = torch.uint8 if mode == "int4" else torch.int8
        shape = (num_layers, batch, num_kv_heads, capacity, width)
        self.k = torch.zeros(shape, dtype=code_dtype, device=device)  # [L, B, H_kv, C, d or d/2] codes
        self.v = torch.zeros(shape, dtype=code_dtype, device=device)
        sshape = (num_layers, batch, num_kv_heads, capacity, 1)
        self.k_scale = torch.ones(sshape, dtype=torch.float32, device=device)  # [L, B, H_kv, C, 1]
        self.v_scale = torch.ones(sshape, dtype=torch.float32, device=device)
        self.bits = BITS[mode]

    def buffers(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v, self.k_scale, self.v_scale

    @property
    def bytes_per_value(self) -> int:  # not a whole number of bytes for int4: use bytes_per_position
        return 1

    @property
    def bytes_per_position(self) -> int:
        """Per position: K and V codes for every layer and KV head, plus their scales."""
        return quantized_bytes_per_position(self.num_layers, self.num_kv_heads, self.head_dim, self.mode) * self.batch

    @property
    def payload_bytes(self) -> int:
        return self.length * self.bytes_per_position

    @property
    def allocated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_scale, self.v_scale))

    def _store(self, codes_buf, scale_buf, layer, start, x):
        codes, scales = quantize(x, self.mode, self.head_dim)  # [B, H_kv, T, d], [B, H_kv, T, 1]
        end = start + x.shape[2]
        codes_buf[layer, :, :, start:end] = pack_int4(codes) if self.mode == "int4" else codes
        scale_buf[layer, :, :, start:end] = scales

    def _load(self, codes_buf, scale_buf, layer, end):
        codes = codes_buf[layer, :, :, :end]
        codes = unpack_int4(codes) if self.mode == "int4" else codes
        return dequantize(codes, scale_buf[layer, :, :, :end], self.dtype)  # [B, H_kv, end, d]

    def put(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._store(self.k, self.k_scale, layer, start, k)
        self._store(self.v, self.v_scale, layer, start, v)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of slots 0..end-1 of one layer, dequantized to the model dtype: [B, H_kv, end, d] each."""
        return self._load(self.k, self.k_scale, layer, end), self._load(self.v, self.v_scale, layer, end)


def quantized_bytes_per_position(num_layers: int, num_kv_heads: int, head_dim: int, mode: str) -> int:
    """2 · L · H_kv · (d · bits/8 + 4): codes for K and V of every layer and KV head, one float32 scale each."""
    return 2 * num_layers * num_kv_heads * (head_dim * BITS[mode] // 8 + 4)


def bytes_per_position(config, dtype: torch.dtype, kv: str = "none") -> int:
    """What one cached position takes for a model config, in the model dtype ("none") or int8/int4 codes: in its
    attention layers (a hybrid's others keep a state that does not grow)."""
    if kv == "none":
        size = torch.empty((), dtype=dtype).element_size()
        return payload_bytes(config.kv_layers, 1, config.cache_heads, config.cache_width, size)
    check_mode(kv)
    return quantized_bytes_per_position(config.kv_layers, config.cache_heads, config.cache_width, kv)


def _layers_cache(layers: int, config, capacity: int, dtype, device, kv: str) -> KVCache:
    """A cache of `layers` layers of the config's heads at a precision: the model dtype ("none") or codes + scales."""
    if kv == "none":
        return KVCache(layers, config.cache_heads, config.cache_width, capacity, dtype, device)
    return QuantKVCache(layers, config.cache_heads, config.cache_width, capacity, dtype, device, kv)


DEFAULT_CAPACITY = 4096  # KV positions when neither the person nor the model's context says fewer
RING_SPARE = 1024  # slots a sliding layer keeps past its window: an edit this recent keeps the cache (see below)


def ring_slots(config, capacity: int, chunk: int = 0) -> int | None:
    """The slots each sliding layer of `config` keeps in a cache of `capacity`: W + max(RING_SPARE, chunk), when that
    is fewer than the capacity; None when every layer keeps the capacity (no window, or a window as large)."""
    if config.sliding_window is None or all(w is None for w in config.windows):
        return None
    slots = config.sliding_window + max(RING_SPARE, chunk)
    return slots if slots < capacity else None


def make_cache(config, capacity: int, dtype: torch.dtype, device, kv: str = "none", chunk: int = 0) -> KVCache:
    """The cache for a model config at a precision: the model dtype ("none"), or int8/int4 codes + scales. A model
    with sliding layers whose window (and spare) is below the capacity gets a WindowedKVCache; `chunk`: the most
    positions one forward writes (the session's prefill step)."""
    slots = ring_slots(config, capacity, chunk)
    if slots is not None:
        return WindowedKVCache(config, capacity, dtype, device, kv, slots)
    if any(config.state_layers):  # a hybrid: K/V for its attention layers, a state for the others
        kv_layers = _layers_cache(config.kv_layers, config, capacity, dtype, device, kv)
        return HybridCache(config, capacity, dtype, device, kv_layers)
    return _layers_cache(config.num_layers, config, capacity, dtype, device, kv)


class WindowedKVCache:
    """K/V for a model with sliding-window layers: the full-attention layers keep every position up to the capacity
    ([L_full, B, H_kv, C, d]); each sliding layer keeps a ring of S = W + spare slots ([L_sliding, B, H_kv, S, d]),
    position p in slot p mod S. Attention reads the whole ring with a mask of the slots' positions (the order of
    keys does not change a softmax), so nothing is copied to put the window in order.

    What an edit can keep: to go on from position n a sliding layer needs positions n−W+1..n−1, which the ring holds
    while n ≥ length − (S − W) − 1 (`resumable`). An older edit cannot be resumed from anywhere but 0: recomputing a
    sliding layer's K/V at an earlier position needs the layers below at positions that slid out too.
    """

    quantized = False
    windowed = True
    batch = 1

    def __init__(self, config, capacity: int, dtype, device, kv: str, slots: int):
        windows = config.windows
        self.window = config.sliding_window  # W
        self.slots = slots  # S
        self.full_layers = [i for i, w in enumerate(windows) if w is None]
        self.ring_layers = [i for i, w in enumerate(windows) if w is not None]
        self.where = {i: (None, j) for j, i in enumerate(self.full_layers)} | {
            i: ("ring", j) for j, i in enumerate(self.ring_layers)
        }
        self.full = (
            _layers_cache(len(self.full_layers), config, capacity, dtype, device, kv) if self.full_layers else None
        )
        self.ring = _layers_cache(len(self.ring_layers), config, slots, dtype, device, kv)
        self.quantized = self.ring.quantized
        self.num_layers, self.num_kv_heads, self.head_dim = config.num_layers, config.cache_heads, config.cache_width
        self.capacity = capacity
        self.max_chunk = slots - self.window + 1  # positions one forward may write (the ring must not eat its window)
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        self._length = n
        self.ring.length = min(n, self.slots)
        if self.full is not None:
            self.full.length = n

    @property
    def positions(self) -> int:
        return self._length

    @property
    def bytes_per_position(self) -> int:
        """What one position takes while every layer holds it (the full cache's figure): 2·L·H_kv·d·b."""
        per_layer = self.ring.bytes_per_position // max(1, self.ring.num_layers)
        return per_layer * self.num_layers

    def kinds(self) -> list[dict]:
        """Per layer kind: its layers, the positions attention needs of each (payload: 2·L·T·H·d·b, T = min(T, W)
        for the sliding layers), its slots, and the bytes allocated (a ring's spare slots count there, not in the
        payload)."""
        out = []
        for kind, cache, layers in (("full", self.full, self.full_layers), ("sliding", self.ring, self.ring_layers)):
            if cache is None:
                continue
            needed = self._length if kind == "full" else min(self._length, self.window)
            out.append(
                {
                    "kind": kind,
                    "layers": len(layers),
                    "window": None if kind == "full" else self.window,
                    "slots": cache.capacity,
                    "positions": needed,
                    "payload_bytes": needed * cache.bytes_per_position,
                    "allocated_bytes": cache.allocated_bytes,
                }
            )
        return out

    @property
    def payload_bytes(self) -> int:
        return sum(k["payload_bytes"] for k in self.kinds())

    @property
    def allocated_bytes(self) -> int:
        return sum(k["allocated_bytes"] for k in self.kinds())

    @property
    def full_bytes(self) -> int:
        return self.allocated_bytes

    def readable_by_kernels(self, dtype) -> bool:
        return False  # the kernels attend over positions in order; a ring's are not

    def resumable(self, n: int) -> bool:
        """Whether the cache can go on from position n (≤ length) exactly: the ring still holds the window before it."""
        if n >= self._length or n == 0:
            return True
        return max(0, n - self.window + 1) >= max(0, self._length - self.slots)

    def restore_needs(self, n: int) -> int:
        return max(0, n - self.window + 1)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The full layers' buffers, then the ring's (positions on dimension 3; the ring's by slot)."""
        return (self.full.buffers() if self.full is not None else ()) + self.ring.buffers()

    def _slots(self, a: int, b: int) -> list[tuple[int, int, int]]:
        """Positions a..b-1 as runs (first position, first slot, count) of the ring's slots."""
        runs, p = [], a
        while p < b:
            slot = p % self.slots
            n = min(b - p, self.slots - slot)
            runs.append((p, slot, n))
            p += n
        return runs

    def held_from(self, a: int, b: int) -> int:
        """The first of positions a..b-1 the ring still holds (b: none of them)."""
        return min(b, max(a, self._length - self.slots))

    def take(self, a: int, b: int) -> tuple[torch.Tensor | None, ...]:
        """As KVCache.take; the ring's parts hold positions held_from(a, b)..b-1 (zeros before), None when the ring
        holds none of them."""
        full = self.full.take(a, b) if self.full is not None else ()
        h = self.held_from(a, b)
        if h >= b:
            return full + (None,) * len(self.ring.buffers())
        ring = []
        for buf in self.ring.buffers():
            held = torch.cat([buf[:, :, :, slot : slot + n] for _, slot, n in self._slots(h, b)], dim=3)
            ring.append(
                held if h == a else torch.cat([held.new_zeros((*held.shape[:3], h - a, held.shape[4])), held], 3)
            )
        return full + tuple(ring)

    def give(self, a: int, b: int, tensors) -> None:
        nfull = len(self.full.buffers()) if self.full is not None else 0
        if self.full is not None:
            self.full.give(a, b, tensors[:nfull])
        for buf, t in zip(self.ring.buffers(), tensors[nfull:]):
            if t is None:
                continue
            for p, slot, n in self._slots(a, b):
                buf[:, :, :, slot : slot + n].copy_(t[:, :, :, p - a : p - a + n])

    shared_positions = 0

    def reserve(self, start: int, end: int) -> None:
        """Positions start..end-1 are writable: always (write checks the ring's chunk)."""

    def release(self) -> None:
        self.length = 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} positions to {length}")
        if not self.resumable(length):
            raise ValueError(f"position {length} slid out of the sliding layers' window: the cache cannot resume there")
        self.length = length

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, H_kv, T, d]) at positions start..start+T-1. A full layer returns positions 0..start+T-1;
        a sliding layer its ring's filled slots, whose positions `ring_mask` gives."""
        which, j = self.where[layer]
        if which is None:
            return self.full.write(j, start, k, v)
        T = k.shape[2]
        if T > self.max_chunk:
            raise ValueError(f"{T} positions in one step overrun a sliding layer's ring (at most {self.max_chunk})")
        for p, slot, n in self._slots(start, start + T):  # at most two runs: to the ring's end, then from its start
            self.ring.put(j, slot, k[:, :, p - start : p - start + n], v[:, :, p - start : p - start + n])
        return self.ring.read(j, min(self.slots, start + T))

    def ring_mask(self, start: int, t: int, device) -> torch.Tensor:
        """[T, filled] bool: which ring slots query start+i sees once positions start..start+T-1 are written: those
        holding a position not ahead of it and within W."""
        end, S = start + t, self.slots
        filled = min(S, end)
        slot = torch.arange(filled, device=device)
        held = end - 1 - (end - 1 - slot) % S  # the position each slot holds
        q = torch.arange(start, end, device=device)[:, None]
        return (held[None, :] <= q) & (q - held[None, :] < self.window)

    def stats(self) -> dict:
        return {
            "positions": self._length,
            "capacity": self.capacity,
            "payload_bytes": self.payload_bytes,
            "allocated_bytes": self.allocated_bytes,
            "layer_kinds": self.kinds(),
        }


def cache_plan(config, dtype: torch.dtype, capacity: int | None = None) -> dict:
    """What a session's cache for `config` takes, before any weight is read (the Models dialog's figures): the
    capacity (default: min(context, DEFAULT_CAPACITY)), bytes per position while every layer holds it, the bytes
    allocated, and, for a sliding-window cache or a hybrid's, its layers in words."""
    capacity = capacity or min(config.max_position_embeddings, DEFAULT_CAPACITY)
    cache = make_cache(config, capacity, dtype, "meta")  # shapes only: nothing is allocated
    sliding = next((k for k in cache.kinds() or () if k["kind"] == "sliding"), None)
    layers = short = None
    if sliding is not None:
        layers = f"{sliding['layers']} of {config.num_layers} layers sliding: ≤ {sliding['slots']:,} positions each"
        short = f"{sliding['layers']}/{config.num_layers} sliding ≤ {sliding['slots']:,}"
    elif isinstance(cache, HybridCache):  # a hybrid: the state layers' state, the same at any length
        layers, short = cache.plan_words(config.num_layers)
    return {
        "capacity": capacity,
        "bytes_per_position": cache.bytes_per_position,
        "allocated_bytes": cache.allocated_bytes,
        "layers": layers,
        "layers_short": short,
    }
