"""`cbsim tune`: a deployment search for the highest goodput per GPU under SLOs, in the seed's order.

A tune file names a base experiment (workload fixed), `slo` (capacity SLOs: summary metric ->
limit), the GPU budget (`gpus`: count, type, price) and, under `stages`, candidate lists that
replace the defaults of tune_stages.py. Stages run in the order of seed 000 §7; each one runs a
capacity search (cbsim.capacity.find_capacity) per candidate and fixes the best before the next
stage (coordinate descent: a small, explainable search, not an exhaustive one).

Invariants:
- Every candidate's config is built from the base plus the overrides of the winners so far plus
  its own, and validated before it runs; a candidate the tune file lists that does not load is a
  ConfigError naming the tune file and `stages.<stage>[i]`, checked up front against the base.
- A candidate's capacity search is a point: its id hashes the resolved config (sweep.point_id)
  and the search settings; a finished point is DIR/points/<id>.json, written atomically
  (sweep.write_json_atomic), so a rerun runs only what is missing and writes the same outputs. The
  candidates of one stage run in parallel (sweep.run_parallel: local processes or Ray).
- The ranking is total and deterministic: goodput per GPU (capacity / GPUs), then SLO headroom at
  that capacity (the smallest (limit - value) / limit over the SLO metrics and seeds), then the
  order candidates are listed in (the incumbent's own value first in every default list).
- Every stage after parallelism competes with the incumbent (added first when no candidate equals
  it), so a stage never loses ground and the chosen deployment ranks first among all evaluated.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal

from .config import ExperimentConfig, check_name, load_config, read_yaml
from .errors import ConfigError
from .schema import option, parse, require
from .sweep import load_finished, point_id, run_parallel, write_json_atomic
from .tune_stages import STAGE_NAMES, STAGES, Stage, StageContext

KEPT_METRICS = ("ttft_p50", "ttft_p99", "tpot_p99", "itl_p99", "queue_delay_p50", "throughput_tokens_per_s",
                "num_preemptions", "short_p_mean", "finished_fraction")


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
    """The capacity search run per candidate (cbsim.capacity.find_capacity)."""

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
    slo: dict = option(help="capacity SLOs {summary metric: limit}, e.g. {ttft_p99: 2.0, itl_p99: 0.1}")
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
        for i, tp in enumerate(self.stages.get("parallelism") or []):
            require(self.gpus.count % tp == 0, f"stages.parallelism[{i}]",
                    f"a TP degree dividing gpus.count ({self.gpus.count})", tp)
        for i, split in enumerate(self.stages.get("pd") or []):
            if isinstance(split, dict):
                require(split["prefill"] + split["decode"] <= self.gpus.count, f"stages.pd[{i}]",
                        f"pools of at most gpus.count ({self.gpus.count}) GPUs together", split)


@dataclass(frozen=True)
class CapacityPoint:
    """One candidate's capacity search: its config, the SLO and search settings, and its id."""

    id: str
    config: ExperimentConfig
    slo: dict
    search: dict


@dataclass
class Candidate:
    """A stage's candidate: its label, tune-file value, overrides, point and (once run) record."""

    label: str
    value: Any
    overrides: dict  # the full overrides of the base (winners so far + this candidate)
    point: CapacityPoint
    record: dict | None = None


@dataclass
class StageOutcome:
    stage: Stage
    status: Literal["searched", "fixed", "skipped"]
    reason: str  # why it ran or was skipped (the seed's condition, or the knob missing)
    candidates: list[Candidate] = field(default_factory=list)
    winner: Candidate | None = None
    why: str = ""  # why the winner won
    dropped: list[str] = field(default_factory=list)  # default candidates the cost model refused


@dataclass
class TuneResult:
    spec: TuneSpec
    base: ExperimentConfig
    stages: list[StageOutcome]
    best: Candidate
    records: dict[str, dict]  # point id -> record, every point this tune used
    ran: int = 0  # capacity searches run by this call (the others were loaded from finished points)


def load_tune(source, root: str | Path | None = None) -> TuneSpec:
    """Parse a tune file (YAML path, mapping or TuneSpec); a relative `base` resolves against the
    tune file's folder, else `root` (default: the current directory)."""
    if isinstance(source, TuneSpec):
        return source
    file = str(source) if isinstance(source, (str, Path)) else None
    data = read_yaml(source) if file else source
    try:
        spec = parse(TuneSpec, data)
    except ConfigError as err:
        raise err.in_file(file) if file else err
    folder = Path(file).parent if file else Path(root or ".")
    if isinstance(spec.base, str):
        base = Path(spec.base).expanduser()
        base = base if base.is_absolute() else (folder / base).resolve()
        if not base.is_file():
            raise ConfigError("base", "an existing experiment YAML (relative to the tune file)", spec.base, file)
        spec = replace(spec, base=str(base))
    spec.source = file
    return spec


