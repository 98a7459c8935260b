"""`cbsim workload describe FILE`: build an experiment's workload, print its statistics, optionally plot it.

Registered by cbsim.cli.app through `register(app)`, which adds the `workload` command group; `describe`
builds exactly the requests `cbsim run` would (same seed, same base folder for trace paths) without
running the simulation.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import typer

from cbsim.cli.errors import user_errors
from cbsim.cli.logs import warn


def register(app: typer.Typer) -> None:
    group = typer.Typer(no_args_is_help=True, help="Inspect the requests an experiment's workload generates.")
    app.add_typer(group, name="workload")

    @group.command("describe")
    @user_errors
    def describe(file: Path = typer.Argument(..., help="experiment YAML (its `workload:` section is used)"),
                 plot: Optional[Path] = typer.Option(None, "--plot", help="also write a PNG of the workload here"),
                 seed: Optional[int] = typer.Option(None, "--seed", help="random seed (default: the experiment's)")):
        """Describe the requests an experiment's workload generates."""
        from cbsim.config import read_yaml
        from cbsim.core.errors import ConfigError

        from cbsim.workloads.build import build_run
        from cbsim.workloads.config import parse_workload
        from cbsim.workloads.describe import describe_requests, format_description, plot_workload
        from cbsim.workloads.trace_source import drop_warnings

        data = read_yaml(file)
        try:
            cfg = parse_workload(data.get("workload"), "workload")
            value = seed if seed is not None else data.get("seed", 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError("--seed" if seed is not None else "seed", "an integer >= 0", value)
            rng = np.random.default_rng(value)
            run = build_run(cfg, rng, base_dir=file.parent)
            requests, dropped = run.requests, run.dropped
        except ConfigError as err:
            raise err.in_file(str(file))
        typer.echo(format_description(describe_requests(requests)))
        if dropped is not None:
            text = ", ".join(f"{reason}: {n}" for reason, n in dropped.items()) or "none"
            typer.echo(f"trace rows dropped: {text}")
        warn(drop_warnings(dropped))
        if "token_lengths" in run.notes:
            typer.echo(f"token lengths: {run.notes['token_lengths']}")
        for line in client_lines(cfg):
            typer.echo(line)
        if plot is not None:
            typer.echo(f"plot: {plot_workload(requests, plot, title=f'{file.name}: workload')}")


def client_lines(cfg) -> list[str]:
    """What describe says about the clients: a closed loop's arrivals are planned times only."""
    lines = []
    if cfg.closed_loop:
        lines.append(f"closed loop: at most {cfg.max_concurrency} requests in flight, think time {cfg.think_time:g} s; "
                     "arrivals above are planned times, the run decides the real ones")
    if cfg.agentic is not None:
        lines.append(f"agentic: {cfg.agentic.sessions} sessions; every turn's arrival above is its session's start, "
                     "the run sends each turn after its previous reply and tool calls or sub-agents")
    if cfg.timeout is not None:
        lines.append(f"client timeout: {cfg.timeout:g} s (an unfinished request is aborted and counts as failed)")
    return lines
