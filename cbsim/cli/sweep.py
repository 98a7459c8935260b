"""`cbsim sweep SWEEP.yaml` and `cbsim capacity EXPERIMENT --slo metric=limit`.

Registered by cbsim.cli.app through `register(app)`. Both are thin: they parse options, call
cbsim.tools.sweep.sweep.run_sweep / cbsim.tools.sweep.capacity.find_capacities, show progress, and print a short table.
The sweep, the capacity search, pandas and rich are imported inside the commands: every `cbsim`
invocation registers these commands, and only these two should load them.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
import yaml

from cbsim.cli.errors import user_errors
from cbsim.core.atomic import write_file_atomic
from cbsim.cli.logs import log
from cbsim.cli.progress import Reporter
from cbsim.core.errors import ConfigError
from cbsim.core.units import limit_seconds
from cbsim.sim.metrics.summary_units import display, unit_of


def register(app: typer.Typer) -> None:
    app.command("sweep")(user_errors(sweep))
    app.command("capacity")(user_errors(capacity))


def sweep(file: Path = typer.Argument(..., help="sweep YAML (base, set, grid, seeds, plot)"),
          out: Optional[Path] = typer.Option(None, "--out", help="results folder (default: results/sweeps/<name>)"),
          workers: Optional[int] = typer.Option(None, "--workers", help="parallel points (default: CPU count)"),
          backend: str = typer.Option("local", "--backend", help="local (processes) or ray"),
          address: Optional[str] = typer.Option(None, "--address", help="Ray cluster address to join (ray backend)"),
          retry_failed: bool = typer.Option(False, "--retry-failed", help="rerun points recorded as failed"),
          plots: bool = typer.Option(True, "--plots/--no-plots", help="write the sweep plots"),
          seeds: Optional[List[int]] = typer.Option(None, "--seed", min=0, help="run every grid point with these "
                                                    "seeds instead of the file's `seeds` (repeatable)"),
          quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar on stderr (as --log-level "
                                     "warning)")):
    """Run an experiment over a grid of config values and seeds; finished points are kept, so a
    rerun resumes where a killed sweep stopped."""
    from cbsim.core.atomic import locked  # lazy (module docstring): the sweep
    from cbsim.preflight import check_writable
    from cbsim.tools.sweep.sweep import load_sweep, run_sweep

    check_parallel_options(backend, workers)
    spec = load_sweep(file)
    spec.seeds = seeds_option(seeds) or spec.seeds
    target = out or Path("results") / "sweeps" / spec.name
    check_writable(target, "--out" if out else "name")
    with locked(target), Reporter(quiet) as report:  # one sweep writes a folder at a time; the bar ends first
        bar = report.task(f"sweep {spec.name}")
        table = run_sweep(spec, out_dir=target, workers=workers, backend=backend, address=address,
                          retry_failed=retry_failed,
                          on_start=lambda done, total: report.update(bar, done=done, total=total),
                          on_point=lambda record, done, total: report.update(bar, done=done,
                                                                             status=point_text(record)))
    failed = table[table["status"] != "ok"]
    typer.echo(f"{len(table)} runs, {len(failed)} failed; results: {target / 'results.parquet'}")
    for _, row in failed.drop_duplicates("error").head(5).iterrows():
        typer.secho(f"  failed: {row['error']}", fg=typer.colors.RED)
    if plots and len(failed) < len(table):
        from cbsim.tools.sweep.plots import write_sweep_plots  # lazy: matplotlib

        x = spec.plot.x or spec.keys[-1]
        for path in write_sweep_plots(table, target, x, spec.plot.metrics, band=spec.plot.band, title=spec.name):
            typer.echo(f"plot: {path}")


def capacity(file: Path = typer.Argument(..., help="experiment YAML"),
             slo: List[str] = typer.Option(..., "--slo", help="metric=limit, repeatable: a latency in seconds or with a unit "
                                              "(itl_p99=100ms queue_delay_p50=2), or vLLM's metric:milliseconds "
                                              "(ttft_p99:500)"),
             policy: Optional[List[str]] = typer.Option(None, "--policy", help="a policy name, or a YAML mapping "
                                                        "'{name: prefill_first, token_budget: null}'; repeatable"),
             lo: Optional[float] = typer.Option(None, "--lo", help="first rate tried (default: the experiment's)"),
             hi: Optional[float] = typer.Option(None, "--hi", help="upper rate (default: doubling until an SLO fails)"),
             tol: float = typer.Option(0.05, "--tol", help="stop when the failing rate is within (1 + tol) x the passing"),
             seeds: Optional[List[int]] = typer.Option(None, "--seed", min=0, help="seeds that must all meet the SLOs "
                                                       "(repeatable; default 0)"),
             min_finished: float = typer.Option(0.99, "--min-finished", help="fraction of requests a run must "
                                                "finish (not reject) to count as meeting the SLOs"),
             rate_key: str = typer.Option("workload.arrival.rate", "--rate-key", help="the key searched over"),
             set_: Optional[List[str]] = typer.Option(None, "--set", help="override a key: workload.num_requests=500"),
             out: Optional[Path] = typer.Option(None, "--out", help="write every probe to this CSV"),
             quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar on stderr (as "
                                        "--log-level warning)")):
    """Find the highest arrival rate meeting every SLO, per policy (bracketing, then bisection)."""
    import pandas as pd  # lazy (module docstring), as the capacity search

    from cbsim.tools.sweep.capacity import find_capacities, find_capacity, short_probe_warning
    from cbsim.config import load_config
    from cbsim.preflight import check_writable

    if out is not None:
        check_writable(out.parent, "--out")
    limits = {}
    for item in slo:
        name, seconds = limit_seconds(item, "--slo", lambda metric: unit_of(metric) == "s")
        if name in limits:  # the second would silently replace the first
            raise ConfigError("--slo", f"each metric once (a second limit on {name})", item)
        limits[name] = seconds
    options = dict(rate_key=rate_key, lo=lo, hi=hi, rel_tol=tol, seeds=tuple(seeds_option(seeds) or (0,)),
                   min_finished=min_finished)
    with Reporter(quiet) as report:  # the probes' bar ends before the table
        if policy:
            results = find_capacities(file, limits, [_policy(p) for p in policy], overrides=set_,
                                      progress=report.runs(f"capacity {file.name}"), **options)
        else:
            name = load_config(file, set_).policy["name"]
            results = {name: find_capacity(file, limits, overrides=set_, progress=report.runs(f"capacity {name}"),
                                           **options)}
    width = max(len(label) for label in results)
    typer.echo(f"capacity ({rate_key}) under " + ", ".join(f"{k} <= {display(k, v)}" for k, v in limits.items()))
    for label, result in results.items():
        if result.rate is None:
            text = f"none: even {result.fail_rate:.4g} violates an SLO or finishes < {min_finished:g} of its requests"
        else:
            bound = f"< {result.fail_rate:.4g}" if result.fail_rate is not None else "(no failing rate found)"
            text = f"{result.rate:.4g} {bound}   per GPU {result.rate_per_gpu:.4g} ({result.num_gpus} GPU)"
        probes = result.points["probe"].nunique()
        typer.echo(f"  {label:<{width}}  {text}   [{probes} probes]")
        warning = short_probe_warning(result.shortest_probe, label)
        if warning:
            log.warning(warning)
    if out is not None:
        frames = [r.points.assign(policy=label) for label, r in results.items()]
        out.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(out, lambda tmp: pd.concat(frames, ignore_index=True).to_csv(tmp, index=False))
        typer.echo(f"probes: {out}")


def point_text(record: dict) -> str:
    """A finished sweep point as its bar shows it: 'last: policy.token_budget=512, seed 1 ok (3 s)'."""
    params = ", ".join(f"{key}={value}" for key, value in record["params"].items())
    return f"last: {params}{', ' if params else ''}seed {record['seed']} {record['status']} ({record['wall_seconds']:.0f} s)"


def _policy(text: str):
    """A --policy value: a name, or a YAML mapping of the whole policy section."""
    value = yaml.safe_load(text)
    if not isinstance(value, (str, dict)):
        raise ConfigError("--policy", "a policy name or a YAML mapping {name: ..., options}", text)
    return value


def seeds_option(seeds: list[int] | None) -> list[int] | None:
    """--seed of the commands that run several seeds (sweep, capacity, tune): distinct integers (>= 0 by the
    option's own check); None when not given, so the file's seeds stand."""
    if seeds and len(set(seeds)) != len(seeds):
        raise ConfigError("--seed", "distinct seeds (each once)", seeds)
    return list(seeds) if seeds else None


def check_parallel_options(backend: str, workers: int | None) -> None:
    """--backend and --workers of the commands that run points in parallel (sweep, tune)."""
    if backend not in ("local", "ray"):
        raise ConfigError("--backend", "local or ray", backend)
    if workers is not None and workers < 1:
        raise ConfigError("--workers", "an integer >= 1 (default: the CPU count)", workers)
