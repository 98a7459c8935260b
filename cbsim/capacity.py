"""Capacity: the highest arrival rate at which every SLO still holds (Sarathi-Serve's definition:
e.g. P99 ITL <= X and median queue delay <= 2 s), found by bracketing then bisection over the rate.

Invariants:
- A rate meets the SLOs when, for every seed, at least `min_finished` of the requests finished (a
  policy that rejects what it cannot serve must not look fast) and every SLO metric of the run's
  summary is defined and at most its limit (an undefined metric is a violation).
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

from .config import ExperimentConfig, load_config
from .errors import ConfigError


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
    def rate_per_gpu(self) -> float | None:
        """Per-GPU goodput: capacity / the number of GPUs the config uses (replicas x tp)."""
        return None if self.rate is None else self.rate / self.num_gpus


def num_gpus(config: ExperimentConfig) -> int:
    """GPUs an experiment uses: cluster.replicas x tensor-parallel degree (cluster.tp, else the cost
    model's tp, else 1)."""
    tp = config.cluster.tp or config.cost_model.get("tp", 1) or 1
    return int(config.cluster.replicas) * int(tp)


def per_gpu_capacity(result: CapacityResult, config) -> float | None:
    """Per-GPU goodput of a capacity result for an experiment (path, mapping or config)."""
    gpus = num_gpus(load_config(config))
    return None if result.rate is None else result.rate / gpus


def meets_slo(summary: dict, slo: dict[str, float], min_finished: float = 0.0) -> bool:
    """True when at least `min_finished` of the requests finished and every SLO metric is defined in
    the summary and at most its limit."""
    if finished_fraction(summary) < min_finished:
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
                  min_finished: float = 0.99) -> CapacityResult:
    """The highest rate (the value at `rate_key`) at which the experiment meets every SLO.

    `lo` defaults to the config's own rate. If `lo` fails, it is halved until a rate passes; if it
    passes, the search tries `hi` (default: doubling from `lo` until a rate fails, at most
    `max_expansions` times) and then bisects. `overrides` are `--set` strings applied first;
    `min_finished` is the fraction of requests every run must finish (not reject) to count.
    """
    base = load_config(config, overrides)
    _check_slo(slo)
    if rel_tol <= 0:
        raise ConfigError("rel_tol", "a relative tolerance > 0", rel_tol)
    if not 0 <= min_finished <= 1:
        raise ConfigError("min_finished", "a fraction in [0, 1]", min_finished)
    start = float(lo if lo is not None else _rate_of(base, rate_key))
    if start <= 0 or (hi is not None and hi <= start):
        raise ConfigError("--lo/--hi", "0 < lo < hi", (start, hi))
    rows: list[dict] = []

    def passes(rate: float) -> bool:
        return _probe(base, rate_key, rate, seeds, slo, min_finished, rows)

    good, bad = _bracket(passes, start, hi, max_expansions)
    if good is not None and bad is not None:
        while bad > good * (1 + rel_tol):
            mid = math.sqrt(good * bad)
            if passes(mid):
                good = mid
            else:
                bad = mid
    return CapacityResult(good, bad, dict(slo), rate_key, pd.DataFrame(rows), num_gpus(base))


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
           rows: list) -> bool:
    """Run the experiment at `rate` for every seed, record one row per seed, return whether all met."""
    from .api import run_experiment

    ok = True
    probe = len({row["rate"] for row in rows})
    for seed in seeds:
        cfg = load_config(base, [f"{rate_key}={rate!r}", f"seed={int(seed)}", "output.dir=null"])
        summary = run_experiment(cfg).summary
        unknown = sorted(set(slo) - set(summary))
        if unknown:
            raise ConfigError(f"slo.{unknown[0]}", "a summary metric: " + ", ".join(sorted(summary)), has_got=False)
        met = meets_slo(summary, slo, min_finished)
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
        if not isinstance(limit, (int, float)) or isinstance(limit, bool):
            raise ConfigError(f"slo.{metric}", "a number", limit)


def _flow(mapping: dict) -> str:
    return yaml.safe_dump(mapping, default_flow_style=True, width=1 << 30).strip()
