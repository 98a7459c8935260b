"""The `cbsim` command line (typer). User errors print one line naming the file, key and
expectation, and exit with code 2, without a traceback (errors.py).

Imports: what a command needs from cbsim.config, cbsim.api and cbsim.workloads is imported inside
the command, because those load numpy and pandas (~1 s) and `cbsim --help` or `cbsim policies`
should not pay for them; everything light is imported here.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from cbsim.policies import policy_help
from cbsim.sim.costmodels.registry import engine_of

from cbsim.cli import calibrate as calibrate_commands
from cbsim.cli import catalog as catalog_commands
from cbsim.cli import compare as compare_commands
from cbsim.cli import fit as fit_commands
from cbsim.cli import profile as profile_commands
from cbsim.cli import regress as regress_commands
from cbsim.cli import scoreboard as scoreboard_commands
from cbsim.cli import sim2real as sim2real_commands
from cbsim.cli import sweep as sweep_commands
from cbsim.cli import tune as tune_commands
from cbsim.cli import workloads as workload_commands
from cbsim.cli.errors import user_errors
from cbsim.cli.logs import app_options, warn
from cbsim.cli.progress import Reporter
from cbsim.core.errors import ConfigError
from cbsim.sim.metrics.summary_units import band_text, display

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="cbsim: simulate LLM serving schedulers on calibrated step-latency cost models.")
app.callback()(app_options)  # --version, --log-level, -v, -q (logs.py)


SUMMARY_KEYS = ("num_requests", "num_finished", "num_rejected", "makespan", "throughput_tokens_per_s",
                "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "itl_p50", "itl_p99", "e2e_p50",
                "slo_attainment", "dec_at_p_mean", "short_p_mean", "num_preemptions", "num_stalls",
                "sim_wall_seconds")


# what a printed number counts, where its name does not say
HINTS = {"num_stalls": "  (inter-token gaps over {stall_factor:g}x the run's median ITL)",
         "dec_at_p_mean": "  (short requests' decode tokens during a long prompt's prefill)"}


def tier_keys(summary: dict) -> list[str]:
    """The printed keys of a run with lower KV tiers (none without): the hit rate, its split, the restore wait."""
    if "kv_tier_gpu_hit_rate" not in summary:
        return []
    split = [k for k in summary if k.startswith("kv_tier_") and k.endswith("_hit_rate")]
    return ["prefix_hit_rate", *split, "kv_tier_restore_ttft_share"]


@app.command()
@user_errors
def run(file: Optional[Path] = typer.Argument(None, help="experiment YAML; without one, the experiment the "
                                             "vllm bench flags below describe (cbsim/cli/quick_run.py)"),
        set_: Optional[List[str]] = typer.Option(None, "--set", help="override a key: policy.token_budget=1024"),
        out: Optional[Path] = typer.Option(None, "--out", help="results folder (default: output.dir or results/<name>)"),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar on stderr (as --log-level "
                                   "warning)"),
        overwrite: bool = typer.Option(False, "--overwrite", help="replace a results folder that holds other files "
                                       "(cbsim's own earlier results are replaced without it)"),
        plots: Optional[bool] = typer.Option(None, "--plots/--no-plots", help="draw the PNG figures (or not), "
                                             "whatever the file's output.plots says (default: the file's; off)"),
        seed: Optional[int] = typer.Option(None, "--seed", min=0, help="the run's seed (the file's `seed`; "
                                           "default 0)"),
        model: Optional[str] = typer.Option(None, "--model", help="no file: model preset, catalog name, HF id or "
                                            "config.json (default llama-3-8b)"),
        gpu: Optional[str] = typer.Option(None, "--gpu", help="no file: GPU of the roofline cost model (default h100)"),
        tp: Optional[int] = typer.Option(None, "--tensor-parallel-size", "--tp", help="no file: tensor-parallel "
                                         "degree (default 1)"),
        request_rate: Optional[float] = typer.Option(None, "--request-rate", help="no file: requests per second, "
                                                     "Poisson (default inf: all at once, as vllm bench serve)"),
        burstiness: Optional[float] = typer.Option(None, "--burstiness", help="no file: gamma shape of the gaps "
                                                   "(default 1: Poisson)"),
        num_prompts: Optional[int] = typer.Option(None, "--num-prompts", help="no file: requests (default 1000)"),
        input_len: Optional[int] = typer.Option(None, "--input-len", "--random-input-len", help="no file: prompt "
                                                "tokens (default 1024)"),
        output_len: Optional[int] = typer.Option(None, "--output-len", "--random-output-len", help="no file: output "
                                                 "tokens (default 128)"),
        range_ratio: Optional[float] = typer.Option(None, "--random-range-ratio", help="no file: lengths uniform in "
                                                    "len x [1 - r, 1 + r] (default 0)"),
        dataset_name: Optional[str] = typer.Option(None, "--dataset-name", help="no file: random (the only one)"),
        policy: Optional[str] = typer.Option(None, "--policy", help="no file: scheduling policy (cbsim policies; "
                                             "default sarathi)"),
        max_concurrency: Optional[int] = typer.Option(None, "--max-concurrency", help="no file: at most this many "
                                                      "requests in flight (closed loop)"),
        goodput: Optional[List[str]] = typer.Option(None, "--goodput", help="SLO as vllm bench serve: ttft:500 "
                                                    "tpot:50 (milliseconds; repeatable); sets metrics.slo"),
        band: Optional[str] = typer.Option(None, "--band", help="TTFT/E2E band from two more runs at the step-time "
                                           "bounds: Q (a fitted model's central interval, 0.9) or LOW,HIGH (kernel "
                                           "time factors, 0.9,1.15); sets metrics.band")):
    """Run one experiment (a YAML file, or vllm bench serve's flags) and write its results folder."""
    from cbsim.api import run_experiment  # lazy, as below: numpy and pandas (module docstring)
    from cbsim.config import load_config
    from cbsim.core.atomic import check_target, locked
    from cbsim.preflight import check_writable

    from cbsim.cli.quick_run import run_source

    flags = dict(model=model, gpu=gpu, tp=tp, rate=request_rate, burstiness=burstiness, num_prompts=num_prompts,
                 input_len=input_len, output_len=output_len, range_ratio=range_ratio, dataset_name=dataset_name,
                 policy=policy, max_concurrency=max_concurrency)
    from cbsim.band import band_overrides

    source, set_ = run_source(file, flags, seed, goodput, set_)
    set_ = [*band_overrides(band), *(set_ or [])]
    if plots is not None:
        set_ = [*set_, f"output.plots={str(plots).lower()}"]
    cfg = load_config(source, set_)
    target = out or cfg.output.dir or Path("results") / cfg.name
    try:
        check_writable(target, "--out" if out else "output.dir" if cfg.output.dir else "name")
    except ConfigError as err:
        raise err.in_file(str(file)) if not out and file else err
    key = "--out" if out else "output.dir" if cfg.output.dir else "name"
    check_target(target, key, overwrite)  # refused before simulating, and no other writer while it runs
    with locked(target), Reporter(quiet) as report:  # the bar ends before the summary (cli/progress.py)
        results = run_experiment(cfg, out_dir=target, progress=report.runs(f"run {cfg.name}"), overwrite=overwrite)
    print_summary(cfg, results, target)


def print_summary(cfg, results, target: Path) -> None:
    """The run's warnings (logged first: nothing follows the summary on stderr), the resolved settings,
    the summary in units and the results folder, on stdout."""
    from cbsim.sim.metrics import cut_warning
    from cbsim.workloads import drop_warnings

    from cbsim.band import band_line
    from cbsim.sim.metrics.knee import knee_note

    notes = [cut_warning(results.summary), knee_note(results.summary)]  # a max_time cut; a load near the knee
    warn([note for note in notes if note] + drop_warnings(results.summary.get("dropped_rows")))
    sys.stderr.flush()
    typer.echo(resolved_line(cfg, results.kv_blocks))
    width = max(len(k) for k in SUMMARY_KEYS)
    for key in SUMMARY_KEYS:
        if key == "slo_attainment" and results.summary.get(key) is None:
            continue  # no metrics.slo: no attainment to show
        hint = HINTS.get(key, "").format(stall_factor=cfg.metrics.stall_factor)
        shown = summary_text(key, results.summary.get(key))
        typer.echo(f"{key:<{width}}  {shown}{hint}" + (f"  {band}" if (band := band_text(results.summary, key)) else ""))
    if "band_source" in results.summary:  # the band's runs (cbsim/band.py)
        typer.echo(f"{'band':<{width}}  {band_line(results.summary)}")
    if results.summary.get("dropped_rows"):
        typer.echo(f"{'dropped_rows':<{width}}  {results.summary['dropped_rows']}")
    for key in ("num_timed_out", "token_lengths", "rejected_reasons", "cut_at_max_time"):  # beyond the table
        if key in results.summary:
            typer.echo(f"{key:<{width}}  {results.summary[key]}")
    for key in tier_keys(results.summary):  # lower KV tiers: where the prefix hits came from
        typer.echo(f"{key:<{width}}  {summary_text(key, results.summary[key])}")
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
        from cbsim.config import pool_policy  # lazy: pandas (module docstring)

        pools = ", ".join(f"{pool}: {getattr(cfg.cluster, pool).replicas} x {pool_policy(cfg, pool)['name']}"
                          for pool in ("prefill", "decode"))
        layout = f"P/D ({pools})"
    else:
        layout = f"{cfg.cluster.replicas} x {cfg.policy['name']}"
    return (f"resolved: {cost['type']}{f' ({where})' if where else ''}, engine {engine}, "
            f"KV {blocks} x {cfg.cluster.kv_cache.block_size} tokens per replica, {layout}")


def summary_text(key: str, value) -> str:
    """A summary value as printed: in its unit ('69.34 ms', '44.46 s' from 10 s, '1976 tokens/s'), counts
    bare, 'n/a' for None (sim/metrics/summary_units.py, the one rule every command prints by)."""
    return display(key, value)


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

    from cbsim.config import load_config, server_lines
    from cbsim.preflight import preflight

    cfg = load_config(file, set_)
    warn(drop_warnings(preflight(cfg)))
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
@user_errors
def schema(readme: Optional[Path] = typer.Option(None, "--readme", help="rewrite the generated sections of this Markdown page "
                                            "(docs/reference/experiment-file.md, server-flags.md)"),
           summary: bool = typer.Option(False, "--summary", help="print the summary.json reference instead: the "
                                        "unit of every key")):
    """Print the experiment-file reference (every key, type, default and help) as Markdown."""
    from cbsim.reference import embed, reference_markdown  # lazy: pandas (module docstring)
    from cbsim.sim.metrics.summary_units import schema_markdown

    if summary:
        typer.echo(schema_markdown(), nl=False)
    elif readme is None:
        typer.echo(reference_markdown(), nl=False)
    else:
        readme.write_text(embed(readme.read_text(), str(readme)))


# Every command family, imported by name: a reader (and the import graph) sees each command here.
# Each module keeps its heavy imports inside its commands, so `cbsim --help` stays fast.
for _commands in (profile_commands, fit_commands, workload_commands, sweep_commands, regress_commands,
                  compare_commands, calibrate_commands, catalog_commands, tune_commands, scoreboard_commands,
                  sim2real_commands):
    _commands.register(app)


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
