"""`cbsim tune`: a deployment search for the highest goodput per GPU under SLOs, in a fixed order (stages.py).

A tune file names a base experiment (workload fixed), `slo` (capacity SLOs: summary metric ->
limit), the GPU budget (`gpus`: count, type, price) and, under `stages`, candidate lists that
replace the defaults of tune_stages.py. Stages run in the order of tune/stages.py; each one runs a
capacity search (cbsim.tools.sweep.capacity.find_capacity) per candidate and fixes the best before the next
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from cbsim.tools.sweep.capacity import find_capacity, num_gpus
from cbsim.config import ExperimentConfig, load_config
from cbsim.core.errors import ConfigError
from cbsim.tools.sweep.sweep import load_finished, point_id, run_parallel, write_json_atomic
from cbsim.tools.tune.spec import TuneSpec, base_config, load_tune, set_strings
from cbsim.tools.tune.stages import STAGES, Stage, StageContext, policy_settings

KEPT_METRICS = tuple(dict.fromkeys(("ttft_p50", "ttft_p99", "tpot_p99", "itl_p99", "queue_delay_p50",
                                     "throughput_tokens_per_s", "num_preemptions", "short_p_mean",
                                     "finished_fraction", *(m for stage in STAGES for m in stage.shows))))


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
    reason: str  # why it ran or was skipped (the stage's condition, or the knob missing)
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


def candidate_config(base: ExperimentConfig, overrides: dict) -> ExperimentConfig:
    """The base with `overrides` ({dotted key: value}, in order) applied and validated, its policy
    spelled out with every option (so a default given explicitly is the same experiment and point)."""
    config = load_config(base, set_strings(overrides) + ["output.dir=null"])
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
    started = time.perf_counter()
    record = {"point_id": point.id, "status": "ok", "error": None, "config_error": None, "rate": None,
              "fail_rate": None, "num_gpus": num_gpus(point.config), "probes": 0, "binding": None,
              "at_capacity": [], "at_fail": []}
    try:
        result = find_capacity(point.config, point.slo, **point.search)
        rows = result.points
        keep = [c for c in dict.fromkeys(["rate", "seed", "meets", *point.slo, *KEPT_METRICS]) if c in rows]
        record.update(rate=result.rate, fail_rate=result.fail_rate, probes=int(rows["probe"].nunique()),
                      shortest_probe=result.shortest_probe)
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
                 retry_failed: bool = False, on_point: Callable[[dict, int, int, str], None] | None = None,
                 source: str | None = None):
        self.points_dir, self.workers, self.backend, self.address = points_dir, workers, backend, address
        self.retry_failed, self.on_point, self.source = retry_failed, on_point, source
        self.records: dict[str, dict] = {}
        self.ran = 0  # capacity searches run in this call (not loaded from points_dir)

    def run(self, points: list[CapacityPoint], labels: dict[str, str] | None = None) -> dict[str, dict]:
        """Each point's record (run, or loaded from points_dir); on_point gets `labels`' name of each."""
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
                self.on_point(record, done, len(todo), (labels or {}).get(record["point_id"], ""))

        if todo:
            run_parallel(todo, run_capacity_point, collect, self.workers, self.backend, self.address)
        return {p.id: self.records[p.id] for p in points}


def run_tune(source, out_dir: str | Path | None = None, workers: int | None = None,
             backend: Literal["local", "ray"] = "local", address: str | None = None, retry_failed: bool = False,
             root: str | Path | None = None, on_stage: Callable[[StageOutcome], None] | None = None,
             on_point: Callable[[dict, int, int, str], None] | None = None) -> TuneResult:
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
    if not candidates:
        return StageOutcome(stage, "skipped", "the experiment refuses every default candidate", dropped=dropped)
    incumbent = capacity_point(config, spec)
    if stage.name != "parallelism" and incumbent.id not in {c.point.id for c in candidates}:
        current = stage.defaults(ctx)[0]  # default lists start with the incumbent's value
        candidates.insert(0, Candidate(f"{stage.label(current)} (incumbent)", current, dict(chosen), incumbent))
    reason = "candidates listed in the tune file" if listed is not None else "default candidates"
    if len(candidates) == 1:
        return StageOutcome(stage, "fixed", reason + " (one candidate: fixed without a search)", candidates,
                            candidates[0], "the only candidate", dropped)
    records = runner.run([c.point for c in candidates], {c.point.id: f"{stage.name} {c.label}" for c in candidates})
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
    record = runner.run([point], {point.id: "the chosen configuration"})[point.id]
    return Candidate("chosen", None, dict(chosen), point, record)


def check_candidates(spec: TuneSpec, base: ExperimentConfig) -> None:
    """Every listed candidate applied to the base alone must load: a bad value stops the tune before
    anything runs. A policy knob the base's policy lacks is not an error here (the policy stage may
    pick a policy that has it; else the stage is skipped and says why)."""
    ctx = StageContext(base, spec.gpus.count, spec.slo, lambda: {}, {})
    for stage in STAGES:
        absent = stage.applies(ctx)
        for i, value in enumerate(spec.stages.get(stage.name) or []):
            try:
                candidate_config(base, stage.overrides(value, ctx))
            except ConfigError as err:
                if absent and err.path.startswith("policy"):
                    continue
                raise ConfigError(f"stages.{stage.name}[{i}]", f"{err.expected} (at {err.path})", err.got,
                                  spec.source, err.has_got) from None
