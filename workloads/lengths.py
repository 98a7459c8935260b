"""Length distributions for prompt and output token counts.

Invariant: `sample_lengths` returns n integers >= 1, drawn only from the rng it is given. Bounds
(`min`, `max`) *truncate* a distribution: a value outside them is redrawn (in vectorised batches,
so the result is deterministic for a given rng state) until every value lies inside. A value is
never clamped to a bound, which would pile up probability at the bound. Bounds that leave almost
no probability inside are a configuration error, not an endless loop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from cbsim.core.errors import ConfigError
from cbsim.core.schema import option, require

from cbsim.workloads.trace_source import TraceConfig, load_trace

MIN_INSIDE_MASS = 1e-4  # bounds must keep at least this share of the distribution


@dataclass
class FixedLength:
    """Every request gets the same length."""

    value: int = option(help="the length in tokens (>= 1)")

    def validate(self):
        require(self.value >= 1, "value", "a length >= 1", self.value)


@dataclass
class UniformLength:
    """Integers drawn uniformly from min..max, both included."""

    min: int = option(help="smallest length (>= 1)")
    max: int = option(help="largest length (>= min)")

    def validate(self):
        require(self.min >= 1, "min", "a length >= 1", self.min)
        require(self.max >= self.min, "max", f"a value >= min ({self.min})", self.max)


@dataclass
class LognormalLength:
    """Lognormal lengths, rounded to integers; truncated (redrawn, never clamped) to [min, max]."""

    median: float = option(help="median length in tokens (> 0); the lognormal's exp(mu)")
    sigma: float = option(help="standard deviation of log(length) (>= 0); with 1.0, one sigma is a factor of e (2.7)")
    min: int = option(1, help="truncation: smaller draws are redrawn, not clamped (>= 1)")
    max: int | None = option(None, help="truncation: larger draws are redrawn, not clamped; null for no bound")

    def validate(self):
        require(self.median > 0, "median", "a median > 0", self.median)
        require(self.sigma >= 0, "sigma", "a sigma >= 0", self.sigma)
        self.sigma = abs(self.sigma)  # -0.0 passes >= 0, but numpy's lognormal refuses its sign bit
        _check_bounds(self.min, self.max)
        inside = _lognormal_mass(self)
        require(inside >= MIN_INSIDE_MASS, "max" if self.max is not None else "min",
                f"bounds that keep at least {MIN_INSIDE_MASS:g} of the distribution (these keep {inside:.2g})",
                {"min": self.min, "max": self.max})


@dataclass
class ZipfLength:
    """Zipf lengths: P(min - 1 + k) proportional to k^-a for k = 1, 2, ...; truncated to max by redrawing."""

    a: float = option(help="Zipf exponent (> 1); larger means lengths concentrate near min")
    min: int = option(1, help="smallest length, the mode of the distribution (>= 1)")
    max: int | None = option(None, help="truncation: larger draws are redrawn, not clamped; null for no bound")

    def validate(self):
        require(self.a > 1, "a", "an exponent a > 1", self.a)
        _check_bounds(self.min, self.max)
        inside = _zipf_mass(self)
        require(inside >= MIN_INSIDE_MASS, "max", f"a bound that keeps at least {MIN_INSIDE_MASS:g} of the "
                f"distribution (this keeps {inside:.2g}; raise a or max)", self.max)


@dataclass
class EmpiricalLength:
    """Draw lengths with replacement from a list of values or from a trace's column.

    With a trace, `prompt_len` uses its prompt lengths and `output_len` its output lengths, after
    the trace's own options (window, filters, sample). The two are drawn independently, so the
    prompt/output correlation of the trace is lost; use `workload.trace` to keep pairs together.
    """

    values: list[int] | None = option(None, help="the lengths to draw from (each >= 1)")
    trace: TraceConfig | None = option(None, help="a trace whose prompt or output column to draw from")

    def validate(self):
        if (self.values is None) == (self.trace is None):
            raise ConfigError("values", "exactly one of 'values' or 'trace'", has_got=False)
        if self.values is not None:
            require(len(self.values) > 0, "values", "a non-empty list", self.values)
            bad = [v for v in self.values if v < 1]
            require(not bad, "values", "lengths >= 1", bad[:3])


LENGTHS: dict[str, type] = {
    "fixed": FixedLength,
    "uniform": UniformLength,
    "lognormal": LognormalLength,
    "zipf": ZipfLength,
    "empirical": EmpiricalLength,
}

LengthConfig = FixedLength | UniformLength | LognormalLength | ZipfLength | EmpiricalLength


def sample_lengths(cfg: LengthConfig, n: int, rng: np.random.Generator, *, role: str = "prompt",
                   base_dir: Path | None = None, path: str = "workload.prompt_len") -> np.ndarray:
    """n integer lengths >= 1 (int64). `role` ("prompt" or "output") picks an empirical trace's column."""
    if isinstance(cfg, FixedLength):
        return np.full(n, cfg.value, dtype=np.int64)
    if isinstance(cfg, UniformLength):
        return rng.integers(cfg.min, cfg.max + 1, size=n, dtype=np.int64)
    if isinstance(cfg, LognormalLength):
        mu = math.log(cfg.median)
        draw = lambda k: np.rint(rng.lognormal(mu, cfg.sigma, k)).astype(np.int64)  # noqa: E731
        return truncated(draw, n, cfg.min, cfg.max, _lognormal_mass(cfg))
    if isinstance(cfg, ZipfLength):
        draw = lambda k: rng.zipf(cfg.a, k).astype(np.int64) + (cfg.min - 1)  # noqa: E731
        return truncated(draw, n, cfg.min, cfg.max, _zipf_mass(cfg))
    if isinstance(cfg, EmpiricalLength):
        pool = _empirical_pool(cfg, rng, role, base_dir, path)
        return rng.choice(pool, size=n, replace=True).astype(np.int64)
    raise TypeError(f"not a length config: {cfg!r}")


