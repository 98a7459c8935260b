"""A `cbsim tune` file: the base experiment, the SLO, the GPU budget, the capacity search run per
candidate and the stages' candidate lists, parsed and validated where they are born.

Invariant: a bad tune file is a ConfigError naming the file and the key (`stages.<stage>[i]`,
`slo.<metric>`, `set.<key>`, `gpus.count`, ...) before any simulation runs.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cbsim.tools.sweep.capacity import num_gpus
from cbsim.config import ExperimentConfig, check_name, load_config
from cbsim.core.errors import ConfigError
from cbsim.core.schema import option, parse, require
from cbsim.core.units import SHORT_LATENCIES, parse_duration
from cbsim.sim.metrics.summary_units import unit_of
from cbsim.tools.sweep.sweep import load_spec_file
from cbsim.tools.tune.stages import STAGE_NAMES, STAGES, parallel_shape


@dataclass
class GpuBudget:
    """The hardware the deployment may use."""

    count: int = option(help="GPUs available: every candidate deployment uses at most this many")
    type: str | None = option(None, help="GPU type, set as cost_model.gpu (default: the base experiment's)")
    price_per_gpu_hour: float | None = option(None, help="price of one GPU-hour; adds requests per dollar to the "
                                                         "table (null: no price)")

    def validate(self) -> None:
        require(self.count >= 1, "count", "an integer >= 1", self.count)
        require(self.price_per_gpu_hour is None or self.price_per_gpu_hour > 0, "price_per_gpu_hour",
                "a price > 0 or null", self.price_per_gpu_hour)


@dataclass
class SearchOptions:
    """The capacity search run per candidate (cbsim.tools.sweep.capacity.find_capacity)."""

    rate_key: str = option("workload.arrival.rate", help="the arrival-rate key searched over")
    lo: float | None = option(None, help="first rate tried (default: the base's rate); the same for every "
                                         "candidate, so their probes are comparable")
    hi: float | None = option(None, help="upper rate (default: doubling until an SLO fails)")
    rel_tol: float = option(0.1, help="stop when the failing rate is within (1 + rel_tol) x the passing one")
    seeds: list[int] = option([0], help="seeds that must all meet the SLOs at a rate")
    min_finished: float = option(0.99, help="fraction of requests a run must finish to count as meeting the SLOs")
    min_attainment: float | None = option(None, help="also require this fraction of requests to meet metrics.slo "
                                                     "(DistServe goodput); null: not required")
    max_expansions: int = option(10, help="at most this many doublings or halvings while bracketing")

    def validate(self) -> None:
        require(self.rel_tol > 0, "rel_tol", "a relative tolerance > 0", self.rel_tol)
        require(len(self.seeds) >= 1 and len(set(self.seeds)) == len(self.seeds) and min(self.seeds) >= 0, "seeds",
                "a non-empty list of distinct integers >= 0", self.seeds)
        require(0 <= self.min_finished <= 1, "min_finished", "a fraction in [0, 1]", self.min_finished)
        require(self.lo is None or self.lo > 0, "lo", "a rate > 0 or null", self.lo)
        require(self.hi is None or self.hi > (self.lo or 0), "hi", "a rate above lo, or null", self.hi)
        require(self.max_expansions >= 1, "max_expansions", "an integer >= 1", self.max_expansions)

    def kwargs(self) -> dict:
        return dict(rate_key=self.rate_key, lo=self.lo, hi=self.hi, rel_tol=self.rel_tol, seeds=tuple(self.seeds),
                    min_finished=self.min_finished, min_attainment=self.min_attainment,
                    max_expansions=self.max_expansions)


@dataclass
class TuneSpec:
    """A tune file, parsed. `base` is a path (relative to the tune file) or an inline experiment."""

    base: Any = option(help="the base experiment (its workload is the one tuned for): a YAML path relative to "
                            "the tune file, or an inline mapping; colocated (the pd stage decides P/D)")
    slo: dict = option(help="capacity SLOs {summary metric: limit}, e.g. {ttft_p99: 2s, itl_p99: 100ms}; a "
                            "latency is a duration (a bare number is seconds)")
    gpus: GpuBudget = option(help="the GPU budget {count, type, price_per_gpu_hour}")
    name: str = option("tune", help="tune name (the default results folder results/tune/<name>)")
    set: dict = option({}, help="fixed overrides {key.path: value} of the base (e.g. workload.num_requests)")
    search: SearchOptions = option(SearchOptions(), help="the capacity search run per candidate")
    stages: dict = option({}, help="{stage: [candidates]} replacing a stage's defaults; [] or false skips it. "
                                   "Stages: " + ", ".join(STAGE_NAMES))
    source: str | None = field(default=None, repr=False, init=False)  # the tune file

    def validate(self) -> None:
        require(isinstance(self.base, (str, dict)), "base", "an experiment path or mapping", self.base)
        check_name(self.name, "name")
        require(isinstance(self.slo, dict) and (len(self.slo) >= 1 or self.search.min_attainment is not None),
                "slo", "a mapping {metric: limit} with at least one metric", self.slo)
        for metric, limit in self.slo.items():
            require(isinstance(metric, str), "slo", "metric names as keys", metric)
            if unit_of(metric) == "s":  # a time: seconds, or a duration with its unit (500ms)
                self.slo[metric] = limit = parse_duration(limit, f"slo.{metric}",
                                                          objective=metric.startswith(SHORT_LATENCIES))
            ok = isinstance(limit, (int, float)) and not isinstance(limit, bool) and math.isfinite(limit) and limit > 0
            require(ok, f"slo.{metric}", "a finite limit > 0", limit)
        for name, values in self.stages.items():
            require(name in STAGE_NAMES, f"stages.{name}", "one of the stages " + ", ".join(STAGE_NAMES), name)
            require(values is False or isinstance(values, list), f"stages.{name}",
                    "a list of candidates, or [] / false to skip the stage", values)
            stage = STAGES[STAGE_NAMES.index(name)]
            for i, value in enumerate(values or []):
                stage.check(value, f"stages.{name}[{i}]")
            labels = [json.dumps(v, sort_keys=True) for v in values or []]
            require(len(set(labels)) == len(labels), f"stages.{name}", "distinct candidates", values)
        for i, shape in enumerate(self.stages.get("parallelism") or []):
            tp, pp = parallel_shape(shape)
            require(self.gpus.count % (tp * pp) == 0, f"stages.parallelism[{i}]",
                    f"a TP degree (times PP stages) dividing gpus.count ({self.gpus.count})", shape)
        for i, split in enumerate(self.stages.get("pd") or []):
            if isinstance(split, dict):
                require(split["prefill"] + split["decode"] <= self.gpus.count, f"stages.pd[{i}]",
                        f"pools of at most gpus.count ({self.gpus.count}) GPUs together", split)


def load_tune(source, root: str | Path | None = None) -> TuneSpec:
    """Parse a tune file (YAML path, mapping or TuneSpec); a relative `base` resolves against the
    tune file's folder, else `root` (default: the current directory)."""
    return load_spec_file(TuneSpec, source, root, "tune")


