"""The cache of a hybrid model (LFM2, Granite 4.0-H, Qwen3-Next): its attention layers keep K/V for every position,
its state layers a state of fixed size whatever the length — a short convolution's last K − 1 gated inputs (LFM2),
a Mamba-2 mixer's convolution inputs and its scan's state [H_m, P, N] (Granite 4.0-H), or a gated DeltaNet's
convolution inputs and its matrix [H_v, d_k, d_v] (Qwen3-Next). A state only goes forward, so
the cache also keeps a snapshot of every state layer's state each `every` positions: an edit goes back to the last
snapshot before it and recomputes from there (`resume_every`), and the prefix store and the disk tier keep the
snapshots with the blocks they hold.

The snapshot at position p (a multiple of `every`) lives in the block of 16 positions that ends at p, spread over
its 16 rows in a buffer laid out as K/V are, [L_state, 1, 1, rows, w] — so every tier copies it as it copies K/V,
a block's positions at a time, and a block copied whole brings its snapshot whole; the other blocks carry none (a
tier's copy holds None there). `every` is 16 where a snapshot costs little (LFM2's), more where a state is large
(a Mamba-2 layer's, a DeltaNet's): the smallest 16 · 2^k at which the snapshots take at most SNAPSHOT_SHARE times
the K/V beside them a position (engine/MODELS.md, "Hybrid caches").

The last positions stay within reach without a snapshot (a speculative verify's rejected drafts taken back): a
convolution's state is its last inputs, kept for RECENT positions; a scanning layer (Mamba-2, DeltaNet) keeps its
state at two bases at most RECENT positions apart and its inputs since, and runs them again from the base
(MambaMixer, GatedDeltaNet).

Shapes: L_state state layers, D hidden, K the kernel's width, C the capacity, w = ⌈state values / 16⌉.
"""

from __future__ import annotations

import math

import torch

BLOCK = 16  # the prefix store's and the KV pool's block: a snapshot is spread over one
SNAPSHOT = BLOCK  # the spacing where snapshots are cheap (LFM2's)
SNAPSHOT_SHARE = 4  # the snapshots take at most this many times the K/V bytes of a position
# each kind of state layer in words: the panel's, the kind's in a list of layers, its short name
KIND_WORDS = {"conv": ("convolution", "short convolutions", "conv"), "mamba": ("Mamba-2", "Mamba-2", "mamba"),
              "delta": ("gated DeltaNet", "gated DeltaNet", "delta")}  # fmt: skip
SCANNING = tuple(k for k in KIND_WORDS if k != "conv")  # the kinds that scan: bases and inputs kept to go back


def kind_layers(kind: str) -> str:
    """A kind of state layers in words: "convolution layers", "Mamba-2 layers", "gated DeltaNet layers" (an unknown
    kind: a convolution's)."""
    return KIND_WORDS.get(kind, KIND_WORDS["conv"])[0] + " layers"


RECENT = 64  # the last positions a state can be set back to without a snapshot (a speculative rollback)


def snapshot_spacing(state_values: int, value_bytes: int, kv_bytes_per_position: int) -> int:
    """The positions between snapshots: the smallest 16 · 2^k at which one snapshot (state_values of value_bytes)
    spread over them takes at most SNAPSHOT_SHARE times a position's K/V bytes."""
    every = SNAPSHOT
    budget = max(1, SNAPSHOT_SHARE * kv_bytes_per_position)
    while state_values * value_bytes / every > budget and every < 1 << 20:
        every *= 2
    return every


