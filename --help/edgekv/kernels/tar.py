"""TaR: temporal-axis redundancy of every cached vision key (InfiniPot-V, seed 004, sec. 3.1, eq. 4).

    s(t, i, j) = -(1/r) sum_{t' in recent} cos(K_past(t, i, j), K_recent(t', i, j))
               = -k_hat(t, i, j) . R(i, j),   R(i, j) = (1/r) sum_{t'} k_hat(t', i, j)

per layer and KV head, where ``(i, j)`` is the merged-grid cell of the slot (slot metadata, so it holds
after any number of compactions) and ``k_hat`` the l2-normalized key, with the temporal M-RoPE rotation
undone first when ``unrotated`` (Qwen2.5-VL: rotary pair ``(j, j + D/2)`` of frequency ``j <
temporal_section`` turns by ``tpos * inv_freq[j]``). Non-vision slots score 0.

Two launches of one kernel over (L*H, slot blocks), each recomputing the unrotated unit key of its
slots in registers: phase 0 scatters the recent keys into R with atomic adds (a cell gets one add per
recent frame, so contention is r-fold at most); phase 1 gathers R of each slot's cell and takes one
dot product. Trade-off: the keys are read twice and the sin/cos recomputed instead of writing the
unit keys out (an [L, H, n, D] fp32 temporary, 226 MB at the 3B shape); the workspace is only R and its
counts, [L, H, rows*cols, D + 1] fp32 (9.4 MB at 3B: 16x16 cells). Atomic fp32 adds make R's summation
order, and so the last bits of the scores, run-dependent. At large temporal positions most of the
error is the fp32 angle ``tpos * inv_freq`` itself (1.5e-5 in s at tpos ~ 5000), the same in the
reference; compiled kernels use libdevice sin/cos, exact enough at such angles. D must be even (rotary
pairs); it is padded to a power of two and masked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgekv.kernels._triton import (cdiv, dense, interpreting, jit, libdevice, next_power_of_2, precise_trig, tl,
                                    use_triton)

# edgekv.cache.capped.SlotKind.VISION; not imported, so that the cache may import edgekv.kernels.
VISION_KIND = 2


# ---------------------------------------------------------------------------------------------- reference
def unrotate_temporal(keys: torch.Tensor, tpos: torch.Tensor, inv_freq: torch.Tensor, temporal_section: int) -> torch.Tensor:
    """Keys with the temporal rotation undone, in keys' dtype (``positions.rotate_temporal`` by -tpos)."""
    half = keys.shape[-1] // 2
    angle = (-tpos).to(keys.dtype).unsqueeze(-1) * inv_freq[:temporal_section].to(device=keys.device, dtype=keys.dtype)
    cos, sin = torch.cos(angle), torch.sin(angle)
    x1, x2 = keys[..., :temporal_section], keys[..., half:half + temporal_section]
    out = keys.clone()
    out[..., :temporal_section] = x1 * cos - x2 * sin
    out[..., half:half + temporal_section] = x2 * cos + x1 * sin
    return out