def base_config(spec: TuneSpec) -> ExperimentConfig:
    """The base with `set` and the GPU type applied, validated; errors name the tune file's key."""
    overrides = dict(spec.set)
    if spec.gpus.type is not None:
        overrides["cost_model.gpu"] = spec.gpus.type
    try:
        config = load_config(spec.base, set_strings(overrides))
    except ConfigError as err:
        key = next((k for k in spec.set if err.path == k or err.path.startswith(k + ".")), None)
        where = f"set.{key}" if key else "gpus.type" if err.path.startswith("cost_model.gpu") else \
            f"base ({spec.base if isinstance(spec.base, str) else 'inline'}): {err.path}"
        raise ConfigError(where, err.expected, err.got, spec.source, err.has_got) from None
    if config.cluster.mode != "colocated":
        raise ConfigError("base", "a colocated experiment (the pd stage decides P/D)", config.cluster.mode, spec.source)
    if spec.stages.get("parallelism") in ([], False) and num_gpus(config) > spec.gpus.count:
        raise ConfigError("gpus.count", f"at least the base's {num_gpus(config)} GPUs (or a parallelism stage)",
                          spec.gpus.count, spec.source)
    return config


def set_strings(overrides: dict) -> list[str]:
    """{dotted key: value} as `--set` strings (values in YAML flow style)."""
    import yaml

    def text(value) -> str:
        return yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip().removesuffix("...").strip()

    return [f"{key}={text(value)}" for key, value in overrides.items()]
