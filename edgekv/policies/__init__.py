"""Cache policies, one file each, found through one registry."""

from edgekv.policies import full, infinipot_v, sink_recent, sliding_window, tar, uniform_frames, van  # noqa: F401
from edgekv.policies.base import CachePolicy, CacheView, ScoredPolicy, make_policy, policy_names, register

__all__ = ["CachePolicy", "CacheView", "ScoredPolicy", "make_policy", "policy_names", "register"]
