"""Exact SimPy timing helpers.

A step's end time is `start + duration` in floating point, and the simulator records those sums.
`delay_to(now, target)` returns a delay d with now + d == target exactly, so that SimPy's clock
lands on a precomputed time (used when many steps are advanced at once). `UrgentTimeout` fires
before ordinary events due at the same instant: an arrival at time t is visible to a step that
starts at t.
"""
from __future__ import annotations

import math

from simpy.core import URGENT
from simpy.events import Event


def delay_to(now: float, target: float) -> float:
    delay = target - now
    for _ in range(8):
        reached = now + delay
        if reached == target:
            return delay
        delay = math.nextafter(delay, math.inf if reached < target else -math.inf)
    return delay


class UrgentTimeout(Event):
    """Like simpy.Timeout, scheduled with URGENT priority."""

    def __init__(self, env, delay: float, value=None):
        super().__init__(env)
        self._ok = True
        self._value = value
        env.schedule(self, URGENT, delay)
