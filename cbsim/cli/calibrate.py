"""`cbsim calibrate` (fit engine terms to measured steps or serving metrics), `cbsim engines`
(list the engine presets) and `cbsim splitwise-steps` (the Splitwise CSV as a step table).

Registered by cbsim.cli.app through `register(app)`. Exit codes: 0 done, 2 a user error naming the
file, row or key. The fits themselves are cbsim/tools/calibrate/steps.py and cbsim/tools/calibrate/serving.py; they,
the engine presets and the Splitwise reader load numpy, scipy or pandas, so the commands import them
when they run, not when every `cbsim` invocation registers them.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from cbsim.core.atomic import write_file_atomic
from cbsim.sim.costmodels.catalog.specs import DEFAULT_MODEL
from cbsim.profiler.converters.step_table import read_steps, step_row

from cbsim.cli.errors import user_errors
from cbsim.core.errors import ConfigError


def register(app: typer.Typer) -> None:
    """Add `calibrate`, `engines` and `splitwise-steps` to `app`."""

    @app.command("calibrate")
    @user_errors
    def calibrate_command(
            steps: Optional[List[Path]] = typer.Option(None, "--steps", help="measured steps (JSON lines: prefill, "
                                                       "decode, time_s, tp...) or a Splitwise perf_model CSV"),
            cost_model: Optional[Path] = typer.Option(None, "--cost-model", help="YAML with model: and cost_model: "
                                                      "(any experiment file): the kernels the engine wraps"),
            serving: Optional[List[str]] = typer.Option(None, "--serving", help="EXP.yaml=MEASURED.json: fit so the "
                                                        "simulated metrics match the measured ones"),
            holdout: Optional[List[str]] = typer.Option(None, "--holdout", help="EXP.yaml=MEASURED.json scored but "
                                                        "not fitted (serving mode)"),
            fit: Optional[str] = typer.Option(None, "--fit", help="comma-separated terms to fit (default: steps "
                                              "host_per_step_s,host_per_seq_s,host_per_token_s,launch_per_layer_s,"
                                              "collective_per_rank_s; serving host_per_step_s,host_per_seq_s,"
                                              "frontend_s)"),
            fit_kernel_scale: bool = typer.Option(False, "--fit-kernel-scale", help="also fit a correction factor "
                                                  "on the kernel time (GEMM efficiency)"),
            engine: Optional[str] = typer.Option(None, "--engine", help="base engine (preset or file) whose other "
                                                 "terms are kept (overlap, CUDA graphs); default none"),
            max_evals: int = typer.Option(60, "--max-evals", help="serving mode: simulations the search may run"),
            out: Path = typer.Option(..., "--out", help="engine file to write (load with cost_model.engine: FILE)")):
        """Fit the engine terms to measured step times (--steps) or serving metrics (--serving)."""
        names = _fit_names(fit, fit_kernel_scale)
        if bool(steps) == bool(serving):
            raise ConfigError("calibrate", "either --steps (with --cost-model) or --serving", has_got=False)
        _check_out(out)
        report = _from_steps(steps, cost_model, names, engine) if steps else \
            _from_serving(serving, holdout or [], names, engine, max_evals)
        write_file_atomic(out, lambda tmp: tmp.write_text(json.dumps(report, indent=2) + "\n"))
        typer.echo(_summary(report))
        typer.echo(f"engine file: {out}  (use it as cost_model.engine: {out})")

    @app.command("engines")
    def engines_command():
        """List the engine presets and their terms."""
        from cbsim.sim.costmodels.engine import load_engine, preset_names  # lazy (module docstring)

        for name in preset_names():
            engine = load_engine(name)
            typer.secho(name, bold=True, nl=False)
            typer.echo(f"  {(engine.provenance or {}).get('description', '').strip()}")
            terms = {k: v for k, v in engine.describe()["terms"].items() if v not in (0, 0.0, False, 1.0)}
            typer.echo("    " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in terms.items()))

    @app.command("splitwise-steps")
    @user_errors
    def splitwise_command(csv: Path = typer.Argument(..., help="Splitwise perf_model CSV"),
                          out: Path = typer.Option(..., "--out", help="step table to write (JSON lines)")):
        """Convert the Splitwise profiling CSV into a measured step table for `cbsim calibrate --steps`."""
        from cbsim.profiler.converters.splitwise import read_splitwise  # lazy (module docstring)

        rows, notes = read_splitwise(csv)
        _check_out(out)
        write_file_atomic(out, lambda tmp: tmp.write_text("".join(json.dumps(step_row(r)) + "\n" for r in rows)))
        for note in notes:
            typer.echo(f"note: {note}", err=True)
        typer.echo(f"{len(rows)} steps: {out}")


def _fit_names(fit: str | None, kernel_scale: bool) -> tuple[str, ...] | None:
    names = tuple(n.strip() for n in fit.split(",") if n.strip()) if fit else None
    if kernel_scale:
        from cbsim.tools.calibrate.steps import DEFAULT_FIT  # lazy (module docstring)

        names = (names or DEFAULT_FIT) + ("kernel_scale",)
    return names


def _check_out(out: Path) -> None:
    if not out.parent.is_dir():
        raise ConfigError("--out", "a file in an existing folder", str(out))


def read_step_tables(paths) -> tuple[list, list, list[str]]:
    """(steps, data provenance, notes) from step tables and Splitwise CSVs."""
    from cbsim.profiler.converters.splitwise import read_splitwise  # lazy (module docstring)

    from cbsim.tools.calibrate.steps import file_digest

    steps, data, notes = [], [], []
    for path in paths:
        rows, extra = read_splitwise(path) if path.suffix == ".csv" else (read_steps(path), [])
        steps += rows
        notes += extra
        data.append({**file_digest(path), "rows": len(rows)})
    return steps, data, notes


def _from_steps(paths, cost_model: Path | None, names, engine) -> dict:
    from cbsim.tools.calibrate.steps import DEFAULT_FIT, calibrate_steps  # lazy (module docstring)
    from cbsim.config import read_yaml

    if cost_model is None:
        raise ConfigError("--cost-model", "a YAML file with model: and cost_model: (the kernels the engine wraps)",
                          has_got=False)
    base = read_yaml(cost_model)
    if not isinstance(base.get("cost_model"), dict):
        raise ConfigError("cost_model", "a cost_model: mapping (type: roofline, vidur or fitted)", base.get("cost_model"),
                          file=str(cost_model))
    steps, data, notes = read_step_tables(paths)
    try:
        report = calibrate_steps(steps, base.get("model", DEFAULT_MODEL), base["cost_model"], names or DEFAULT_FIT,
                                 engine)
    except ConfigError as err:
        raise err.in_file(str(cost_model)) if err.file is None and err.path.startswith(("cost_model", "model")) \
            else err
    report["data"] = data
    report["notes"] = notes
    report["base_cost_model"]["file"] = str(cost_model)
    return report


def _from_serving(serving, holdout, names, engine, max_evals: int) -> dict:
    from cbsim.tools.calibrate.serving import DEFAULT_FIT, calibrate_serving, load_cases  # lazy (module docstring)

    cases = load_cases(serving, "--serving")
    held = load_cases(holdout, "--holdout")
    return calibrate_serving(cases, names or DEFAULT_FIT, engine, max_evals, held)


def _summary(report: dict) -> str:
    """The fitted terms, then the errors table."""
    from cbsim.cli.compare import format_table  # lazy, as every heavy import here (module docstring)
    from cbsim.tools.compare.compare import Row

    lines = ["fitted terms:"]
    lines += [f"  {name:<28} {report['terms'][name]:.6g}" for name in report["fitted"]]
    errors = report["errors"]
    if "in_sample" in errors:  # steps: by class and TP
        lines.append(f"{'abs. relative error':<28} " + "  ".join(f"{g:>8}" for g in errors["in_sample"]))
        for kind, table in errors.items():
            lines.append(f"  {kind + ' (median)':<26} " + "  ".join(f"{table[g]['median_abs']:>8.1%}"
                                                                   for g in errors["in_sample"] if g in table))
    else:  # serving: per case and metric
        for part, cases in errors.items():
            for case, metrics in cases.items():
                lines.append(f"{part}: {case}")  # compare's table: latencies in ms, as `cbsim compare` prints
                rows = {k: Row(v["measured"], v["simulated"], v["error"]) for k, v in metrics.items()}
                lines += ["  " + line for line in format_table(rows).splitlines()]
    return "\n".join(lines)
