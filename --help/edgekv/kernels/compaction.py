"""Fused in-place compaction of the capped cache: K, V and the six metadata fields gathered by ``keep``.

    buf[l, h, c] <- buf[l, h, keep[l, h, c]]   for c < C, every buffer; metadata tail [C, M) reset

``keep`` is strictly increasing per (layer, head) row (``CappedKVCache.validate_keep``), so
``keep[c] >= c``: the source of slot ``c`` is never a slot that an earlier ``c' < c`` overwrote. The
torch reference (what ``CappedKVCache.compact`` does) still goes through a preallocated scratch, one
head at a time: every byte is read, written to scratch, read back and written again, in about
4 * L * H + 12 * L small launches (720 at the 3B shape). The kernel does it in place in one launch:
one program per (layer, head, block of D) walks the row in order, a block of ``BLOCK_C`` slots at a time:
load the block's sources, barrier, store. Within a block a source may be a destination of the same
block (hence the barrier); a block's sources are >= its first slot, so they never meet the slots that
earlier blocks wrote, and later blocks only write after their own loads. Trade-off: the ordered walk
serializes each row (parallelism L * H * D / BLOCK_D programs, 144 at the 3B shape) and the in-order
argument needs a strictly increasing ``keep`` (not checked here: the cache validates it before any
write); in exchange no scratch is read and each kept byte moves once. Metadata moves with the program
of the first D block; ``tpos`` keeps its stale tail, as the cache does.
"""

from __future__ import annotations

import torch

from edgekv.kernels._triton import cdiv, interpreting, jit, next_power_of_2, tl, use_triton

METADATA_FIELDS = ("kind", "sink", "frame", "row", "col", "tpos")
# Values the metadata tail [C, M) is reset to (SlotKind.EMPTY = 0, no sink, no frame, no cell); tpos is kept.
TAIL_FILL = {"kind": 0, "sink": 0, "frame": -1, "row": -1, "col": -1}


# ---------------------------------------------------------------------------------------------- reference
def compact_reference_(
    k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *, kind: torch.Tensor, sink: torch.Tensor,
    frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor, tpos: torch.Tensor,
    scratch_kv: torch.Tensor | None = None, scratch_meta: dict[str, torch.Tensor] | None = None,
) -> None:
    """``CappedKVCache.compact`` after validation: per head through ``scratch_kv`` (flat, >= C * D, k's
    dtype) and per layer through ``scratch_meta[name]`` (flat, >= H * C); allocated when not given."""
    layers, heads, _, dim = k.shape
    kept = keep.shape[2]
    keep = keep.to(device=k.device, dtype=torch.int64)
    meta = {"kind": kind, "sink": sink, "frame": frame, "row": row, "col": col, "tpos": tpos}
    if scratch_kv is None:
        scratch_kv = torch.empty(kept * dim, dtype=k.dtype, device=k.device)
    if scratch_meta is None:
        scratch_meta = {name: torch.empty(heads * kept, dtype=buf.dtype, device=buf.device) for name, buf in meta.items()}
    kv_scratch = scratch_kv[: kept * dim].view(kept, dim)
    for layer in range(layers):
        for head in range(heads):
            for buf in (k, v):
                torch.index_select(buf[layer, head], 0, keep[layer, head], out=kv_scratch)
                buf[layer, head, :kept].copy_(kv_scratch)
        for name, buf in meta.items():
            scratch = scratch_meta[name][: heads * kept].view(heads, kept)
            torch.gather(buf[layer], 1, keep[layer], out=scratch)
            buf[layer, :, :kept].copy_(scratch)
    for name, value in TAIL_FILL.items():
        meta[name][:, :, kept:] = value


