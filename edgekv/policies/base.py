"""Cache policies: what a full cache gives up to make room (one policy per file, one registry).

A policy only scores; the base class owns the plumbing (kvpress's ScorerPress habit): protected slots
(the system prefix, StateKV sinks, the ``r`` most recent frame pairs), top-k per (layer, KV head),
sorting and the in-place compaction of K, V and slot metadata. Policies never see a question
(DESIGN invariant 3: query-agnostic).

Budget terms (InfiniPot-V, seed 004, Alg. 1 and App. A.2): ``M`` is the hard cap of the cache in
slots; the prefix and the video may use ``M - text_reserve`` of it (the rest is kept for a question
and its answer). A compression runs when the next frame pair would not fit and leaves ``C`` slots
(default ``0.75 * (M - text_reserve)``), ``C`` counting the prefix. ``f`` is the number of frame
pairs that fit, ``r = max(1, round(recent_ratio * f))`` the recent pairs that are always kept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from edgekv.cache.capped import CapTooSmallError, SlotKind


@dataclass
class CacheView:
    """What a policy may look at: the valid prefix ``[0, n)`` of the cache and the stream's shape."""

    k: torch.Tensor       # [L, H, n, D] (an 8-bit cache: a DequantizedView, indexed by layer blocks or slots)
    v: torch.Tensor       # [L, H, n, D] (likewise)
    kind: torch.Tensor    # [L, H, n] int8
    sink: torch.Tensor    # [L, H, n] bool
    frame: torch.Tensor   # [L, H, n] int32
    row: torch.Tensor     # [L, H, n] int16
    col: torch.Tensor     # [L, H, n] int16
    tpos: torch.Tensor    # [L, H, n] int32 temporal position the key is rotated with
    grid: tuple[int, int]  # merged grid (rows, cols) of one frame pair
    latest_pair: int
    recent_pairs: int
    tokens_per_pair: int
    inv_freq: torch.Tensor  # [D/2] rotary inverse frequencies
    temporal_section: int   # how many rotary frequencies carry the temporal position

    @property
    def vision(self) -> torch.Tensor:
        return self.kind == int(SlotKind.VISION)

    @property
    def recent(self) -> torch.Tensor:
        """Slots of the ``recent_pairs`` newest frame pairs (always kept, TaR's reference frames)."""
        return self.vision & (self.frame > self.latest_pair - self.recent_pairs)


class CachePolicy:
    """Base of every policy. ``evicts = False`` means a full cache is an error, never silent loss."""

    name: ClassVar[str] = "base"
    evicts: ClassVar[bool] = True

    def check(self, session) -> None:
        """Refuse a budget this policy cannot work in (called once the frame grid is known)."""

    def compress(self, session, incoming: int) -> None:
        raise NotImplementedError(f"policy '{self.name}' does not evict")

    def stats(self, session) -> dict:
        return {}

    def observe_pair(self, pair: int, tokens: torch.Tensor) -> None:
        """Called with each ingested frame pair's visual tokens [P, d] before its prefill (query-agnostic:
        video only); most policies need nothing from them."""

    def state(self) -> dict:
        """What a snapshot keeps of this policy between compressions (JSON values); most keep nothing."""
        return {}

    def load_state(self, state: dict) -> None:
        if state:
            raise ValueError(f"policy '{self.name}' keeps no state, got {sorted(state)}")


@dataclass
class ScoredPolicy(CachePolicy):
    """Keep the ``C`` best-scored slots per (layer, KV head); protected slots always survive."""

    target_tokens: int | None = None   # C; None = 0.75 * (M - text_reserve)
    recent_ratio: float = 0.125        # r as a share of the frame pairs that fit
    keeps_recent: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if not 0.0 < self.recent_ratio < 1.0:
            raise ValueError(f"cache.recent_ratio must be in (0, 1), got {self.recent_ratio}")
        if self.target_tokens is not None and self.target_tokens <= 0:
            raise ValueError(f"cache.target_tokens must be positive, got {self.target_tokens}")

    # ------------------------------------------------------------------ budget
    def target(self, session) -> int:
        if self.target_tokens is not None:
            return int(self.target_tokens)
        return int(0.75 * session.video_limit)

    def recent_pairs(self, session) -> int:
        fit = (session.video_limit - session.prefix_tokens) // session.tokens_per_pair
        return max(1, round(self.recent_ratio * fit)) if self.keeps_recent else 0

    def check(self, session) -> None:
        per_pair, target = session.tokens_per_pair, self.target(session)
        if target + per_pair > session.video_limit:
            raise ValueError(
                f"{self.target_text(session)}: after a compression the next frame pair ({per_pair} tokens) must "
                f"fit under M - text_reserve = {session.video_limit}; the maximum is {session.video_limit - per_pair}"
            )
        protected = session.prefix_tokens + self.recent_pairs(session) * per_pair + session.sink_budget
        if protected >= target:
            raise CapTooSmallError(
                f"{self.target_text(session)} cannot hold the prefix ({session.prefix_tokens}), the "
                f"{self.recent_pairs(session)} recent frame pairs always kept (cache.recent_ratio="
                f"{self.recent_ratio}) and {session.sink_budget} sinks: the minimum is {protected + 1}"
                + self.room_hint(session, protected + 1)
            )

    def target_text(self, session) -> str:
        """C as the user set it, or (unset) how its default came about: an error naming "cache.target_tokens=360"
        read as a setting the user never made."""
        if self.target_tokens is not None:
            return f"cache.target_tokens={self.target(session)}"
        return (f"the compression target C = 0.75 x (M - text_reserve) = {self.target(session)} (cache.target_tokens "
                f"unset)")

    def room_hint(self, session, minimum: int) -> str:
        """What to change when C is below ``minimum``: C itself where a larger one fits, else the cap."""
        largest = session.video_limit - session.tokens_per_pair
        if minimum <= largest:
            return f"; set cache.target_tokens between {minimum} and {largest}, or raise cache.max_tokens"
        return (f"; no target fits under M - text_reserve = {session.video_limit}: raise cache.max_tokens (or lower "
                f"cache.text_reserve_tokens or cache.recent_ratio)")

    # ------------------------------------------------------------------ scoring
    def score(self, view: CacheView) -> torch.Tensor:
        """[L, H, n] float, higher = keep. Protected slots are handled by the caller."""
        raise NotImplementedError

    def protected(self, view: CacheView) -> torch.Tensor:
        keep = (view.kind == int(SlotKind.PREFIX)) | view.sink
        return keep | view.recent if self.keeps_recent else keep

    def select(self, view: CacheView, target: int) -> torch.Tensor:
        """keep: [L, H, C] sorted slot indices."""
        scores = self.score(view).to(torch.float32)
        scores = scores.masked_fill(self.protected(view), float("inf"))
        return torch.topk(scores, target, dim=-1, sorted=False).indices.sort(dim=-1).values

    def compress(self, session, incoming: int) -> None:
        view = session.view(self.recent_pairs(session))
        target = min(self.target(session), session.cache.length)
        keep = self.select(view, target)
        session.compact(keep)


_REGISTRY: dict[str, type[CachePolicy]] = {}


def register(cls: type[CachePolicy]) -> type[CachePolicy]:
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(name: str, **kwargs) -> CachePolicy:
    """Build a registered policy from config values; keys a policy does not take are ignored."""
    if name not in _REGISTRY:
        raise ValueError(f"cache.policy: unknown policy {name!r} (known: {', '.join(policy_names())})")
    cls = _REGISTRY[name]
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return cls(**{key: value for key, value in kwargs.items() if key in fields})
