"""Capacity: the highest arrival rate at which every SLO still holds (Sarathi-Serve's definition:
e.g. P99 ITL <= X and median queue delay <= 2 s), found by bracketing then bisection over the rate.

Invariants:
- A rate meets the SLOs when, for every seed, at least `min_finished` of the requests finished (a
  policy that rejects what it cannot serve must not look fast), every SLO metric of the run's
  summary is defined and at most its limit (an undefined metric is a violation), and, when
  `min_attainment` is set, at least that fraction of all requests met the experiment's per-request
  objectives (metrics.slo; DistServe's goodput: e.g. 90 % within both TTFT and TPOT).
- Per-GPU goodput (`find_goodput`) is that capacity divided by the GPUs the config uses (both
  pools of a P/D cluster, each replicas x tp).
- The search assumes the outcome is monotone in the rate (met below capacity, violated above). It
  keeps a passing rate `good` and, once found, a failing rate `bad` above it; it bisects
  geometrically until bad <= good * (1 + rel_tol). The result is `good`: a rate that was run and
  met every SLO, while `bad` (<= rate * (1 + rel_tol)) was run and did not.
- Every probe is a row of `points` (rate, seed, every summary metric, meets), in probing order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd
import yaml

from cbsim.api import run_experiment
from cbsim.config import ExperimentConfig, load_config
from cbsim.core.errors import ConfigError
from cbsim.replica_gpus import num_gpus  # also capacity.num_gpus for the tuner: replicas x GPUs per replica


# A probe simulating fewer seconds than this (first arrival to last completion) is mostly start-up: the
# queue fills from empty, so an overloaded rate still meets a latency SLO for a while. A stated floor
# for the warning, not a measured one: the tune example's probes simulate ~6 s.
MIN_STEADY_SECONDS = 60.0


def short_probe_warning(span: float | None, label: str = "") -> str | None:
    """A warning when the shortest probe (`span` simulated seconds) is under MIN_STEADY_SECONDS, else None."""
    if span is None or span >= MIN_STEADY_SECONDS:
        return None
    return (f"{label + ': ' if label else ''}a capacity probe simulated only {span:.1f} s of traffic (< "
            f"{MIN_STEADY_SECONDS:g} s): its queue never left the start-up transient, so a rate above capacity "
            "can pass; raise workload.num_requests")


@dataclass
class CapacityResult:
    """The capacity search's answer: `rate` meets every SLO (None if no probed rate did);
    `fail_rate` is the lowest probed rate above it that did not (None: no failing rate found up
    to the search's ceiling, so the capacity is at least `rate`). `points` holds every probe."""

    rate: float | None
    fail_rate: float | None
    slo: dict
    rate_key: str
    points: pd.DataFrame
    num_gpus: int = 1

    @property
    def shortest_probe(self) -> float | None:
        """The fewest simulated seconds (makespan: first arrival to last completion) of any probe run."""
        spans = self.points["makespan"].dropna() if "makespan" in self.points else []
        return float(spans.min()) if len(spans) else None

    @property
    def rate_per_gpu(self) -> float | None:
        """Per-GPU goodput: capacity / the number of GPUs the config uses (replicas x tp)."""
        return None if self.rate is None else self.rate / self.num_gpus


def per_gpu_capacity(result: CapacityResult, config) -> float | None:
    """Per-GPU goodput of a capacity result for an experiment (path, mapping or config)."""
    gpus = num_gpus(load_config(config))
    return None if result.rate is None else result.rate / gpus


def meets_slo(summary: dict, slo: dict[str, float], min_finished: float = 0.0,
              min_attainment: float | None = None) -> bool:
    """True when at least `min_finished` of the requests finished, every SLO metric is defined in
    the summary and at most its limit, and slo_attainment is at least `min_attainment` (if set)."""
    if finished_fraction(summary) < min_finished:
        return False
    if min_attainment is not None and (summary.get("slo_attainment") or 0.0) < min_attainment:
        return False
    for metric, limit in slo.items():
        value = summary.get(metric)
        if value is None or (isinstance(value, float) and math.isnan(value)) or value > limit:
            return False
    return True


def finished_fraction(summary: dict) -> float:
    """Finished requests over all requests of a run (0 for an empty run)."""
    total = summary.get("num_requests") or 0
    return (summary.get("num_finished") or 0) / total if total else 0.0


def find_capacity(config, slo: dict[str, float], rate_key: str = "workload.arrival.rate",
                  lo: float | None = None, hi: float | None = None, rel_tol: float = 0.05,
                  seeds=(0,), overrides: list[str] | None = None, max_expansions: int = 10,
                  min_finished: float = 0.99, min_attainment: float | None = None, progress=None) -> CapacityResult:
    """The highest rate (the value at `rate_key`) at which the experiment meets every SLO.

    `lo` defaults to the config's own rate. If `lo` fails, it is halved until a rate passes; if it
    passes, the search tries `hi` (default: doubling from `lo` until a rate fails, at most
    `max_expansions` times) and then bisects. `overrides` are `--set` strings applied first;
    `min_finished` is the fraction of requests every run must finish (not reject) to count;
    `min_attainment` the fraction that must meet metrics.slo (then `slo` may be empty); `progress`
    (sim/outputs/progress.py) reports each probe run that is long.
    """
    base = load_config(config, overrides)
    if min_attainment is None or slo:
        _check_slo(slo)
    if min_attainment is not None and not 0 < min_attainment <= 1:
        raise ConfigError("min_attainment", "a fraction in (0, 1]", min_attainment)
    if min_attainment is not None and not base.metrics.slo.is_set():
        raise ConfigError("min_attainment", "an experiment with metrics.slo set (attainment is of its objectives)",
                          min_attainment, file=base.source)
    if not rel_tol > 0 or not math.isfinite(rel_tol):
        raise ConfigError("rel_tol", "a relative tolerance > 0", rel_tol)
    if not 0 <= min_finished <= 1:
        raise ConfigError("min_finished", "a fraction in [0, 1]", min_finished)
    start = float(lo if lo is not None else _rate_of(base, rate_key))
    if not 0 < start < math.inf or (hi is not None and not start < hi < math.inf):
        raise ConfigError("--lo/--hi", "0 < lo < hi", (start, hi))
    rows: list[dict] = []

    def passes(rate: float) -> bool:
        return _probe(base, rate_key, rate, seeds, slo, min_finished, rows, min_attainment, progress)

    good, bad = _bracket(passes, start, hi, max_expansions)
    if good is not None and bad is not None:
        while bad > good * (1 + rel_tol):
            mid = math.sqrt(good * bad)
            if passes(mid):
                good = mid
            else:
                bad = mid
    return CapacityResult(good, bad, dict(slo), rate_key, pd.DataFrame(rows), num_gpus(base))


def find_goodput(config, ttft: float, tpot: float, attainment: float = 0.9, overrides: list[str] | None = None,
                 **kwargs) -> CapacityResult:
    """DistServe's goodput: the highest rate at which at least `attainment` of the requests meet both
    TTFT <= `ttft` and TPOT <= `tpot` seconds (set as metrics.slo, replacing the experiment's). Its
    `rate_per_gpu` is the per-GPU goodput; other arguments as find_capacity."""
    objectives = [f"metrics.slo.ttft={float(ttft)!r}", f"metrics.slo.tpot={float(tpot)!r}",
                  "metrics.slo.itl_max=null"]
    return find_capacity(config, {}, overrides=list(overrides or []) + objectives, min_attainment=attainment,
                         **kwargs)


def find_capacities(config, slo: dict[str, float], policies: list, overrides: list[str] | None = None,
                    **kwargs) -> dict[str, CapacityResult]:
    """find_capacity once per policy: a name replaces policy.name (other options kept), a mapping
    replaces the whole policy section. Keys of the result are the names (or the mappings as YAML)."""
    results = {}
    for policy in policies:
        label = _flow(policy) if isinstance(policy, dict) else str(policy)
        item = f"policy={label}" if isinstance(policy, dict) else f"policy.name={label}"
        results[label] = find_capacity(config, slo, overrides=list(overrides or []) + [item], **kwargs)
    return results


def _bracket(passes, start: float, hi: float | None, max_expansions: int) -> tuple[float | None, float | None]:
    """(good, bad): a passing rate and a failing rate above it; either may be None when not found."""
    if not passes(start):
        bad = start
        for _ in range(max_expansions):
            rate = bad / 2
            if passes(rate):
                return rate, bad
            bad = rate
        return None, bad
    if hi is not None:
        return (start, hi) if not passes(hi) else (hi, None)
    good = start
    for _ in range(max_expansions):
        rate = good * 2
        if not passes(rate):
            return good, rate
        good = rate
    return good, None


def _probe(base: ExperimentConfig, rate_key: str, rate: float, seeds, slo: dict, min_finished: float,
           rows: list, min_attainment: float | None = None, progress=None) -> bool:
    """Run the experiment at `rate` for every seed, record one row per seed, return whether all met;
    `progress` (sim/outputs/progress.py) reports each run that is long, labelled with its rate and seed."""
    ok = True
    probe = len({row["rate"] for row in rows})
    for seed in seeds:
        cfg = load_config(base, [f"{rate_key}={rate!r}", f"seed={int(seed)}", "output.dir=null"])
        if progress is not None:
            progress.restart(f"rate {rate:.4g}, seed {int(seed)}")
        summary = run_experiment(cfg, progress=progress).summary
        unknown = sorted(set(slo) - set(summary))
        if unknown:
            raise ConfigError(f"slo.{unknown[0]}", "a summary metric: " + ", ".join(sorted(summary)), has_got=False)
        met = meets_slo(summary, slo, min_finished, min_attainment)
        ok = ok and met
        rows.append({"probe": probe, "rate": rate, "seed": int(seed), "meets": met,
                     "finished_fraction": finished_fraction(summary), **summary})
    return ok


def _rate_of(config: ExperimentConfig, rate_key: str) -> float:
    node = config.to_dict()
    for part in rate_key.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            raise ConfigError(rate_key, "a rate in the experiment (or pass lo)", has_got=False, file=config.source)
        node = node[part]
    if not isinstance(node, (int, float)) or isinstance(node, bool):
        raise ConfigError(rate_key, "a number", node, file=config.source)
    return float(node)


def _check_slo(slo: dict[str, float]) -> None:
    if not slo:
        raise ConfigError("slo", "at least one metric=limit, e.g. itl_p99=0.1", slo)
    for metric, limit in slo.items():
        if not isinstance(limit, (int, float)) or isinstance(limit, bool) or not (math.isfinite(limit) and limit > 0):
            raise ConfigError(f"slo.{metric}", "a finite limit > 0 (NaN would never be violated)", limit)


def _flow(mapping: dict) -> str:
    return yaml.safe_dump(mapping, default_flow_style=True, width=1 << 30).strip()