class HybridCache:
    """K/V for the attention layers (`kv`, a KVCache or QuantKVCache of those layers alone, at the cache's precision)
    and each state layer's live state with its snapshots: a convolution's [1, D, K − 1] in the model dtype, a Mamba-2
    mixer's convolution inputs [1, C_m, K_m − 1] and scan state [1, H_m, P, N] in float32 (a DeltaNet's likewise:
    [1, C_δ, K_δ − 1] and [1, H_v, d_k, d_v])."""

    quantized = False
    windowed = False
    batch = 1
    shared_positions = 0

    def __init__(self, config, capacity: int, dtype, device, kv):
        kinds = config.state_layers
        self.kind = "delta" if any(config.delta_layers) else "mamba" if any(config.mamba_layers) else "conv"
        self.conv = [i for i, c in enumerate(kinds) if c]  # the state layers, by model layer
        self.attn = [i for i, c in enumerate(kinds) if not c]
        self.where = {i: j for j, i in enumerate(self.attn)} | {i: j for j, i in enumerate(self.conv)}
        self.kv = kv  # [L_attn, 1, H_kv, C, d] each
        self.quantized = kv.quantized
        L = len(self.conv)
        if self.scans:
            if self.kind == "mamba":
                C, k = config.mamba_conv_width, config.mamba_kernel
                self.ssm_shape = (config.mamba_heads, config.mamba_head_dim, config.mamba_state)
            else:
                C, k = config.delta_conv_width, config.delta_kernel
                self.ssm_shape = (config.delta_v_heads, config.delta_k_dim, config.delta_v_dim)
            self.state_shape = (C, k - 1)
            state_dtype = torch.float32  # the scan's state: in float32 whatever the weights
            self.state = torch.zeros(L, 1, C, k - 1, dtype=state_dtype, device=device)  # [L, 1, C_m, K_m − 1]
            self.ssm = torch.zeros(L, 1, *self.ssm_shape, dtype=state_dtype, device=device)  # [L, 1, H_m, P, N]
        else:
            D, k = config.hidden_size, config.conv_kernel
            self.state_shape = (D, k - 1)
            self.ssm_shape = None
            state_dtype = dtype
            self.state = torch.zeros(L, 1, D, k - 1, dtype=state_dtype, device=device)  # [L_conv, 1, D, K − 1]
            self.ssm = None
        self.values = math.prod(self.state_shape) + (math.prod(self.ssm_shape) if self.ssm_shape else 0)
        self.every = snapshot_spacing(self.values * L, self.state.element_size(), kv.bytes_per_position)
        self.width = math.ceil(self.values / BLOCK)  # w
        self.snap = torch.zeros(L, 1, 1, capacity // self.every * BLOCK, self.width, dtype=state_dtype, device=device)
        self.has_snap = [False] * (capacity // self.every + 1)  # snapshot k (at k · every) written for these positions
        self.at = [0] * L  # the position each layer's live state is at
        # a convolution's last positions: (the first, its inputs [1, D, K − 1 + n] from the state before it)
        self.recent: list[tuple[int, torch.Tensor] | None] = [None] * L
        # a scanning layer's bases [(position, conv inputs, scan state)] and its inputs since the first, one piece a
        # forward (the raw convolution inputs [1, C_m, n] and steps [1, n, ·], Mamba-2's Δ or the DeltaNet's b and a):
        # appended to, never copied whole on a decode step
        self.bases: list[list[tuple]] = [[] for _ in range(L)]
        self.inputs: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(L)]
        self.num_layers, self.num_kv_heads, self.head_dim = config.num_layers, config.cache_heads, config.cache_width
        self.capacity = capacity
        self._length = 0
        self._reset_bases()

    @property
    def scans(self) -> bool:
        """Whether the state layers run a scan (a Mamba-2 mixer, a gated DeltaNet: bases and inputs kept for going
        back) rather than a short convolution (its last inputs are its state)."""
        return self.kind in SCANNING

    # --- length, and going back ----------------------------------------------------------------------------------
    @property
    def length(self) -> int:
        return self._length

    @length.setter
    def length(self, n: int) -> None:
        """n positions held: where a layer's state is elsewhere (a cut, positions brought in from a tier), it is set
        from the snapshot at n, which must be one (a scanning layer's when it next asks for it)."""
        self._length = n
        self.kv.length = n
        for j, at in enumerate(self.at):
            if at != n and not self.scans:
                self._restore(j, n)
        if self.scans and any(at != n for at in self.at) and not self._reachable(n):
            raise ValueError(f"position {n} has no snapshot of the state layers' state (every {self.every})")

    @property
    def positions(self) -> int:
        return self._length

    @property
    def resume_every(self) -> int:
        """The positions it can go on from: multiples of this (engine.kv_tiers rounds down)."""
        return self.every

    def resumable(self, n: int) -> bool:
        """At 0, at a snapshot, or within the last positions (a verify's rejected drafts taken back)."""
        return n == 0 or (n <= self._length and self._reachable(n))

    def _reachable(self, n: int) -> bool:
        if n == 0 or self.snapshot_held(n):
            return True
        if self.scans:
            return all(bases and bases[0][0] <= n <= self._inputs_end(j) for j, bases in enumerate(self.bases))
        return all(self._recent_holds(r, n) for r in self.recent)

    def _recent_holds(self, recent, n: int) -> bool:
        """Whether a convolution layer's last inputs (first position, inputs) give its state at n."""
        return recent is not None and recent[0] <= n <= recent[0] + recent[1].shape[-1] - self.state_shape[1]

    def snapshot_held(self, n: int) -> bool:
        """Whether the snapshot at n is held for the positions the cache holds (written, or brought in whole)."""
        return n % self.every == 0 and n // self.every < len(self.has_snap) and self.has_snap[n // self.every]

    def restore_needs(self, n: int) -> int:
        return n

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} positions to {length}")
        if not self.resumable(length) and length != self._length:
            raise ValueError(f"position {length} has no snapshot of the state layers' state (every {self.every})")
        for k in range(length // self.every + 1, len(self.has_snap)):  # the snapshots past the cut: of other positions
            self.has_snap[k] = False
        k1 = self.state_shape[1]  # the inputs past the cut are of other positions too
        self.recent = [None if r is None or r[0] > length else (r[0], r[1][:, :, : length - r[0] + k1])
                       for r in self.recent]  # fmt: skip
        if self.scans:  # a live state past the cut is of other positions: set again when next asked for
            self.at = [at if at == length else -1 for at in self.at]
        for j, bases in enumerate(self.bases):
            self.bases[j] = [b for b in bases if b[0] <= length]
            self.inputs[j] = self._pieces(j, bases[0][0], length, bases[0][0]) if self.bases[j] else []
        if length == 0:
            self._reset_bases()
        self.length = length

    def release(self) -> None:
        self.truncate(0)

    def reserve(self, start: int, end: int) -> None:
        """Positions start..end-1 are writable: always, within the capacity (the model checks it)."""

    def _reset_bases(self) -> None:
        if self.scans:
            for j in range(len(self.conv)):
                self.bases[j] = [(0, torch.zeros_like(self.state[j]), torch.zeros_like(self.ssm[j]))]
                self.inputs[j] = []

    def _inputs_end(self, j: int) -> int:
        return self.bases[j][0][0] + sum(dt.shape[1] for _, dt in self.inputs[j])

    def _pieces(self, j: int, a: int, b: int, first: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Layer j's kept inputs of positions a..b-1 (they start at `first`): its pieces, one cut where it straddles
        a or b (copied, so the piece it was cut from can go)."""
        out, pos = [], first
        for xbc, dt in self.inputs[j]:
            n = dt.shape[1]
            lo, hi = max(a, pos), min(b, pos + n)
            if lo == pos and hi == pos + n:
                out.append((xbc, dt))
            elif lo < hi:
                out.append((xbc[:, :, lo - pos : hi - pos].clone(), dt[:, lo - pos : hi - pos].clone()))
            pos += n
        return out

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
        and a snapshot at each multiple of `every` the T positions reach."""
        j, k1 = self.where[layer], self.state_shape[1]
        T = full.shape[-1] - k1
        for b in self._snapshot_points(start, start + T):  # the states after b - 1
            self._write_snapshot(j, b, full[0, :, b - start : b - start + k1])
        self.state[j].copy_(full[:, :, T:])
        self.at[j] = start + T
        r = self.recent[j]  # the last RECENT positions' inputs, this forward's after those before it
        if r is not None and r[0] + r[1].shape[-1] - k1 == start:
            s0, inputs = r[0], torch.cat((r[1], full[:, :, k1:]), dim=-1)
        else:
            s0, inputs = start, full
        extra = inputs.shape[-1] - k1 - RECENT
        self.recent[j] = (s0 + extra, inputs[:, :, extra:].clone()) if extra > 0 else (s0, inputs)

    def scan_state(self, layer: int, start: int):
        """A scanning layer's (Mamba-2, DeltaNet) state before position `start`, as (base, conv inputs [1, C_m,
        K_m − 1], scan state [1, H_m, P, N], the raw inputs of positions base..start-1 (xBC [1, C_m, n], the steps
        [1, n, ·]) or None): the live state (base = start), a snapshot's, or a base's with the inputs since, which the
        layer runs again."""
        j = self.where[layer]
        bases = self.bases[j]
        if self.at[j] == start:
            if not bases:  # every base was past a cut: this live state is the first
                bases.append((start, self.state[j].clone(), self.ssm[j].clone()))
                self.inputs[j] = []
            elif start - bases[-1][0] >= RECENT:  # a new base: the oldest positions drop out of reach
                first = bases[0][0]
                bases[:] = [bases[-1], (start, self.state[j].clone(), self.ssm[j].clone())]
                self.inputs[j] = self._pieces(j, bases[0][0], start, first)
            return start, self.state[j], self.ssm[j], None
        if self.snapshot_held(start):
            conv, ssm = self._read_snapshot(j, start)
            self.state[j].copy_(conv)
            self.ssm[j].copy_(ssm)
            self.at[j] = start
            self.bases[j] = [(start, conv.clone(), ssm.clone())]
            self.inputs[j] = []
            return start, self.state[j], self.ssm[j], None
        base = next((b for b in reversed(bases) if b[0] <= start), None)
        if base is None or start > self._inputs_end(j):
            raise ValueError(f"position {start} has no snapshot of the state layers' state (every {self.every})")
        since = self._pieces(j, base[0], start, bases[0][0])
        if not since:
            return base[0], base[1], base[2], None
        return base[0], base[1], base[2], (torch.cat([x for x, _ in since], -1), torch.cat([d for _, d in since], 1))

    def keep_scan_state(self, layer: int, base: int, full: torch.Tensor, dt: torch.Tensor, states: dict) -> None:
        """After the mixer ran positions base..base+t-1: full [1, C_m, K_m − 1 + t] the conv inputs before base then
        the t raw xBC, dt [1, t, H_m] the raw steps, states {position: scan state [1, H_m, P, N]} at the points
        `state_points` named. Snapshots written, the live state and the inputs since the first base kept."""
        j, k1 = self.where[layer], self.state_shape[1]
        t = dt.shape[1]
        end = base + t
        for p in self._snapshot_points(base, end):
            self._write_snapshot(j, p, torch.cat((full[0, :, p - base : p - base + k1].reshape(-1).float(),
                                                  states[p].reshape(-1))))  # fmt: skip
        self.state[j].copy_(full[:, :, t:])
        self.ssm[j].copy_(states[end])
        self.at[j] = end
        first = self.bases[j][0][0]
        if not first <= base <= self._inputs_end(j):  # no inputs from the first base to this run's: the live state
            self.bases[j] = [(end, self.state[j].clone(), self.ssm[j].clone())]  # starts the reach again
            self.inputs[j] = []
            return
        self.inputs[j] = [*self._pieces(j, first, base, first), (full[:, :, k1:], dt.clone())]  # this run's, appended
        q = end - RECENT  # a long run: its state RECENT positions before the end, the first base now
        if q in states and q - first > RECENT:
            self.bases[j] = [(q, full[:, :, q - base : q - base + k1].clone(), states[q].clone())]
            self.inputs[j] = self._pieces(j, q, end, first)

    def state_points(self, base: int, end: int) -> list[int]:
        """The positions in (base, end] whose scan state a scanning layer's run must give: its snapshots', RECENT
        before the end (a base, so the inputs kept stay few after a long prompt) and the end (the live state)."""
        return sorted({*self._snapshot_points(base, end - 1), *([end - RECENT] if end - RECENT > base else []), end})

    def _snapshot_points(self, start: int, end: int) -> range:
        """The snapshot positions p with start < p ≤ end (the state after p − 1 among those computed)."""
        return range((start // self.every + 1) * self.every, min(end, self.capacity) + 1, self.every)

    def _write_snapshot(self, j: int, p: int, state: torch.Tensor) -> None:
        k = p // self.every
        flat = torch.zeros(BLOCK * self.width, dtype=self.snap.dtype, device=self.snap.device)
        flat[: state.numel()] = state.reshape(-1)
        self.snap[j, 0, 0, (k - 1) * BLOCK : k * BLOCK] = flat.view(BLOCK, self.width)
        self.has_snap[k] = True

    def _read_snapshot(self, j: int, p: int):
        k = p // self.every
        flat = self.snap[j, 0, 0, (k - 1) * BLOCK : k * BLOCK].reshape(-1)
        n = math.prod(self.state_shape)
        conv = flat[:n].view(1, *self.state_shape).to(self.state.dtype)
        if self.ssm_shape is None:
            return conv, None
        return conv, flat[n : n + math.prod(self.ssm_shape)].view(1, *self.ssm_shape)

    def _restore(self, j: int, n: int) -> None:
        """A convolution layer's state set to the one after position n − 1: zeros at 0, from the last positions'
        inputs where n is among them, else its snapshot."""
        recent = self.recent[j]
        if n == 0:
            self.state[j].zero_()
        elif self._recent_holds(recent, n):
            self.state[j].copy_(recent[1][:, :, n - recent[0] : n - recent[0] + self.state_shape[1]])
        elif self.snapshot_held(n):
            self.state[j].copy_(self._read_snapshot(j, n)[0])
        else:
            raise ValueError(f"position {n} has no snapshot of the state layers' state (every {self.every})")
        self.at[j] = n

    # --- what the tiers copy --------------------------------------------------------------------------------------
    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The attention layers' K/V buffers, then the snapshots' (positions on dimension 3 in each; the snapshots'
        rows are their blocks' only)."""
        return (*self.kv.buffers(), self.snap)

    @property
    def optional_buffers(self) -> tuple[int, ...]:
        """The buffers a block may lack: the snapshots' (a block that ends at no snapshot, or before its state was
        computed, carries none)."""
        return (len(self.kv.buffers()),)

    def _snapshot_rows(self, a: int, b: int) -> slice | None:
        """Where positions a..b-1 sit in the snapshots' buffer: every one in blocks that end at a snapshot, else
        None."""
        if self.every == BLOCK:
            return slice(a, b)
        last = (b - 1) // BLOCK * BLOCK  # the block of b − 1: the range must lie in it, and it must end at a snapshot
        if a < last or (last + BLOCK) % self.every:
            return None
        k = (last + BLOCK) // self.every
        return slice((k - 1) * BLOCK + a - last, (k - 1) * BLOCK + b - last)

    def take(self, a: int, b: int) -> tuple[torch.Tensor | None, ...]:
        rows = self._snapshot_rows(a, b)
        held = rows is not None and self.snapshot_held((b - 1) // BLOCK * BLOCK + BLOCK)
        snap = self.snap[:, :, :, rows].clone() if held else None
        return (*(buf[:, :, :, a:b].clone() for buf in self.kv.buffers()), snap)

    def held_from(self, a: int, b: int) -> int:
        return a

    def give(self, a: int, b: int, tensors) -> None:
        *kv, snap = tensors
        for buf, t in zip(self.kv.buffers(), kv):
            if t is not None:
                buf[:, :, :, a:b].copy_(t)
        rows = self._snapshot_rows(a, b)
        end = (b - 1) // BLOCK * BLOCK + BLOCK
        if snap is not None and rows is not None and b - a == rows.stop - rows.start:
            self.snap[:, :, :, rows].copy_(snap)
            if a <= end - BLOCK and b == end and end % self.every == 0:  # the whole block: the snapshot whole
                self.has_snap[end // self.every] = True

    def readable_by_kernels(self, dtype) -> bool:
        return False  # the kernels read a cache whose layer i is the model's layer i

    def kernel_table(self) -> None:
        return None

    # --- what it takes ------------------------------------------------------------------------------------------
    @property
    def layer_words(self) -> str:
        """The state layers in words: "convolution layers" (LFM2), "Mamba-2 layers" (Granite 4.0-H), "gated DeltaNet
        layers" (Qwen3-Next)."""
        return kind_layers(self.kind)

    def plan_words(self, num_layers: int) -> tuple[str, str]:
        """The Models dialog's words for the state layers, long and short: how many, the state, the snapshots."""
        n, state = len(self.conv), _size(self.state_bytes)
        kind, short = KIND_WORDS[self.kind][1:]
        return (f"{n} of {num_layers} layers {kind}: a state of {state} at any length, a snapshot of it every "
                f"{self.every:,} positions", f"{n}/{num_layers} {short}, state {state}")  # fmt: skip

    @property
    def state_bytes(self) -> int:
        """The state layers' live state, the same at any length: L_conv · D · (K − 1) · b, or per Mamba-2 layer its
        convolution inputs and scan state, (C_m · (K_m − 1) + H_m · P · N) · 4 (a DeltaNet's, (C_δ · (K_δ − 1) +
        H_v · d_k · d_v) · 4)."""
        return len(self.conv) * self.values * self.state.element_size()

    @property
    def snapshot_bytes(self) -> int:
        """One snapshot of every state layer."""
        return len(self.conv) * BLOCK * self.width * self.snap.element_size()

    @property
    def snapshot_bytes_per_position(self) -> int:
        return self.snapshot_bytes // self.every

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
        """Per layer kind: the attention layers' K/V (growing with the positions) and the state layers' state (the
        same at any length; its snapshots, `every` positions apart, in the allocated bytes)."""
        n = self._length
        snapshots = n // self.every
        return [
            {"kind": "full", "layers": len(self.attn), "window": None, "slots": self.capacity, "positions": n,
             "payload_bytes": self.kv.payload_bytes, "allocated_bytes": self.kv.allocated_bytes},
            {"kind": self.kind, "layers": len(self.conv), "window": None, "slots": self.capacity // self.every,
             "positions": n, "payload_bytes": self.state_bytes, "state_bytes": self.state_bytes,
             "snapshots": snapshots, "snapshot_bytes": snapshots * self.snapshot_bytes,
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


def _size(n: int) -> str:
    """Bytes in the Models dialog's words: MiB for a scanning model's state (tens of them), KiB, or bytes."""
    if n >= 1 << 20:
        return f"{n / 2**20:,.1f} MiB"
    return f"{n / 1024:,.0f} KiB" if n >= 1024 else f"{n:,} B"
