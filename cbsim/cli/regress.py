"""`cbsim regress`: rerun the regression suite and compare with its committed baseline.

Registered by cbsim.cli.app through `register(app)`. Exit codes: 0 pass, 1 a regression (or, in mode
`any`, any change beyond tolerance; also a missing metric or experiment), 2 a user error.
The comparison rules are documented in cbsim/tools/regress.py, which the command imports when it runs
(it runs experiments: numpy, pandas), not when every `cbsim` invocation registers it.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import typer

from cbsim.cli.errors import user_errors
from cbsim.core.errors import ConfigError

DEFAULT_SUITE = Path("experiments/regression")


def register(app: typer.Typer) -> None:
    """Add the `regress` command to `app`."""

    @app.command("regress")
    @user_errors
    def regress(suite: Path = typer.Option(DEFAULT_SUITE, "--suite", help="suite folder: *.yaml experiments, "
                                           "baseline.json, optional tolerances.yaml"),
                update: bool = typer.Option(False, "--update", help="rewrite the baseline from this run "
                                            "(after a deliberate change) instead of comparing"),
                only: Optional[List[str]] = typer.Option(None, "--only", help="run only this experiment "
                                                         "(file stem; repeatable)"),
                set_: Optional[List[str]] = typer.Option(None, "--set", help="override a key in every "
                                                         "experiment: policy.token_budget=256 (not with --update)"),
                changes_only: bool = typer.Option(False, "--changes-only", help="print only rows that are "
                                                  "not ok")):
        """Rerun the regression suite and compare its metrics with the baseline; exit 1 on a regression."""
        from cbsim.tools.regress import (compare, format_report, load_tolerances, read_baseline, run_suite,  # lazy
                                   write_baseline)

        if update and set_:
            raise ConfigError("--set", "no overrides with --update (the baseline must match the suite's files)",
                              set_)
        tolerances = load_tolerances(suite)
        baseline = read_baseline(suite)
        started = time.perf_counter()
        outcomes = run_suite(suite, only, set_)
        wall = time.perf_counter() - started
        for name, outcome in outcomes.items():
            typer.echo(f"ran {name} ({outcome.wall_seconds:.2f} s)")
        typer.echo(f"suite: {len(outcomes)} experiment(s) in {wall:.1f} s")
        if update:
            path = write_baseline(suite, outcomes)
            typer.echo(f"baseline written: {path}")
            return
        expected = list(only) if only else None
        report = compare(baseline, outcomes, tolerances, expected)
        typer.echo(format_report(report, changes_only))
        if not report.passed:
            raise typer.Exit(1)
