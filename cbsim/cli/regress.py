"""`cbsim regress`: rerun the regression suite and compare with its committed baseline.

Registered by cbsim.cli.app through `register(app)`. Exit codes: 0 pass, 1 a regression (or, in mode
`any`, any change beyond tolerance; also a missing metric or experiment), 2 a user error (a suite
without its baseline.json among them). By default only the changes are printed, with a count of the
rest (--all: every row); --format json|junit (regress_formats.py) for CI, to stdout or --report FILE.
The comparison rules are documented in cbsim/tools/regress.py, which the command imports when it runs
(it runs experiments: numpy, pandas), not when every `cbsim` invocation registers it.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import typer

from cbsim.cli.errors import user_errors
from cbsim.cli.logs import log
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
                all_rows: bool = typer.Option(False, "--all", help="print every metric, not only the changes "
                                              "and a count of the rest"),
                changes_only: bool = typer.Option(True, "--changes-only", hidden=True, help="the default now"),
                format_: str = typer.Option("text", "--format", help="text | json | junit (JUnit XML for CI)"),
                report_path: Optional[Path] = typer.Option(None, "--report", help="write the --format json|junit "
                                                           "report to this file (the text verdict stays on stdout)")):
        """Rerun the regression suite and compare its metrics with the baseline; exit 1 on a regression."""
        from cbsim.tools.regress import (BASELINE_FILE, compare, format_report, load_tolerances,  # lazy
                                         read_baseline, run_suite, write_baseline)

        from cbsim.tools.regress_formats import FORMATS, report_json, report_junit

        if update and set_:
            raise ConfigError("--set", "no overrides with --update (the baseline must match the suite's files)",
                              set_)
        if format_ not in FORMATS:
            raise ConfigError("--format", " or ".join(FORMATS), format_)
        if not update and not (suite / BASELINE_FILE).is_file():
            raise ConfigError("--suite", f"a suite with its {BASELINE_FILE} (none in {suite}: record one with "
                              "cbsim regress --update)", has_got=False)
        tolerances = load_tolerances(suite)
        baseline = read_baseline(suite)
        started = time.perf_counter()
        outcomes = run_suite(suite, only, set_)
        for name, outcome in outcomes.items():
            log.info("ran %s (%.2f s)", name, outcome.wall_seconds)
        log.info("suite: %d experiment(s) in %.1f s", len(outcomes), time.perf_counter() - started)
        if update:
            path = write_baseline(suite, outcomes)
            typer.echo(f"baseline written: {path}")
            return
        expected = list(only) if only else None
        report = compare(baseline, outcomes, tolerances, expected)
        text = format_report(report, changes_only=not all_rows)
        formatted = {"text": lambda _: text + "\n", "json": report_json, "junit": report_junit}[format_](report)
        if report_path is not None:
            report_path.write_text(formatted)
            typer.echo(text)
        else:
            typer.echo(formatted, nl=False)
        if not report.passed:
            raise typer.Exit(1)
