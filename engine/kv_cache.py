"""A preallocated KV cache with an explicit length: it never grows by concatenation."""

from __future__ import annotations

import torch

from .quant import BITS, check_mode, dequantize, pack_int4, quantize, unpack_int4


def payload_bytes(num_layers: int, positions: int, num_kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
    """Ideal KV payload, 2 · L · T · H_kv · d · b (K and V). For several sequences pass the sum of lengths as T."""
    return 2 * num_layers * positions * num_kv_heads * head_dim * bytes_per_value


class KVCache:
    """K and V for every layer: [L, B, H_kv, capacity, d] each, plus `length`, the positions consumed.

    A position counts once a forward pass has consumed it: prefill of an 8-position prompt leaves
    length 8; consuming token 1 makes it 9.
    """

    quantized = False  # K/V held in the model dtype, as the attention kernels read them

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
        shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, C, d]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, B, H_kv, C, d]
        self.num_layers, self.batch, self.num_kv_heads, self.capacity, self.head_dim = (
            num_layers,
            batch,
            num_kv_heads,
            capacity,
            head_dim,
        )
        self.length = 0

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

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """Every tensor that holds a position, each [L, B, H_kv, C, w] (the prefix store copies these)."""
        return self.k, self.v

    def readable_by_kernels(self, dtype: torch.dtype) -> bool:
        """Whether a CPU kernel can attend over this cache in place: one sequence, K/V of `dtype` in memory."""
        return not self.quantized and self.batch == 1 and self.k.dtype == dtype and self.k.is_cpu

    def truncate(self, length: int) -> None:
        """Forget positions from `length` on; their slots are overwritten by later writes."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        self.length = length

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v ([B, H_kv, T, d]) at positions start..start+T-1; return views of positions 0..start+T-1."""
        end = start + k.shape[2]
        self.k[layer, :, :, start:end] = k
        self.v[layer, :, :, start:end] = v
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
        self.num_layers, self.batch, self.num_kv_heads, self.capacity, self.head_dim = (
            num_layers,
            batch,
            num_kv_heads,
            capacity,
            head_dim,
        )
        width = head_dim // 2 if mode == "int4" else head_dim
        code_dtype = torch.uint8 if mode == "int4" else torch.int8
        shape = (num_layers, batch, num_kv_heads, capacity, width)
        self.k = torch.zeros(shape, dtype=code_dtype, device=device)  # [L, B, H_kv, C, d or d/2] codes
        self.v = torch.zeros(shape, dtype=code_dtype, device=device)
        sshape = (num_layers, batch, num_kv_heads, capacity, 1)
        self.k_scale = torch.ones(sshape, dtype=torch.float32, device=device)  # [L, B, H_kv, C, 1]
        self.v_scale = torch.ones(sshape, dtype=torch.float32, device=device)
        self.bits = BITS[mode]
        self.length = 0

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

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor):
        self._store(self.k, self.k_scale, layer, start, k)
        self._store(self.v, self.v_scale, layer, start, v)
        end = start + k.shape[2]
        return self._load(self.k, self.k_scale, layer, end), self._load(self.v, self.v_scale, layer, end)


def quantized_bytes_per_position(num_layers: int, num_kv_heads: int, head_dim: int, mode: str) -> int:
    """2 · L · H_kv · (d · bits/8 + 4): codes for K and V of every layer and KV head, one float32 scale each."""
    return 2 * num_layers * num_kv_heads * (head_dim * BITS[mode] // 8 + 4)


def bytes_per_position(config, dtype: torch.dtype, kv: str = "none") -> int:
    """What one cached position takes for a model config, in the model dtype ("none") or int8/int4 codes."""
    if kv == "none":
        size = torch.empty((), dtype=dtype).element_size()
        return payload_bytes(config.num_layers, 1, config.num_kv_heads, config.head_dim, size)
    check_mode(kv)
    return quantized_bytes_per_position(config.num_layers, config.num_kv_heads, config.head_dim, kv)


def make_cache(config, capacity: int, dtype: torch.dtype, device, kv: str = "none") -> KVCache:
    """The cache for a model config at a precision: the model dtype ("none"), or int8/int4 codes + scales."""
    if kv == "none":
        return KVCache(config.num_layers, config.num_kv_heads, config.head_dim, capacity, dtype, device)
    return QuantKVCache(config.num_layers, config.num_kv_heads, config.head_dim, capacity, dtype, device, kv)
