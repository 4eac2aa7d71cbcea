"""The capped KV cache: specs that report bytes, preallocated buffers and per-slot metadata."""

from edgekv.cache.specs import CacheSpec, LayerKVSpec

__all__ = ["CacheSpec", "LayerKVSpec"]
