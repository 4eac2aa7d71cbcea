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
    _prune_pair_times(session)
    if session.next_position > session.rebase_at:
        rebase_positions(session)


def _prune_pair_times(session) -> None:
    """Keep the time of the frame pairs some slot still holds (at most M of them, whatever the stream's length)."""
    cache, n = session.cache, session.cache.length
    held = set(torch.unique(cache.frame[:, :, :n]).tolist())
    for pair in [pair for pair in session.pair_times if pair not in held]:
        del session.pair_times[pair]
        session.pair_ends.pop(pair, None)


def forget(session, t_from: float, t_to: float) -> tuple[list[int], int]:
    """Remove every frame pair with a frame in ``[t_from, t_to]`` from the cache (issue 31's "forget";
    ``StreamSession.pairs_in``).

    Each (layer, KV head) keeps its other slots; as every head must hold the same number of slots, heads that
    held fewer of the forgotten tokens also drop their lowest-scored others (the policy's own score, protected
    slots first kept) down to the smallest count left. The bytes of every slot past the new length are zeroed:
    nothing of the window stays in the cache's memory (and so in any later snapshot). A waiting frame of the
    window is dropped too. Returns (the pairs forgotten, the slots removed).
    """
    cache, n = session.cache, session.cache.length
    pairs = session.pairs_in(t_from, t_to)
    pending = session.ingestor.pending
    if pending is not None and t_from <= pending[1] <= t_to:
        session.ingestor.pending = None
    if not pairs:
        return [], 0
    frames = cache.frame[:, :, :n]
    gone = torch.isin(frames, torch.tensor(pairs, dtype=frames.dtype, device=frames.device))
    gone &= cache.kind[:, :, :n] == int(SlotKind.VISION)
    target = int((~gone).sum(dim=-1).min())
    view = cache_view(session, session.policy.recent_pairs(session) if hasattr(session.policy, "recent_pairs") else 1)
    if hasattr(session.policy, "score"):
        scores = session.policy.score(view).to(torch.float32)
        scores = scores.masked_fill(session.policy.protected(view), float("inf"))
    else:  # a policy without scores: keep the newest
        scores = torch.arange(n, dtype=torch.float32, device=frames.device).expand_as(frames).clone()
        scores = scores.masked_fill(view.kind == int(SlotKind.PREFIX), float("inf"))
    scores = scores.masked_fill(gone, float("-inf"))
    keep = torch.topk(scores, target, dim=-1, sorted=False).indices.sort(dim=-1).values
    cache.compact(keep)
    cache.k[:, :, target:n].zero_()
    cache.v[:, :, target:n].zero_()
    if cache.quantized:
        cache.k_scale[:, :, target:n].zero_()
        cache.v_scale[:, :, target:n].zero_()
    cache.clear_meta(target, n)
    if session.sinks is not None:
        session.sinks.mass[:, :, target:n].zero_()
    for pair in pairs:
        session.pair_times.pop(pair, None)
        session.pair_ends.pop(pair, None)
    _prune_pair_times(session)
    return pairs, int(gone.sum())


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
