"""CappedKVCache: every byte allocated once, when the session starts.

Layout (gpt-fast style, one buffer for all layers, written by index):

    k, v:   [layers, kv_heads, M, head_dim]
    kind:   [layers, kv_heads, M]  int8   SlotKind (empty / prefix / vision / text)
    sink:   [layers, kv_heads, M]  bool   StateKV sink flag (a flag, never a second copy)
    frame:  [layers, kv_heads, M]  int32  frame-pair index the token came from (-1: none)
    row,col:[layers, kv_heads, M]  int16  merged-grid coordinates of a vision token (-1: none)
    tpos:   [layers, kv_heads, M]  int32  temporal M-RoPE position the key was rotated with
    k_scale, v_scale: [layers, kv_heads, M] bf16   only for an 8-bit cache (edgekv/cache/quant.py)

Readers never index ``k``/``v`` directly: ``keys(layer)`` / ``values(layer)`` return them in the
model's dtype — views of the buffers for a 16/32-bit cache, dequantized copies for an 8-bit one. Writes
go through ``write_layer`` (quantize on write), ``retime_`` (re-basing) and ``compact`` (scales move
with their slots).

An 8-bit cache stores keys **time-neutral**: before quantizing, the temporal M-RoPE pairs of each key
are rotated back by the slot's ``tpos`` (edgekv/positions.py), and ``keys()`` rotates them forward again
after dequantizing. Re-basing then only rewrites ``tpos``: no key is re-quantized, so no rounding error
accumulates however often positions are re-based. Rotating and re-quantizing in place instead was
measured (1,000 re-basings of random keys, head_dim 128, temporal section 16): 11 % relative error for
int8 and 92 % for fp8, against the one-time quantization error (0.6 % / 3 %) this layout keeps. The
price is one extra rotation of the temporal pairs on every read (the fp32 math of ``rotate_temporal``
over ``2 * temporal_section`` of the ``head_dim`` channels). ``tpos`` of a chunk is written before its
keys (``StreamSession._prefill`` writes the metadata first).

Metadata is per layer *and* per KV head because a compression keeps different tokens in different
heads (DESIGN invariant 2). Slot ``i`` of head ``h`` and slot ``i`` of head ``h'`` may therefore hold
different tokens; what every (layer, head) shares is the *count* of valid slots: the valid slots are
always the prefix ``[0, length)``. New tokens are written at ``[length, length + P)`` for all heads at
once, and a compaction packs the kept slots back to the front in their original order.

Nothing here allocates after ``__init__``: writes go through ``copy_``/``index_select(out=)``, and the
compaction scratch is a preallocated one-layer buffer that is part of ``capacity_bytes``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import IntEnum

import torch

from edgekv.cache.quant import SCALE_DTYPE, bit_view, dequantize
from edgekv.cache.specs import CacheSpec
from edgekv.kernels._triton import use_triton
from edgekv.kernels.compaction import compact_
from edgekv.kernels.quant_write import quantize_write_reference, quantize_write_triton
from edgekv.positions import rotate_temporal, rotate_temporal_

log = logging.getLogger("edgekv.cache")


class SlotKind(IntEnum):
    EMPTY = 0
    PREFIX = 1
    VISION = 2
    TEXT = 3


class CacheFullError(RuntimeError):
    """Raised when a write would exceed the hard cap and the policy may not evict."""


class CapTooSmallError(ValueError):
    """A cap that cannot hold what a session always keeps (the prefix, two frame pairs, the text reserve, a
    policy's recent pairs and sinks): raised once the first frame fixes the grid, before anything is written."""


@dataclass(frozen=True)
class ChunkMeta:
    """Metadata of a chunk of ``P`` tokens about to be written (same for every layer and head)."""

    kind: SlotKind
    frame: int = -1
    rows: torch.Tensor | None = None  # [P] int16 merged-grid row (vision only)
    cols: torch.Tensor | None = None  # [P] int16 merged-grid column (vision only)
    tpos: torch.Tensor | None = None  # [P] int32 temporal position


METADATA_FIELDS = ("kind", "sink", "frame", "row", "col", "tpos")


class CappedKVCache:
    """A fixed-capacity KV cache with per-slot provenance. See the module docstring for the layout."""

    def __init__(self, spec: CacheSpec, capacity: int, device: torch.device | str = "cpu",
                 compute_dtype: torch.dtype | None = None,
                 rope: tuple[torch.Tensor, int] | None = None) -> None:
        """``compute_dtype``: what ``keys``/``values`` return (the model's dtype); default the storage dtype,
        fp32 for an 8-bit cache. ``rope``: (rotary inverse frequencies [D/2], temporal section), which an
        8-bit cache needs to store keys time-neutral (see the module docstring)."""
        if capacity <= 0:
            raise ValueError(f"cache capacity must be positive, got {capacity}")
        first = spec.layers[0]
        if any(layer != first for layer in spec.layers):
            raise ValueError("CappedKVCache needs the same KV shape in every layer")
        self.spec = spec
        self.capacity = capacity
        self.device = torch.device(device)
        self.num_layers = len(spec.layers)
        self.kv_heads = first.kv_heads
        self.head_dim = first.head_dim
        self.dtype = first.dtype  # storage
        self.quantized = first.quantized
        self.compute_dtype = compute_dtype or (torch.float32 if self.quantized else self.dtype)
        if self.quantized and rope is None:
            raise ValueError(f"an 8-bit ({self.dtype}) CappedKVCache needs rope=(inv_freq, temporal_section)")
        # inverse frequencies on the cache's device once (the int8 write kernel reads them every layer)
        self.rope = None if rope is None else (rope[0].to(device=device, dtype=torch.float32), rope[1])
        self.triton_write = self.dtype is torch.int8  # kernels/quant_write.py where Triton runs, until it fails once
        shape = (self.num_layers, self.kv_heads, capacity)
        # k, v: [layers, kv_heads, M, head_dim]
        self.k = torch.zeros(*shape, self.head_dim, dtype=self.dtype, device=self.device)
        self.v = torch.zeros_like(self.k)
        self.kind = torch.zeros(shape, dtype=torch.int8, device=self.device)
        self.sink = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self.frame = torch.full(shape, -1, dtype=torch.int32, device=self.device)
        self.row = torch.full(shape, -1, dtype=torch.int16, device=self.device)
        self.col = torch.full(shape, -1, dtype=torch.int16, device=self.device)
        self.tpos = torch.zeros(shape, dtype=torch.int32, device=self.device)
        # Per-slot scales of an 8-bit cache (one for K, one for V), and one layer of scratch to compact them.
        self.k_scale = torch.ones(shape, dtype=SCALE_DTYPE, device=self.device) if self.quantized else None
        self.v_scale = torch.ones_like(self.k_scale) if self.quantized else None
        self._scratch_scale = (torch.zeros(self.kv_heads * capacity, dtype=SCALE_DTYPE, device=self.device)
                               if self.quantized else None)
        # Compaction scratch: one layer of K/V and one layer of each metadata field.
        # Compaction scratch: one head of one layer of K (or V), and one layer of each metadata field.
        # Flat, so that a prefix of any length is a contiguous view.
        self._scratch_kv = torch.zeros(capacity * self.head_dim, dtype=self.dtype, device=self.device)
        self._scratch_meta = {
            name: torch.zeros(self.kv_heads * capacity, dtype=getattr(self, name).dtype, device=self.device)
            for name in METADATA_FIELDS
        }
        self.length = 0

    # ------------------------------------------------------------------ accounting
    def buffers(self) -> list[torch.Tensor]:
        scales = [self.k_scale, self.v_scale, self._scratch_scale] if self.quantized else []
        return [self.k, self.v, *(getattr(self, n) for n in METADATA_FIELDS),
                self._scratch_kv, *self._scratch_meta.values(), *scales]

    @property
    def capacity_bytes(self) -> int:
        """Every byte this cache holds: K/V, metadata and the compaction scratch (= spec.bytes_for(M))."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    @property
    def kv_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    # ------------------------------------------------------------------ reading
    def keys(self, layer: int | None = None, end: int | None = None) -> torch.Tensor:
        """K of slots ``[0, end)`` (default: every slot) of one layer [kv_heads, n, D], or of all layers
        [layers, kv_heads, n, D] when ``layer`` is None, in ``compute_dtype``; a view unless quantized."""
        return self._read(self.k, self.k_scale, layer, end)

    def values(self, layer: int | None = None, end: int | None = None) -> torch.Tensor:
        """V, as ``keys``."""
        return self._read(self.v, self.v_scale, layer, end)

    def slots(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots ``[start, end)`` of every layer, [layers, kv_heads, n, D] in ``compute_dtype`` with the
        keys rotated to their slots' positions (what the archive stores of a pair): views of a 16/32-bit cache,
        dequantized copies of an 8-bit one."""
        if not self.quantized:
            return self.k[:, :, start:end], self.v[:, :, start:end]
        k = dequantize(self.k[:, :, start:end], self.k_scale[:, :, start:end], torch.float32)
        k = rotate_temporal(k, self.tpos[:, :, start:end], *self.rope)
        v = dequantize(self.v[:, :, start:end], self.v_scale[:, :, start:end], torch.float32)
        return k.to(self.compute_dtype), v.to(self.compute_dtype)

    def policy_keys(self, end: int) -> "torch.Tensor | DequantizedView":
        """K of slots ``[0, end)`` of every layer for a policy: the buffer's view, or, for an 8-bit cache,
        a ``DequantizedView`` that dequantizes only the layers (or gathered slots) a reader indexes."""
        return DequantizedView(self, self.k, self.k_scale, end) if self.quantized else self.keys(end=end)

    def policy_values(self, end: int) -> "torch.Tensor | DequantizedView":
        """V, as ``policy_keys``."""
        return DequantizedView(self, self.v, self.v_scale, end) if self.quantized else self.values(end=end)

    def _read(self, data: torch.Tensor, scale: torch.Tensor | None, layer: int | None, end: int | None) -> torch.Tensor:
        end = self.capacity if end is None else end
        index = (slice(None),) if layer is None else (layer,)
        if not self.quantized:
            return data[(*index, slice(None), slice(0, end))]
        return self._dequantized(data, scale, end, index)

    def _dequantized(self, data: torch.Tensor, scale: torch.Tensor, end: int, index) -> torch.Tensor:
        """``data[:, :, :end][index]`` of an 8-bit buffer in ``compute_dtype`` (the math in fp32); keys are
        stored time-neutral, so they are rotated forward to each slot's temporal position."""
        out = dequantize(data[:, :, :end][index], scale[:, :, :end][index], torch.float32)
        if data is self.k:
            out = rotate_temporal(out, self.tpos[:, :, :end][index], *self.rope)
        return out.to(self.compute_dtype)

    def data_ptrs(self) -> tuple[int, ...]:
        return tuple(t.data_ptr() for t in self.buffers())

    @property
    def free(self) -> int:
        return self.capacity - self.length

    # ------------------------------------------------------------------ writing
    def check_room(self, num_tokens: int) -> None:
        if self.length + num_tokens > self.capacity:
            raise CacheFullError(
                f"cache holds {self.length} of {self.capacity} slots; {num_tokens} more do not fit"
            )

    def write_layer(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one layer's K/V for slots ``[start, start + P)``. k, v: [kv_heads, P, head_dim]."""
        end = start + k.shape[1]
        if self.triton_write and use_triton(k):  # one launch (kernels/quant_write.py): torch's codes
            try:
                quantize_write_triton(k, v, self.tpos[layer, :, start:end], *self.rope, self.k[layer, :, start:end],
                                      self.k_scale[layer, :, start:end], self.v[layer, :, start:end],
                                      self.v_scale[layer, :, start:end])
                return
            except ValueError:
                raise
            except Exception as exc:  # a kernel this device's Triton cannot build: nothing was written
                log.warning("int8 cache write: the Triton kernel failed (%s: %s); torch's write from now on",
                            type(exc).__name__, str(exc)[:300])
                self.triton_write = False
        if self.quantized:
            codes = quantize_write_reference(k, v, self.tpos[layer, :, start:end], *self.rope, self.dtype)
            for target, written in zip((self.k, self.k_scale, self.v, self.v_scale), codes):
                target[layer, :, start:end].copy_(written)
            return
        self.k[layer, :, start:end].copy_(k)
        self.v[layer, :, start:end].copy_(v)

    def retime_(self, tpos: torch.Tensor, inv_freq: torch.Tensor, temporal_section: int) -> None:
        """Give slots ``[0, n)`` the temporal positions ``tpos`` [layers, kv_heads, n] and move their keys
        to match (re-basing, DESIGN invariant 5): a 16/32-bit cache rotates each key's temporal M-RoPE
        pairs by (new - old), exact up to one rounding to the storage dtype; an 8-bit cache stores keys
        time-neutral, so rewriting ``tpos`` is the whole move and nothing is re-quantized."""
        n = tpos.shape[-1]
        if not self.quantized:
            old = self.tpos[:, :, :n].long()
            for layer in range(self.num_layers):
                rotate_temporal_(self.k[layer, :, :n], tpos[layer].long() - old[layer], inv_freq, temporal_section)
        self.tpos[:, :, :n] = tpos.to(self.tpos.dtype)

    def write_meta(self, start: int, num_tokens: int, meta: ChunkMeta) -> None:
        end = start + num_tokens
        self.kind[:, :, start:end] = int(meta.kind)
        self.sink[:, :, start:end] = False
        self.frame[:, :, start:end] = meta.frame
        if meta.rows is not None:
            self.row[:, :, start:end] = meta.rows.to(self.row.dtype)
            self.col[:, :, start:end] = meta.cols.to(self.col.dtype)
        else:
            self.row[:, :, start:end] = -1
            self.col[:, :, start:end] = -1
        if meta.tpos is not None:
            self.tpos[:, :, start:end] = meta.tpos.to(self.tpos.dtype)

    def commit(self, num_tokens: int) -> None:
        """Make the slots written at ``[length, length + num_tokens)`` part of the cache."""
        self.check_room(num_tokens)
        self.length += num_tokens

    def truncate(self, length: int) -> None:
        """Forget every slot at ``length`` and beyond (question and answer tokens after an ask)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} slots to {length}")
        self.clear_meta(length, self.length)
        self.length = length

    def clear_meta(self, start: int, end: int) -> None:
        """Mark slots ``[start, end)`` empty (after a truncation, or a chunk whose prefill failed)."""
        self.kind[:, :, start:end] = int(SlotKind.EMPTY)
        self.sink[:, :, start:end] = False
        self.frame[:, :, start:end] = -1

    # ------------------------------------------------------------------ compaction
    def validate_keep(self, keep: torch.Tensor) -> None:
        """keep: [layers, kv_heads, C] slot indices, strictly increasing per row, all < length."""
        expected = (self.num_layers, self.kv_heads)
        if keep.dim() != 3 or tuple(keep.shape[:2]) != expected:
            raise ValueError(f"keep must be [layers={expected[0]}, kv_heads={expected[1]}, C], got {tuple(keep.shape)}")
        if keep.shape[2] > self.length:
            raise ValueError(f"keep selects {keep.shape[2]} slots but the cache holds {self.length}")
        if keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= self.length):
            raise ValueError(f"keep indices must lie in [0, {self.length})")
        if keep.shape[2] > 1 and not bool((keep[..., 1:] > keep[..., :-1]).all()):
            raise ValueError("keep indices must be strictly increasing in every (layer, head) row")

    def compact(self, keep: torch.Tensor) -> None:
        """Keep only the slots ``keep[l, h]`` in each (layer, head), packed to the front in order.

        Validates everything before touching a buffer, so a bad ``keep`` leaves the cache as it was
        (DESIGN invariant 7: never half-compacted).
        """
        self.validate_keep(keep)
        kept = keep.shape[2]
        compact_(bit_view(self.k), bit_view(self.v), keep, **{name: getattr(self, name) for name in METADATA_FIELDS},
                 scratch_kv=bit_view(self._scratch_kv), scratch_meta=self._scratch_meta)
        if self.quantized:
            index = keep.to(device=self.device, dtype=torch.int64)
            scratch = self._scratch_scale[: self.kv_heads * kept].view(self.kv_heads, kept)
            for scale in (self.k_scale, self.v_scale):
                for layer in range(self.num_layers):
                    torch.gather(scale[layer], 1, index[layer], out=scratch)
                    scale[layer, :, :kept].copy_(scratch)
        self.length = kept


class DequantizedView:
    """K or V of an 8-bit cache's slots ``[0, end)``, dequantized only where it is indexed.

    A compression reads the whole cache: handing policies ``keys()`` of an 8-bit cache would build a
    full-size copy in the compute dtype first (~113 MB each for K and V at the 3B shape, bf16, M =
    6,144) — memory outside the cap. This stands in for that [layers, kv_heads, end, head_dim] tensor
    where the policies' scores read it: ``view[lo:hi]`` (a block of layers, as the CPU passes of
    ``edgekv.kernels`` read K and V) and ``view[where]`` (advanced indexing, e.g. the recent slots) return
    dequantized tensors of just those elements, with the same elementwise fp32 math as ``keys()`` (so the
    scores are bit-identical, tested). ``materialize()`` returns the whole tensor (the Triton paths).
    """

    def __init__(self, cache: CappedKVCache, data: torch.Tensor, scale: torch.Tensor, end: int) -> None:
        self._cache, self._data, self._scale, self._end = cache, data, scale, end
        self.shape = torch.Size((cache.num_layers, cache.kv_heads, end, cache.head_dim))
        self.dtype = cache.compute_dtype
        self.device = cache.device

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def dim(self) -> int:
        return 4

    def __getitem__(self, index) -> torch.Tensor:
        return self._cache._dequantized(self._data, self._scale, self._end, index)

    def materialize(self) -> torch.Tensor:
        return self[:]
