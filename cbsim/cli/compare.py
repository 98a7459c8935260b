"""`cbsim compare EXP.yaml MEASURED.json`: an experiment's simulated metrics beside a measured run's.

Registered by cbsim.cli.app through `register(app)`. Exit codes: 0 compared, 2 a user error (a bad
experiment or measured file, named with its key). The comparison itself is cbsim/tools/compare/compare.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from cbsim.cli.errors import user_errors


def register(app: typer.Typer) -> None:
    """Add the `compare` command to `app`."""
    @app.command("compare")
    @user_errors
    def compare_command(experiment: Path = typer.Argument(..., help="experiment YAML (without a workload: the "
                                                          "measured requests' lengths are replayed)"),
                        measured: Path = typer.Argument(..., help="measured results: cbsim flat JSON (seconds), "
                                                        "vllm bench serve --save-result JSON, or sglang.bench_serving "
                                                        "JSONL (last line)"),
                        out: Optional[Path] = typer.Option(None, "--out", help="results folder (default: "
                                                           "results/<name>-compare)"),
                        set_: Optional[List[str]] = typer.Option(None, "--set", help="override a key: "
                                                                 "policy.token_budget=1024"),
                        overwrite: bool = typer.Option(False, "--overwrite", help="replace a results folder that "
                                                       "holds other files"),
                        warmup: int = typer.Option(0, "--warmup", min=0, help="leave the first N requests sent out "
                                                   "of the latencies, on both sides (per-request measured data)"),
                        warmup_s: float = typer.Option(0.0, "--warmup-s", min=0.0, help="leave the requests sent in "
                                                       "the first S seconds out of the latencies, on both sides "
                                                       "(measured start_times)"),
                        band: Optional[str] = typer.Option(None, "--band", help="each latency's band from two more "
                                                           "runs at the step-time bounds: Q (a fitted model's "
                                                           "central interval, 0.9) or LOW,HIGH (kernel time "
                                                           "factors, 0.9,1.15); sets metrics.band")):
        """Run an experiment and compare its TTFT, TPOT, ITL, E2E and throughput with a measured benchmark."""
        from cbsim.band import band_overrides
        from cbsim.tools.compare.compare import compare, write
        from cbsim.tools.compare.pairing import Warmup

        from cbsim.core.atomic import check_target

        if out is not None:  # refused before simulating
            check_target(out, "--out", overwrite)
        window = Warmup(warmup, warmup_s)  # checked before simulating
        result = compare(experiment, measured, overrides=[*band_overrides(band), *(set_ or [])], warmup=window)
        target = out or Path("results") / f"{result.results.config.name}-compare"
        write(result, target, overwrite)
        typer.echo(f"measured: {result.measured.source} ({result.measured.format})")
        for note in result.notes:
            typer.echo(f"note: {note}")
        typer.echo(format_table(result.rows, result.band()))
        if result.per_request:
            typer.echo(format_pairs(result.per_request))
        typer.echo(f"results: {target}")


def format_table(rows: dict, band: dict | None = None) -> str:
    """Latencies in ms, then throughputs per second; error = (simulated - measured) / measured. With a
    band (CompareResult.band), each latency's simulated values at the band's low and high step time,
    and '*' where the measured value lies outside them."""
    from cbsim.tools.compare.measured import RATES

    if not rows:
        return "no metric is present on both sides"
    band = band or {}
    latency = {name: row for name, row in rows.items() if name not in RATES}
    rate = {name: row for name, row in rows.items() if name in RATES}
    width = max(len(name) for name in rows)
    lines = []
    for group, unit, scale in ((latency, "ms", 1e3), (rate, "/s", 1.0)):
        if not group:
            continue
        banded = any(name in band for name in group)
        lines.append(f"{'metric':<{width}}  {f'measured ({unit})':>15}  {f'simulated ({unit})':>15}  {'error %':>8}"
                     + (f"  {f'band ({unit})':>21}" if banded else ""))
        for name, row in group.items():
            line = (f"{name:<{width}}  {row.measured * scale:>15.4g}  {row.simulated * scale:>15.4g}  "
                    f"{row.error * 100:>+8.1f}")
            if name in band:
                low, high = band[name]
                outside = "" if low <= row.measured <= high else " *"
                line += f"  {f'{low * scale:.4g} .. {high * scale:.4g}':>21}{outside}"
            lines.append(line)
    lines.append("error % = (simulated - measured) / measured"
                 + ("; band: simulated at the low and high step time (metrics.band), * measured outside it"
                    if band else ""))
    return "\n".join(lines)


def format_pairs(errors: dict) -> str:
    """The per-request errors of the paired requests (cbsim/tools/compare/pairing.py), in % and ms."""
    width = max(len(f"{name}_per_request") for name in errors)
    lines = [f"{'paired requests':<{width}}  {'pairs':>6}  {'median error %':>14}  {'p90 |error| %':>13}  "
             f"{'median diff (ms)':>16}"]
    for name, e in errors.items():
        lines.append(f"{f'{name}_per_request':<{width}}  {e.pairs:>6}  {e.median * 100:>+14.1f}  "
                     f"{e.p90_abs * 100:>13.1f}  {e.median_diff * 1e3:>+16.4g}")
    lines.append("per request: error = (simulated - measured) / measured of request i, simulated and measured")
    return "\n".join(lines)
