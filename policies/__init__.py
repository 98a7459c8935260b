"""Scheduling policies: one file each, registered by name (see registry.py)."""
from cbsim.policies.registry import POLICIES, make_policy, policy_help, register

__all__ = ["POLICIES", "make_policy", "policy_help", "register"]
