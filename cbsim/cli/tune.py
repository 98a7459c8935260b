"""`cbsim tune TUNE.yaml`: registered by cbsim.cli.app through `register(app)`. Thin: parses options,
calls cbsim.tools.tune.tune.run_tune, prints each stage and the answer, writes the outputs (tune_report)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from cbsim.cli.errors import user_errors
from cbsim.cli.logs import log
from cbsim.cli.progress import Reporter


def register(app: typer.Typer) -> None:
    app.command("tune")(user_errors(tune))


def tune(file: Path = typer.Argument(..., help="tune YAML (base, slo, gpus, search, stages)"),
         out: Optional[Path] = typer.Option(None, "--out", help="results folder (default: results/tune/<name>)"),
         workers: Optional[int] = typer.Option(None, "--workers", help="parallel capacity searches within a stage "
                                               "(default: CPU count)"),
         backend: str = typer.Option("local", "--backend", help="local (processes) or ray"),
         address: Optional[str] = typer.Option(None, "--address", help="Ray cluster address to join (ray backend)"),
         retry_failed: bool = typer.Option(False, "--retry-failed", help="rerun candidates recorded as failed"),
         plots: bool = typer.Option(True, "--plots/--no-plots", help="write pareto.png"),
         seeds: Optional[List[int]] = typer.Option(None, "--seed", min=0, help="seeds that must all meet the SLOs "
                                                   "at a rate, instead of the file's search.seeds (repeatable)"),
         quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar on stderr (as --log-level "
                                    "warning)")):
    """Search deployments (TP x replicas, policy, token budget, batch size, chunk size, partial-prefill
    limits, admission headroom, queue policy, P/D split) for the highest goodput per GPU under SLOs,
    stage by stage in a fixed order (docs/howto/tune-sla.md); finished capacity searches are kept, so a
    rerun resumes."""
    import time

    from cbsim.core.atomic import locked
    from cbsim.preflight import check_writable
    from cbsim.cli.sweep import check_parallel_options, seeds_option
    from cbsim.tools.tune.tune import load_tune, run_tune
    from cbsim.tools.sweep.capacity import short_probe_warning
    from cbsim.tools.tune.report import write_outputs

    check_parallel_options(backend, workers)
    spec = load_tune(file)
    spec.search.seeds = seeds_option(seeds) or spec.search.seeds
    target = out or Path("results") / "tune" / spec.name
    check_writable(target, "--out" if out else "name")
    started = time.perf_counter()

    def on_point(record: dict, done: int, total: int, label: str) -> None:
        rate = record.get("rate")
        text = "failed: " + str(record["error"]) if record["status"] != "ok" else \
            f"capacity {rate:.4g} req/s" if rate is not None else "no rate met the SLO"
        report.update(bar, done=done, total=total, status=f"last: {label}: {text} ({record['wall_seconds']:.0f} s)")

    stages: list[str] = []  # the results: printed once the bar has ended (cbsim/cli/progress.py)

    def on_stage(outcome) -> None:
        if outcome.status == "skipped":
            stages.append(f"  {outcome.stage.name}: skipped ({outcome.reason})")
        else:
            stages.append(f"  {outcome.stage.name} = {outcome.winner.label} ({outcome.status}, "
                          f"{len(outcome.candidates)} candidates): {outcome.why}")
        report.update(bar, name=f"tune {spec.name}: {len(stages)} stages done")

    with locked(target), Reporter(quiet) as report:  # one tune writes a folder at a time (cbsim/core/atomic.py)
        bar = report.task(f"tune {spec.name}")
        result = run_tune(spec, out_dir=target, workers=workers, backend=backend, address=address,
                          retry_failed=retry_failed, on_point=on_point, on_stage=on_stage)
        files = write_outputs(result, target, plots=plots)
    typer.echo(f"tune {spec.name}: stages in their fixed order (docs/howto/tune-sla.md)")
    for line in stages:
        typer.echo(line)
    spans = [r["shortest_probe"] for r in result.records.values() if r.get("shortest_probe") is not None]
    warning = short_probe_warning(min(spans) if spans else None, f"tune {spec.name}")
    if warning:
        log.warning(warning)
    best = result.best.record
    rate, gpus = best.get("rate"), best["num_gpus"]
    capacity = "none" if rate is None else f"{rate:.4g} req/s on {gpus} GPUs ({rate / gpus:.4g} per GPU)"
    typer.echo(f"chosen: {capacity}; {time.perf_counter() - started:.0f} s, {result.ran} capacity searches run")
    typer.echo("results: " + ", ".join(str(path) for path in files.values()))
