"""VaN: value norms, per-layer CV and layer-adaptive 2D pooling over each frame's grid (InfiniPot-V,
seed 004, sec. 3.2, eq. 7, Alg. 2 lines 14-22).

    VaN(l, h, s)  = ||V_{l,h,s}||_2
    CV(l)         = sigma / mu of VaN over layer l's vision slots (all heads)
    pooled(l,h,s) = sum_{c in W_k(s)} VaN(c) / |{c in W_k(s) present}|

where ``W_k(s)`` is the k x k window (k = g(CV(l)) in {7, 5, 3, 1}) around the slot's (row, col) in
the same frame's merged grid, and only cells still present after earlier compactions count (a mean over
what is there, not over zeros). Non-vision slots keep their own norm. ``zero_padded=True`` instead divides
by ``k^2`` — evicted cells and the border count as zeros, ``avg_pool2d`` with zero padding over the frame
plane as the InfiniPot-V reference code pools — so a slot whose neighbours were evicted scores lower.

Kernels: one pass over V for the norms; one program per layer for the CV (two loops over the layer's
norms — mean, then squared deviations — as the reference does, rather than a one-pass sum of squares
that cancels badly); pooling in two launches of one kernel: phase 0 scatters each vision slot's norm
and a presence count into a dense per-frame grid with atomic adds, phase 1 reads the k x k window of
each slot (k per layer, from a [L] radius tensor, so one launch serves every layer that pools; size-1
layers are left out and keep their norms). Trade-off: the dense grid is [Lk*H, F, rows, cols] x 2 fp32
with F the distinct frames the pooling layers hold (``frame_ranks``, one host sync), in exchange for O(k^2)
reads per slot instead of a search of the slot list. F grows with the stream (heads keep tokens of many
old pairs), so the grid covers at most ``POOL_CELLS`` cells a pass and the frames are taken in chunks
(``frame_chunks``): the memory stays fixed however long the stream (issue 32).

CPU (``pooled_van_torch``): the reference's ``avg_pool2d`` evaluates the window at every cell of every
frame plane, ``F * rows * cols`` per (layer, head). Once compactions have thinned the old frames, the
cache holds slots of many frames (measured at M = 2048 after 25 compressions: 168-258 distinct frames,
the planes 7-11x the slots held), so most of that work pools empty cells. The CPU path then reads the
``k x k`` window at the slots only, from a zero-padded dense grid, and adds its cells in the order
``avg_pool2d`` does (row-major, one after the other from 0) before dividing by ``k^2`` as it does — so its
scores are bit-identical to the reference (tested), not merely close (the presence counts are small
integers, exact in any order). While the planes are fewer than ``_DENSE_PLANES_PER_SLOT`` times the slots
(early in a stream) the reference's single ``avg_pool2d`` is faster and is used: both give the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from edgekv.kernels._triton import cdiv, dense, interpreting, jit, next_power_of_2, tl, use_triton
from edgekv.kernels.tar import layers_per_block


# ---------------------------------------------------------------------------------------------- reference
def value_norms_reference(v: torch.Tensor, *, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """v: [L, H, n, D] -> [L, H, n] fp32."""
    return v.to(compute_dtype).norm(dim=-1).to(torch.float32)


def layer_cv_reference(norms: torch.Tensor, vision: torch.Tensor, *, compute_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """norms, vision: [L, H, n] -> [L] fp32 coefficient of variation over each layer's vision slots."""
    norms = norms.to(compute_dtype)
    weight = vision.to(compute_dtype)
    count = weight.sum(dim=(1, 2)).clamp(min=1.0)
    mean = (norms * weight).sum(dim=(1, 2)) / count
    var = (((norms - mean[:, None, None]) ** 2) * weight).sum(dim=(1, 2)) / count
    return (var.sqrt() / mean.clamp(min=1e-12)).to(torch.float32)


