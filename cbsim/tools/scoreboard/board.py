"""The fidelity scoreboard: rows (sources.py) grouped into cells, written as CSV, JSON and a markdown
table, and checked against the committed board.

A cell is one (source, cost model + engine, GPU, model, TP, phase); its numbers are the median and
p90 of |predicted / measured - 1| and the median signed error (the bias: + means cbsim predicts more
of the metric: a longer time, a higher throughput), over its rows. Values are rounded to 4 decimals
so the files are the same on every platform.

The check fails a cell whose median |error| grew by more than TOLERANCE (2 points) over the committed
board's, naming it. A committed cell the run did not produce is skipped and counted when its source
had no data (CBSIM_DATA absent), and fails under `strict` (CI); cells new in this run are listed.
"""
from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cbsim.core.errors import ConfigError
from cbsim.tools.scoreboard.sources import CITATIONS, SOURCES, Row

TOLERANCE = 0.02  # points of median |error| a cell may grow before the check fails
KEY = ("source", "cost_model", "gpu", "model", "tp", "phase")
STATS = ("n", "median_abs", "p90_abs", "bias")


@dataclass
class Board:
    """A scored run: its cells (key tuple -> stats) and the sources it skipped, with why."""

    cells: dict = field(default_factory=dict)
    skipped: dict = field(default_factory=dict)


def score(data: Path | None, only=None, log=None) -> Board:
    """Run every source (or those in `only`) on the data under `data` and group the rows into cells."""
    unknown = [s for s in only or () if s not in SOURCES]
    if unknown:
        raise ConfigError("--source", "one of " + ", ".join(SOURCES), unknown[0])
    board = Board()
    for name, source in SOURCES.items():
        if only and name not in only:
            continue
        rows, why = source(data)
        if why:
            board.skipped[name] = why
        board.cells.update(cells(rows))
        if log:
            log(f"{name}: {len(rows)} rows" + (f" (skipped: {why})" if why else ""))
    return board


def cells(rows: list[Row]) -> dict:
    """Key tuple -> {n, median_abs, p90_abs, bias}."""
    groups = defaultdict(list)
    for row in rows:
        groups[tuple(getattr(row, k) for k in KEY)].append(row.error)
    out = {}
    for key in sorted(groups, key=lambda k: tuple(str(v) for v in k)):
        err = np.array(groups[key])
        out[key] = {"n": len(err), "median_abs": _round(np.median(np.abs(err))),
                    "p90_abs": _round(np.quantile(np.abs(err), 0.9)), "bias": _round(np.median(err))}
    return out


def _round(value) -> float:
    return round(float(value), 4)


def to_json(board: Board) -> str:
    """The committed form: the cells as a list of flat records, plus the sources' citations."""
    records = [{**dict(zip(KEY, key)), **stats} for key, stats in board.cells.items()]
    return json.dumps({"tolerance": TOLERANCE, "citations": CITATIONS, "cells": records}, indent=1) + "\n"


def to_csv(board: Board) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([*KEY, *STATS])
    for key, stats in board.cells.items():
        writer.writerow([*key, *(stats[s] for s in STATS)])
    return buffer.getvalue()


def to_markdown(board: Board) -> str:
    """Per source: its citation, then one line per cell (errors in %)."""
    lines = ["# cbsim fidelity scoreboard", "",
             "Written by `cbsim scoreboard --write`; `cbsim scoreboard --check` fails when a cell's median |error| "
             f"grows by more than {100 * TOLERANCE:.0f} points. Error = predicted / measured - 1 of the cell's metric "
             "(bias +: cbsim predicts more: a longer time, a higher throughput).", ""]
    by_source = defaultdict(list)
    for key, stats in board.cells.items():
        by_source[key[0]].append((key, stats))
    for source, items in by_source.items():
        lines += [f"## {source}", "", f"Source: {CITATIONS[source]}", "",
                  "| cost model | GPU | model | TP | phase | n | median abs | p90 abs | bias |",
                  "|---|---|---|---:|---|---:|---:|---:|---:|"]
        for key, s in items:
            lines.append(f"| {key[1]} | {key[2]} | {key[3]} | {key[4]} | {key[5]} | {s['n']} | "
                         f"{100 * s['median_abs']:.1f} | {100 * s['p90_abs']:.1f} | {100 * s['bias']:+.1f} |")
        lines.append("")
    if board.skipped:
        lines += ["Skipped: " + "; ".join(f"{k} ({v})" for k, v in board.skipped.items()), ""]
    return "\n".join(lines)


def write(board: Board, json_path: Path) -> list[Path]:
    """scoreboard.json, .csv and .md side by side; returns the paths."""
    paths = [json_path, json_path.with_suffix(".csv"), json_path.with_suffix(".md")]
    for path, text in zip(paths, (to_json(board), to_csv(board), to_markdown(board))):
        path.write_text(text)
    return paths


def read(json_path: Path) -> dict:
    """The committed cells: key tuple -> stats; ConfigError naming the file when it is not a board."""
    try:
        data = json.loads(Path(json_path).read_text())
        return {tuple(rec[k] for k in KEY): {s: rec[s] for s in STATS} for rec in data["cells"]}
    except FileNotFoundError:
        raise ConfigError("--board", "an existing scoreboard.json (cbsim scoreboard --write)", str(json_path)) from None
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ConfigError("cells", f"a scoreboard written by cbsim scoreboard --write ({type(err).__name__})",
                          str(json_path), file=str(json_path)) from None


@dataclass
class Check:
    """What the check found: failing cells (with why), skipped and new cells."""

    failures: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    new: list = field(default_factory=list)
    improved: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


def check(board: Board, committed: dict, strict: bool = False, only=None) -> Check:
    """Compare a run with the committed cells (see the module docstring)."""
    out = Check()
    for key, old in committed.items():
        if only and key[0] not in only:
            continue
        new = board.cells.get(key)
        if new is None:
            if key[0] in board.skipped and not strict:
                out.skipped.append(key)
            else:
                out.failures.append((key, "missing from this run" + (f" ({board.skipped[key[0]]})"
                                                                     if key[0] in board.skipped else "")))
            continue
        growth = new["median_abs"] - old["median_abs"]
        if growth > TOLERANCE + 1e-9:
            out.failures.append((key, f"median |error| {100 * old['median_abs']:.1f}% -> "
                                      f"{100 * new['median_abs']:.1f}% (+{100 * growth:.1f} points)"))
        elif growth < -TOLERANCE:
            out.improved.append(key)
    out.new = [key for key in board.cells if key not in committed]
    return out


def cell_name(key) -> str:
    return " ".join(f"{k}={v}" for k, v in zip(KEY, key))
