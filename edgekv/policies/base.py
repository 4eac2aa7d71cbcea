"""Cache policies: what a full cache gives up to make room (one policy per file, a registry).

A policy sees the session's ``CappedKVCache`` and returns scores; the base class owns the plumbing
(protected slots, top-k, sorting, in-place compaction). Policies never see a question: DESIGN
invariant 3 (query-agnostic).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch


class CachePolicy:
    """Base of every policy. ``evicts = False`` means a full cache is an error, never silent loss."""

    name: ClassVar[str] = "base"
    evicts: ClassVar[bool] = True

    def prefill_visibility(self, session) -> Callable[[int], torch.Tensor] | None:
        """Which committed slots a frame pair's queries may attend to (None: all of them)."""
        return None

    def compress(self, session, incoming: int) -> None:
        raise NotImplementedError(f"policy '{self.name}' does not evict")

    def stats(self, session) -> dict:
        return {}


_REGISTRY: dict[str, type[CachePolicy]] = {}


def register(cls: type[CachePolicy]) -> type[CachePolicy]:
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_policy(name: str, **kwargs) -> CachePolicy:
    if name not in _REGISTRY:
        raise ValueError(f"cache.policy: unknown policy {name!r} (known: {', '.join(policy_names())})")
    return _REGISTRY[name](**kwargs)