def tar_scores_reference(
    k: torch.Tensor, tpos: torch.Tensor, frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor,
    kind: torch.Tensor, recent_mask: torch.Tensor, grid: tuple[int, int], inv_freq: torch.Tensor,
    temporal_section: int, unrotated: bool = True, *, compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Eq. 4 in plain torch; the arguments as in ``tar_scores``. Returns [L, H, n] fp32."""
    keys = k.to(compute_dtype)  # [L, H, n, D]
    if unrotated:
        keys = unrotate_temporal(keys, tpos, inv_freq, temporal_section)
    keys = F.normalize(keys, dim=-1)
    layers, heads, n, dim = keys.shape
    cells = grid[0] * grid[1]
    cell = (row.long() * grid[1] + col.long()).clamp(min=0)  # [L, H, n]
    reference = torch.zeros(layers, heads, cells, dim, dtype=compute_dtype, device=keys.device)
    count = torch.zeros(layers, heads, cells, dtype=compute_dtype, device=keys.device)
    weight = recent_mask.to(compute_dtype)
    reference.scatter_add_(2, cell.unsqueeze(-1).expand(-1, -1, -1, dim), keys * weight.unsqueeze(-1))
    count.scatter_add_(2, cell, weight)
    reference = reference / count.clamp(min=1.0).unsqueeze(-1)
    partner = torch.gather(reference, 2, cell.unsqueeze(-1).expand(-1, -1, -1, dim))  # [L, H, n, D]
    scores = -(keys * partner).sum(-1)
    return scores.masked_fill(kind != VISION_KIND, 0.0).to(torch.float32)


# Rotation tables of the CPU path, per (device, rotary frequencies): cos / sin of p * inv_freq[j] for every
# temporal position p below the table's length. A few per process (one per model), grown by doubling.
_ROTATION_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_MAX_ROTATION_TABLES = 4


def rotation_table(inv_freq: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [P, t] fp32 with ``P >= positions``: entry ``[p, j]`` is ``cos(p * inv_freq[j])``.

    The angle is the same fp32 product ``float(p) * inv_freq[j]`` that ``unrotate_temporal`` and the
    per-slot formula compute and the same ``torch.cos`` / ``torch.sin`` is applied, so a lookup equals
    the direct evaluation bit for bit (tested); ``cos(-a) = cos(a)`` and ``sin(-a) = -sin(a)`` hold
    exactly as well. Cached, because the temporal positions in the cache only move forward (and back at
    a re-base): after the first compression a lookup replaces ``L * H * n * t`` cos and sin evaluations.
    """
    freqs = inv_freq.to(torch.float32)
    key = (str(freqs.device), tuple(freqs.tolist()))
    table = _ROTATION_TABLES.get(key)
    if table is None or table[0].shape[0] < positions:
        size = 1 << max(10, (int(positions) - 1).bit_length())
        angle = torch.arange(size, dtype=torch.float32, device=freqs.device).unsqueeze(-1) * freqs  # [P, t]
        table = (torch.cos(angle), torch.sin(angle))
        if key not in _ROTATION_TABLES and len(_ROTATION_TABLES) >= _MAX_ROTATION_TABLES:
            _ROTATION_TABLES.pop(next(iter(_ROTATION_TABLES)))
        _ROTATION_TABLES[key] = table
    return table


def _rotate_pairs_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, temporal_section: int) -> None:
    """Rotate the temporal rotary pairs ``(j, j + D/2)`` of ``x`` [..., D] by the angle of (cos, sin) [..., t],
    in place: ``x1 cos - x2 sin``, ``x2 cos + x1 sin`` — the same fp32 products and sums as
    ``unrotate_temporal``. The pairs are first packed into one contiguous [2, ..., t] block, so the six
    elementwise ops run on contiguous operands instead of two-wide strided slices of ``x``."""
    half = x.shape[-1] // 2
    pairs = torch.stack((x[..., :temporal_section], x[..., half:half + temporal_section]))  # [2, ..., t]
    x1, x2 = pairs[0], pairs[1]
    x[..., :temporal_section] = x1 * cos - x2 * sin
    x[..., half:half + temporal_section] = x2 * cos + x1 * sin


_BLOCK_BYTES = 4 << 20  # fp32 bytes of K per block of the CPU passes: a few MiB stay in the caches


