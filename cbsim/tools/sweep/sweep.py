"""Sweeps: one experiment run over a grid of config values, times seeds, into one tidy table.

A sweep file names a base experiment, fixed overrides (`set`), a `grid` (a mapping of key paths to
value lists, whose cartesian product is run, or a list of such mappings, whose products are run one
after the other) and `seeds`. Keys are experiment key paths with `--set` semantics.

Invariants:
- Every point's config is loaded and validated before anything runs: a bad key or value stops the
  sweep up front with a ConfigError naming the sweep file and its key.
- A point's id hashes its fully resolved config (seed included; name and output excluded), so an
  edited base file gives new ids and never reuses stale results.
- A finished point (ok or failed) is one JSON file DIR/points/<id>.json, written to a temporary
  name and os.replace'd as soon as its result arrives; a rerun loads those files and runs only the
  missing points. A point that raises is recorded with its error; the others go on.
- Table rows follow grid order (sub-grids in order, first key slowest, seeds fastest), never
  completion order, so the table does not depend on the worker count or the backend.
"""
from __future__ import annotations

import ctypes
import hashlib
import itertools
import json
import os
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal

import pandas as pd
import yaml

from cbsim.core import bounds
from cbsim.core.atomic import mark_complete, mark_incomplete, write_file_atomic

from cbsim.api import run_experiment
from cbsim.config import ExperimentConfig, check_name, load_config, read_yaml
from cbsim.core.errors import ConfigError, RunAborted
from cbsim.core.schema import option, parse, require

DEFAULT_METRICS = ["ttft_p50", "itl_p99", "throughput_tokens_per_s", "dec_at_p_mean", "short_p_mean"]
NONDETERMINISTIC = ("sim_wall_seconds",)  # summary metrics that measure the host, not the simulation
POINT_COLUMNS = ("seed", "status", "error", "point_id")


@dataclass
class PlotConfig:
    """Which plots `cbsim sweep` draws from the results table."""

    x: str | list[str] | None = option(None, help="the knob on the x axis: a grid key, or a list of grid keys "
                                                  "whose first non-null value is the knob; default: the last grid key")
    metrics: list[str] = option(DEFAULT_METRICS, help="summary metrics plotted against the knob")
    band: Literal["minmax", "sd"] = option("minmax", help="seed band: min-max, or mean +- one standard deviation")


@dataclass
class SweepSpec:
    """A sweep file, parsed. `base` is a path (relative to the sweep file) or an inline experiment."""

    base: Any = option(help="the base experiment: a YAML path relative to the sweep file, or an inline mapping")
    grid: Any = option(help="{key.path: [values]} (cartesian product), or a list of such mappings")
    name: str = option("sweep", help="sweep name (the default results folder)")
    set: dict = option({}, help="fixed overrides {key.path: value} applied to every point")
    seeds: list[int] = option([0], help="seeds: every grid point runs once per seed (replacing the base's seed)")
    plot: PlotConfig = option(PlotConfig(), help="plots drawn by `cbsim sweep`")
    source: str | None = field(default=None, repr=False, init=False)  # the sweep file

    def validate(self) -> None:
        require(isinstance(self.base, (str, dict)), "base", "an experiment path or mapping", self.base)
        check_name(self.name, "name")
        require(len(self.seeds) >= 1 and len(set(self.seeds)) == len(self.seeds) and min(self.seeds) >= 0, "seeds",
                "a non-empty list of distinct integers >= 0", self.seeds)
        grids = self.grids
        keys = [k for grid in grids for k in grid]
        for key in self.set:
            require(key not in keys, f"set.{key}", "a key that is not also in the grid", self.set[key])
        x = [self.plot.x] if isinstance(self.plot.x, str) else self.plot.x or []
        for key in x:
            require(key in keys, "plot.x", "grid keys", self.plot.x)

    @property
    def grids(self) -> list[dict[str, list]]:
        """The sub-grids, each checked: non-empty, dotted string keys, non-empty lists of distinct values."""
        grids = self.grid if isinstance(self.grid, list) else [self.grid]
        require(len(grids) >= 1, "grid", "a mapping {key.path: [values]} or a non-empty list of them", self.grid)
        for i, grid in enumerate(grids):
            path = f"grid[{i}]" if isinstance(self.grid, list) else "grid"
            require(isinstance(grid, dict) and len(grid) >= 1, path, "a non-empty mapping {key.path: [values]}", grid)
            for key, values in grid.items():
                _check_axis(f"{path}.{key}", key, values)
        return grids

    @property
    def keys(self) -> list[str]:
        """Every grid key, in first-appearance order (the table's leading columns)."""
        return list(dict.fromkeys(k for grid in self.grids for k in grid))


