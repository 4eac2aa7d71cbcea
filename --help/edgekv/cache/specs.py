"""Frozen per-layer KV-cache specs that report their own bytes.

The budget of a session is computed from these specs, never guessed: the hard cap ``M`` (tokens) and
the bytes it costs are two views of one number (``bytes = M * bytes_per_token``). Metadata per slot
(kind, frame, row, col, temporal position, sink flag) is counted too, so ``cache_capacity_bytes``
is everything the capped cache allocates. An 8-bit cache (``cache.kv_dtype: int8 | fp8``,
edgekv/cache/quant.py) also keeps one bf16 scale per slot, layer and KV head for K and one for V;
those are counted as well, so ``max_mib`` buys what the scales leave.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from edgekv.cache.quant import SCALE_DTYPE, is_quantized

# Per slot, per layer and per KV head, CappedKVCache keeps: kind (int8), sink flag (bool),
# frame index (int32), merged-grid row and column (int16 each), temporal position (int32).
METADATA_BYTES_PER_SLOT = 1 + 1 + 4 + 2 + 2 + 4


KV_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8,
             "fp8": torch.float8_e4m3fn}


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class LayerKVSpec:
    """One decoder layer's share of the cache: K and V of ``kv_heads`` heads of ``head_dim``, stored in
    ``dtype`` (int8 / float8_e4m3fn: quantized, with a scale per slot for K and for V)."""

    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"LayerKVSpec needs positive kv_heads and head_dim, got {self.kv_heads}, {self.head_dim}")

    @property
    def quantized(self) -> bool:
        return is_quantized(self.dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.kv_heads * self.head_dim * dtype_bytes(self.dtype)

    @property
    def scale_bytes_per_token(self) -> int:
        """K and V scales of every KV head (quantized caches only)."""
        return 2 * self.kv_heads * dtype_bytes(SCALE_DTYPE) if self.quantized else 0

    @property
    def metadata_bytes_per_token(self) -> int:
        return self.kv_heads * METADATA_BYTES_PER_SLOT

    @property
    def bytes_per_token(self) -> int:
        return self.kv_bytes_per_token + self.metadata_bytes_per_token + self.scale_bytes_per_token


@dataclass(frozen=True)
class CacheSpec:
    """All layers of a model; converts between a token cap and bytes."""

    layers: tuple[LayerKVSpec, ...]

    @classmethod
    def uniform(cls, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> "CacheSpec":
        return cls(tuple(LayerKVSpec(kv_heads, head_dim, dtype) for _ in range(num_layers)))

    @property
    def scratch_bytes_per_token(self) -> int:
        """Compaction scratch: one head's K (or V) row, one layer's metadata and one layer's scales, per slot."""
        return max(layer.head_dim * dtype_bytes(layer.dtype) + layer.metadata_bytes_per_token
                   + layer.scale_bytes_per_token // 2 for layer in self.layers)

    @property
    def bytes_per_token(self) -> int:
        return sum(layer.bytes_per_token for layer in self.layers) + self.scratch_bytes_per_token

    def bytes_for(self, tokens: int) -> int:
        return tokens * self.bytes_per_token

    def tokens_for_bytes(self, num_bytes: int) -> int:
        """Largest token cap whose cache fits in ``num_bytes``."""
        return int(num_bytes // self.bytes_per_token)

    def tokens_for_mib(self, mib: float) -> int:
        return self.tokens_for_bytes(int(mib * 1024 * 1024))