def layers_per_block(heads: int, n: int, dim: int) -> int:
    """Layers per block of the CPU passes over K or V so one block's fp32 copy is at most ``_BLOCK_BYTES``
    (at least one layer). One layer at the 3B shape (2 x 2063 x 128 x 4 B = 2.1 MB)."""
    return max(1, _BLOCK_BYTES // max(1, heads * n * dim * 4))


def tar_scores_torch(
    k: torch.Tensor, tpos: torch.Tensor, frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor,
    kind: torch.Tensor, recent_mask: torch.Tensor, grid: tuple[int, int], inv_freq: torch.Tensor,
    temporal_section: int, unrotated: bool = True,
) -> torch.Tensor:
    """Eq. 4 for devices without Triton (CPU): the reference's numbers in about two passes over the keys.

    Same math, arranged so no full-size temporary is rotated or normalized:

    * a rotation keeps the norm, so ``|unrot(k)| = |k|`` comes from the raw keys;
    * the cell references R are built from the recent slots only (r frame pairs, a few percent of n),
      gathered first, then unrotated and normalized;
    * ``unrot(k) . R`` splits into the dims the temporal rotation leaves alone (raw keys, one fused
      multiply-add against the gathered partner) and the ``2 * temporal_section`` temporal dims, where
      ``unrot(k) . R_t = k . rot(R_t, +tpos)`` — the inverse rotation moved onto the (gathered) reference;
    * cos / sin of every slot's angle come from a cached per-position table (``rotation_table``) instead
      of being evaluated per slot, and the pair rotation runs on packed contiguous pairs.

    * the per-slot pass runs over a few layers at a time (``layers_per_block``): K is read once, in its own
      dtype, and upcast to fp32 one cache-sized block at a time, and the partner temporary is a block too
      (issue 17: the whole-cache ``k.float()`` and [L, H, n, D] partner made bf16/fp16 compressions slower
      than fp32 ones; every element goes through the same fp32 operations as before, so fp32 scores are
      unchanged bit for bit and half-precision ones equal those of the upcast keys).

    Returns [L, H, n] fp32 equal to ``tar_scores_reference`` up to fp32 rounding (tested), and bit-identical
    to the per-slot evaluation of the same formula (tested: the selections built on it do not move).
    """
    layers, heads, n, dim = k.shape
    cells = grid[0] * grid[1]
    cell = (row.long() * grid[1] + col.long()).clamp_(min=0)  # [L, H, n]
    flat_cell = cell.add_((torch.arange(layers * heads, device=k.device) * cells).view(layers, heads, 1))
    rotate = unrotated and temporal_section > 0
    if rotate:
        low, high = (int(x) for x in torch.aminmax(tpos)) if tpos.numel() else (0, 0)
        rotate_by_table = low >= 0
        if rotate_by_table:
            cos_table, sin_table = rotation_table(inv_freq[:temporal_section].to(k.device), high + 1)
    # R: mean unit (unrotated) key of the recent slots of each (layer, head, cell).
    where = recent_mask.nonzero(as_tuple=True)  # (layer, head, slot) of each recent slot
    recent = k[where].to(torch.float32)  # [m, D]; indexes the (usually strided) cache view without copying all of it
    if rotate and rotate_by_table:  # rotation by -tpos: cos(-a) = cos(a), sin(-a) = -sin(a), both exact
        at = tpos[where].long()
        _rotate_pairs_(recent, cos_table.index_select(0, at), sin_table.index_select(0, at).neg_(), temporal_section)
    elif rotate:
        recent = unrotate_temporal(recent, tpos[where], inv_freq, temporal_section)
    recent = F.normalize(recent, dim=-1)
    target = flat_cell[where]
    reference = torch.zeros(layers * heads * cells, dim, dtype=torch.float32, device=k.device)
    reference.index_add_(0, target, recent)
    count = torch.zeros(layers * heads * cells, dtype=torch.float32, device=k.device)
    count.index_add_(0, target, torch.ones_like(target, dtype=torch.float32))
    reference /= count.clamp(min=1.0).unsqueeze(-1)
    scores = torch.empty(layers, heads, n, dtype=torch.float32, device=k.device)
    step = layers_per_block(heads, n, dim)
    for lo in range(0, layers, step):  # one cache-sized block of layers at a time (see layers_per_block)
        hi = min(lo + step, layers)
        keys = k[lo:hi].to(torch.float32)  # [b, H, n, D]: the block's only read of K, upcast once
        partner = reference.index_select(0, flat_cell[lo:hi].reshape(-1)).view(hi - lo, heads, n, dim)
        if rotate:
            # rot(R_t, +tpos) on the 2 * temporal_section temporal dims of each slot's partner, in place.
            if rotate_by_table:
                positions = tpos[lo:hi].reshape(-1).long()
                cos = cos_table.index_select(0, positions).view(hi - lo, heads, n, temporal_section)
                sin = sin_table.index_select(0, positions).view(hi - lo, heads, n, temporal_section)
            else:
                angle = (tpos[lo:hi].to(torch.float32).unsqueeze(-1)
                         * inv_freq[:temporal_section].to(k.device, torch.float32))
                cos, sin = torch.cos(angle), torch.sin(angle)
            _rotate_pairs_(partner, cos, sin, temporal_section)
        dots = partner.mul_(keys).sum(-1)  # [b, H, n]; in place: no second temporary
        norms = torch.linalg.vector_norm(keys, dim=-1).clamp(min=1e-12)  # F.normalize's eps
        torch.div(dots, norms, out=scores[lo:hi]).neg_()
    return scores.masked_fill(kind != VISION_KIND, 0.0)


# ---------------------------------------------------------------------------------------------- kernel
@jit
def _tar_kernel(
    k_ptr, tpos_ptr, row_ptr, col_ptr, kind_ptr, recent_ptr, inv_freq_ptr, ref_ptr, count_ptr, out_ptr,
    heads, n, half, temporal_section, grid_cols, cells,
    s_kl, s_kh, s_kn, s_kd,
    PHASE: tl.constexpr, UNROTATED: tl.constexpr, PRECISE_TRIG: tl.constexpr, VISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # grid: (L*H, cdiv(n, BLOCK_N)). metadata and out: contiguous [L*H, n];
    # ref: [L*H, cells, 2*half] fp32, count: [L*H, cells] fp32.
    lh = tl.program_id(0)
    layer, head = lh // heads, lh % heads
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_HALF)  # rotary pair j = dims (j, j + half)
    n_ok, j_ok = offs_n < n, offs_j < half
    tile_ok = n_ok[:, None] & j_ok[None, :]
    meta = lh.to(tl.int64) * n + offs_n
    key = k_ptr + layer.to(tl.int64) * s_kl + head.to(tl.int64) * s_kh + offs_n[:, None] * s_kn + offs_j[None, :] * s_kd
    x1 = tl.load(key, mask=tile_ok, other=0.0).to(tl.float32)
    x2 = tl.load(key + half * s_kd, mask=tile_ok, other=0.0).to(tl.float32)
    if UNROTATED:
        t = tl.load(tpos_ptr + meta, mask=n_ok, other=0).to(tl.float32)
        freq = tl.load(inv_freq_ptr + offs_j, mask=offs_j < temporal_section, other=0.0)  # 0: pair not temporal
        angle = -(t[:, None] * freq[None, :])
        if PRECISE_TRIG:
            cos, sin = libdevice.cos(angle), libdevice.sin(angle)
        else:
            cos, sin = tl.cos(angle), tl.sin(angle)
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    norm = tl.sqrt(tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1))
    inv = 1.0 / tl.maximum(norm, 1e-12)  # F.normalize's eps
    x1, x2 = x1 * inv[:, None], x2 * inv[:, None]
    row = tl.maximum(tl.load(row_ptr + meta, mask=n_ok, other=0).to(tl.int32), 0)
    col = tl.maximum(tl.load(col_ptr + meta, mask=n_ok, other=0).to(tl.int32), 0)
    cell = lh.to(tl.int64) * cells + row * grid_cols + col
    ref = ref_ptr + cell[:, None] * (2 * half) + offs_j[None, :]
    if PHASE == 0:
        recent = (tl.load(recent_ptr + meta, mask=n_ok, other=0) != 0) & n_ok
        tl.atomic_add(ref, x1, mask=recent[:, None] & j_ok[None, :])
        tl.atomic_add(ref + half, x2, mask=recent[:, None] & j_ok[None, :])
        tl.atomic_add(count_ptr + cell, tl.full([BLOCK_N], 1.0, tl.float32), mask=recent)
    else:
        vision = (tl.load(kind_ptr + meta, mask=n_ok, other=0) == VISION) & n_ok
        count = tl.maximum(tl.load(count_ptr + cell, mask=vision, other=1.0), 1.0)
        r1 = tl.load(ref, mask=vision[:, None] & j_ok[None, :], other=0.0) / count[:, None]
        r2 = tl.load(ref + half, mask=vision[:, None] & j_ok[None, :], other=0.0) / count[:, None]
        score = -(tl.sum(x1 * r1, 1) + tl.sum(x2 * r2, 1))
        tl.store(out_ptr + meta, tl.where(vision, score, 0.0), mask=n_ok)