def truncated(draw: Callable[[int], np.ndarray], n: int, lo: int, hi: int | None, inside: float) -> np.ndarray:
    """n draws restricted to [lo, hi]: out-of-range values are redrawn in batches sized by `inside`.

    `draw(k)` returns k candidates; `inside` estimates the share that falls in range, so most calls
    finish in one or two batches. The order of calls is fixed, so the result depends only on the rng.
    """
    out = np.empty(n, dtype=np.int64)
    filled = 0
    while filled < n:
        want = n - filled
        batch = draw(int(math.ceil(want / max(inside, MIN_INSIDE_MASS) * 1.1)) + 16)
        keep = batch[(batch >= lo) & ((batch <= hi) if hi is not None else True)][:want]
        out[filled:filled + len(keep)] = keep
        filled += len(keep)
    return out


def _check_bounds(lo: int, hi: int | None) -> None:
    require(lo >= 1, "min", "a length >= 1", lo)
    if hi is not None:
        require(hi >= lo, "max", f"a value >= min ({lo})", hi)


def _lognormal_mass(cfg: LognormalLength) -> float:
    """Probability that a rounded lognormal draw lands in [min, max]."""
    if cfg.sigma == 0:
        value = round(cfg.median)
        return 1.0 if value >= cfg.min and (cfg.max is None or value <= cfg.max) else 0.0
    mu = math.log(cfg.median)

    def cdf(x: float) -> float:
        return 0.0 if x <= 0 else 0.5 * (1 + math.erf((math.log(x) - mu) / (cfg.sigma * math.sqrt(2))))

    upper = 1.0 if cfg.max is None else cdf(cfg.max + 0.5)
    return upper - cdf(cfg.min - 0.5)


def _zipf_mass(cfg: ZipfLength) -> float:
    """Probability that a shifted Zipf draw is at most max (its support starts at min)."""
    if cfg.max is None:
        return 1.0
    k = np.arange(1, min(cfg.max - cfg.min + 1, 1_000_000) + 1, dtype=np.float64)
    return float(np.sum(k ** -cfg.a) / _zeta(cfg.a))


def _zeta(a: float) -> float:
    from scipy.special import zeta

    return float(zeta(a, 1))


def _empirical_pool(cfg: EmpiricalLength, rng, role: str, base_dir: Path | None, path: str) -> np.ndarray:
    if cfg.values is not None:
        return np.asarray(cfg.values, dtype=np.int64)
    trace = load_trace(cfg.trace, rng, base_dir, f"{path}.trace")
    pool = trace.prompt_len if role == "prompt" else trace.output_len
    if len(pool) == 0:
        raise ConfigError(f"{path}.trace", "a trace with at least one request left after its filters", 0,
                          file=trace.source)
    return pool
