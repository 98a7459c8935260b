"""CI regression check on policy metrics: rerun a suite of canonical experiments and compare their
summary metrics with a committed baseline.

A suite is a folder. Every `*.yaml` in it is one experiment (an ordinary experiment file, runnable
with `cbsim run`), named by its file stem; `baseline.json` holds the tracked metrics of each
experiment; an optional `tolerances.yaml` sets how they are compared (see `Tolerances`).

Runs are deterministic (same config and seed: identical numbers), so tolerances can be tight.
Each tracked metric has a direction (`DIRECTIONS`: lower or higher is better). For every
(experiment, metric) the verdict is one of:

- ok: |now - baseline| <= max(rel * |baseline|, abs), the metric's tolerance;
- regressed: beyond tolerance in the worse direction (fails);
- improved: beyond tolerance in the better direction (fails only in mode `any`; either way the
  baseline should then be refreshed with `--update`);
- changed: defined in one and undefined (null) in the other (fails);
- missing: in the baseline but not produced by the run (fails);
- new: produced by the run but not in the baseline (reported, does not fail).

An experiment in the baseline whose YAML is gone is `missing` (fails); a YAML without a baseline
entry is `new` (reported). The baseline also records a digest of each resolved config; a
mismatch is reported as a note (the YAML or an override changed), not a failure by itself.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from cbsim.core import bounds
from cbsim.api import run_experiment
from cbsim.config import load_config, read_yaml
from cbsim.core.errors import ConfigError
from cbsim.core.schema import option, parse, require

BASELINE_FILE = "baseline.json"
TOLERANCES_FILE = "tolerances.yaml"
BASELINE_FORMAT = 1

LOWER, HIGHER = "lower", "higher"
# The tracked summary metrics and which way is better (sim_wall_seconds is deliberately absent:
# it measures the machine, not the policy).
DIRECTIONS = {
    "ttft_p50": LOWER, "ttft_p99": LOWER, "tpot_p50": LOWER, "tpot_p99": LOWER,
    "itl_p50": LOWER, "itl_p99": LOWER, "itl_max": LOWER, "e2e_p50": LOWER, "e2e_p99": LOWER,
    "queue_delay_p99": LOWER, "makespan": LOWER, "short_p_mean": LOWER,
    "num_preemptions": LOWER, "num_stalls": LOWER, "num_rejected": LOWER,
    "throughput_tokens_per_s": HIGHER, "goodput_requests_per_s": HIGHER, "slo_attainment": HIGHER,
    "dec_at_p_mean": HIGHER, "num_finished": HIGHER,
}

FAILING = ("regressed", "changed", "missing")


# ---------------------------------------------------------------- tolerances


@dataclass
class Tolerance:
    """Allowed difference: |now - baseline| <= max(rel * |baseline|, abs)."""

    rel: float = option(1e-3, help="relative tolerance (0.001 = 0.1 %)")
    abs: float = option(0.0, help="absolute tolerance, for values at or near zero (counts: 0 = exact)")

    def validate(self) -> None:
        require(self.rel >= 0, "rel", "a number >= 0", self.rel)
        require(self.abs >= 0, "abs", "a number >= 0", self.abs)

    def allows(self, base: float, now: float) -> bool:
        return abs(now - base) <= max(self.rel * abs(base), self.abs)


@dataclass
class Tolerances:
    """The comparison rules of a suite (its tolerances.yaml)."""

    mode: Literal["worse", "any"] = option("worse", help="worse: fail on regressions only; any: fail on any "
                                           "change beyond tolerance, improvements included")
    default: Tolerance = option(Tolerance(), help="tolerance of every metric not listed under metrics")
    metrics: dict = option({}, help="per-metric tolerances: {metric_name: {rel: ..., abs: ...}}")

    def validate(self) -> None:
        parsed = {}
        for name, value in self.metrics.items():
            require(name in DIRECTIONS, f"metrics.{name}", "a tracked metric: " + ", ".join(DIRECTIONS), name)
            parsed[name] = parse(Tolerance, value, f"metrics.{name}")
        self.metrics = parsed

    def of(self, metric: str) -> Tolerance:
        return self.metrics.get(metric, self.default)


def load_tolerances(suite_dir: Path) -> Tolerances:
    """The suite's tolerances.yaml, or the defaults when it has none."""
    path = Path(suite_dir) / TOLERANCES_FILE
    if not path.exists():
        return Tolerances()
    try:
        return parse(Tolerances, read_yaml(path))
    except ConfigError as err:
        raise err.in_file(str(path)) from None


