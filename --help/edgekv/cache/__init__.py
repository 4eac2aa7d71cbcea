"""The capped KV cache: specs that report bytes, preallocated buffers and per-slot metadata."""

from edgekv.cache.capped import CacheFullError, CappedKVCache, CapTooSmallError, ChunkMeta, SlotKind
from edgekv.cache.specs import CacheSpec, LayerKVSpec

__all__ = [
    "CacheFullError", "CacheSpec", "CappedKVCache", "CapTooSmallError", "ChunkMeta", "LayerKVSpec", "SlotKind",
]
