"""Cost model `fitted`: step time from a profile fitted to measurements (profiler/fit.py).

    layer  = g(T) + gp(Tp) + a1 P + a1h Ph + a1n Pn + a2 Kp + b1 Kd + b2 n_dec + b3 n_pref + k  (features.py)
    gpu    = L (layer + allreduce(T)) + lm_head(rows) + step_overhead
    step   = the serving engine around the kernels: host work, launches, overlap             (engine.py)

Profile formats: 2 (profiler/fit.py now) fits the tile step gp(Tp) (absent when its `tile` is
null) and the split pair rates a1h, a1n, with a1 = 0; 1 had one pair rate a1 and no tile, so
gp = 0 and a1h = a1n = 0. The terms that a format lacks add exactly 0.0, so a format-1 profile
gives the same numbers, bit for bit, as before format 2 existed.

Invariant: `step_time` (plain Python on the shape's aggregates, a few microseconds) and
`decode_run_times` (numpy over a run of decode steps, where only Kd changes; T, hence Tp, is the
number of rows) call the same private function `_gpu` with the same operands in the same order,
so they agree bit for bit. The profile's out-of-fold residual quantiles give
`prediction_interval` and `sample_factor`. Every profile is checked when loaded (profile_check.py):
a bad one is a ProfileError naming its file and key, never a KeyError or a NaN step time.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cbsim.core import bounds
from cbsim.core.errors import ConfigError
from cbsim.core.schema import option, require
from cbsim.sim.cost import CostModel
from cbsim.sim.shape import StepShape

from cbsim.sim.costmodels.features import (PADDED_PREFIX, aggregates, padded_segments, padded_tokens, ramp_values_at_knots,
                        rows_aggregates, segment_name)
from cbsim.sim.costmodels.allreduce import AllReduce, profile_collective_seconds
from cbsim.sim.costmodels.engine import NO_ENGINE, CpuOverheadConfig, Engine, engine_option, resolve_engine
from cbsim.sim.costmodels.curves import Curve
from cbsim.sim.costmodels.pipeline import profile_pipeline, slowest
from cbsim.sim.costmodels.profile_check import MAX_LAYERS, check_fitted
from cbsim.sim.costmodels.registry import register_cost_model

PROFILES = Path(__file__).resolve().parent / "profiles"


@register_cost_model("fitted")
class FittedCostModel(CostModel):
    @dataclass
    class Config:
        profile: str = option(help="fitted profile JSON (cbsim fit); a relative path is also looked up in the "
                              "shipped profiles folder")
        num_layers: int | None = option(None, help="decoder layers; default: the profile's")
        step_overhead: float | None = option(None, help="seconds added per step on the GPU side; default: the profile's")
        pp: int = option(1, help="pipeline stages: the fitted layer's time on each stage's layers (split as vLLM "
                         "splits them), step_time one stage's time, the activation hand-off priced as roofline's "
                         "(pipeline.py); the hidden size is the experiment model's")
        engine: Any = engine_option()
        cpu_overhead: CpuOverheadConfig | None = option(None, help="the older form of the engine's host terms "
                                                        "(kept for old configs; use engine:)")

        def validate(self) -> None:
            require(isinstance(self.pp, int) and not isinstance(self.pp, bool) and self.pp >= 1, "pp",
                    "an integer >= 1", self.pp)
            require(self.num_layers is None or 1 <= self.num_layers <= MAX_LAYERS, "num_layers",
                    f"an integer >= 1 and <= {MAX_LAYERS}", self.num_layers)
            require(self.step_overhead is None or 0 <= self.step_overhead < math.inf, "step_overhead",
                    "a finite number >= 0", self.step_overhead)

    def __init__(self, profile: dict, *, num_layers: int | None = None, step_overhead: float | None = None,
                 engine: Engine = NO_ENGINE, source: str = "", pp: int = 1, hidden: int | None = None):
        if profile.get("type") != "fitted":
            raise ValueError(f"{source or 'profile'} is not a fitted profile (type {profile.get('type')!r})")
        check_fitted(profile, source)  # ProfileError naming the file and key
        self.profile = profile
        self.source = source
        self.num_layers = int(num_layers or profile["num_layers"])
        self.engine = engine
        self.pipeline_stages = pp
        self._pipeline = None
        if pp > 1:
            self._pipeline = profile_pipeline(self.num_layers, pp, int(profile.get("tp") or 1), hidden,
                                              str(profile.get("gpu")), "cost_model.pp")
        stage = max(self._pipeline.layers) if self._pipeline else self.num_layers
        self._engine = engine.bind(stage, int(profile.get("tp") or 1))
        self.step_overhead = float(profile["step_overhead"] if step_overhead is None else step_overhead)
        coef = profile["coefficients"]
        knots = profile["knots"]
        self._g = _ramp_curve(knots, [coef[segment_name(knots, k)] for k in range(len(knots))])
        self.tile = None if profile.get("tile") is None else int(profile["tile"])
        padded = {k: coef[segment_name(knots, k, PADDED_PREFIX)] for k in padded_segments(knots, self.tile)}
        self._gp = _ramp_curve(knots, [padded.get(k, 0.0) for k in range(len(knots))]) if padded else None
        self._a1 = coef.get("pairs", 0.0)
        self._a1h, self._a1n = coef.get("pairs_history", 0.0), coef.get("pairs_new", 0.0)
        self._a2 = coef["prefill_kv"]
        self._b1, self._b2, self._b3 = coef["decode_kv"], coef["num_decode"], coef["num_prefill"]
        self._k = coef["const"]
        self._lm0, self._lm1 = profile["lm_head"]["const"], profile["lm_head"]["per_row"]
        self.allreduce = AllReduce(profile["allreduce"]) if profile.get("allreduce") else None
        res = profile["residuals"]
        self._probs, self._quantiles = list(res["probs"]), list(res["quantiles"])

    @classmethod
    def from_config(cls, config: "FittedCostModel.Config", model=None) -> "FittedCostModel":
        if hasattr(model, "check_measured_precision"):  # 16-bit profiles: refuse fp8/int4 (specs.py)
            model.check_measured_precision("fitted")
        return cls.from_file(resolve_profile(config.profile), num_layers=config.num_layers,
                             step_overhead=config.step_overhead,
                             engine=resolve_engine(config.engine, config.cpu_overhead), pp=config.pp,
                             hidden=getattr(model, "hidden", None))

    @classmethod
    def from_file(cls, path, **kwargs) -> "FittedCostModel":
        """Load a fitted profile JSON; errors name the file."""
        path = Path(path)
        try:
            profile = bounds.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError("profile", "an existing fitted profile JSON", str(path)) from None
        except ValueError as err:  # not JSON, or not UTF-8 text
            raise ConfigError("profile", f"valid JSON ({err})", str(path), file=str(path)) from None
        if not isinstance(profile, dict) or profile.get("type") != "fitted":
            got = profile.get("type") if isinstance(profile, dict) else type(profile).__name__
            raise ConfigError("profile", f"a fitted profile (cbsim fit); {path} has type {got!r}", has_got=False)
        return cls(profile, source=str(path), **kwargs)  # checks it (profile_check.py)

    # --- the one function of aggregates --------------------------------------------------

    def _layer(self, tokens, pairs, ph, pn, kp, kd, n_dec, n_pref):
        """One layer's seconds; `kd` may be a numpy array (a decode run)."""
        g = self._g.at(tokens)
        if self._gp is not None:
            g = g + self._gp.at(padded_tokens(tokens, self.tile))
        return (g + self._a1 * pairs + self._a1h * ph + self._a1n * pn + self._a2 * kp + self._b1 * kd
                + self._b2 * n_dec + self._b3 * n_pref + self._k)

    def _gpu(self, tokens, pairs, ph, pn, kp, kd, n_dec, n_pref, rows):
        layer = self._layer(tokens, pairs, ph, pn, kp, kd, n_dec, n_pref)
        if self.allreduce is not None:
            layer = layer + self.allreduce.seconds(tokens)
        lm = self._lm0 + self._lm1 * rows if rows else 0.0
        if self._pipeline is not None:
            return self._slowest_stage(tokens, layer, lm) + self.step_overhead
        return self.num_layers * layer + lm + self.step_overhead

    def _slowest_stage(self, tokens, layer, lm):
        """One pipeline stage's seconds (the slowest; elementwise over arrays): its layers, the LM head on
        the last stage, its activation hand-off (the fit has no embedding term of its own)."""
        pipe = self._pipeline
        last = pipe.stages - 1
        return slowest(n * layer + (lm if s == last else 0.0) + pipe.handoff_seconds(tokens, s)
                       for s, n in enumerate(pipe.layers))

    def collective_time(self, tokens: float) -> float:
        """Seconds a step of `tokens` tokens spends in the profile's all-reduces (num_layers times the
        per-layer `allreduce` term step_time adds; 0 without one). Asked after the run for the steps
        table (sim/metrics/step_efficiency.py)."""
        return profile_collective_seconds(self.allreduce, self._pipeline, self.num_layers, tokens)

    # --- interface ---------------------------------------------------------------------

    def layer_time(self, shape: StepShape) -> float:
        """Seconds of one decoder layer's compute (what the profiler measured per row)."""
        return self._layer(*aggregates(shape))

    def gpu_time(self, shape: StepShape) -> float:
        """Seconds of the step on the GPU (all layers, all-reduce, LM head, step overhead)."""
        return self._gpu(*aggregates(shape), shape.tokens_sampled)

    def step_time(self, shape: StepShape) -> float:
        return self._engine.step_of(self._gpu(*aggregates(shape), shape.tokens_sampled), shape)

    def decode_step_time(self, contexts, offset: int, context_sum: int) -> float:
        n = len(contexts)  # step_time of the decode step from its aggregates (features.aggregates), O(1)
        return self._engine.decode_step(self._gpu(n, 0.0, 0, 0, 0, context_sum, n, 0, n), n)

    def mixed_step_time(self, prefill, contexts, offset: int, context_sum: int, sampled: int) -> float:
        features = rows_aggregates(prefill, len(contexts), context_sum)  # step_time's, O(1) in the decode rows
        return self._engine.step_for(self._gpu(*features, sampled), len(prefill) + len(contexts), len(prefill),
                                     features.tokens)

    def decode_run_times(self, contexts: np.ndarray, steps: int) -> np.ndarray:
        contexts = np.asarray(contexts, dtype=np.int64)
        n = len(contexts)
        kd = int(contexts.sum()) + n * np.arange(steps, dtype=np.int64)
        gpu = self._gpu(n, 0.0, 0, 0, 0, kd, n, 0, n)
        return self._engine.step_many(gpu, n)

    def _quantile(self, p: float) -> float:
        """Residual quantile (log space) at probability p, linear between stored probabilities."""
        probs, qs = self._probs, self._quantiles
        i = min(max(bisect_right(probs, p) - 1, 0), len(probs) - 2)
        w = (p - probs[i]) / (probs[i + 1] - probs[i])
        return qs[i] + w * (qs[i + 1] - qs[i])

    def interval_factors(self, q: float = 0.9) -> tuple[float, float]:
        """The factors on the kernel time that bound a central fraction q of the measurements (the
        residuals' (1 - q) / 2 and (1 + q) / 2 quantiles, out of fold): the same for every step shape."""
        if not 0.0 < q < 1.0:
            raise ValueError("q must be in (0, 1)")
        return math.exp(self._quantile((1 - q) / 2)), math.exp(self._quantile((1 + q) / 2))

    def prediction_interval(self, shape: StepShape, q: float = 0.9) -> tuple[float, float]:
        """Central interval holding a fraction q of measurements like this one (from residuals)."""
        low, high = self.interval_factors(q)
        gpu = self.gpu_time(shape)
        return self._engine.step_of(gpu * low, shape), self._engine.step_of(gpu * high, shape)

    def sample_factor(self, rng: np.random.Generator) -> float:
        """A multiplicative noise factor drawn from the fit's residual distribution."""
        return math.exp(self._quantile(float(rng.random())))

    def describe(self) -> dict:
        p = self.profile
        return {"type": self.name, "profile": self.source, "model": p.get("model"), "gpu": p.get("gpu"),
                "tp": p.get("tp"), "format": p.get("format", 1), "tile": self.tile, "num_layers": self.num_layers,
                "step_overhead": self.step_overhead, "engine": self.engine.describe(),
                **({"pp": self.pipeline_stages} if self.pipeline_stages > 1 else {})}


def _ramp_curve(knots, slopes) -> Curve:
    """g as a lookup curve from its per-segment slopes (g(0) = 0; the last slope continues)."""
    return Curve(knots, ramp_values_at_knots(knots, slopes), tail_slope=slopes[-1])


def resolve_profile(name: str) -> Path:
    """A profile path as given, else relative to the shipped profiles folder (also profiles/fitted/)."""
    for candidate in (Path(name), PROFILES / name, PROFILES / "fitted" / name):
        if candidate.exists():
            return candidate
    raise ConfigError("profile", f"an existing file (also looked in {PROFILES})", name)