# ---------------------------------------------------------------------------------------------- launcher
def tar_scores_triton(
    k: torch.Tensor, tpos: torch.Tensor, frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor,
    kind: torch.Tensor, recent_mask: torch.Tensor, grid: tuple[int, int], inv_freq: torch.Tensor,
    temporal_section: int, unrotated: bool = True,
) -> torch.Tensor:
    layers, heads, n, dim = k.shape
    if dim % 2:
        raise ValueError(f"TaR needs an even head_dim (rotary pairs), got {dim}")
    for name, t in (("tpos", tpos), ("row", row), ("col", col), ("kind", kind), ("recent_mask", recent_mask)):
        if tuple(t.shape) != (layers, heads, n):
            raise ValueError(f"{name} must be [L, H, n] = {(layers, heads, n)}, got {tuple(t.shape)}")
    # metadata is small: pack it (slices of the cache's [L, H, M] buffers are not contiguous)
    tpos, row, col, kind = (t.contiguous() for t in (tpos, row, col, kind))
    recent = recent_mask.contiguous()
    recent = recent.view(torch.uint8) if recent.dtype == torch.bool else recent
    half, cells = dim // 2, grid[0] * grid[1]
    ref = torch.zeros(layers * heads, cells, dim, dtype=torch.float32, device=k.device)
    count = torch.zeros(layers * heads, cells, dtype=torch.float32, device=k.device)
    out = torch.empty(layers, heads, n, dtype=torch.float32, device=k.device)
    inv_freq = inv_freq.to(device=k.device, dtype=torch.float32).contiguous()
    block_n = 32 if interpreting() else 64
    launch = (layers * heads, cdiv(n, block_n))
    for phase in (0, 1):
        _tar_kernel[launch](
            k, tpos, row, col, kind, recent, inv_freq, ref, count, out,
            heads, n, half, temporal_section, grid[1], cells, *k.stride(),
            PHASE=phase, UNROTATED=unrotated, PRECISE_TRIG=precise_trig(), VISION=VISION_KIND,
            BLOCK_N=block_n, BLOCK_HALF=next_power_of_2(half), num_warps=4,
        )
    return out