def _check_axis(path: str, key, values) -> None:
    require(isinstance(key, str) and all(key.split(".")), path, "a dotted key path such as policy.token_budget", key)
    require(key != "seed", path, "no seed axis (list seeds under `seeds:`)", key)
    require(isinstance(values, list) and len(values) >= 1, path, "a non-empty list of values", values)
    canonical = [_canonical(v) for v in values]
    require(len(set(canonical)) == len(canonical), path, "distinct values", values)


@dataclass(frozen=True)
class Point:
    """One run of a sweep: its position in grid order, grid values, seed, config and id."""

    index: int
    params: dict
    seed: int
    config: ExperimentConfig
    id: str


def load_sweep(source, root: str | Path | None = None) -> SweepSpec:
    """Parse a sweep from a YAML path, a mapping or a SweepSpec (load_spec_file)."""
    return load_spec_file(SweepSpec, source, root, "sweep")


def load_spec_file(kind: type, source, root: str | Path | None, noun: str):
    """Parse a file of dataclass `kind` (a sweep or tune spec with `base` and `source`) from a YAML
    path, a mapping or an instance. A relative `base` path resolves against the file's folder, else
    against `root` (default: the current directory)."""
    if isinstance(source, kind):
        return source
    file = str(source) if isinstance(source, (str, Path)) else None
    data = read_yaml(source) if file else source
    try:
        spec = parse(kind, data)
    except ConfigError as err:
        raise err.in_file(file)
    folder = Path(file).parent if file else Path(root or ".")
    if isinstance(spec.base, str):
        base = Path(spec.base).expanduser()
        base = base if base.is_absolute() else (folder / base).resolve()
        if not base.is_file():
            raise ConfigError("base", f"an existing experiment YAML (relative to the {noun} file)", spec.base, file)
        spec = replace(spec, base=str(base))
    spec.source = file
    return spec


def expand_grid(grid: dict[str, list] | list[dict[str, list]]) -> list[dict]:
    """Every combination of the grid's values, first key slowest; a list of grids is concatenated."""
    grids = grid if isinstance(grid, list) else [grid]
    return [dict(zip(g, combo)) for g in grids for combo in itertools.product(*g.values())]


def sweep_points(spec: SweepSpec) -> list[Point]:
    """Load and validate every point's config (before anything runs); ConfigError names the sweep key."""
    points = []
    seen: dict[str, dict] = {}
    for params in expand_grid(spec.grids):
        values = {**spec.set, **params, "output.dir": None}
        try:
            config = load_config(spec.base, [f"{k}={_yaml(v)}" for k, v in values.items()])
        except ConfigError as err:
            raise _sweep_error(err, spec, params) from None
        for seed in spec.seeds:
            cfg = replace(config, seed=seed)
            cfg.source = config.source  # not an init field: replace() does not carry it
            pid = point_id(cfg)
            if pid in seen:
                raise ConfigError("grid", "combinations that give different experiments", f"{seen[pid]} twice",
                                  file=spec.source)
            seen[pid] = params
            points.append(Point(len(points), params, seed, cfg, pid))
    return points


def point_id(config: ExperimentConfig) -> str:
    """A hash of everything that decides a run's results: the resolved config and, when the
    workload reads a trace, the folder its relative path resolves from."""
    data = config.to_dict()
    data.pop("output")
    data.pop("name")
    if config.source and "trace" in (config.workload or {}):
        data["base_dir"] = str(Path(config.source).resolve().parent)
    return hashlib.sha256(_canonical(data).encode()).hexdigest()[:16]


def run_point(point: Point) -> dict:
    """Run one point; never raises: a failure is a record with status 'failed' and the error text."""
    started = time.perf_counter()
    try:
        summary, status, error = run_experiment(point.config).summary, "ok", None
    except Exception as err:  # a failing point is a result, it must not stop the sweep
        summary, status, error = {}, "failed", f"{type(err).__name__}: {err}"
    return {"point_id": point.id, "params": point.params, "seed": point.seed, "status": status, "error": error,
            "summary": summary, "wall_seconds": time.perf_counter() - started}