def pooled_van_reference(
    norms: torch.Tensor, frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor, vision: torch.Tensor,
    grid: tuple[int, int], sizes: Sequence[int], *, compute_dtype: torch.dtype = torch.float32,
    zero_padded: bool = False,
) -> torch.Tensor:
    """Alg. 2 l.22 with avg_pool2d over a dense per-frame grid; arguments as in ``pooled_van``."""
    norms = norms.to(compute_dtype)
    layers, heads, n = norms.shape
    rows, cols = grid
    frames, inverse = torch.unique(frame.masked_fill(~vision, -1), return_inverse=True)
    num_frames = frames.numel()
    cell = inverse.long() * rows * cols + row.long().clamp(min=0) * cols + col.long().clamp(min=0)
    dense = torch.zeros(layers, heads, num_frames * rows * cols, dtype=compute_dtype, device=norms.device)
    mask = torch.zeros_like(dense)
    dense.scatter_add_(2, cell, norms * vision)
    mask.scatter_add_(2, cell, vision.to(compute_dtype))
    # values and presence as two channels: one pooling call per kernel size, over its layers only
    stacked = torch.stack((dense.view(layers, heads, num_frames, rows, cols),
                           mask.view(layers, heads, num_frames, rows, cols)), dim=3)  # [L, H, F, 2, R, C]
    stacked = stacked.view(layers, heads * num_frames, 2, rows, cols)
    pooled = torch.empty_like(norms)
    for size in sorted(set(sizes)):
        chosen = [layer for layer, s in enumerate(sizes) if s == size]
        if size == 1:
            pooled[chosen] = norms[chosen]
            continue
        planes = stacked[chosen].reshape(-1, 2, rows, cols)
        pooled_planes = F.avg_pool2d(planes, size, stride=1, padding=size // 2, count_include_pad=True)
        sums, present = pooled_planes[:, 0], pooled_planes[:, 1]
        average = (sums if zero_padded else sums / present.clamp(min=1e-12)).reshape(len(chosen), heads, -1)
        pooled[chosen] = torch.gather(average, 2, cell[chosen])
    return torch.where(vision, pooled, norms).to(torch.float32)


def value_norms_torch(v: torch.Tensor) -> torch.Tensor:
    """``value_norms_reference`` one cache-sized block of layers at a time (CPU): V is read once in its own
    dtype and each block upcast to fp32 while it is in the caches, instead of one whole-cache fp32 copy
    (issue 17: at [36, 2, 2063, 128] the copy made bf16/fp16 norms ~9x slower than fp32). Every slot's
    norm is the same fp32 reduction as the reference's, so the results are bit-identical (tested)."""
    layers, heads, n, dim = v.shape
    if isinstance(v, torch.Tensor) and v.dtype == torch.float32:
        return v.norm(dim=-1)
    out = torch.empty(layers, heads, n, dtype=torch.float32, device=v.device)
    step = layers_per_block(heads, n, dim)
    for lo in range(0, layers, step):
        torch.linalg.vector_norm(v[lo:lo + step].to(torch.float32), dim=-1, out=out[lo:lo + step])
    return out


_WINDOW_READS = 1 << 20  # window cells gathered at once by pooled_van_torch (8 MiB of cells)
# pooled_van_torch gathers windows at the slots when the frame planes hold more cells than this many per
# slot; below it avg_pool2d over the planes is cheaper. Measured on the 2-core x86 CPU (4 and 36 layers,
# 8x8 grid, pool sizes 3-7): the slot gather is 1.4-5x slower at 1-3 cells per slot, 1.1-2x faster at 6-12.
_DENSE_PLANES_PER_SLOT = 4


POOL_CELLS = 1 << 21  # cells of a pooling pass's dense frame planes (8 MiB of fp32 a plane set), whatever the stream


def frame_chunks(num_frames: int, cells_per_frame: int) -> tuple[int, int]:
    """(frames a pass, passes) so that one pass's dense planes hold at most ``POOL_CELLS`` cells.

    Why: the planes cover every distinct frame the cache still holds a slot of, and under StateKV or
    TaR/VaN that count grows with the stream (each head keeps its own tokens of many old pairs; the H200
    run of issue 32 saw the pooling's transient grow ~135 MiB over 1,000 3B pairs, allocated memory flat,
    and reserved memory grow 7.8 -> 10.4 GiB with the vision tower in a CUDA graph). Passes over chunks of
    frames keep the memory fixed; each slot is pooled in the one pass that holds its frame, from the same
    cells, so the values do not change."""
    per_chunk = max(1, min(num_frames, POOL_CELLS // max(1, cells_per_frame)))
    return per_chunk, cdiv(num_frames, per_chunk) if num_frames else 0


def _pooled_layers(sizes: Sequence[int], device: torch.device):
    """(the layers that pool: size > 1, a function that selects them along dim 0 — the identity if all do)."""
    chosen = [layer for layer, size in enumerate(sizes) if size > 1]
    if len(chosen) == len(sizes):
        return chosen, lambda t: t
    index = torch.tensor(chosen, dtype=torch.long, device=device)
    return chosen, lambda t: t.index_select(0, index)


def frame_ranks(frame: torch.Tensor, vision: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Dense rank of each slot's frame among the distinct frames held (non-vision slots count as frame -1).

    Equals ``torch.unique(frame.masked_fill(~vision, -1), return_inverse=True)`` — (inverse [L, H, n]
    int64, number of distinct values) — without its sort: frame indices are small non-negative pair
    numbers, so a presence table over ``[-1, max frame]`` and its running count give the ranks in O(n).
    Falls back to ``torch.unique`` for negative or very sparse frame numbers.
    """
    key = frame.masked_fill(~vision, -1).long().add_(1)  # [L, H, n] >= 0 for real metadata
    if key.numel() == 0:
        return key, 0
    low, high = (int(x) for x in torch.aminmax(key))
    if low < 0 or high >= 4 * key.numel() + 1024:
        values, inverse = torch.unique(key, return_inverse=True)
        return inverse, values.numel()
    flat = key.view(-1)
    lookup = torch.zeros(high + 1, dtype=torch.int64, device=key.device).index_fill_(0, flat, 1).cumsum_(0)
    count = int(lookup[-1])  # 1 + rank of each present key, so the last entry is the number of distinct keys
    return lookup.sub_(1).index_select(0, flat).view_as(key), count


def pooled_van_torch(
    norms: torch.Tensor, frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor, vision: torch.Tensor,
    grid: tuple[int, int], sizes: Sequence[int], zero_padded: bool = False,
) -> torch.Tensor:
    """Alg. 2 l.22 for devices without Triton (CPU), bit-identical to ``pooled_van_reference`` (fp32).

    Per pool size ``k`` (its layers at once): the value and the presence of every vision slot go into a
    zero-padded dense grid [Lk, H, F, rows + k - 1, cols + k - 1, 2] (F frames at a time, at most
    ``POOL_CELLS`` cells a pass: ``frame_chunks``); each slot then gathers the ``k^2``
    cells of its window (one gather of [k^2, slots] 8-byte (value, presence) words, in chunks of at most
    ``_WINDOW_READS``) and adds them one cell after the other in ``avg_pool2d``'s row-major order
    (padding adds exact zeros, as skipping does). Both sums are divided
    by ``k^2`` (``count_include_pad``), then one by the other, exactly as the reference. Returns
    [L, H, n] fp32; size-1 layers and non-vision slots keep their own norm.
    """
    layers, heads, n = norms.shape
    if len(sizes) != layers:
        raise ValueError(f"one pool size per layer: {layers} layers, {len(sizes)} sizes")
    norms = norms.to(torch.float32)
    pooled = norms.clone()
    by_size = {size: [layer for layer, s in enumerate(sizes) if s == size] for size in sorted(set(sizes)) if size > 1}
    if not by_size or n == 0:
        return pooled
    rows, cols = grid
    rank, num_frames = frame_ranks(frame, vision)  # [L, H, n]
    if num_frames * rows * cols < _DENSE_PLANES_PER_SLOT * n:  # few planes: pooling them all is cheaper
        return pooled_van_reference(norms, frame, row, col, vision, grid, sizes, zero_padded=zero_padded)
    weight = vision.to(torch.float32)
    # value (0 off vision, as the reference scatters) and presence side by side: one gather reads both
    sources = torch.stack((norms * weight, weight), dim=-1)  # [L, H, n, 2]
    for size, chosen in by_size.items():
        pad = size // 2
        width = cols + 2 * pad
        plane = (rows + 2 * pad) * width
        index = torch.tensor(chosen, device=norms.device) if len(chosen) < layers else None

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if index is None else t.index_select(0, index)

        group = len(chosen) * heads
        slot_rank, slot_row, slot_col, slot_sources = pick(rank), pick(row).long(), pick(col).long(), pick(sources)
        total = torch.empty(group * n, 2, dtype=torch.float32, device=norms.device)
        per_chunk, chunks = frame_chunks(num_frames, group * plane)  # the dense planes stay under POOL_CELLS
        for first in range(0, chunks * per_chunk, per_chunk):
            # the slots of frames ranked [first, first + per_chunk): all of them when one pass holds every frame
            slots = None if chunks == 1 else ((slot_rank >= first) & (slot_rank < first + per_chunk)).view(-1) \
                .nonzero().squeeze(1)
            # first cell of each slot's window in the padded grid, flat over [Lk, H, frames of the pass, rows + 2p,
            # cols + 2p]
            base = (torch.arange(group, device=norms.device) * (per_chunk * plane)).view(len(chosen), heads, 1)
            corner = (base + (slot_rank - first) * plane + slot_row.clamp(min=0) * width
                      + slot_col.clamp(min=0)).view(-1)  # [Lk * H * n]
            values = slot_sources.view(-1, 2)
            if slots is not None:
                corner, values = corner.index_select(0, slots), values.index_select(0, slots)
            dense = torch.zeros(group * per_chunk * plane, 2, dtype=torch.float32, device=norms.device)
            dense.index_add_(0, corner + (pad * width + pad), values)
            summed = _window_sums(dense, corner, size, width)
            if slots is None:
                total = summed
            else:
                total.index_copy_(0, slots, summed)
        average = total[:, 0] / (size * size)
        if not zero_padded:
            average = average / (total[:, 1] / (size * size)).clamp(min=1e-12)
        average = average.view(len(chosen), heads, n)
        if index is None:
            pooled = average
        else:
            pooled.index_copy_(0, index, average)
    return torch.where(vision, pooled, norms)


def _window_sums(dense: torch.Tensor, corner: torch.Tensor, size: int, width: int) -> torch.Tensor:
    """[slots, 2] (value, presence) sums of the ``size x size`` window from each slot's ``corner`` in the padded
    ``dense`` grid [cells, 2], its cells added one after the other in avg_pool2d's row-major order."""
    pairs = dense.view(torch.int64).view(-1)  # each (value, presence) cell as one 8-byte word: a plain copy
    steps = torch.arange(size, device=dense.device)
    offsets = (steps.view(-1, 1) * width + steps.view(1, -1)).view(-1, 1)  # [k*k, 1], avg_pool2d's row-major order
    if pairs.numel() < 2**31:
        corner, offsets = corner.int(), offsets.int()
    total = torch.empty(corner.numel(), 2, dtype=torch.float32, device=dense.device)
    chunk = max(1, _WINDOW_READS // (size * size))  # bounds the [k*k, chunk] temporaries
    for lo in range(0, corner.numel(), chunk):
        window = (corner[lo:lo + chunk].view(1, -1) + offsets).view(-1)  # [k*k * chunk]
        cells = pairs.index_select(0, window).view(torch.float32).view(size * size, -1, 2)
        acc = total[lo:lo + chunk]
        acc.copy_(cells[0])
        for j in range(1, size * size):  # one cell after the other, from 0 (0 + x = x); counts are exact anyway
            acc += cells[j]
    return total


# ---------------------------------------------------------------------------------------------- kernels
@jit
def _value_norm_kernel(
    v_ptr, out_ptr, heads, n, dim, s_vl, s_vh, s_vn, s_vd,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid: (L*H, cdiv(n, BLOCK_N)); out: contiguous [L*H, n] fp32
    lh = tl.program_id(0)
    layer, head = lh // heads, lh % heads
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < n
    x = tl.load(v_ptr + layer.to(tl.int64) * s_vl + head.to(tl.int64) * s_vh + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd,
                mask=n_ok[:, None] & (offs_d < dim)[None, :], other=0.0).to(tl.float32)
    tl.store(out_ptr + lh.to(tl.int64) * n + offs_n, tl.sqrt(tl.sum(x * x, 1)), mask=n_ok)


@jit
def _layer_cv_kernel(norms_ptr, vision_ptr, cv_ptr, per_layer, BLOCK: tl.constexpr):
    # grid: (L,); norms [L, per_layer] fp32 and vision [L, per_layer] uint8, contiguous
    layer = tl.program_id(0)
    base = layer.to(tl.int64) * per_layer
    total = tl.zeros([BLOCK], dtype=tl.float32)
    count = tl.zeros([BLOCK], dtype=tl.float32)
    for i0 in range(0, per_layer, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        w = (tl.load(vision_ptr + base + offs, mask=offs < per_layer, other=0) != 0).to(tl.float32)
        total += w * tl.load(norms_ptr + base + offs, mask=offs < per_layer, other=0.0)
        count += w
    num = tl.maximum(tl.sum(count, 0), 1.0)
    mean = tl.sum(total, 0) / num
    spread = tl.zeros([BLOCK], dtype=tl.float32)
    for i0 in range(0, per_layer, BLOCK):
        offs = i0 + tl.arange(0, BLOCK)
        w = (tl.load(vision_ptr + base + offs, mask=offs < per_layer, other=0) != 0).to(tl.float32)
        dev = tl.load(norms_ptr + base + offs, mask=offs < per_layer, other=0.0) - mean
        spread += w * dev * dev
    tl.store(cv_ptr + layer, tl.sqrt(tl.sum(spread, 0) / num) / tl.maximum(mean, 1e-12))


@jit
def _van_pool_kernel(
    norms_ptr, vision_ptr, rank_ptr, row_ptr, col_ptr, radius_ptr, sum_ptr, count_ptr, out_ptr,
    heads, n, grid_rows, grid_cols, dense_per_lh, frame_lo, frame_hi,
    PHASE: tl.constexpr, ZERO_PADDED: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # grid: (L*H, cdiv(n, BLOCK_N)). norms, vision, rank (the slot's frame among the distinct frames),
    # row, col, out: contiguous [L*H, n]; sum, count: [L*H, dense_per_lh] fp32 zeros, the planes of the
    # frames ranked [frame_lo, frame_hi) (one chunk of them); out holds the norms already, and phase 1 writes
    # the pooled value of the chunk's vision slots only.
    lh = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < n
    slot = lh.to(tl.int64) * n + offs_n
    rank = tl.load(rank_ptr + slot, mask=n_ok, other=0).to(tl.int64)
    vision = (tl.load(vision_ptr + slot, mask=n_ok, other=0) != 0) & n_ok & (rank >= frame_lo) & (rank < frame_hi)
    row = tl.maximum(tl.load(row_ptr + slot, mask=n_ok, other=0).to(tl.int32), 0)
    col = tl.maximum(tl.load(col_ptr + slot, mask=n_ok, other=0).to(tl.int32), 0)
    frame_base = lh.to(tl.int64) * dense_per_lh + (rank - frame_lo) * grid_rows * grid_cols
    if PHASE == 0:
        norm = tl.load(norms_ptr + slot, mask=n_ok, other=0.0)
        cell = frame_base + row * grid_cols + col
        tl.atomic_add(sum_ptr + cell, norm, mask=vision)
        tl.atomic_add(count_ptr + cell, tl.full([BLOCK_N], 1.0, tl.float32), mask=vision)
    else:
        radius = tl.load(radius_ptr + lh // heads)
        total = tl.zeros([BLOCK_N], dtype=tl.float32)
        present = tl.zeros([BLOCK_N], dtype=tl.float32)
        for dr in range(-radius, radius + 1):
            for dc in range(-radius, radius + 1):
                r, c = row + dr, col + dc
                inside = vision & (r >= 0) & (r < grid_rows) & (c >= 0) & (c < grid_cols)
                cell = frame_base + r * grid_cols + c
                total += tl.load(sum_ptr + cell, mask=inside, other=0.0)
                present += tl.load(count_ptr + cell, mask=inside, other=0.0)
        if ZERO_PADDED:
            side = (2 * radius + 1).to(tl.float32)
            mean = total / (side * side)
        else:
            mean = total / tl.maximum(present, 1e-12)
        tl.store(out_ptr + slot, mean, mask=vision)  # the launcher passes pooling layers only (radius >= 1)


# ---------------------------------------------------------------------------------------------- launchers
def _block_n() -> int:
    return 32 if interpreting() else 128


def value_norms_triton(v: torch.Tensor) -> torch.Tensor:
    layers, heads, n, dim = v.shape
    out = torch.empty(layers, heads, n, dtype=torch.float32, device=v.device)
    _value_norm_kernel[(layers * heads, cdiv(n, _block_n()))](
        v, out, heads, n, dim, *v.stride(), BLOCK_N=_block_n(), BLOCK_D=next_power_of_2(dim), num_warps=4,
    )
    return out


def _as_bytes(mask: torch.Tensor) -> torch.Tensor:
    mask = mask.contiguous()
    return mask.view(torch.uint8) if mask.dtype == torch.bool else mask


def layer_cv_triton(norms: torch.Tensor, vision: torch.Tensor) -> torch.Tensor:
    layers = norms.shape[0]
    cv = torch.empty(layers, dtype=torch.float32, device=norms.device)
    block = 256 if interpreting() else 1024
    _layer_cv_kernel[(layers,)](
        norms.to(torch.float32).contiguous(), _as_bytes(vision), cv, norms[0].numel(), BLOCK=block, num_warps=4,
    )
    return cv


def pooled_van_triton(
    norms: torch.Tensor, frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor, vision: torch.Tensor,
    grid: tuple[int, int], sizes: Sequence[int], zero_padded: bool = False,
) -> torch.Tensor:
    layers, heads, n = norms.shape
    if len(sizes) != layers:
        raise ValueError(f"one pool size per layer: {layers} layers, {len(sizes)} sizes")
    source = norms.to(torch.float32).contiguous()
    out = source.clone()  # size-1 layers and non-vision slots keep their own norm
    chosen, pick = _pooled_layers(sizes, norms.device)
    if not chosen or n == 0:
        return out
    subset = len(chosen) < layers
    rows, cols = grid
    rank, num_frames = frame_ranks(pick(frame), pick(vision))  # ranks among the frames the pooled layers hold
    group = len(chosen) * heads
    per_chunk, chunks = frame_chunks(num_frames, group * rows * cols)
    dense_per_lh = per_chunk * rows * cols
    sums = torch.empty(group, dense_per_lh, dtype=torch.float32, device=norms.device)
    counts = torch.empty_like(sums)
    radius = torch.tensor([sizes[layer] // 2 for layer in chosen], dtype=torch.int32, device=norms.device)
    pooled = pick(out) if subset else out  # a copy of the chosen layers' norms when some layers do not pool
    args = (pick(source), _as_bytes(pick(vision)), rank.to(torch.int32).contiguous(), pick(row).contiguous(),
            pick(col).contiguous(), radius, sums, counts, pooled, heads, n, rows, cols, dense_per_lh)
    for chunk in range(chunks):
        sums.zero_()
        counts.zero_()
        for phase in (0, 1):
            _van_pool_kernel[(group, cdiv(n, _block_n()))](*args, chunk * per_chunk, (chunk + 1) * per_chunk,
                                                           PHASE=phase, ZERO_PADDED=zero_padded,
                                                           BLOCK_N=_block_n(), num_warps=4)
    if subset:
        out.index_copy_(0, torch.tensor(chosen, device=norms.device), pooled)
    return out


# ---------------------------------------------------------------------------------------------- ops
def value_norms(v: torch.Tensor) -> torch.Tensor:
    """VaN: ||V||_2 per slot. v: [L, H, n, D] (any float dtype, strided views fine) -> [L, H, n] fp32."""
    return value_norms_triton(dense(v)) if use_triton(v) else value_norms_torch(v)


def layer_cv(norms: torch.Tensor, vision: torch.Tensor) -> torch.Tensor:
    """sigma / mu of each layer's VaN over its vision slots (Alg. 2 l.16-18). norms, vision: [L, H, n] -> [L] fp32."""
    return layer_cv_triton(norms, vision) if use_triton(norms) else layer_cv_reference(norms, vision)


def pooled_van(
    norms: torch.Tensor, frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor, vision: torch.Tensor,
    grid: tuple[int, int], sizes: Sequence[int], zero_padded: bool = False,
) -> torch.Tensor:
    """VaN averaged over the k x k window of the slot's frame grid, k = sizes[layer] (Alg. 2 l.22).

    norms: [L, H, n] fp32 from ``value_norms``; frame, row, col: [L, H, n] slot metadata; vision: [L, H, n]
    bool; grid: merged (rows, cols) of a frame pair; sizes: odd window size per layer (1 = no pooling).
    Returns [L, H, n] fp32; non-vision slots keep their own norm. ``zero_padded``: divide by k^2 (absent
    cells count as zeros) instead of by the cells present.
    """
    if use_triton(norms):
        return pooled_van_triton(norms, frame, row, col, vision, grid, sizes, zero_padded)
    return pooled_van_torch(norms, frame, row, col, vision, grid, sizes, zero_padded)
