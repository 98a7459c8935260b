"""Exact SimPy timing helpers.

A step's end time is `start + duration` in floating point, and the simulator records those sums.
`delay_to(now, target)` returns a delay d with now + d == target exactly where possible, so that
SimPy's clock follows the exact sums; the replicas and the arrival feed keep the exact times
themselves and never rely on SimPy's clock to order events closer than a few ulps. `UrgentTimeout` fires
before ordinary events due at the same instant: an arrival at time t is visible to a step that
starts at t.
"""
from __future__ import annotations

import math

from simpy.core import URGENT
from simpy.events import Event


def delay_to(now: float, target: float) -> float:
    """A delay d >= 0 with now + d == target when one exists, else the smallest with now + d > target
    (never early: SimPy's clock cannot land on every float from every starting time)."""
    delay = target - now
    if now + delay == target or delay <= 0:
        return max(delay, 0.0)
    slack = 4 * math.ulp(target)
    lo, hi = max(delay - slack, 0.0), delay + slack  # now + lo <= target <= now + hi
    for _ in range(80):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        if now + mid < target:
            lo = mid
        else:
            hi = mid
    return lo if now + lo == target else hi


class UrgentTimeout(Event):
    """Like simpy.Timeout, scheduled with URGENT priority."""

    def __init__(self, env, delay: float, value=None):
        super().__init__(env)
        self._ok = True
        self._value = value
        env.schedule(self, URGENT, delay)
