"""Tool-call durations of agentic sessions: how long a tool runs between two turns (seconds).

Invariant: `sample_tool_times` returns n finite durations >= 0, drawn only from the rng it is given
(a fixed duration draws nothing). The forms are the ones agent traces are summarised with: an
exponential (memoryless calls), a lognormal (a heavy right tail: a test suite, a web fetch), a fixed
time, or an empirical list of measured durations drawn with replacement. A lognormal may be
truncated by `max` (redrawn, never clamped, as workloads/lengths.py truncates lengths).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cbsim.core.schema import option, require
from cbsim.core.units import Seconds


@dataclass
class FixedToolTime:
    """Every tool call takes the same time."""

    value: Seconds = option(help="seconds (>= 0)")

    def validate(self):
        require(math.isfinite(self.value) and self.value >= 0, "value", "seconds >= 0", self.value)


@dataclass
class ExponentialToolTime:
    """Exponential durations of a given mean."""

    mean: Seconds = option(help="mean seconds (> 0)")

    def validate(self):
        require(math.isfinite(self.mean) and self.mean > 0, "mean", "seconds > 0", self.mean)


@dataclass
class LognormalToolTime:
    """Lognormal durations; `max` truncates (a longer draw is redrawn, never clamped)."""

    median: Seconds = option(help="median seconds (> 0); the lognormal's exp(mu)")
    sigma: float = option(help="standard deviation of log(seconds) (>= 0)")
    max: Seconds | None = option(None, help="truncation in seconds (> median); null: no bound")

    def validate(self):
        require(math.isfinite(self.median) and self.median > 0, "median", "seconds > 0", self.median)
        require(math.isfinite(self.sigma) and self.sigma >= 0, "sigma", "a sigma >= 0", self.sigma)
        self.sigma = abs(self.sigma)  # -0.0 passes >= 0, but numpy's lognormal refuses its sign bit
        require(self.max is None or (math.isfinite(self.max) and self.max > self.median), "max",
                f"seconds > median ({self.median}) or null", self.max)


@dataclass
class EmpiricalToolTime:
    """Durations drawn with replacement from a list of measured ones."""

    values: list[float] = option(help="the measured durations in seconds (each >= 0)")

    def validate(self):
        require(len(self.values) > 0, "values", "a non-empty list of seconds", self.values)
        bad = [v for v in self.values if not (math.isfinite(v) and v >= 0)]
        require(not bad, "values", "seconds >= 0", bad[:3])


TOOL_TIMES: dict[str, type] = {
    "fixed": FixedToolTime,
    "exponential": ExponentialToolTime,
    "lognormal": LognormalToolTime,
    "empirical": EmpiricalToolTime,
}

ToolTimeConfig = FixedToolTime | ExponentialToolTime | LognormalToolTime | EmpiricalToolTime


def sample_tool_times(cfg: ToolTimeConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    """n durations in seconds (float64), as the module docstring says."""
    if isinstance(cfg, FixedToolTime):
        return np.full(n, float(cfg.value))
    if isinstance(cfg, ExponentialToolTime):
        return rng.exponential(cfg.mean, n)
    if isinstance(cfg, EmpiricalToolTime):
        return np.asarray(cfg.values, dtype=np.float64)[rng.integers(0, len(cfg.values), n)]
    out = rng.lognormal(math.log(cfg.median), cfg.sigma, n)
    while cfg.max is not None and (over := out > cfg.max).any():  # max > median: each pass keeps > half
        out[over] = rng.lognormal(math.log(cfg.median), cfg.sigma, int(over.sum()))
    return out