def base_config(spec: TuneSpec) -> ExperimentConfig:
    """The base with `set` and the GPU type applied, validated; errors name the tune file's key."""
    overrides = dict(spec.set)
    if spec.gpus.type is not None:
        overrides["cost_model.gpu"] = spec.gpus.type
    try:
        config = load_config(spec.base, _strings(overrides))
    except ConfigError as err:
        key = next((k for k in spec.set if err.path == k or err.path.startswith(k + ".")), None)
        where = f"set.{key}" if key else "gpus.type" if err.path.startswith("cost_model.gpu") else \
            f"base ({spec.base if isinstance(spec.base, str) else 'inline'}): {err.path}"
        raise ConfigError(where, err.expected, err.got, spec.source, err.has_got) from None
    if config.cluster.mode != "colocated":
        raise ConfigError("base", "a colocated experiment (the pd stage decides P/D)", config.cluster.mode, spec.source)
    from .capacity import num_gpus

    if spec.stages.get("parallelism") in ([], False) and num_gpus(config) > spec.gpus.count:
        raise ConfigError("gpus.count", f"at least the base's {num_gpus(config)} GPUs (or a parallelism stage)",
                          spec.gpus.count, spec.source)
    return config


def candidate_config(base: ExperimentConfig, overrides: dict) -> ExperimentConfig:
    """The base with `overrides` ({dotted key: value}, in order) applied and validated, its policy
    spelled out with every option (so a default given explicitly is the same experiment and point)."""
    from .tune_stages import policy_settings

    config = load_config(base, _strings(overrides) + ["output.dir=null"])
    config.policy = {"name": config.policy["name"], **policy_settings(config)}
    config.source = base.source
    return config


def capacity_point(config: ExperimentConfig, spec: TuneSpec) -> CapacityPoint:
    """The point of one capacity search; its id hashes the resolved config and the search settings."""
    search = spec.search.kwargs()
    key = json.dumps([point_id(config), spec.slo, {k: list(v) if isinstance(v, tuple) else v
                                                   for k, v in search.items()}], sort_keys=True)
    return CapacityPoint(hashlib.sha256(key.encode()).hexdigest()[:16], config, dict(spec.slo), search)


def run_capacity_point(point: CapacityPoint) -> dict:
    """Run one capacity search; never raises: a failure is a record with status 'failed'."""
    from .capacity import find_capacity, num_gpus

    started = time.perf_counter()
    record = {"point_id": point.id, "status": "ok", "error": None, "config_error": None, "rate": None,
              "fail_rate": None, "num_gpus": num_gpus(point.config), "probes": 0, "binding": None,
              "at_capacity": [], "at_fail": []}
    try:
        result = find_capacity(point.config, point.slo, **point.search)
        rows = result.points
        keep = [c for c in dict.fromkeys(["rate", "seed", "meets", *point.slo, *KEPT_METRICS]) if c in rows]
        record.update(rate=result.rate, fail_rate=result.fail_rate, probes=int(rows["probe"].nunique()))
        for name, rate in (("at_capacity", result.rate), ("at_fail", result.fail_rate)):
            if rate is not None:
                record[name] = json.loads(rows.loc[rows["rate"] == rate, keep].to_json(orient="records"))
        record["binding"] = binding_metric(record["at_fail"], point.slo, point.search["min_finished"])
    except ConfigError as err:  # the same for every candidate: the main process raises it
        record.update(status="failed", error=str(err), config_error=[err.path, err.expected, repr(err.got)])
    except Exception as err:  # a failing candidate is a result, it must not stop the tune
        record.update(status="failed", error=f"{type(err).__name__}: {err}")
    record["wall_seconds"] = time.perf_counter() - started
    return record


def binding_metric(rows: list[dict], slo: dict, min_finished: float) -> str | None:
    """The SLO that broke first at the failing rate: the metric furthest over its limit (or
    'finished' when too few requests finished)."""
    if not rows:
        return None
    if any((row.get("finished_fraction") or 0) < min_finished for row in rows):
        return "finished"
    ratios = {}
    for metric, limit in slo.items():
        values = [row.get(metric) for row in rows]
        ratios[metric] = math.inf if any(v is None for v in values) else max(values) / limit
    return max(ratios, key=lambda m: ratios[m]) if ratios else None


