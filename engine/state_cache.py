"""The cache of a hybrid model (LFM2): its attention layers keep K/V for every position, its short-convolution layers a
state of fixed size (the last K − 1 gated inputs of each channel), whatever the length. A state only goes forward, so
the cache also keeps a snapshot of every convolution layer's state each SNAPSHOT positions: an edit goes back to the
last snapshot before it and recomputes from there (`resume_point`), and the prefix store and the disk tier keep
snapshots with the blocks they hold.

A snapshot is spread over the positions of its block — block k's (the state after position 16k + 15) as 16 rows of
its slots 16k..16k + 15 in a buffer laid out as K/V are, [L_conv, 1, 1, C, w] — so every tier copies it as it copies
K/V, a block's positions at a time, and a block copied whole brings its snapshot whole.

Shapes: L_conv convolution layers, D hidden, K the kernel's width, C the capacity, w = ⌈D·(K − 1) / SNAPSHOT⌉.
"""

from __future__ import annotations

import math

import torch

SNAPSHOT = 16  # positions between snapshots: the prefix store's and the KV pool's block
RECENT = 64  # the last positions whose inputs are kept: a state at any of them (a speculative rollback)


class HybridCache:
    """K/V for the attention layers (`kv`, a KVCache or QuantKVCache of those layers alone, at the cache's precision)
    and, for each convolution layer, its live state [1, D, K − 1] with its snapshots (in the model dtype)."""

    quantized = False
    windowed = False
    batch = 1
    shared_positions = 0

    def __init__(self, config, capacity: int, dtype, device, kv):
        kinds = config.conv_layers
        self.conv = [i for i, c in enumerate(kinds) if c]
        self.attn = [i for i, c in enumerate(kinds) if not c]
        self.where = {i: j for j, i in enumerate(self.attn)} | {i: j for j, i in enumerate(self.conv)}
        self.kv = kv  # [L_attn, 1, H_kv, C, d] each
        self.quantized = kv.quantized
        D, k = config.hidden_size, config.conv_kernel
        self.state_shape = (D, k - 1)
        self.width = math.ceil(D * (k - 1) / SNAPSHOT)  # w
        self.state = torch.zeros(len(self.conv), 1, D, k - 1, dtype=dtype, device=device)  # [L_conv, 1, D, K − 1]
        self.snap = torch.zeros(len(self.conv), 1, 1, capacity, self.width, dtype=dtype, device=device)
        self.at = [0] * len(self.conv)  # the position each layer's live state is at
        self.recent: list[tuple[int, torch.Tensor] | None] = [None] * len(self.conv)  # each layer's last positions:
        # (the first, the inputs [1, D, K − 1 + n] from the state before it): the state at any of them
        self.num_layers, self.num_kv_heads, self.head_dim = config.num_layers, config.cache_heads, config.cache_width
        self.capacity = capacity
        self._length = 0

    # --- length, and going back ----------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        """n positions held: where a layer's state is elsewhere (a cut, positions brought in from a tier), it is set
        from the snapshot at n, which must be one."""
        self._length = n
        self.kv.length = n
        for j, at in enumerate(self.at):
            if at != n:
                self._restore(j, n)

    @property
    def positions(self) -> int:
        return self._length

    resume_every = SNAPSHOT  # the positions it can go on from: multiples of this (engine.kv_tiers rounds down)

    def resumable(self, n: int) -> bool:
        """At 0, at a snapshot, or within the last RECENT positions (a verify's rejected drafts taken back)."""
        within = all(r is not None and r[0] <= n <= r[0] + r[1].shape[-1] - self.state_shape[1] for r in self.recent)
        return n == 0 or (n <= self._length and (n % SNAPSHOT == 0 or within))

    def restore_needs(self, n: int) -> int:
        return n

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} positions to {length}")
        if not self.resumable(length) and length != self._length:
            raise ValueError(f"position {length} has no snapshot of the convolution layers' state (every {SNAPSHOT})")
        self.recent = [r if r is not None and r[0] <= length else None for r in self.recent]
        self.length = length

    def release(self) -> None:
        self.length = 0

    def reserve(self, start: int, end: int) -> None:
        """Positions start..end-1 are writable: always, within the capacity (the model checks it)."""

    # --- the layers' reads and writes ----------------------------------------------------------------------------
    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """An attention layer's new K/V ([1, H_kv, T, d]) at start..: its positions 0..start+T-1, as KVCache.write."""
        return self.kv.write(self.where[layer], start, k, v)

    def conv_state(self, layer: int, start: int) -> torch.Tensor:
        """The convolution layer's state before position `start` [1, D, K − 1] (where its state is)."""
        j = self.where[layer]
        if self.at[j] != start:
            self._restore(j, start)
        return self.state[j]

    def keep_conv_state(self, layer: int, start: int, full: torch.Tensor) -> None:
        """full [1, D, K − 1 + T]: the state before `start` then the T new gated inputs. The state after them kept,
        and a snapshot at each multiple of SNAPSHOT the T positions reach."""
        j, k1 = self.where[layer], self.state_shape[1]
        T = full.shape[-1] - k1
        for b in range((start // SNAPSHOT + 1) * SNAPSHOT, start + T + 1, SNAPSHOT):  # the states after b - 1
            state = full[0, :, b - start : b - start + k1]  # [D, K − 1]
            flat = torch.zeros(SNAPSHOT * self.width, dtype=self.snap.dtype, device=self.snap.device)
            flat[: state.numel()] = state.reshape(-1)
            self.snap[j, 0, 0, b - SNAPSHOT : b] = flat.view(SNAPSHOT, self.width)
        self.state[j].copy_(full[:, :, T:])
        self.at[j] = start + T
        r = self.recent[j]  # the last RECENT positions' inputs, this forward's after those before it
        if r is not None and r[0] + r[1].shape[-1] - k1 == start:
            s0, inputs = r[0], torch.cat((r[1], full[:, :, k1:]), dim=-1)
        else:
            s0, inputs = start, full
        extra = inputs.shape[-1] - k1 - RECENT
        self.recent[j] = (s0 + extra, inputs[:, :, extra:].clone()) if extra > 0 else (s0, inputs)

    def _restore(self, j: int, n: int) -> None:
        """Layer j's state set to the one after position n − 1: zeros at 0, from the last positions' inputs where n
        is among them, else its snapshot (n a multiple of SNAPSHOT, the block before it computed or brought in
        whole)."""
        recent = self.recent[j]
        if n == 0:
            self.state[j].zero_()
        elif recent is not None and recent[0] <= n <= recent[0] + recent[1].shape[-1] - self.state_shape[1]:
            self.state[j].copy_(recent[1][:, :, n - recent[0] : n - recent[0] + self.state_shape[1]])
        elif n % SNAPSHOT == 0:
            flat = self.snap[j, 0, 0, n - SNAPSHOT : n].reshape(-1)[: self.state_shape[0] * self.state_shape[1]]
            self.state[j, 0].copy_(flat.view(self.state_shape))
        else:
            raise ValueError(f"position {n} has no snapshot of the convolution layers' state (every {SNAPSHOT})")
        self.at[j] = n

    # --- what the tiers copy --------------------------------------------------------------------------------------
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The attention layers' K/V buffers, then the snapshots' (positions on dimension 3 in each)."""
        return (*self.kv.buffers(), self.snap)

    def take(self, a: int, b: int) -> tuple[torch.Tensor, ...]:
        return tuple(buf[:, :, :, a:b].clone() for buf in self.buffers())

    def held_from(self, a: int, b: int) -> int:
        return a

    def give(self, a: int, b: int, tensors) -> None:
        for buf, t in zip(self.buffers(), tensors):
            if t is not None:
                buf[:, :, :, a:b].copy_(t)

    def readable_by_kernels(self, dtype) -> bool:
        return False  # the kernels read a cache whose layer i is the model's layer i

    def kernel_table(self) -> None:
        return None

    # --- what it takes ------------------------------------------------------------------------------------------
    @property
    def state_bytes(self) -> int:
        """The convolution layers' live state: L_conv · D · (K − 1) · b, the same at any length."""
        return self.state.numel() * self.state.element_size()

    @property
    def snapshot_bytes_per_position(self) -> int:
        return len(self.conv) * self.width * self.snap.element_size()

    @property
    def bytes_per_position(self) -> int:
        """What one position takes in the attention layers' K/V (the state does not grow with positions; its
        snapshots add snapshot_bytes_per_position)."""
        return self.kv.bytes_per_position

    @property
    def payload_bytes(self) -> int:
        return self.kv.payload_bytes + self.state_bytes

    @property
    def allocated_bytes(self) -> int:
        return self.kv.allocated_bytes + self.state_bytes + self.snap.numel() * self.snap.element_size()

    @property
    def full_bytes(self) -> int:
        return self.allocated_bytes

    def kinds(self) -> list[dict]:
        """Per layer kind: the attention layers' K/V (growing with the positions) and the convolution layers' state
        (the same at any length; its snapshots, SNAPSHOT positions apart, in the allocated bytes)."""
        n = self._length
        return [
            {"kind": "full", "layers": len(self.attn), "window": None, "slots": self.capacity, "positions": n,
             "payload_bytes": self.kv.payload_bytes, "allocated_bytes": self.kv.allocated_bytes},
            {"kind": "conv", "layers": len(self.conv), "window": None, "slots": self.capacity // SNAPSHOT,
             "positions": n, "payload_bytes": self.state_bytes, "state_bytes": self.state_bytes,
             "snapshots": n // SNAPSHOT, "snapshot_bytes": n // SNAPSHOT * SNAPSHOT * self.snapshot_bytes_per_position,
             "allocated_bytes": self.state_bytes + self.snap.numel() * self.snap.element_size()},
        ]  # fmt: skip

    def stats(self) -> dict:
        return {
            "positions": self._length,
            "capacity": self.capacity,
            "payload_bytes": self.payload_bytes,
            "allocated_bytes": self.allocated_bytes,
            "layer_kinds": self.kinds(),
        }
