"""Cache policies, one file each, found through one registry."""

from edgekv.policies import full  # noqa: F401 - registers
from edgekv.policies.base import CachePolicy, make_policy, policy_names, register

__all__ = ["CachePolicy", "make_policy", "policy_names", "register"]
