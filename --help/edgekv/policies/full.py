"""``full``: the unbounded reference. Keeps every token; a full cache raises, it never drops tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from edgekv.policies.base import CachePolicy, register


@register
@dataclass
class FullPolicy(CachePolicy):
    name: ClassVar[str] = "full"
    evicts: ClassVar[bool] = False