# ---------------------------------------------------------------- running the suite


@dataclass
class Outcome:
    """One experiment's tracked metrics from a run, its config digest and how long it took."""

    metrics: dict
    digest: str
    wall_seconds: float


def suite_files(suite_dir: Path, only: list[str] | None = None) -> dict[str, Path]:
    """{name: yaml path} of the suite's experiments (sorted), restricted to `only` when given."""
    suite_dir = Path(suite_dir)
    if not suite_dir.is_dir():
        raise ConfigError("--suite", "an existing suite folder", str(suite_dir))
    files = {p.stem: p for p in sorted(suite_dir.glob("*.yaml")) if p.name != TOLERANCES_FILE}
    for name in only or []:
        if name not in files:
            raise ConfigError("--only", "one of the suite's experiments: " + ", ".join(files), name)
    return {k: v for k, v in files.items() if not only or k in only}


def config_digest(cfg) -> str:
    """A short digest of a resolved ExperimentConfig (what was run, not how the file was written)."""
    text = json.dumps(cfg.to_dict(), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_one(path: Path, overrides: list[str] | None = None) -> Outcome:
    """Run one suite experiment (never writing an output folder) and keep its tracked metrics."""
    cfg = load_config(path, overrides)
    cfg.output.dir = None
    started = time.perf_counter()
    summary = run_experiment(cfg).summary
    wall = time.perf_counter() - started
    return Outcome({k: summary[k] for k in DIRECTIONS if k in summary}, config_digest(cfg), wall)


def run_suite(suite_dir: Path, only: list[str] | None = None,
              overrides: list[str] | None = None) -> dict[str, Outcome]:
    """Run every experiment of the suite (or those in `only`), each with the same `overrides`."""
    return {name: run_one(path, overrides) for name, path in suite_files(suite_dir, only).items()}


# ---------------------------------------------------------------- baseline


def read_baseline(suite_dir: Path) -> dict:
    """{name: {"metrics": {...}, "config_digest": str}} from the suite's baseline.json ({} if none)."""
    path = Path(suite_dir) / BASELINE_FILE
    if not path.exists():
        return {}
    try:
        data = bounds.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError("<file>", f"valid JSON ({err})", has_got=False, file=str(path)) from None
    if not isinstance(data, dict) or data.get("format") != BASELINE_FORMAT:
        raise ConfigError("format", f"a cbsim regress baseline of format {BASELINE_FORMAT}",
                          data.get("format") if isinstance(data, dict) else data, file=str(path))
    return data.get("experiments", {})


def write_baseline(suite_dir: Path, outcomes: dict[str, Outcome], keep_others: bool = True) -> Path:
    """Write baseline.json from `outcomes`; entries of experiments not run are kept when they still
    have a YAML in the suite (an `--only` update), dropped otherwise."""
    path = Path(suite_dir) / BASELINE_FILE
    entries = {}
    if keep_others:
        present = suite_files(suite_dir)
        entries = {k: v for k, v in read_baseline(suite_dir).items() if k in present}
    for name, outcome in outcomes.items():
        entries[name] = {"config_digest": outcome.digest, "metrics": outcome.metrics}
    data = {"format": BASELINE_FORMAT,
            "note": "written by `cbsim regress --update`; compare with `cbsim regress`",
            "experiments": dict(sorted(entries.items()))}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


# ---------------------------------------------------------------- comparison


@dataclass
class Row:
    """One line of the comparison table."""

    experiment: str
    metric: str
    baseline: float | None
    now: float | None
    verdict: str

    @property
    def change(self) -> float | None:
        """Relative change (now / baseline - 1), None when undefined."""
        if self.baseline is None or self.now is None:
            return None
        if self.baseline == 0:
            return 0.0 if self.now == 0 else math.copysign(math.inf, self.now)
        return self.now / self.baseline - 1.0


@dataclass
class Report:
    """The comparison of a run with the baseline."""

    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    mode: Literal["worse", "any"] = "worse"

    def fails(self, row: Row) -> bool:
        """Whether this row fails the check (improvements fail only in mode `any`)."""
        return row.verdict in FAILING or (self.mode == "any" and row.verdict == "improved")

    def failures(self) -> list[Row]:
        return [r for r in self.rows if self.fails(r)]

    @property
    def passed(self) -> bool:
        return not self.failures()

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for row in self.rows:
            out[row.verdict] = out.get(row.verdict, 0) + 1
        return out


def verdict(metric: str, base, now, tol: Tolerance) -> str:
    """ok, regressed, improved or changed for one metric (see the module docstring)."""
    if base is None or now is None:
        return "ok" if base is None and now is None else "changed"
    if tol.allows(base, now):
        return "ok"
    worse = now > base if DIRECTIONS.get(metric, LOWER) == LOWER else now < base
    return "regressed" if worse else "improved"


def compare(baseline: dict, outcomes: dict[str, Outcome], tolerances: Tolerances,
            expected: list[str] | None = None) -> Report:
    """Compare run `outcomes` with `baseline` entries. `expected`: the experiments that should have
    been run (default: all in the baseline); a baseline experiment among them without an outcome
    is reported missing."""
    report = Report(mode=tolerances.mode)
    names = sorted(set(outcomes) | set(expected if expected is not None else baseline))
    for name in names:
        entry, outcome = baseline.get(name), outcomes.get(name)
        if outcome is None:
            if entry is not None:
                report.rows.append(Row(name, "(experiment)", None, None, "missing"))
            continue
        if entry is None:
            report.rows.append(Row(name, "(experiment)", None, None, "new"))
            continue
        if entry.get("config_digest") != outcome.digest:
            report.notes.append(f"{name}: config differs from the one the baseline was recorded with")
        report.rows.extend(_compare_metrics(name, entry.get("metrics", {}), outcome.metrics, tolerances))
    return report


def _compare_metrics(name: str, base: dict, now: dict, tolerances: Tolerances) -> list[Row]:
    rows = []
    for metric in [m for m in DIRECTIONS if m in base or m in now] + sorted(set(base) - set(DIRECTIONS)):
        if metric not in now:
            rows.append(Row(name, metric, base[metric], None, "missing"))
        elif metric not in base:
            rows.append(Row(name, metric, None, now[metric], "new"))
        else:
            rows.append(Row(name, metric, base[metric], now[metric],
                            verdict(metric, base[metric], now[metric], tolerances.of(metric))))
    return rows


# ---------------------------------------------------------------- text


def _number(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.6g}"


def _percent(change: float | None) -> str:
    if change is None:
        return "-"
    if math.isinf(change):
        return "+inf%" if change > 0 else "-inf%"
    pct = 100.0 * change
    if pct == 0:
        return "0.00%"
    return f"{pct:+.2f}%" if abs(pct) >= 0.01 else f"{pct:+.1e}%"


def format_report(report: Report, changes_only: bool = False) -> str:
    """The comparison table (experiment, metric, baseline, now, change %, verdict) and a verdict line."""
    header = ("experiment", "metric", "baseline", "now", "change", "verdict")
    rows = [r for r in report.rows if not changes_only or r.verdict != "ok"]
    hidden = len(report.rows) - len(rows)
    cells = [header] + [(r.experiment, r.metric, _number(r.baseline), _number(r.now), _percent(r.change),
                         r.verdict.upper() if report.fails(r) else r.verdict) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    align = ("<", "<", ">", ">", ">", "<")
    lines = ["  ".join(f"{c:{a}{w}}" for c, a, w in zip(cell, align, widths)).rstrip() for cell in cells]
    if not rows:
        lines = []
    if hidden:
        lines.append(f"({hidden} metrics within tolerance not shown; --all shows every row)")
    lines += [f"note: {n}" for n in report.notes]
    counts = ", ".join(f"{n} {v}" for v, n in sorted(report.counts().items()))
    lines.append(f"{'PASS' if report.passed else 'FAIL'} ({counts}; mode {report.mode})")
    return "\n".join(lines)
