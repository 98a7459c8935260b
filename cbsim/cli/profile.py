"""The `cbsim profile` command; `register(app)` adds it to the main typer app.

Importing this module does not import torch: the command imports the pipeline when it runs, so
the rest of the CLI works on machines without the `profile` extra. Options map one to one onto
cbsim.profiler.run.ProfileConfig, which validates them; errors print without a traceback, exit 2.
"""
from pathlib import Path
from typing import Optional

import typer

from cbsim.core.errors import ConfigError
from cbsim.core.schema import parse


def register(app: typer.Typer) -> None:
    """Add the `profile` command to `app`."""

    @app.command("profile")
    def profile(
        out: Path = typer.Option(..., help="output folder: measurements.csv, metadata.json, overhead.csv"),
        device: str = typer.Option("cpu", help="torch device: cpu, cuda or cuda:N"),
        model: str = typer.Option("tiny", help="layer shape: llama-3-8b, llama-3-70b-tp2/tp4/tp8, tiny"),
        backend: str = typer.Option("sdpa", help="attention backend: sdpa, torch, flash_attn, flashinfer"),
        grid: str = typer.Option("tiny", help="named grid (tiny, h200-8b), or 'none' for --batches only"),
        batches: Optional[Path] = typer.Option(None, help="JSONL of held-out batch shapes to measure too"),
        max_seconds: Optional[float] = typer.Option(None, help="stop cleanly once this many seconds passed"),
        dtype: str = typer.Option("bfloat16", help="bfloat16, float16 or float32"),
        page_size: Optional[int] = typer.Option(None, help="KV page size (default 16 or the backend's multiple)"),
        replicas: Optional[int] = typer.Option(None, help="layer replicas rotated (default 1 cpu, 4 cuda)"),
        warmup: int = typer.Option(3, help="untimed calls per batch (>= 3)"),
        repeats: int = typer.Option(10, help="timed samples per batch (>= 10)"),
        graphs: bool = typer.Option(True, help="time decode batches as CUDA graphs too (GPU)"),
        check: bool = typer.Option(True, help="check the backend against sdpa first"),
        seed: int = typer.Option(0, help="seed of the run"),
        threads: Optional[int] = typer.Option(None, help="torch CPU threads (default 1 on cpu, torch's own on cuda)"),
    ) -> None:
        """Measure one decoder layer over a grid of batches and write the measurement files."""
        mapping = {
            "out": str(out), "device": device, "model": model, "backend": backend,
            "grid": None if grid == "none" else grid, "batches": str(batches) if batches else None,
            "max_seconds": max_seconds, "dtype": dtype, "page_size": page_size, "replicas": replicas,
            "warmup": warmup, "repeats": repeats, "graphs": graphs, "check": check, "seed": seed,
            "threads": threads,
        }
        try:
            from cbsim.profiler.run import ProfileConfig, run_profile
        except ModuleNotFoundError as err:
            if err.name != "torch":
                raise
            typer.echo("error: cbsim profile needs torch (install the 'profile' extra)", err=True)
            raise typer.Exit(2)
        try:
            result = run_profile(parse(ProfileConfig, mapping, "profile"))
        except ConfigError as err:
            typer.echo(f"error: {err}", err=True)
            raise typer.Exit(2)
        typer.echo(f"{result.rows} rows from {result.batches_measured}/{result.batches_planned} batches "
                   f"in {result.wall_s:.1f} s ({result.stop_reason}) -> {result.out}")
