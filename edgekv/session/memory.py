"""What the policies see of a session's cache, compaction, and the re-basing of temporal positions
(DESIGN invariants 1, 2 and 5). Policies call ``session.view`` and ``session.compact``; these are their bodies."""

from __future__ import annotations

import torch

from edgekv.cache.capped import SlotKind
from edgekv.policies.base import CacheView
from edgekv.positions import squeeze_gaps


def cache_view(session, recent_pairs: int) -> CacheView:
    """The valid part of the cache, as policies see it."""
    n, cache = session.cache.length, session.cache
    return CacheView(
        k=cache.policy_keys(n), v=cache.policy_values(n), kind=cache.kind[:, :, :n], sink=cache.sink[:, :, :n],
        frame=cache.frame[:, :, :n], row=cache.row[:, :, :n], col=cache.col[:, :, :n],
        tpos=cache.tpos[:, :, :n], grid=session.grid, latest_pair=session.counters.frame_pairs - 1,
        recent_pairs=recent_pairs, tokens_per_pair=session.tokens_per_pair, inv_freq=session.inv_freq,
        temporal_section=session.temporal_section,
    )


def compact(session, keep: torch.Tensor) -> None:
    """Compact the cache to ``keep`` (policies call this), then re-base positions if they ran high."""
    session.cache.compact(keep)
    if session.next_position > session.rebase_at:
        rebase_positions(session)


def rebase_positions(session) -> None:
    """Squeeze the temporal positions of kept video tokens; rotate their keys to match.

    Rule (order-preserving, per layer and KV head, since each keeps its own tokens): going back in
    time from the newest kept frame pair, every gap between consecutive distinct temporal positions
    wider than one nominal pair spacing ``G`` is shortened to ``G``; tokens of one pair keep one
    position, and the recent pairs (kept whole, at most ``G`` apart) keep their exact spacing. Then
    every video position shifts down by one common amount so the oldest lands at the video's start,
    and new frames continue right after the newest (``t_offset``). A (layer, head) holding ``k``
    distinct times spans at most ``(k - 1) G`` < ``C G`` positions, whatever the stream length.
    Each key moves by rotating only its temporal M-RoPE pairs by (new - old) — exact, because RoPE
    rotations compose (DESIGN invariant 5). Text after the video starts after the largest position
    in use, as in Qwen's ``get_rope_index``.
    """
    n, cache = session.cache.length, session.cache
    vision = cache.kind[:, :, :n] == int(SlotKind.VISION)  # [L, H, n]
    if not bool(vision.any()):
        return
    old = cache.tpos[:, :, :n].long()
    layers, heads = vision.shape[:2]
    new = squeeze_gaps(old.reshape(layers * heads, n), vision.reshape(layers * heads, n), session.pair_spacing)
    new = new.view(layers, heads, n)
    shift = int(new[vision].min()) - session.video_start
    new = torch.where(vision, new - shift, old)
    cache.retime_(new, session.inv_freq, session.temporal_section)
    session.t_offset += shift
    newest = int(new[vision].max())
    rows, cols = session.grid
    session.next_position = max(newest, session.video_start + max(rows, cols) - 1) + 1
    session.rebases += 1

# ------------------------------------------------------------------ model plumbing