def run_sweep(spec_or_path, out_dir: str | Path | None = None, workers: int | None = None,
              backend: Literal["local", "ray"] = "local", address: str | None = None,
              on_point: Callable[[dict, int, int], None] | None = None, retry_failed: bool = False,
              root: str | Path | None = None, on_start: Callable[[int, int], None] | None = None) -> pd.DataFrame:
    """Run a sweep (YAML path, mapping or SweepSpec) and return its results table.

    With `out_dir`, finished points are kept under out_dir/points/ (a rerun skips them; failed ones
    too unless `retry_failed`) and the table is written as results.parquet and results.csv.
    `workers`: local processes (default: CPU count; 1 runs in this process) or Ray task CPUs.
    `address` joins a Ray cluster. `on_start(done, total)` is called once the finished points are
    loaded, `on_point(record, done, total)` each time a point finishes in this call.
    """
    if workers is not None and workers < 1:
        raise ConfigError("workers", "an integer >= 1, or null for the CPU count", workers)
    spec = load_sweep(spec_or_path, root)
    points = sweep_points(spec)
    points_dir = Path(out_dir) / "points" if out_dir is not None else None
    if out_dir is not None:  # complete again only once its results table is written (save_table)
        mark_incomplete(Path(out_dir))
    records = load_finished(points, points_dir, retry_failed)
    todo = [p for p in points if p.id not in records]
    done = len(points) - len(todo)
    if on_start is not None:
        on_start(done, len(points))

    def collect(record: dict) -> None:
        nonlocal done
        records[record["point_id"]] = record
        if points_dir is not None:
            write_json_atomic(points_dir / f"{record['point_id']}.json", record)
        done += 1
        if on_point is not None:
            on_point(record, done, len(points))

    if todo:
        run_parallel(todo, run_point, collect, workers, backend, address)
    table = results_table(spec, points, records)
    if out_dir is not None:
        save_table(table, out_dir)
    return table


def run_parallel(items: list, func: Callable[[Any], dict], collect: Callable[[dict], None],
                 workers: int | None = None, backend: Literal["local", "ray"] = "local",
                 address: str | None = None) -> None:
    """Call `func(item)` for every item and `collect` each result in this process as it arrives:
    in this process (workers 1), a local process pool, or Ray tasks. `func` must be a picklable
    module-level function that never raises (a failure is a result); sweeps and tunes share it."""
    run = _run_ray if backend == "ray" else _run_local
    run(items, func, workers, collect, address)


def _run_local(items: list, func, workers: int | None, collect, address=None) -> None:
    workers = min(workers or os.cpu_count() or 1, len(items))
    if workers <= 1:
        for item in items:
            collect(func(item))
        return
    try:
        with ProcessPoolExecutor(max_workers=workers, initializer=die_with_parent, initargs=(os.getpid(),)) as pool:
            for future in as_completed([pool.submit(func, item) for item in items]):
                collect(future.result())
    except BrokenProcessPool:  # func never raises: only a worker's death (a kill, the OOM killer) gets here
        raise RunAborted("a worker process died (killed, or out of memory) before its point finished; the points "
                         "finished so far are kept: rerun the same command to resume") from None


def die_with_parent(parent: int, interval: float = 0.5) -> None:
    """Run in each pool worker: exit as soon as the process that started the pool is gone (a sweep
    killed with `kill -9` leaves no worker behind). When the worker is that process's child, Linux
    is asked to kill it with its parent (prctl PR_SET_PDEATHSIG); in every case (forkserver or spawn
    workers, other systems) a daemon thread checks every `interval` seconds that the parent lives."""
    if os.getppid() == parent:
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass

    def alive() -> bool:
        try:
            os.kill(parent, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def watch() -> None:
        while alive():
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="die-with-parent").start()


def _run_ray(items: list, func, workers: int | None, collect, address: str | None = None) -> None:
    """The same function as Ray tasks; joins `address` or starts a local Ray (`workers` CPUs)."""
    try:
        import ray  # lazy: an optional dependency (pip install 'cbsim[ray]'), only for --backend ray
    except ImportError as err:
        raise ConfigError("--backend", "ray installed (pip install 'cbsim[ray]')", "ray") from err
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, num_cpus=None if address else workers, include_dashboard=False,
                 log_to_driver=False)
    try:
        task = ray.remote(func)
        pending = [task.remote(item) for item in items]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            collect(ray.get(ready[0]))
    finally:
        if started:
            ray.shutdown()