def rank_key(record: dict | None, slo: dict) -> tuple[float, float]:
    """(goodput per GPU, SLO headroom at capacity): larger is better; failed or none: (-1, -inf)."""
    if not record or record.get("status") != "ok" or record.get("rate") is None:
        return (-1.0, -math.inf)
    headroom = math.inf
    for metric, limit in slo.items():
        values = [row.get(metric) for row in record["at_capacity"] if row.get(metric) is not None]
        if values:
            headroom = min(headroom, (limit - max(values)) / limit)
    return (record["rate"] / record["num_gpus"], headroom if headroom != math.inf else 0.0)


class PointRunner:
    """Runs capacity points in parallel, keeping each finished one under points_dir (resumable)."""

    def __init__(self, points_dir: Path | None, workers=None, backend="local", address=None,
                 retry_failed: bool = False, on_point: Callable[[dict, int, int], None] | None = None,
                 source: str | None = None):
        self.points_dir, self.workers, self.backend, self.address = points_dir, workers, backend, address
        self.retry_failed, self.on_point, self.source = retry_failed, on_point, source
        self.records: dict[str, dict] = {}
        self.ran = 0  # capacity searches run in this call (not loaded from points_dir)

    def run(self, points: list[CapacityPoint]) -> dict[str, dict]:
        unique = list({p.id: p for p in points if p.id not in self.records}.values())
        self.records.update(load_finished(unique, self.points_dir, self.retry_failed))
        todo = [p for p in unique if p.id not in self.records]
        done = 0

        def collect(record: dict) -> None:
            nonlocal done
            done += 1
            self.ran += 1
            if record["config_error"]:
                path, expected, got = record["config_error"]
                raise ConfigError(path, expected, got, self.source)
            self.records[record["point_id"]] = record
            if self.points_dir is not None:
                write_json_atomic(self.points_dir / f"{record['point_id']}.json", record)
            if self.on_point is not None:
                self.on_point(record, done, len(todo))

        if todo:
            run_parallel(todo, run_capacity_point, collect, self.workers, self.backend, self.address)
        return {p.id: self.records[p.id] for p in points}


def run_tune(source, out_dir: str | Path | None = None, workers: int | None = None,
             backend: Literal["local", "ray"] = "local", address: str | None = None, retry_failed: bool = False,
             root: str | Path | None = None, on_stage: Callable[[StageOutcome], None] | None = None,
             on_point: Callable[[dict, int, int], None] | None = None) -> TuneResult:
    """Run the stages in order and return the result; with `out_dir`, points are kept under
    out_dir/points/ (a rerun runs only the missing ones). Outputs are written by tune_report.
    `on_stage(outcome)` is called as each stage ends, `on_point(record, done, total)` as each
    capacity search of this call finishes."""
    if workers is not None and workers < 1:
        raise ConfigError("workers", "an integer >= 1, or null for the CPU count", workers)
    spec = load_tune(source, root)
    base = base_config(spec)
    check_candidates(spec, base)
    runner = PointRunner(Path(out_dir) / "points" if out_dir is not None else None, workers, backend, address,
                         retry_failed, on_point, spec.source)
    chosen: dict = {}
    outcomes: list[StageOutcome] = []
    for stage in STAGES:
        outcome = run_stage(stage, spec, base, chosen, runner, outcomes)
        if on_stage is not None:
            on_stage(outcome)
        outcomes.append(outcome)
        if outcome.winner is not None:
            chosen = dict(outcome.winner.overrides)
    best = _evaluated(spec, base, chosen, runner)
    return TuneResult(spec, base, outcomes, best, dict(runner.records), runner.ran)


def run_stage(stage: Stage, spec: TuneSpec, base: ExperimentConfig, chosen: dict, runner: PointRunner,
              done: list[StageOutcome]) -> StageOutcome:
    """One stage: its candidates (listed or default), each one's capacity, the best fixed."""
    config = candidate_config(base, chosen)
    history = {o.stage.name: [{"label": c.label, "record": c.record} for c in o.candidates] for o in done}
    ctx = StageContext(config, spec.gpus.count, spec.slo, lambda: _evaluated(spec, base, chosen, runner).record,
                       history)
    listed = spec.stages.get(stage.name)
    if listed is not None and not listed:
        return StageOutcome(stage, "skipped", "skipped by the tune file (stages." + stage.name + ": [])")
    missing = stage.applies(ctx)
    if missing:
        return StageOutcome(stage, "skipped", missing)
    if listed is None:
        condition = stage.when(ctx)
        if condition:
            return StageOutcome(stage, "skipped", condition)
    values = listed if listed is not None else stage.defaults(ctx)
    candidates, dropped = _candidates(stage, spec, base, chosen, ctx, values, listed is not None)
    incumbent = capacity_point(config, spec)
    if stage.name != "parallelism" and incumbent.id not in {c.point.id for c in candidates}:
        label = f"{stage.label(stage.defaults(ctx)[0])} (incumbent)"  # defaults start with the current value
        candidates.insert(0, Candidate(label, None, dict(chosen), incumbent))  # a stage never loses ground
    reason = "candidates listed in the tune file" if listed is not None else "default candidates"
    if len(candidates) == 1:
        return StageOutcome(stage, "fixed", reason + " (one candidate: fixed without a search)", candidates,
                            candidates[0], "the only candidate", dropped)
    records = runner.run([c.point for c in candidates])
    for c in candidates:
        c.record = records[c.point.id]
    winner, why = pick(candidates, spec.slo)
    return StageOutcome(stage, "searched", reason, candidates, winner, why, dropped)


