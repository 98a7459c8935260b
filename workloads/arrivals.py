"""Synthetic arrival processes: when requests arrive.

Invariant: `sample_arrivals(cfg, n, rng)` returns n non-decreasing times in seconds whose first
value is exactly 0, drawn only from `rng`. Every process is the same recipe: draw the event times
of the process from time 0, then shift them so the first arrival is at 0 (for a renewal process
that is the same as starting the clock at the first arrival).

Time-varying rates (bursts, diurnal) use time rescaling: a unit-rate Poisson process pushed
through the inverse of the cumulative intensity Lambda(t) is a Poisson process of rate lambda(t).

Load stages (`stages`, like inference-perf's load stages) are one run whose rate changes at fixed
times: stage k holds rate_k for duration_k seconds from the end of stage k-1, the first stage
starting at 0 with an arrival (a quiet first stage, rate 0, delays it to the first busy stage).
Their count is what the stages hold (at most n); nothing after the last stage. One simulation runs
them all, so the KV cache, the prefix cache and the backlog of one stage are there when the next
begins.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from cbsim.core.schema import option, require
from cbsim.core.units import Seconds


@dataclass
class PoissonArrival:
    """Poisson arrivals: exponential inter-arrival gaps (coefficient of variation 1)."""

    rate: float = option(help="mean arrivals per second (> 0)")

    def validate(self):
        require(self.rate > 0, "rate", "a rate > 0", self.rate)


@dataclass
class GammaArrival:
    """Gamma-distributed inter-arrival gaps: cv > 1 is burstier than Poisson, cv < 1 more regular."""

    rate: float = option(help="mean arrivals per second (> 0)")
    cv: float = option(help="coefficient of variation of the inter-arrival gaps (> 0; 1 is Poisson)")

    def validate(self):
        require(self.rate > 0, "rate", "a rate > 0", self.rate)
        require(self.cv > 0, "cv", "a cv > 0", self.cv)


@dataclass
class ConstantArrival:
    """Evenly spaced arrivals: request i arrives at i / rate."""

    rate: float = option(help="arrivals per second (> 0)")

    def validate(self):
        require(self.rate > 0, "rate", "a rate > 0", self.rate)


@dataclass
class AllAtOnceArrival:
    """Every request arrives at time 0 (an offline batch)."""


@dataclass(kw_only=True)
class BurstsArrival:
    """On/off Poisson bursts: `on_seconds` at `on_rate`, then `off_seconds` at `off_rate`, repeated."""

    on_rate: float = option(help="arrivals per second during a burst (> 0)")
    off_rate: float = option(0.0, help="arrivals per second between bursts (>= 0; 0 means silence)")
    on_seconds: Seconds = option(help="length of each burst in seconds (> 0)")
    off_seconds: Seconds = option(help="length of each quiet period in seconds (>= 0)")

    def validate(self):
        require(self.on_rate > 0, "on_rate", "a rate > 0", self.on_rate)
        require(self.off_rate >= 0, "off_rate", "a rate >= 0", self.off_rate)
        require(self.on_seconds > 0, "on_seconds", "a duration > 0", self.on_seconds)
        require(self.off_seconds >= 0, "off_seconds", "a duration >= 0", self.off_seconds)


@dataclass
class DiurnalArrival:
    """Poisson arrivals with a sinusoidal rate: mean_rate * (1 + amplitude * sin(2 pi t / period))."""

    mean_rate: float = option(help="arrivals per second averaged over a period (> 0)")
    amplitude: float = option(0.5, help="relative swing of the rate, 0 (flat) to 1 (drops to zero at the trough)")
    period: Seconds = option(86400.0, help="length of one cycle in seconds (> 0)")

    def validate(self):
        require(self.mean_rate > 0, "mean_rate", "a rate > 0", self.mean_rate)
        require(0 <= self.amplitude <= 1, "amplitude", "an amplitude between 0 and 1", self.amplitude)
        require(self.period > 0, "period", "a period > 0", self.period)


@dataclass
class Stage:
    """One load stage: a rate held for a duration."""

    rate: float = option(help="arrivals per second during the stage (>= 0; 0 is a quiet stage)")
    duration: Seconds = option(help="length of the stage in seconds (> 0)")

    def validate(self):
        require(self.rate >= 0 and math.isfinite(self.rate), "rate", "a finite rate >= 0", self.rate)
        require(self.duration > 0 and math.isfinite(self.duration), "duration", "a finite duration > 0",
                self.duration)


@dataclass
class StagesArrival:
    """Load stages: a list of {rate, duration}, run back to back (inference-perf's `load.stages`)."""

    stages: list[Stage] = option(help="the stages in order, each {rate: arrivals/s >= 0, duration: s > 0}; the "
                                      "first starts at 0, each next one where the previous ends")
    process: Literal["poisson", "constant"] = option(
        "poisson", help="within a stage: poisson (exponential gaps) or constant (evenly spaced at the rate)")

    def validate(self):
        require(len(self.stages) > 0, "stages", "a non-empty list of {rate, duration}", self.stages)
        require(any(s.rate > 0 for s in self.stages), "stages", "at least one stage with a rate > 0",
                [s.rate for s in self.stages])

    @property
    def boundaries(self) -> np.ndarray:
        """Start of each stage and end of the last (seconds)."""
        return np.concatenate(([0.0], np.cumsum([s.duration for s in self.stages])))

    @property
    def expected(self) -> float:
        """Mean number of arrivals over all stages (the exact count for constant stages, +1 at 0)."""
        return sum(s.rate * s.duration for s in self.stages)


ARRIVALS: dict[str, type] = {
    "poisson": PoissonArrival,
    "gamma": GammaArrival,
    "constant": ConstantArrival,
    "all_at_once": AllAtOnceArrival,
    "bursts": BurstsArrival,
    "diurnal": DiurnalArrival,
    "stages": StagesArrival,
}

ArrivalConfig = (PoissonArrival | GammaArrival | ConstantArrival | AllAtOnceArrival | BurstsArrival | DiurnalArrival
                 | StagesArrival)


def sample_arrivals(cfg: ArrivalConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    """n arrival times in seconds, non-decreasing, the first at 0 (stages: at most n, see the module
    docstring)."""
    if n <= 0:
        return np.zeros(0)
    if isinstance(cfg, StagesArrival):
        return _stage_times(cfg, n, rng)
    times = _event_times(cfg, n, rng)
    return times - times[0]


def _event_times(cfg: ArrivalConfig, n: int, rng: np.random.Generator) -> np.ndarray:
    if isinstance(cfg, PoissonArrival):
        return np.cumsum(rng.exponential(1.0 / cfg.rate, n))
    if isinstance(cfg, GammaArrival):
        shape = 1.0 / cfg.cv**2
        return np.cumsum(rng.gamma(shape, 1.0 / (cfg.rate * shape), n))
    if isinstance(cfg, ConstantArrival):
        return np.arange(n) / cfg.rate
    if isinstance(cfg, AllAtOnceArrival):
        return np.zeros(n)
    if isinstance(cfg, BurstsArrival):
        return _bursts_inverse(cfg, np.cumsum(rng.exponential(1.0, n)))
    if isinstance(cfg, DiurnalArrival):
        return _diurnal_inverse(cfg, np.cumsum(rng.exponential(1.0, n)))
    raise TypeError(f"not an arrival config: {cfg!r}")


def _stage_times(cfg: StagesArrival, n: int, rng: np.random.Generator) -> np.ndarray:
    """Arrivals of the stages: an arrival at 0, then the events of the process at cumulative intensity
    masses (unit exponential gaps for poisson, 1, 2, ... for constant) mapped through Lambda^-1."""
    total = cfg.expected
    if cfg.process == "constant":
        mass = np.arange(0.0, min(total, n - 1) + 1)  # masses 0, 1, ..., within the stages
        mass = mass[mass < total]
    else:
        chunk = int(total + 10 * math.sqrt(total) + 10)
        mass = np.concatenate(([0.0], np.cumsum(rng.exponential(1.0, chunk))))
        while mass[-1] < total and len(mass) <= n:
            mass = np.concatenate((mass, mass[-1] + np.cumsum(rng.exponential(1.0, chunk))))
        mass = mass[mass < total]
    return _stages_inverse(cfg, mass[:n])


def _stages_inverse(cfg: StagesArrival, mass: np.ndarray) -> np.ndarray:
    """Invert the piecewise-linear cumulative intensity of the stages (quiet stages take no mass)."""
    rates = np.array([s.rate for s in cfg.stages])
    starts = cfg.boundaries[:-1]
    cum = np.concatenate(([0.0], np.cumsum(rates * np.diff(cfg.boundaries))))
    k = np.searchsorted(cum[1:], mass, side="right")  # stage holding each mass: first with cum end > mass
    k = np.minimum(k, len(rates) - 1)
    rate = np.where(rates[k] > 0, rates[k], np.inf)
    return starts[k] + (mass - cum[k]) / rate


def _bursts_inverse(cfg: BurstsArrival, mass: np.ndarray) -> np.ndarray:
    """Invert the piecewise-linear cumulative intensity of an on/off cycle."""
    on_mass = cfg.on_rate * cfg.on_seconds
    cycle_mass = on_mass + cfg.off_rate * cfg.off_seconds
    cycle = cfg.on_seconds + cfg.off_seconds
    k = np.floor(mass / cycle_mass)
    rest = np.clip(mass - k * cycle_mass, 0.0, cycle_mass)
    in_on = rest < on_mass
    off_rate = cfg.off_rate if cfg.off_rate > 0 else math.inf  # off mass is zero then; never used
    offset = np.where(in_on, rest / cfg.on_rate, cfg.on_seconds + (rest - on_mass) / off_rate)
    return k * cycle + offset


def _diurnal_inverse(cfg: DiurnalArrival, mass: np.ndarray) -> np.ndarray:
    """Invert Lambda(t) = mean * (t + A P / 2pi * (1 - cos(2 pi t / P))) by bisection within a period."""
    period_mass = cfg.mean_rate * cfg.period
    k = np.floor(mass / period_mass)
    rest = mass - k * period_mass
    lo = np.zeros_like(rest)
    hi = np.full_like(rest, cfg.period)
    w = 2 * math.pi / cfg.period
    for _ in range(60):  # 2^-60 of a period: exact to float precision
        mid = 0.5 * (lo + hi)
        below = cfg.mean_rate * (mid + cfg.amplitude / w * (1 - np.cos(w * mid))) < rest
        lo = np.where(below, mid, lo)
        hi = np.where(below, hi, mid)
    return k * cfg.period + 0.5 * (lo + hi)
