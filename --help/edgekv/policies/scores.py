"""Scores shared by the policies: TaR (InfiniPot-V eq. 4) and VaN with adaptive pooling (Alg. 2 lines
14-22), read off a ``CacheView``. The math and its torch reference live in ``edgekv.kernels`` (fused
Triton versions beside them, chosen by ``edgekv.kernels.use_triton``); this module only unpacks the view.
"""

from __future__ import annotations

import torch

from edgekv.kernels import tar as tar_ops
from edgekv.kernels import van as van_ops
from edgekv.policies.base import CacheView

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
    return tar_ops.tar_scores(
        view.k, view.tpos, view.frame, view.row, view.col, view.kind, view.recent, view.grid,
        view.inv_freq, view.temporal_section, unrotated,
    )


def value_norms(view: CacheView) -> torch.Tensor:
    """VaN: ||V||_2 per slot, layer and KV head (section 3.2). [L, H, n] fp32."""
    return van_ops.value_norms(view.v)


def layer_cv(norms: torch.Tensor, vision: torch.Tensor) -> torch.Tensor:
    """Coefficient of variation sigma/mu of each layer's VaN over its vision slots (Alg. 2 l.16-18). [L]."""
    return van_ops.layer_cv(norms, vision)


def pool_sizes(cv: torch.Tensor, thresholds: tuple[float, float, float]) -> list[int]:
    """g(CV): 7 below tau1, 5 below tau2, 3 below tau3, else 1 (Alg. 2 line 21)."""
    t1, t2, t3 = thresholds
    return [7 if c < t1 else 5 if c < t2 else 3 if c < t3 else 1 for c in cv.tolist()]


def pooled_van(view: CacheView, sizes: list[int], zero_padded: bool = False,
               norms: torch.Tensor | None = None) -> torch.Tensor:
    """VaN averaged over a k x k window of the same frame's merged grid, k per layer (Alg. 2 l.22).

    After compactions a frame keeps only some of its cells, so by default the average runs over the cells
    still present (sum of values over sum of presence in the window) rather than over zeros;
    ``zero_padded`` divides by k^2 instead (``cache.van_pooling: zeros``, the reference's avg_pool2d).
    ``norms``: this view's ``value_norms`` when the caller already has them (V is then not read again).
    Returns [L, H, n]; non-vision slots keep their own norm.
    """
    norms = value_norms(view) if norms is None else norms
    return van_ops.pooled_van(norms, view.frame, view.row, view.col, view.vision, view.grid, sizes,
                              zero_padded)
