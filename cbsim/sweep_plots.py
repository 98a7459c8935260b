"""Plots of a sweep's results table: matplotlib Figure objects built without pyplot (no global figure
state; a notebook shows a returned Figure, write_sweep_plots saves PNGs).

They read the tidy table run_sweep returns (one row per point x seed, status 'ok' rows only) and
compute nothing beyond seed aggregation: a line is the mean over seeds, its band the min-max (or
mean +- sd) over seeds, one line per combination of the other grid values (`hue`). The knob may be
one column or a list of columns whose first non-null value is the knob (for a grid whose policies
name their chunk differently: token_budget for sarathi, chunk_size for prefill_first).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

LABELS = {
    "ttft_p50": "TTFT p50 (s)", "ttft_p99": "TTFT p99 (s)", "tpot_p50": "TPOT p50 (s)", "tpot_p99": "TPOT p99 (s)",
    "itl_p50": "ITL p50 (s)", "itl_p99": "ITL p99 (s)", "e2e_p50": "E2E p50 (s)", "e2e_p99": "E2E p99 (s)",
    "queue_delay_p50": "queue delay p50 (s)", "queue_delay_p99": "queue delay p99 (s)",
    "throughput_tokens_per_s": "throughput (output tokens/s)", "throughput_requests_per_s": "throughput (requests/s)",
    "goodput_requests_per_s": "goodput (requests/s)", "slo_attainment": "SLO attainment (fraction)",
    "dec_at_p_mean": "dec@P mean (decode tokens during a long prefill)",
    "short_p_mean": "short_P mean (s until earlier short requests finish)", "num_preemptions": "preemptions",
    "num_stalls": "generation stalls", "makespan": "makespan (s)",
}


def label(metric: str) -> str:
    """Axis label with unit for a summary metric (the column name when unknown)."""
    return LABELS.get(metric, metric)


def knob_series(table: pd.DataFrame, x: str | list[str]) -> pd.Series:
    """The knob column: `x`, or the first non-null value of the columns `x` lists."""
    columns = [x] if isinstance(x, str) else list(x)
    values = table[columns[0]].astype(object)
    for column in columns[1:]:
        values = values.where(values.notna(), table[column].astype(object))
    return values.rename(" / ".join(columns))


def seed_stats(table: pd.DataFrame, x: str | list[str], metric: str, hue: list[str], band: str = "minmax") -> pd.DataFrame:
    """Per (hue..., knob): mean over seeds and the band [low, high] (min-max, or mean +- sd)."""
    ok = table[table["status"] == "ok"].copy()
    ok["_knob"] = knob_series(ok, x)
    ok[metric] = pd.to_numeric(ok[metric], errors="coerce")
    grouped = ok.groupby(hue + ["_knob"], dropna=False, sort=False)[metric]
    stats = grouped.agg(["mean", "min", "max", "std"]).reset_index()
    if band == "sd":
        sd = stats["std"].fillna(0.0)
        stats["low"], stats["high"] = stats["mean"] - sd, stats["mean"] + sd
    else:
        stats["low"], stats["high"] = stats["min"], stats["max"]
    return stats


def default_hue(table: pd.DataFrame, x: str | list[str]) -> list[str]:
    """The grid columns other than the knob whose values vary (from table.attrs['grid_keys'])."""
    xs = [x] if isinstance(x, str) else list(x)
    keys = table.attrs.get("grid_keys", [])
    return [k for k in keys if k not in xs and table[k].astype(str).nunique() > 1]


def plot_metrics(table: pd.DataFrame, x: str | list[str], metrics: list[str], *, hue: list[str] | None = None,
                 band: str = "minmax", title: str | None = None, xlabel: str | None = None):
    """One panel per metric vs the knob: a line per hue combination, shaded across seeds.
    `hue` defaults to the varying grid columns other than the knob; `xlabel` to the knob's columns."""
    hue = default_hue(table, x) if hue is None else list(hue)
    ncols = min(3, len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    fig = Figure(figsize=(5.2 * ncols, 3.8 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    knob_name = xlabel or knob_series(table.head(0), x).name
    for ax, metric in zip(axes.flat, metrics):
        stats = seed_stats(table, x, metric, hue, band)
        positions, ticks = _positions(stats["_knob"])
        for key, rows in stats.groupby(hue, dropna=False, sort=False) if hue else [((), stats)]:
            xs = positions(rows["_knob"])
            line, = ax.plot(xs, rows["mean"], marker="o", label=_hue_label(hue, key))
            ax.fill_between(xs, rows["low"], rows["high"], color=line.get_color(), alpha=0.2, linewidth=0)
        ticks(ax)
        ax.set_xlabel(knob_name)
        ax.set_ylabel(label(metric))
        ax.set_title(label(metric).split(" (")[0] + f" vs {knob_name}")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.set_visible(False)
    if hue:
        axes.flat[0].legend(fontsize="small", title=", ".join(hue), title_fontsize="small")
    band_text = "min-max" if band == "minmax" else "mean +- sd"
    fig.suptitle(f"{title or 'sweep'}: mean over seeds, band = {band_text} over seeds")
    return fig


def knee_index(x, y, min_distance: float = 0.02) -> int | None:
    """The knee of a curve: the point farthest from the chord joining its first and last points.

    Both axes are first scaled to [0, 1] by their ranges (a constant axis stays 0), so the
    distance does not depend on units; the knee is the point of largest perpendicular distance to
    the chord (the Kneedle idea). On a p99 ITL vs throughput curve it is where the curve turns:
    beyond it, each further gain in throughput costs disproportionately more tail latency. Points
    are taken in the order given (knob order). None for fewer than three points, or when no point is
    farther than `min_distance` (in scaled units) from the chord: a straight curve has no knee.
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if len(x) < 3:
        return None
    xs = (x - x.min()) / (np.ptp(x) or 1.0)
    ys = (y - y.min()) / (np.ptp(y) or 1.0)
    dx, dy = xs[-1] - xs[0], ys[-1] - ys[0]
    norm = math.hypot(dx, dy)
    if norm == 0:
        return None
    distance = np.abs(dx * (ys - ys[0]) - dy * (xs - xs[0])) / norm
    best = int(np.argmax(distance))
    return best if distance[best] > min_distance else None


def plot_latency_throughput(table: pd.DataFrame, x: str | list[str], *, hue: list[str] | None = None,
                            throughput: str = "throughput_tokens_per_s", latency: str = "itl_p99",
                            title: str | None = None, xlabel: str | None = None):
    """p99 ITL (or `latency`) against throughput, one curve per hue combination, points in knob
    order and labelled with the knob value, the knee (knee_index) of each curve circled."""
    hue = default_hue(table, x) if hue is None else list(hue)
    thr = seed_stats(table, x, throughput, hue)
    lat = seed_stats(table, x, latency, hue)
    merged = thr.merge(lat, on=hue + ["_knob"], suffixes=("_x", "_y"), sort=False)
    fig = Figure(figsize=(7, 4.8), layout="constrained")
    ax = fig.subplots()
    for key, rows in merged.groupby(hue, dropna=False, sort=False) if hue else [((), merged)]:
        line, = ax.plot(rows["mean_x"], rows["mean_y"], marker="o", label=_hue_label(hue, key))
        for _, row in rows.iterrows():
            ax.annotate(_fmt(row["_knob"]), (row["mean_x"], row["mean_y"]), textcoords="offset points",
                        xytext=(4, 4), fontsize="x-small", color=line.get_color())
        knee = knee_index(rows["mean_x"], rows["mean_y"])
        if knee is not None:
            ax.scatter(rows["mean_x"].iloc[knee], rows["mean_y"].iloc[knee], s=180, facecolors="none",
                       edgecolors=line.get_color(), linewidths=2, zorder=3)
    ax.scatter([], [], s=180, facecolors="none", edgecolors="gray", linewidths=2, label="knee")
    ax.set_xlabel(label(throughput))
    ax.set_ylabel(label(latency))
    knob_name = xlabel or knob_series(table.head(0), x).name
    ax.set_title(f"{title or 'sweep'}: {label(latency).split(' (')[0]} vs throughput (labels: {knob_name})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def write_sweep_plots(table: pd.DataFrame, out_dir: str | Path, x: str | list[str], metrics: list[str], *,
                      band: str = "minmax", title: str | None = None) -> list[Path]:
    """Write metrics_vs_knob.png and itl_vs_throughput.png into out_dir; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = {"metrics_vs_knob.png": plot_metrics(table, x, metrics, band=band, title=title),
               "itl_vs_throughput.png": plot_latency_throughput(table, x, title=title)}
    paths = []
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=110)
        paths.append(out / name)
    return paths


def _positions(knobs: pd.Series):
    """x positions for knob values: numeric (log2 axis when positive and spanning >= 8x), else
    categories in first-appearance order. Returns (map values -> positions, set ticks on an axis)."""
    values = list(dict.fromkeys(knobs.tolist()))
    numeric = all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
                  and not pd.isna(v) for v in values)
    if numeric:
        log = min(values) > 0 and max(values) >= 8 * min(values)

        def ticks(ax):
            if log:
                ax.set_xscale("log", base=2)
                ax.set_xticks(sorted(values), [_fmt(v) for v in sorted(values)])

        return (lambda s: np.asarray(s, dtype=float)), ticks
    index = {_fmt(v): i for i, v in enumerate(values)}

    def categorical_ticks(ax):
        ax.set_xticks(range(len(index)), list(index))

    return (lambda s: np.array([index[_fmt(v)] for v in s], dtype=float)), categorical_ticks


def _hue_label(hue: list[str], key) -> str:
    key = key if isinstance(key, tuple) else (key,)
    if len(hue) == 1:
        return _fmt(key[0])
    return ", ".join(f"{h}={_fmt(v)}" for h, v in zip(hue, key))


def _fmt(value) -> str:
    if value is None or (np.ndim(value) == 0 and not isinstance(value, (str, dict)) and pd.isna(value)):
        return "null"
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return str(int(value))
    return str(value)
