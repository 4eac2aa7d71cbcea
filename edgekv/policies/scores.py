"""Reference scores shared by the policies: TaR (InfiniPot-V eq. 4) and VaN with adaptive pooling
(Alg. 2 lines 14-22). Plain torch; ``edgekv.kernels`` holds fused versions checked against these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgekv.policies.base import CacheView
from edgekv.positions import rotate_temporal

POOL_SIZES = (7, 5, 3, 1)


def tar_scores(view: CacheView, unrotated: bool = True) -> torch.Tensor:
    """s(t, i, j) = -(1/r) sum_{t' in recent} cos(K_past(t, i, j), K_recent(t', i, j))   (eq. 4)

    Recent frames are found through slot metadata (frame index), and the partner of a past token is
    the recent token at the same merged-grid (row, col) in the same layer and KV head — so the
    comparison stays patch-aligned after any number of compactions (DESIGN invariant 2). Because
    ``sum cos(k, r_t) = k_hat . sum r_hat_t``, the recent keys of each cell are averaged once (after
    normalization) and every slot costs one dot product. With ``unrotated`` the temporal M-RoPE
    rotation of every key is undone first, so a static patch compares equal across time.
    Returns [L, H, n]; slots with no recent partner (non-vision) score 0.
    """
    keys = view.k.to(torch.float32)
    if unrotated:
        keys = rotate_temporal(keys, -view.tpos, view.inv_freq, view.temporal_section)
    keys = F.normalize(keys, dim=-1)
    layers, heads, n, dim = keys.shape
    cells = view.grid[0] * view.grid[1]
    cell = (view.row.long() * view.grid[1] + view.col.long()).clamp(min=0)  # [L, H, n]
    recent = view.recent
    reference = torch.zeros(layers, heads, cells, dim, dtype=torch.float32, device=keys.device)
    count = torch.zeros(layers, heads, cells, dtype=torch.float32, device=keys.device)
    weight = recent.to(torch.float32)
    reference.scatter_add_(2, cell.unsqueeze(-1).expand(-1, -1, -1, dim), keys * weight.unsqueeze(-1))
    count.scatter_add_(2, cell, weight)
    reference = reference / count.clamp(min=1.0).unsqueeze(-1)
    partner = torch.gather(reference, 2, cell.unsqueeze(-1).expand(-1, -1, -1, dim))  # [L, H, n, D]
    scores = -(keys * partner).sum(-1)
    return scores.masked_fill(~view.vision, 0.0)


def value_norms(view: CacheView) -> torch.Tensor:
    """VaN: ||V||_2 per slot, layer and KV head (section 3.2). [L, H, n] fp32."""
    return view.v.to(torch.float32).norm(dim=-1)


def layer_cv(norms: torch.Tensor, vision: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation sigma/mu of each layer's VaN over its vision slots (Alg. 2 l.16-18). [L]."""
    weight = vision.to(torch.float32)
    count = weight.sum(dim=(1, 2)).clamp(min=1.0)
    mean = (norms * weight).sum(dim=(1, 2)) / count
    var = (((norms - mean[:, None, None]) ** 2) * weight).sum(dim=(1, 2)) / count
    return var.sqrt() / mean.clamp(min=1e-12)


def pool_sizes(cv: torch.Tensor, thresholds: tuple[float, float, float]) -> list[int]:
    """g(CV): 7 below tau1, 5 below tau2, 3 below tau3, else 1 (Alg. 2 line 21)."""
    t1, t2, t3 = thresholds
    return [7 if c < t1 else 5 if c < t2 else 3 if c < t3 else 1 for c in cv.tolist()]


def pooled_van(view: CacheView, sizes: list[int]) -> torch.Tensor:
    """VaN averaged over a k x k window of the same frame's merged grid, k per layer (Alg. 2 l.22).

    After compactions a frame keeps only some of its cells, so the average runs over the cells still
    present (sum of values over sum of presence in the window) rather than over zeros. Returns
    [L, H, n]; non-vision slots keep their own norm.
    """
    norms = value_norms(view)
    layers, heads, n = norms.shape
    rows, cols = view.grid
    vision = view.vision
    frames, inverse = torch.unique(view.frame.masked_fill(~vision, -1), return_inverse=True)
    num_frames = frames.numel()
    cell = (inverse.long() * rows * cols + view.row.long().clamp(min=0) * cols + view.col.long().clamp(min=0))
    dense = torch.zeros(layers, heads, num_frames * rows * cols, device=norms.device)
    mask = torch.zeros_like(dense)
    dense.scatter_add_(2, cell, norms * vision)
    mask.scatter_add_(2, cell, vision.to(torch.float32))
    dense = dense.view(layers * heads * num_frames, 1, rows, cols)
    mask = mask.view(layers * heads * num_frames, 1, rows, cols)
    pooled = torch.empty_like(norms)
    for size in sorted(set(sizes)):
        chosen = [l for l, s in enumerate(sizes) if s == size]
        if size == 1:
            pooled[chosen] = norms[chosen]
            continue
        sums = F.avg_pool2d(dense, size, stride=1, padding=size // 2, count_include_pad=True)
        present = F.avg_pool2d(mask, size, stride=1, padding=size // 2, count_include_pad=True)
        average = (sums / present.clamp(min=1e-12)).view(layers, heads, -1)
        pooled[chosen] = torch.gather(average[chosen], 2, cell[chosen])
    return torch.where(vision, pooled, norms)