# ---------------------------------------------------------------------------------------------- op
def tar_scores(
    k: torch.Tensor, tpos: torch.Tensor, frame: torch.Tensor, row: torch.Tensor, col: torch.Tensor,
    kind: torch.Tensor, recent_mask: torch.Tensor, grid: tuple[int, int], inv_freq: torch.Tensor,
    temporal_section: int, unrotated: bool = True,
) -> torch.Tensor:
    """TaR score of every slot (eq. 4), Triton when available (see ``use_triton``).

    k: [L, H, n, D] cached keys (any float dtype, e.g. the valid prefix of the capped cache, or an 8-bit
    cache's ``DequantizedView``, read a block of layers at a time on CPU);
    tpos, frame, row, col, kind, recent_mask: [L, H, n] slot metadata (recent_mask: bool, the slots of the
    ``r`` newest frame pairs; ``frame`` is accepted for the cache's metadata contract, the recent test is
    already in ``recent_mask``); grid: merged (rows, cols) of a frame pair; inv_freq: [D/2] rotary
    inverse frequencies; temporal_section: how many of them carry time. Returns [L, H, n] fp32, higher =
    less redundant; non-vision slots 0.
    """
    if use_triton(k):
        return tar_scores_triton(dense(k), tpos, frame, row, col, kind, recent_mask, grid, inv_freq, temporal_section, unrotated)
    return tar_scores_torch(k, tpos, frame, row, col, kind, recent_mask, grid, inv_freq, temporal_section, unrotated)
