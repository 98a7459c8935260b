"""CLI commands of the fitting half: `cbsim fit`, `cbsim costcheck`, `cbsim vidur-convert`.

`register(app)` adds them to the main typer app (cbsim/cli/app.py calls it). Each command is a thin
wrapper: parse options, call the library function, print a short summary. User errors
(ConfigError) go to stderr with exit code 2, like the rest of the CLI. The fit (scipy, pandas) and
the Vidur converter are imported when their command runs, not when every `cbsim` invocation
registers the commands.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cbsim.core.errors import ConfigError


def register(app: typer.Typer) -> None:
    """Add the fit, costcheck and vidur-convert commands to `app`."""
    app.command("fit")(fit_command)
    app.command("costcheck")(costcheck_command)
    app.command("vidur-convert")(vidur_convert_command)


def _fail(err: Exception) -> None:
    typer.echo(f"error: {err}", err=True)
    raise typer.Exit(code=2)


def fit_command(
    csv: Path = typer.Argument(..., help="measurement CSV (metadata.json beside it)"),
    out: Path = typer.Option(..., "--out", help="profile JSON to write"),
    num_layers: Optional[int] = typer.Option(None, "--num-layers", help="decoder layers (default: metadata)"),
    tp: Optional[int] = typer.Option(None, "--tp", help="tensor-parallel degree of the measured shard (default: metadata, else 1)"),
    hidden: Optional[int] = typer.Option(None, "--hidden", help="hidden size, for the TP all-reduce (default: metadata)"),
    model: Optional[str] = typer.Option(None, "--model", help="model name recorded in the profile"),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU name recorded in the profile"),
    step_overhead: Optional[float] = typer.Option(None, "--step-overhead", help="seconds per step (default: metadata step_overhead_s, else 0)"),
    graph: str = typer.Option("prefer", "--graph", help="prefer: CUDA-graph rows where measured; eager: eager rows only"),
    folds: int = typer.Option(5, "--folds", help="cross-validation folds for residuals"),
    network: Optional[str] = typer.Option(None, "--network", help="all-reduce table (a100_dgx, h100_dgx, ...) or 'analytic'"),
    allreduce_bandwidth: Optional[float] = typer.Option(None, "--allreduce-bandwidth", help="bus bytes/s for the analytic all-reduce"),
    tiles: str = typer.Option("none,64,128,256", "--tiles",
                              help="GEMM tile candidates (tokens) for the step term, comma-separated; 'none' fits no "
                                   "step; chosen by cross-validation on the grid rows"),
) -> None:
    """Fit F(x) to measurements and write a `fitted` profile."""
    from cbsim.profiler.costcheck import format_table  # lazy, as below (module docstring)
    from cbsim.profiler.fit import fit_profile, load_measurements, tile_label, write_profile

    try:
        frame, meta = load_measurements(csv)
        profile = fit_profile(frame, meta, csv_path=csv, num_layers=num_layers, tp=tp, hidden=hidden, model=model,
                              gpu=gpu, step_overhead=step_overhead, graph=graph, folds=folds, network=network,
                              allreduce_bandwidth=allreduce_bandwidth, tiles=tiles.split(","))
    except ConfigError as err:  # what the fit found missing in the measurements names their file
        _fail(err.in_file(str(csv)))
    except (ValueError, FileNotFoundError) as err:
        _fail(err)
    write_profile(profile, out)
    val = profile["validation"]
    typer.echo(f"wrote {out}: {len(profile['knots'])} g(T) segments, tile {tile_label(profile['tile'])} (of "
               f"{', '.join(profile['provenance']['tile_selection']['candidates'])}), L={profile['num_layers']}, "
               f"tp={profile['tp']}")
    typer.echo(f"layer error ({val['basis']}):\n" + format_table(val["layer_error"]))
    typer.echo(f"90% interval coverage: {100 * val['interval_90_coverage']:.1f}%")


def costcheck_command(
    profile: Path = typer.Argument(..., help="profile JSON (fitted or vidur)"),
    csv: Path = typer.Argument(..., help="measurement CSV"),
    out: Optional[Path] = typer.Option(None, "--out", help="scatter plot PNG to write"),
    rows: str = typer.Option("auto", "--rows", help="heldout, grid, all, or auto (held-out if any)"),
) -> None:
    """Held-out error table of a profile against measurements, and a predicted-vs-measured scatter."""
    from cbsim.profiler.costcheck import costcheck  # lazy (module docstring)

    try:
        _, text = costcheck(profile, csv, out_png=out, rows=rows)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        _fail(err)
    typer.echo(text)
    if out is not None:
        typer.echo(f"wrote {out}")


def vidur_convert_command(
    data: Optional[Path] = typer.Option(None, "--data", help="vidur data folder or its parent (default: $CBSIM_DATA)"),
    out: Optional[Path] = typer.Option(None, "--out", help="output folder (default: the package's profiles/vidur/)"),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="convert one profile: GPU (a100, h100, a40, a30)"),
    model: Optional[str] = typer.Option(None, "--model", help="convert one profile: model (llama-2-70b, ...)"),
    tp: int = typer.Option(1, "--tp", help="convert one profile: TP degree"),
    node: Optional[str] = typer.Option(None, "--node", help="network node for the all-reduce table"),
) -> None:
    """Convert Vidur's published tables into compact JSON profiles (the shipped set, or one)."""
    from cbsim.profiler.converters import vidur_data  # lazy (module docstring)

    try:
        root = vidur_data.data_dir(data)
        target = out or vidur_data.shipped_dir()
        if gpu is None and model is None:
            written = vidur_data.convert_shipped(root, target)
        elif gpu is None or model is None:
            raise ValueError("--gpu and --model go together")
        else:
            path = target / vidur_data.profile_name(gpu, model, tp)
            vidur_data.write_json(vidur_data.convert(root, gpu, model, tp, node), path)
            written = [path]
    except (KeyError, ValueError, FileNotFoundError) as err:
        _fail(err)
    for path in written:
        typer.echo(f"wrote {path} ({path.stat().st_size // 1024} KiB)")


if __name__ == "__main__":  # python -m cbsim.cli.fit ... (before cbsim/cli/app.py registers them)
    _app = typer.Typer()
    register(_app)
    _app()