def _candidates(stage, spec, base, chosen, ctx, values, listed: bool) -> tuple[list[Candidate], list[str]]:
    out, dropped, seen = [], [], set()
    for i, value in enumerate(values):
        overrides = {**chosen, **stage.overrides(value, ctx)}
        try:
            config = candidate_config(base, overrides)
        except ConfigError as err:
            if listed:
                raise ConfigError(f"stages.{stage.name}[{i}]", f"{err.expected} (at {err.path})", err.got,
                                  spec.source, err.has_got) from None
            dropped.append(f"{stage.label(value)}: {err.path}: expected {err.expected}")
            continue
        point = capacity_point(config, spec)
        if point.id in seen:  # the same experiment twice (a knob without effect here): keep the first
            continue
        seen.add(point.id)
        out.append(Candidate(stage.label(value), value, overrides, point))
    if not out:
        raise ConfigError(f"stages.{stage.name}", "at least one candidate the base accepts; refused: "
                          + "; ".join(dropped), has_got=False, file=spec.source)
    return out, dropped


def pick(candidates: list[Candidate], slo: dict) -> tuple[Candidate, str]:
    """The best candidate by rank_key (the first listed among equals) and a sentence saying why."""
    best = candidates[0]
    for c in candidates[1:]:
        if rank_key(c.record, slo) > rank_key(best.record, slo):
            best = c
    others = sorted((c for c in candidates if c is not best), key=lambda c: rank_key(c.record, slo), reverse=True)
    top, headroom = rank_key(best.record, slo)
    if top < 0:
        return best, "no candidate met the SLO at any probed rate; the first listed is kept"
    runner = others[0]
    second, second_headroom = rank_key(runner.record, slo)
    if second < 0:
        return best, f"the only candidate meeting the SLO ({top:.4g} req/s per GPU)"
    if top > second:
        gain = (top / second - 1) * 100 if second > 0 else math.inf
        return best, f"highest goodput: {top:.4g} req/s per GPU, +{gain:.0f}% over {runner.label} ({second:.4g})"
    if headroom > second_headroom:
        return best, (f"tied on goodput ({top:.4g} req/s per GPU) with {runner.label}; more SLO headroom at that "
                      f"rate ({headroom:.0%} vs {second_headroom:.0%})")
    return best, f"tied with {runner.label} ({top:.4g} req/s per GPU, same headroom); listed first"


def _evaluated(spec: TuneSpec, base: ExperimentConfig, chosen: dict, runner: PointRunner) -> Candidate:
    """The incumbent as a candidate with its record (its capacity search run if not yet done)."""
    point = capacity_point(candidate_config(base, chosen), spec)
    record = runner.run([point])[point.id]
    return Candidate("chosen", None, dict(chosen), point, record)


def check_candidates(spec: TuneSpec, base: ExperimentConfig) -> None:
    """Every listed candidate applied to the base alone must load (where its knob exists in the
    base's policy): a bad value stops the tune before anything runs."""
    ctx = StageContext(base, spec.gpus.count, spec.slo, lambda: {}, {})
    for stage in STAGES:
        if not spec.stages.get(stage.name) or stage.applies(ctx):
            continue
        for i, value in enumerate(spec.stages[stage.name]):
            try:
                candidate_config(base, stage.overrides(value, ctx))
            except ConfigError as err:
                raise ConfigError(f"stages.{stage.name}[{i}]", f"{err.expected} (at {err.path})", err.got,
                                  spec.source, err.has_got) from None


def _strings(overrides: dict) -> list[str]:
    import yaml

    def text(value) -> str:
        return yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip().removesuffix("...").strip()

    return [f"{key}={text(value)}" for key, value in overrides.items()]
