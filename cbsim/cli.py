"""The `cbsim` command line (typer). User errors print one line naming the file, key and
expectation, and exit with code 2, without a traceback (cli_errors.py).

Imports: what a command needs from cbsim.config, cbsim.api and cbsim.workloads is imported inside
the command, because those load numpy and pandas (~1 s) and `cbsim --help` or `cbsim policies`
should not pay for them; everything light is imported here.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import List, Optional

import typer

from cbsim.policies import policy_help
from cbsim.profiler.costmodels.registry import engine_of
from cbsim.sim.outputs.progress import Progress

from .cli_errors import user_errors
from .errors import ConfigError
from .server import server_lines

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="cbsim: simulate LLM serving schedulers on calibrated step-latency cost models.")


SUMMARY_KEYS = ("num_requests", "num_finished", "num_rejected", "makespan", "throughput_tokens_per_s",
                "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50", "itl_p99", "e2e_p50",
                "slo_attainment", "dec_at_p_mean", "short_p_mean", "num_preemptions", "num_stalls",
                "sim_wall_seconds")
# how the printed summary shows a key: (unit, factor from summary.json's value); latencies in ms like
# vllm bench serve, every other time in s; counts bare
SUMMARY_UNITS = {"makespan": ("s", 1.0), "throughput_tokens_per_s": ("tokens/s", 1.0), "slo_attainment": ("%", 100.0),
                 "dec_at_p_mean": ("tokens", 1.0), "short_p_mean": ("s", 1.0), "sim_wall_seconds": ("s", 1.0),
                 **{f"{m}_{q}": ("ms", 1e3) for m in ("ttft", "tpot", "itl", "e2e") for q in ("p50", "p99")}}


@app.command()
@user_errors
def run(file: Path = typer.Argument(..., help="experiment YAML"),
        set_: Optional[List[str]] = typer.Option(None, "--set", help="override a key: policy.token_budget=1024"),
        out: Optional[Path] = typer.Option(None, "--out", help="results folder (default: output.dir or results/<name>)"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress lines on stderr (a run longer than "
                                   "2 s reports every 5 s)")):
    """Run one experiment and write its results folder."""
    from cbsim.workloads import drop_warnings  # lazy, as below: numpy and pandas (module docstring)

    from .api import run_experiment
    from .config import load_config
    from .preflight import check_writable

    cfg = load_config(file, set_)
    target = out or cfg.output.dir or Path("results") / cfg.name
    try:
        check_writable(target, "--out" if out else "output.dir" if cfg.output.dir else "name")
    except ConfigError as err:
        raise err.in_file(str(file)) if not out else err
    results = run_experiment(cfg, out_dir=target, progress=None if quiet else Progress())
    typer.echo(resolved_line(cfg, results.kv_blocks))
    width = max(len(k) for k in SUMMARY_KEYS)
    for key in SUMMARY_KEYS:
        typer.echo(f"{key:<{width}}  {summary_text(key, results.summary.get(key))}")
    if results.summary.get("dropped_rows"):
        typer.echo(f"{'dropped_rows':<{width}}  {results.summary['dropped_rows']}")
    for key in ("num_timed_out", "token_lengths"):  # client timeouts; how a text dataset was counted
        if key in results.summary:
            typer.echo(f"{key:<{width}}  {results.summary[key]}")
    for line in drop_warnings(results.summary.get("dropped_rows")):
        typer.secho(line, fg=typer.colors.YELLOW, err=True)
    typer.echo(f"results: {target} ({describe_files(results.files)})")


def resolved_line(cfg, kv_blocks: dict | None) -> str:
    """What the run resolved its settings to: 'resolved: roofline (gpu h100, tp 1), engine vllm-v1,
    KV 28,181 x 16 tokens per replica, 1 replica, sarathi' (P/D: each pool's block counts)."""
    cost = cfg.cost_model
    shown = [k for k in ("gpu", "tp", "profile") if cost.get(k) is not None]
    shown += [k for k in ("pp", "data_parallel") if cost.get(k, 1) != 1]  # a replica's layout beyond tp
    where = ", ".join(f"{k} {cost[k]}" for k in shown)
    engine = engine_of(cost).name
    blocks = "/".join(f"{n:,}" for n in sorted(set((kv_blocks or {}).values()))) or "?"
    if cfg.cluster.mode == "pd":
        from .config import pool_policy  # lazy: pandas (module docstring)

        pools = ", ".join(f"{pool}: {getattr(cfg.cluster, pool).replicas} x {pool_policy(cfg, pool)['name']}"
                          for pool in ("prefill", "decode"))
        layout = f"P/D ({pools})"
    else:
        layout = f"{cfg.cluster.replicas} x {cfg.policy['name']}"
    return (f"resolved: {cost['type']}{f' ({where})' if where else ''}, engine {engine}, "
            f"KV {blocks} x {cfg.cluster.kv_cache.block_size} tokens per replica, {layout}")


def summary_text(key: str, value) -> str:
    """A summary value as printed: in its unit ('69.34 ms', '44.46 s' from 10 s, '1976 tokens/s'), counts
    bare, None as is."""
    unit, factor = SUMMARY_UNITS.get(key, ("", 1.0))
    if value is None:
        return "None"
    if unit == "ms" and value >= 10.0:  # a latency of 10 s or more reads in seconds, not '4.446e+04 ms'
        unit, factor = "s", 1.0
    text = f"{value * factor:.4g}" if isinstance(value, float) or factor != 1.0 else str(value)
    return f"{text} {unit}" if unit else text


def describe_files(files: dict[str, int]) -> str:
    """'3 files, 41.2 MB: steps.parquet 37.5 MB, ...': the total and the largest files."""
    def size(n: int) -> str:
        return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.0f} kB"

    largest = sorted(files.items(), key=lambda item: -item[1])[:3]
    return f"{len(files)} files, {size(sum(files.values()))}: " + ", ".join(f"{k} {size(v)}" for k, v in largest)


@app.command()
@user_errors
def validate(file: Path = typer.Argument(..., help="experiment YAML"),
             set_: Optional[List[str]] = typer.Option(None, "--set", help="override a key")):
    """Check an experiment file, and the traces and profiles it reads, without running it."""
    from cbsim.workloads import drop_warnings  # lazy, as below: numpy and pandas (module docstring)

    from .config import load_config
    from .preflight import preflight

    cfg = load_config(file, set_)
    for line in drop_warnings(preflight(cfg)):
        typer.secho(line, fg=typer.colors.YELLOW, err=True)
    for line in server_lines(file, set_):
        typer.echo(line)
    typer.echo(f"{file}: ok ({cfg.policy['name']} on {cfg.cost_model['type']} cost model)")


@app.command()
def policies():
    """List every policy with its parameters and help text."""
    for name, summary, fields in policy_help():
        typer.secho(f"{name}", bold=True, nl=False)
        typer.echo(f"  {summary}")
        for field, kind, default, text in fields:
            typer.echo(f"    {field} ({kind}, default {default!r}): {text}")


@app.command()
def schema(readme: Optional[Path] = typer.Option(None, "--readme", help="rewrite the reference section of this README")):
    """Print the experiment-file reference (every key, type, default and help) as Markdown."""
    from .reference import embed, reference_markdown  # lazy: pandas (module docstring)

    if readme is None:
        typer.echo(reference_markdown(), nl=False)
    else:
        readme.write_text(embed(readme.read_text()))


def _register_optional_commands() -> None:
    """Commands that live beside their subsystem (profiler, workloads) register themselves."""
    for module in ("cbsim.profiler.profile_cli", "cbsim.profiler.fit_cli", "cbsim.workloads.cli",
                   "cbsim.sweep_cli", "cbsim.regress_cli", "cbsim.compare_cli", "cbsim.calibrate_cli", "cbsim.catalog_cli",
                   "cbsim.tune_cli", "cbsim.tools.sim2real.cli"):
        try:
            importlib.import_module(module).register(app)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise


_register_optional_commands()


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
