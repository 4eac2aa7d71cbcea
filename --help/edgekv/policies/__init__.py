"""Cache policies, one file each, found through one registry."""

from edgekv.policies import (  # noqa: F401 - each import registers a policy
    adaptive_infinipot_v, full, infinipot_v, sink_recent, sliding_window, statekv, tar, uniform_frames, van,
)
from edgekv.policies.base import CachePolicy, CacheView, ScoredPolicy, make_policy, policy_names, register

__all__ = ["CachePolicy", "CacheView", "ScoredPolicy", "make_policy", "policy_names", "register"]
