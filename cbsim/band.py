"""Prediction band: TTFT and E2E at the low and high end of the step-time uncertainty (`metrics.band`).

A cost model's step time is uncertain by some factor: a fitted profile's out-of-fold residuals say
how far measured steps fall from its prediction (`metrics.band.interval: 0.9`: the 5th and 95th
percentile factors, FittedCostModel.interval_factors), and a scoreboard cell or a calibration's
held-out error says it for any cost model (`metrics.band.step_scales: [low, high]`). Far from
saturation a latency moves about as much as the step time does; near the knee (sim/metrics/knee.py) a
queue turns a few percent of step time into orders of magnitude of TTFT, so no analytic propagation
through a mean-value queue formula is sound there. The band is therefore simulated: the same
experiment, the same seed and the same requests, run again with every replica's kernel time scaled
by the low and by the high factor (the engine's `kernel_scale`, the term `calibrate --fit-kernel-scale`
fits; host, launch and front-end terms are not scaled, as the fitted residuals are kernel residuals).

The factors are systematic (every step of the run at the bound), not per-step noise (that is
`sim.cost_noise`, which averages out over a run): the band answers "if the model is this far off,
where do TTFT and E2E land". Summary keys (units in sim/metrics/summary_units.py): `band_source`,
`band_step_scale_low` / `_high`, and `<metric>_low` / `<metric>_high` for each metric of BANDED
(low: the run at the low step-time factor, high: at the high one).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Callable

from cbsim.core.errors import ConfigError
from cbsim.sim.costmodels.engine import CpuOverheadConfig, resolve_engine
from cbsim.sim.costmodels.registry import takes_engine

# the summary keys given a band: latencies and the knee estimate (capacity moves with the step time)
BANDED = ("ttft_p50", "ttft_p90", "ttft_p99", "e2e_p50", "e2e_p99", "tpot_p50", "tpot_p90", "tpot_p99",
          "capacity_requests_per_s", "load_vs_capacity")
PATH = "metrics.band"


def band_overrides(text: str | None, flag: str = "--band") -> list[str]:
    """The `--set` overrides of a command's `--band`: 'Q' (a fitted model's central interval, 0.9) or
    'LOW,HIGH' (factors on the step's kernel time, 0.9,1.15); none for None."""
    if text is None:
        return []
    parts = [part.strip() for part in str(text).split(",")]
    try:
        values = [float(part) for part in parts]
    except ValueError:
        values = []
    if len(values) == 1 and 0 < values[0] < 1:
        return [f"{PATH}.interval={values[0]!r}", f"{PATH}.step_scales=null"]
    if len(values) == 2 and 0 < values[0] <= 1 <= values[1]:
        return [f"{PATH}.step_scales=[{values[0]!r}, {values[1]!r}]", f"{PATH}.interval=null"]
    raise ConfigError(flag, "Q, a probability in (0, 1) (a fitted model's central interval: 0.9), or LOW,HIGH "
                      "factors on the kernel time with 0 < LOW <= 1 <= HIGH (0.9,1.15)", text)


def band_factors(cfg, cost_models: dict) -> tuple[str, dict[str, tuple[float, float]]]:
    """(where the band comes from, pool -> (low, high) kernel-time factors) for a config whose
    `metrics.band` is set; `cost_models` maps each pool to its built cost model (parsed_sections:
    'cluster', and in a P/D run 'prefill' and 'decode', the pools that run)."""
    band = cfg.metrics.band
    pd = cfg.cluster.mode == "pd"
    cost_models = {pool: cost for pool, cost in cost_models.items() if (pool != "cluster") == pd}
    if band.step_scales is not None:
        low, high = band.step_scales
        return f"step_scales [{low:g}, {high:g}]", {pool: (low, high) for pool in cost_models}
    factors = {}
    for pool, cost in cost_models.items():
        interval = getattr(cost, "interval_factors", None)
        if interval is None:
            raise ConfigError(f"{PATH}.interval", "a fitted cost model (type: fitted, whose profile holds "
                              f"residuals); for cost model {cost.name} give metrics.band.step_scales: [low, "
                              "high] instead (e.g. its scoreboard cell's error)", band.interval)
        factors[pool] = interval(band.interval)
    return f"interval {band.interval:g} of the fitted residuals", factors


def scaled_config(cfg, factors: dict[str, float]):
    """The experiment with each pool's engine kernel_scale multiplied by its factor and the band off."""
    metrics = replace(cfg.metrics, band=type(cfg.metrics.band)())
    cost = cfg.cost_model
    if cfg.cluster.mode != "pd":
        return replace(cfg, metrics=metrics, cost_model=_scaled(cost, factors["cluster"], "cost_model"))
    from cbsim.config import pool_cost_model  # lazy: pandas

    cluster = cfg.cluster
    for pool in ("prefill", "decode"):  # each pool's own cost model mapping, its engine scaled
        section = getattr(cluster, pool)
        mapping = _scaled(pool_cost_model(cfg, pool), factors[pool], f"cluster.{pool}.cost_model")
        cluster = replace(cluster, **{pool: replace(section, cost_model=mapping)})
    return replace(cfg, metrics=metrics, cluster=cluster)


def _scaled(mapping: dict, factor: float, path: str) -> dict:
    """A cost-model mapping whose engine is the one it resolves to, every term written out, with
    kernel_scale x factor (the legacy cpu_overhead key resolved into it)."""
    if not takes_engine(mapping, path):
        raise ConfigError(f"{path}.type", f"a cost model with an engine (roofline, vidur, fitted) for {PATH}: the "
                          "band scales the engine's kernel_scale", mapping.get("type"))
    legacy = mapping.get("cpu_overhead")
    engine = resolve_engine(mapping.get("engine"), None if legacy is None else CpuOverheadConfig(**legacy),
                            f"{path}.engine")
    if engine.is_none:  # the kernels alone, unscaled by design (engine.py): nothing to put a factor on
        raise ConfigError(f"{path}.engine", f"an engine for {PATH} (engine none prices the kernels alone, without "
                          "the kernel_scale the band multiplies; name a preset)", "none")
    terms = dataclasses.asdict(engine.terms)
    terms["kernel_scale"] = engine.terms.kernel_scale * factor
    return {**{k: v for k, v in mapping.items() if k != "cpu_overhead"}, "engine": terms}


@dataclass(frozen=True)
class BandPlan:
    """The band's runs, decided before the run itself (a bad band is refused before simulating)."""

    source: str  # where the factors come from
    low: float  # the smallest low factor over the pools
    high: float  # the largest high factor
    configs: tuple  # the experiment at the low and at the high factors


def band_plan(cfg, cost_models: dict) -> BandPlan | None:
    """The band runs of a config (None when `metrics.band` is not set); `cost_models` as band_factors."""
    if not cfg.metrics.band.is_set():
        return None
    source, factors = band_factors(cfg, cost_models)
    configs = tuple(scaled_config(cfg, {pool: pair[index] for pool, pair in factors.items()}) for index in (0, 1))
    return BandPlan(source, min(low for low, _ in factors.values()), max(high for _, high in factors.values()),
                    configs)


def band_summary(plan: BandPlan, run: Callable) -> dict:
    """The band's summary keys: `run(config)` (run_experiment without writing) at each bound."""
    out = {"band_source": plan.source, "band_step_scale_low": plan.low, "band_step_scale_high": plan.high}
    for end, config in zip(("low", "high"), plan.configs):
        summary = run(config).summary
        out.update({f"{key}_{end}": summary.get(key) for key in BANDED})
    return out


def band_line(summary: dict) -> str:
    """What the band was run at and where the knee estimate lands: 'step time x0.9 .. x1.15 (step_scales
    [0.9, 1.15]); load_vs_capacity 0.87 [0.79 .. 1.01]'."""
    def ratio(value):
        return "n/a" if value is None else f"{value:.3g}"

    return (f"step time x{summary['band_step_scale_low']:.3g} .. x{summary['band_step_scale_high']:.3g} "
            f"({summary['band_source']}); load_vs_capacity {ratio(summary.get('load_vs_capacity'))} "
            f"[{ratio(summary.get('load_vs_capacity_low'))} .. {ratio(summary.get('load_vs_capacity_high'))}]")