# ---------------------------------------------------------------------------------------------- kernel
@jit
def _compact_kernel(
    k_ptr, v_ptr, keep_ptr, kind_ptr, sink_ptr, frame_ptr, row_ptr, col_ptr, tpos_ptr,
    heads, kept, capacity, dim, s_kl, s_kh, s_kn, s_kd, s_ml, s_mh, s_mn,
    BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid: (L*H, cdiv(D, BLOCK_D)); keep: contiguous [L*H, kept] int64; k, v share strides, so do the metadata
    lh, block_d = tl.program_id(0), tl.program_id(1)
    layer, head = lh // heads, lh % heads
    meta_kept = tl.where(block_d == 0, kept, 0)  # only the first D block moves metadata
    meta_end = tl.where(block_d == 0, capacity, kept)  # ... and resets the tail
    offs_d = block_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    kv_row = layer.to(tl.int64) * s_kl + head.to(tl.int64) * s_kh
    meta_row = layer.to(tl.int64) * s_ml + head.to(tl.int64) * s_mh
    for c0 in range(0, kept, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)
        c_ok = offs_c < kept
        src = tl.load(keep_ptr + lh.to(tl.int64) * kept + offs_c, mask=c_ok, other=0)
        tile_ok = c_ok[:, None] & d_ok[None, :]
        src_kv = kv_row + src[:, None] * s_kn + offs_d[None, :] * s_kd
        k_tile = tl.load(k_ptr + src_kv, mask=tile_ok)
        v_tile = tl.load(v_ptr + src_kv, mask=tile_ok)
        m_ok = offs_c < meta_kept
        src_meta = meta_row + src * s_mn
        kind = tl.load(kind_ptr + src_meta, mask=m_ok)
        sink = tl.load(sink_ptr + src_meta, mask=m_ok)
        frame = tl.load(frame_ptr + src_meta, mask=m_ok)
        row = tl.load(row_ptr + src_meta, mask=m_ok)
        col = tl.load(col_ptr + src_meta, mask=m_ok)
        tpos = tl.load(tpos_ptr + src_meta, mask=m_ok)
        tl.debug_barrier()  # every load of this block lands before any store of it
        dst_kv = kv_row + offs_c[:, None] * s_kn + offs_d[None, :] * s_kd
        tl.store(k_ptr + dst_kv, k_tile, mask=tile_ok)
        tl.store(v_ptr + dst_kv, v_tile, mask=tile_ok)
        dst_meta = meta_row + offs_c * s_mn
        tl.store(kind_ptr + dst_meta, kind, mask=m_ok)
        tl.store(sink_ptr + dst_meta, sink, mask=m_ok)
        tl.store(frame_ptr + dst_meta, frame, mask=m_ok)
        tl.store(row_ptr + dst_meta, row, mask=m_ok)
        tl.store(col_ptr + dst_meta, col, mask=m_ok)
        tl.store(tpos_ptr + dst_meta, tpos, mask=m_ok)
    for c0 in range(kept, meta_end, BLOCK_C):  # metadata tail: TAIL_FILL
        offs_c = c0 + tl.arange(0, BLOCK_C)
        t_ok = offs_c < meta_end
        dst_meta = meta_row + offs_c * s_mn
        empty = tl.zeros([BLOCK_C], dtype=tl.int32)
        tl.store(kind_ptr + dst_meta, empty, mask=t_ok)
        tl.store(sink_ptr + dst_meta, empty, mask=t_ok)
        tl.store(frame_ptr + dst_meta, empty - 1, mask=t_ok)
        tl.store(row_ptr + dst_meta, empty - 1, mask=t_ok)
        tl.store(col_ptr + dst_meta, empty - 1, mask=t_ok)


# ---------------------------------------------------------------------------------------------- launcher
def _check(k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, meta: dict[str, torch.Tensor]) -> None:
    if k.dim() != 4 or v.shape != k.shape or v.stride() != k.stride():
        raise ValueError(f"k and v must be [L, H, M, D] with the same strides, got {tuple(k.shape)}, {tuple(v.shape)}")
    layers, heads, capacity, _ = k.shape
    if keep.dim() != 3 or tuple(keep.shape[:2]) != (layers, heads) or keep.shape[2] > capacity:
        raise ValueError(f"keep must be [L={layers}, H={heads}, C <= {capacity}], got {tuple(keep.shape)}")
    for name, buf in meta.items():
        if tuple(buf.shape) != (layers, heads, capacity) or buf.stride() != meta["kind"].stride():
            raise ValueError(f"{name} must be [L, H, M] = {(layers, heads, capacity)} like kind, got {tuple(buf.shape)}")


def compact_triton_(
    k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *, kind: torch.Tensor, sink: torch.Tensor,
    frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor, tpos: torch.Tensor,
) -> None:
    meta = {"kind": kind, "sink": sink, "frame": frame, "row": row, "col": col, "tpos": tpos}
    _check(k, v, keep, meta)
    layers, heads, capacity, dim = k.shape
    keep = keep.to(device=k.device, dtype=torch.int64).contiguous()
    block_d = min(64, next_power_of_2(dim))
    sink_bytes = sink.view(torch.uint8) if sink.dtype == torch.bool else sink
    _compact_kernel[(layers * heads, cdiv(dim, block_d))](
        k, v, keep, kind, sink_bytes, frame, row, col, tpos,
        heads, keep.shape[2], capacity, dim, *k.stride(), *kind.stride(),
        BLOCK_C=32 if interpreting() else 64, BLOCK_D=block_d, num_warps=4,
    )


# ---------------------------------------------------------------------------------------------- op
def compact_(
    k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, *, kind: torch.Tensor, sink: torch.Tensor,
    frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor, tpos: torch.Tensor,
    scratch_kv: torch.Tensor | None = None, scratch_meta: dict[str, torch.Tensor] | None = None,
) -> None:
    """Keep slots ``keep[l, h]`` of every buffer, packed to the front in order, in place.

    k, v: [L, H, M, D] (the cache's full buffers); kind, sink, frame, row, col, tpos: [L, H, M];
    keep: [L, H, C] strictly increasing slot indices < the cache length (validate first: a bad keep
    corrupts the cache). Metadata slots ``[C, M)`` are reset to ``TAIL_FILL``. The scratch buffers are
    used by the torch path only (the cache's ``_scratch_kv`` / ``_scratch_meta``); Triton needs none.
    Wiring: ``compact_(c.k, c.v, keep, **{n: getattr(c, n) for n in METADATA_FIELDS},
    scratch_kv=c._scratch_kv, scratch_meta=c._scratch_meta)``.
    """
    fields = {"kind": kind, "sink": sink, "frame": frame, "row": row, "col": col, "tpos": tpos}
    if use_triton(k, v):
        compact_triton_(k, v, keep, **fields)
    else:
        _check(k, v, keep, fields)
        compact_reference_(k, v, keep, **fields, scratch_kv=scratch_kv, scratch_meta=scratch_meta)
