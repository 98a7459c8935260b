"""`cbsim scoreboard`: score every cost model and engine preset on the public measurements (the tool is
cbsim/tools/scoreboard/), write the committed board, or check a run against it.

Registered by cbsim.cli.app through `register(app)`. Exit codes: 0 done (check: no cell worse), 1 a
cell's median |error| grew by more than 2 points (each named), 2 a user error. The tool runs cost
models and experiments (numpy, pandas): imported when the command runs.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

import typer

from cbsim.cli.errors import user_errors

DEFAULT_BOARD = Path("validation/scoreboard.json")


def register(app: typer.Typer) -> None:
    """Add the `scoreboard` command to `app`."""

    @app.command("scoreboard")
    @user_errors
    def scoreboard(board_path: Path = typer.Option(DEFAULT_BOARD, "--board", help="the committed board (JSON; "
                                                   ".csv and .md are written beside it)"),
                   write: bool = typer.Option(False, "--write", help="rewrite the committed board from this run "
                                              "(after a deliberate change)"),
                   check: bool = typer.Option(False, "--check", help="compare with the committed board; exit 1 "
                                              "when a cell's median |error| grew by more than 2 points"),
                   strict: bool = typer.Option(False, "--strict", help="check: a cell whose data is absent "
                                               "fails instead of being skipped (CI)"),
                   source: Optional[List[str]] = typer.Option(None, "--source", help="score only this source "
                                                              "(repeatable)")):
        """Score cbsim on the public measurements; print the board, write it (--write) or check it (--check)."""
        from cbsim.core.data import data_dir  # lazy (module docstring)
        from cbsim.tools.scoreboard import board as sb

        committed = sb.read(board_path) if check else None
        started = time.perf_counter()
        board = sb.score(data_dir(), source, log=lambda line: typer.echo(line, err=True))
        typer.echo(f"{len(board.cells)} cells in {time.perf_counter() - started:.1f} s", err=True)
        if write:
            for path in sb.write(board, board_path):
                typer.echo(f"wrote {path}")
        if committed is None:
            if not write:
                typer.echo(sb.to_markdown(board))
            return
        _report(sb.check(board, committed, strict, source), sb.cell_name)


def _report(result, cell_name) -> None:
    """Print the check's findings; exit 1 on a failure."""
    for key in result.improved:
        typer.echo(f"improved (rewrite the board with --write): {cell_name(key)}")
    if result.new:
        typer.echo(f"{len(result.new)} cells not on the committed board (add them with --write)")
    if result.skipped:
        typer.echo(f"{len(result.skipped)} cells skipped: their data is absent (set CBSIM_DATA)")
    for key, why in result.failures:
        typer.echo(f"WORSE {cell_name(key)}: {why}", err=True)
    if not result.ok:
        raise typer.Exit(1)
    typer.echo("scoreboard: no cell worse than the committed board")
