"""Temporal M-RoPE arithmetic on cached keys: undo time (for TaR) and move keys in time (re-basing).

Qwen2.5-VL's M-RoPE splits the ``head_dim / 2`` rotary frequencies into sections ``[t, h, w]``
(``[16, 24, 24]`` for the 3B model): frequency ``j < t`` rotates by the temporal position id, and the
rotary pair of frequency ``j`` is dims ``(j, j + head_dim / 2)`` (transformers'
``apply_multimodal_rotary_pos_emb`` with ``rotate_half``). Rotations of one pair compose, so a key
rotated at temporal position ``p`` becomes the key rotated at ``p + d`` by one more rotation of the
temporal pairs by ``d * inv_freq[j]`` — exact, no recomputation of the layer (DESIGN invariant 5).

The same rotation by ``-p`` gives the key with time undone: the part of a key that a static patch
shares across frames (InfiniPot-V's TaR compares keys of the same patch across time, eq. 4; raw
post-RoPE keys of an unchanged patch differ between frames only by this rotation).
"""

from __future__ import annotations

import torch

__all__ = ["rotate_temporal", "rotate_temporal_", "squeeze_gaps"]


def rotate_temporal(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, temporal_section: int) -> torch.Tensor:
    """Rotate the temporal rotary pairs of ``keys`` by ``delta`` positions (out of place, fp32 math).

    keys: [..., head_dim]; delta: keys.shape[:-1] (int or float); returns keys' dtype.
    """
    half = keys.shape[-1] // 2
    freqs = inv_freq[:temporal_section].to(keys.device)
    angle = delta.to(torch.float32).unsqueeze(-1) * freqs  # [..., t]
    cos, sin = torch.cos(angle), torch.sin(angle)
    x = keys.to(torch.float32)
    x1, x2 = x[..., :temporal_section], x[..., half:half + temporal_section]
    out = x.clone()
    out[..., :temporal_section] = x1 * cos - x2 * sin
    out[..., half:half + temporal_section] = x2 * cos + x1 * sin
    return out.to(keys.dtype)


def rotate_temporal_(keys: torch.Tensor, delta: torch.Tensor, inv_freq: torch.Tensor, temporal_section: int) -> None:
    """In-place variant for cache buffers: only the temporal dims are written."""
    half = keys.shape[-1] // 2
    freqs = inv_freq[:temporal_section].to(keys.device)
    angle = delta.to(torch.float32).unsqueeze(-1) * freqs
    cos, sin = torch.cos(angle), torch.sin(angle)
    # copies: in fp32 ``.to`` would return views, and the first write would corrupt the second half's input
    x1 = keys[..., :temporal_section].to(torch.float32, copy=True)
    x2 = keys[..., half:half + temporal_section].to(torch.float32, copy=True)
    keys[..., :temporal_section] = (x1 * cos - x2 * sin).to(keys.dtype)
    keys[..., half:half + temporal_section] = (x2 * cos + x1 * sin).to(keys.dtype)


def squeeze_gaps(positions: torch.Tensor, valid: torch.Tensor, max_gap: int) -> torch.Tensor:
    """Order-preserving squeeze of temporal positions, row by row, anchored at each row's newest.

    positions, valid: [R, n]. In each row the distinct valid positions keep their order; going back from
    the newest (which keeps its value), every gap between consecutive distinct positions is kept if it is
    at most ``max_gap`` and shortened to ``max_gap`` otherwise. Equal positions stay equal, and the span of
    a row with ``k`` distinct positions becomes at most ``(k - 1) * max_gap`` — bounded by the cache size,
    whatever the stream length. Invalid entries are returned unchanged.
    """
    out = positions.clone()
    for row in range(positions.shape[0]):
        mask = valid[row]
        if not bool(mask.any()):
            continue
        values, inverse = torch.unique(positions[row][mask], return_inverse=True)  # sorted ascending
        gaps = (values[1:] - values[:-1]).clamp(max=max_gap)
        # distance back from the newest: reverse cumulative sum of the squeezed gaps
        back = torch.cat((gaps.flip(0).cumsum(0).flip(0), gaps.new_zeros(1)))
        out[row][mask] = (values[-1] - back)[inverse]
    return out