def load_finished(points: list, points_dir: Path | None, retry_failed: bool) -> dict[str, dict]:
    """Records of points (anything with an `id`) already finished under points_dir/<id>.json (ok
    ones, and failed ones unless retried); sweeps and tunes share it. A file that is not such a record
    (damaged or edited by hand: the sweep writes each one whole) counts as not finished: the rerun runs
    that point again and replaces it."""
    if points_dir is None or not points_dir.is_dir():
        return {}
    records = {}
    for point in points:
        record = _read_record(points_dir / f"{point.id}.json", point.id)
        if record is not None and (record["status"] == "ok" or not retry_failed):
            records[point.id] = record
    return records


def _read_record(file: Path, point: str) -> dict | None:
    """Point `point`'s record, or None where the file is missing or not its record."""
    try:
        record = bounds.loads(file.read_bytes())
    except (OSError, ValueError):
        return None
    good = isinstance(record, dict) and record.get("point_id") == point and record.get("status") in ("ok", "failed")
    return record if good else None


def write_json_atomic(path: Path, data: dict) -> None:
    """Write JSON to a temporary sibling, then os.replace it: readers see all of it or nothing."""
    write_file_atomic(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1, default=str) + "\n"))


def results_table(spec: SweepSpec, points: list[Point], records: dict[str, dict]) -> pd.DataFrame:
    """One row per point x seed in grid order: grid keys (effective values), seed, every summary
    metric, status, error and point_id."""
    rows = []
    for point in points:
        record = records[point.id]
        row = {key: _lookup(point.config, key) for key in spec.keys}
        row["seed"] = point.seed
        row.update(record["summary"])
        row.update(status=record["status"], error=record["error"], point_id=point.id)
        rows.append(row)
    table = pd.DataFrame(rows)
    metrics = [c for c in table.columns if c not in spec.keys and c not in POINT_COLUMNS]
    table = table[spec.keys + ["seed"] + metrics + ["status", "error", "point_id"]]
    for column in metrics:
        try:
            table[column] = pd.to_numeric(table[column])
        except (TypeError, ValueError):
            pass
    for column in spec.keys:
        raw = [row[column] for row in rows]
        given = [v for v in raw if v is not None]
        if given and all(isinstance(v, int) and not isinstance(v, bool) for v in given):
            table[column] = pd.array(raw, dtype="Int64")  # integers with nulls stay integers
    table.attrs.update(sweep=spec.name, grid_keys=spec.keys)
    return table


def save_table(table: pd.DataFrame, out_dir: str | Path) -> Path:
    """Write results.csv and results.parquet (grid columns of mixed types are stored as text), then the
    folder's completion marker (cbsim/core/atomic.py)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_file_atomic(out / "results.csv", lambda tmp: table.to_csv(tmp, index=False))
    stored = table.copy()
    for column in stored.columns[stored.dtypes == object]:
        kinds = {type(v) for v in stored[column] if v is not None and v is not pd.NA and v == v}
        if len(kinds) > 1 or kinds & {dict, list}:
            stored[column] = stored[column].map(lambda v: None if v is None else str(v))
    write_file_atomic(out / "results.parquet", lambda tmp: stored.to_parquet(tmp, index=False))
    mark_complete(out, ["results.csv", "results.parquet"])
    return out


def _lookup(config: ExperimentConfig, key: str):
    """The effective value at a key path of a config (None where the path is unset)."""
    node: Any = config.to_dict()
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _sweep_error(err: ConfigError, spec: SweepSpec, params: dict) -> ConfigError:
    """A point's config error, re-keyed to the sweep key that caused it (grid, then set, else base)."""
    for section, keys in (("grid", params), ("set", spec.set)):
        for key in keys:
            if err.path == key or err.path.startswith(key + ".") or key.startswith(err.path + "."):
                expected = f"{err.expected} (at {err.path})" if err.path != key else err.expected
                return ConfigError(f"{section}.{key}", expected, err.got, spec.source, err.has_got)
    where = spec.base if isinstance(spec.base, str) else "the inline base"
    return ConfigError(f"base ({where}): {err.path}", err.expected, err.got, spec.source, err.has_got)


def _yaml(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip().removesuffix("...").strip()


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, default=repr)
