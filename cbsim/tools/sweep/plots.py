"""Plots of a sweep's results table: matplotlib Figure objects built without pyplot (no global figure
state; a notebook shows a returned Figure, write_sweep_plots saves PNGs).

They read the tidy table run_sweep returns (one row per point x seed, status 'ok' rows only) and
compute nothing beyond seed aggregation: a line is the mean over seeds, its error bar the min-max
(or mean +- sd) over seeds, one line per combination of the other grid values (`hue`). Each hue
has its own marker and line style, drawn thinner as it goes, and a legend entry says when a line
lies on an earlier one, so no line hides another. Seed-to-seed spread can dwarf what the knob or
the policy changes (throughput at a fixed load); plot_paired_ratios divides every run by its
reference run on the same seed (same workload), where that spread cancels. The knee of the
latency-throughput curve is drawn only when the knob is a load (an arrival rate): along any other
knob the throughput barely moves and a "knee" would be noise. The knob may be one column or a
list of columns whose first non-null value is the knob (for a grid whose policies name their chunk
differently: token_budget for sarathi, chunk_size for prefill_first).
"""
from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from cbsim.core.atomic import write_file_atomic
from cbsim.sim.metrics.summary_units import is_latency

LABELS = {  # latencies in ms, as every command prints them (sim/metrics/summary_units.py)
    "ttft_p50": "TTFT p50 (ms)", "ttft_p99": "TTFT p99 (ms)", "tpot_p50": "TPOT p50 (ms)", "tpot_p99": "TPOT p99 (ms)",
    "itl_p50": "ITL p50 (ms)", "itl_p99": "ITL p99 (ms)", "e2e_p50": "E2E p50 (ms)", "e2e_p99": "E2E p99 (ms)",
    "queue_delay_p50": "queue delay p50 (ms)", "queue_delay_p99": "queue delay p99 (ms)",
    "throughput_tokens_per_s": "throughput (output tokens/s)", "throughput_requests_per_s": "throughput (requests/s)",
    "goodput_requests_per_s": "goodput (requests/s)", "slo_attainment": "SLO attainment (fraction)",
    "dec_at_p_mean": "dec@P mean (decode tokens during a long prefill)",
    "short_p_mean": "short_P mean (s until earlier short requests finish)", "num_preemptions": "preemptions",
    "num_stalls": "generation stalls", "makespan": "makespan (s)",
}
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
STYLES = ("-", "--", ":", "-.")
LOAD_KNOBS = ("arrival.rate", "request_rate", "qps", "rate")  # knob names that are a load
OVERLAP = 0.01  # lines closer than this at every point (of the value or of the axis span) overlap
RATIO_SPAN = 0.01  # the paired-ratio axes show at least 1 +- this
FLAT = 0.01  # a throughput range narrower than this (relative) is flat: no knee
LOG_RANGE = 10.0  # a panel whose positive values span this factor or more gets a log y axis
LABEL_GAP = 0.04  # knob labels closer than this (fraction of the curves' ranges) to a drawn one are left out


Band = Literal["minmax", "sd"]  # the band around a mean over seeds: min to max, or mean +- one sd

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


def seed_stats(table: pd.DataFrame, x: str | list[str], metric: str, hue: list[str], band: Band = "minmax") -> pd.DataFrame:
    """Per (hue..., knob): mean over seeds and the band [low, high] (min-max, or mean +- sd), a latency
    in ms (the unit its axis label says)."""
    ok = _hashable(table[table["status"] == "ok"].copy(), hue)
    ok["_knob"] = knob_series(ok, x)
    ok[metric] = pd.to_numeric(ok[metric], errors="coerce") * (1e3 if is_latency(metric) else 1.0)
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
    return [k for k in keys if k not in xs and table[k].map(_fmt).nunique(dropna=False) > 1]


def plot_metrics(table: pd.DataFrame, x: str | list[str], metrics: list[str], *, hue: list[str] | None = None,
                 band: Band = "minmax", title: str | None = None, xlabel: str | None = None,
                 logy: bool | None = None):
    """One panel per metric vs the knob: a line per hue combination (mean over seeds) with error bars
    across seeds. `hue` defaults to the varying grid columns other than the knob; `xlabel` to the
    knob's columns. `logy`: a log y axis; default a panel's own choice (wide_range: its positive values
    span LOG_RANGE or more, where a linear axis flattens the small end one picks a knob value from)."""
    hue = default_hue(table, x) if hue is None else list(hue)
    fig, axes = _panels(len(metrics))
    knob_name = xlabel or knob_series(table.head(0), x).name
    for ax, metric in zip(axes.flat, metrics):
        stats = seed_stats(table, x, metric, hue, band)
        positions, ticks = _positions(stats["_knob"])
        drawn = []
        bands = prediction_band(table, x, metric, hue)
        for i, (key, rows) in enumerate(_hue_groups(stats, hue)):
            xs, mean = positions(rows["_knob"]), rows["mean"].to_numpy(dtype=float)
            line, = ax.plot(xs, mean, **_style(i), label=_hue_label(hue, key))
            ax.errorbar(xs, mean, yerr=[mean - rows["low"], rows["high"] - mean], fmt="none",
                        ecolor=line.get_color(), elinewidth=1, capsize=3, alpha=0.6)
            if bands is not None:  # the step-time band of metrics.band (cbsim/band.py), shaded
                band_rows = rows[["_knob", *hue]].merge(bands, on=[*hue, "_knob"], how="left", sort=False)
                ax.fill_between(xs, band_rows["band_low"].to_numpy(dtype=float),
                                band_rows["band_high"].to_numpy(dtype=float), color=line.get_color(), alpha=0.15)
            drawn.append((line.get_label(), mean))
        scale = stats[["low", "high"]].to_numpy(dtype=float)
        if bands is not None:
            scale = np.concatenate([scale.ravel(), bands[["band_low", "band_high"]].to_numpy(dtype=float).ravel()])
        if logy if logy is not None else wide_range(scale):
            ax.set_yscale("log")
        ticks(ax)
        ax.set_xlabel(knob_name)
        ax.set_ylabel(label(metric))
        ax.set_title(label(metric).split(" (")[0] + f" vs {knob_name}")
        _note_overlaps(ax, drawn)
        ax.grid(alpha=0.3)
    _legend(fig, axes, hue)
    band_text = "min-max" if band == "minmax" else "mean +- sd"
    shaded = any(f"{metric}_low" in table for metric in metrics)
    shade = "; shaded: the prediction band at the low and high step time (metrics.band)\n" if shaded else " "
    fig.suptitle(f"{title or 'sweep'}: mean over seeds, error bars = {band_text} over seeds{shade}"
                 f"(paired_ratios.png: the same runs divided by their reference on each seed)")
    return fig


def prediction_band(table: pd.DataFrame, x: str | list[str], metric: str, hue: list[str]) -> pd.DataFrame | None:
    """Per (hue..., knob): the mean over seeds of the metric in the band's low and high runs (summary keys
    <metric>_low / _high, cbsim/band.py), in the panel's unit; None when the sweep ran without a band."""
    if f"{metric}_low" not in table or f"{metric}_high" not in table:
        return None
    ok = _hashable(table[table["status"] == "ok"].copy(), hue)
    ok["_knob"] = knob_series(ok, x)
    scale = 1e3 if is_latency(metric) else 1.0
    ok["band_low"] = pd.to_numeric(ok[f"{metric}_low"], errors="coerce") * scale
    ok["band_high"] = pd.to_numeric(ok[f"{metric}_high"], errors="coerce") * scale
    return ok.groupby(hue + ["_knob"], dropna=False, sort=False)[["band_low", "band_high"]].mean().reset_index()


def plot_paired_ratios(table: pd.DataFrame, x: str | list[str], metrics: list[str], *, hue: list[str] | None = None,
                       title: str | None = None, xlabel: str | None = None):
    """Each run's metric divided by its reference run's on the same seed: with hue, the first hue
    combination at the same knob value (ratio to that policy); without, the first knob value of the
    same line. One small dot per seed, the line through their mean, a dotted line at 1."""
    hue = default_hue(table, x) if hue is None else list(hue)
    fig, axes = _panels(len(metrics))
    knob_name = xlabel or knob_series(table.head(0), x).name
    for ax, metric in zip(axes.flat, metrics):
        ratios, reference = paired_ratios(table, x, metric, hue)
        if ratios.empty:  # the reference runs' metric is 0 (no preemption at the first budget) or missing
            ax.text(0.5, 0.5, f"no ratio: {metric} is 0 or missing\nin every reference run ({reference})",
                    ha="center", va="center", transform=ax.transAxes, color="gray")
            ax.set_title(label(metric).split(" (")[0] + f" vs {knob_name}")
            continue
        positions, ticks = _positions(ratios["_knob"])
        for i, (key, rows) in enumerate(_hue_groups(ratios, hue)):
            mean = rows.groupby("_knob", sort=False)["ratio"].mean()
            line, = ax.plot(positions(mean.index.to_series()), mean.to_numpy(), **_style(i),
                            label=_hue_label(hue, key))
            ax.plot(positions(rows["_knob"]), rows["ratio"], ".", color=line.get_color(), alpha=0.5, markersize=4)
        ax.axhline(1.0, color="gray", linestyle=":", linewidth=1)
        low, high = ax.get_ylim()  # at least +-RATIO_SPAN: a 1e-6 difference is drawn as the nothing it is
        ax.set_ylim(min(low, 1 - RATIO_SPAN), max(high, 1 + RATIO_SPAN))
        ticks(ax)
        ax.set_xlabel(knob_name)
        ax.set_ylabel(f"ratio to {reference} (same seed)")
        ax.set_title(label(metric).split(" (")[0] + f" vs {knob_name}")
        ax.ticklabel_format(axis="y", useOffset=False)
        ax.grid(alpha=0.3)
    _legend(fig, axes, hue)
    fig.suptitle(f"{title or 'sweep'}: each run divided by its reference run on the same seed "
                 f"(dots: seeds, line: their mean)")
    return fig


def paired_ratios(table: pd.DataFrame, x: str | list[str], metric: str, hue: list[str]) -> tuple[pd.DataFrame, str]:
    """(rows of hue..., _knob, seed, ratio; the reference's name): metric / the reference run's metric
    on the same seed. Reference: the first value of the first hue column (e.g. the first policy) at
    the same knob value and the same values of the other hue columns that vary within it; with no
    hue, the first knob value of the line. Runs whose reference is missing or zero are left out."""
    ok = _hashable(table[table["status"] == "ok"].copy(), hue)
    ok["_knob"] = knob_series(ok, x)
    ok["_value"] = pd.to_numeric(ok[metric], errors="coerce")
    ok["_key"] = [_fmt(v) for v in ok["_knob"]]
    for column in hue:
        ok[f"_{column}"] = [_fmt(v) for v in ok[column]]
    if hue:
        first = ok[f"_{hue[0]}"].iloc[0]
        mine = ok[ok[f"_{hue[0]}"] == first]
        match = [f"_{c}" for c in hue[1:] if mine[f"_{c}"].nunique() > 1] + ["_key", "seed"]
        reference = first if hue[0].endswith(".name") or len(hue) == 1 else f"{_short(hue[0])}={first}"
    else:
        first = ok["_key"].iloc[0]
        mine = ok[ok["_key"] == first]
        match = ["seed"]
        reference = f"{knob_series(table.head(0), x).name} = {first}"
    ref = mine.groupby(match, sort=False)["_value"].mean().rename("_reference").reset_index()
    ok = ok.merge(ref, on=match, how="left", sort=False)
    ok["ratio"] = ok["_value"] / ok["_reference"].where(ok["_reference"] != 0)
    return ok[hue + ["_knob", "seed", "ratio"]].dropna(subset=["ratio"]), reference


def _panels(count: int):
    ncols = min(3, count)
    nrows = math.ceil(count / ncols)
    fig = Figure(figsize=(5.2 * ncols, 3.8 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    for ax in list(axes.flat)[count:]:
        ax.set_visible(False)
    return fig, axes


def _hue_groups(frame: pd.DataFrame, hue: list[str]):
    return frame.groupby(hue, dropna=False, sort=False) if hue else [((), frame)]


def _style(i: int) -> dict:
    """Marker, line style and width of the i-th line: each differs, later lines thinner and hollow,
    so a line drawn over an earlier one leaves it visible."""
    return {"marker": MARKERS[i % len(MARKERS)], "linestyle": STYLES[i % len(STYLES)],
            "linewidth": max(0.8, 2.4 - 0.5 * i), "markersize": max(4.0, 8.0 - 1.5 * i),
            "markerfacecolor": "none" if i else None, "zorder": 2 + i}


def overlaps(drawn: list, span=None) -> list[tuple[str, str]]:
    """(line, earlier line it lies on) for each (label, values) of `drawn` whose values all lie within
    OVERLAP of `span` (what the axis shows; default: the span of every line's values) of an earlier
    line's: on the plot the later one is drawn over it. Values: one per point, or points x (x, y)."""
    lines = [(text, np.asarray(v, dtype=float).reshape(len(v), -1)) for text, v in drawn]  # points x (x, y)
    stacked = np.concatenate([v for _, v in lines]) if lines else np.zeros((0, 1))
    if span is None:
        span = np.nan_to_num(np.nanmax(stacked, axis=0) - np.nanmin(stacked, axis=0)) if len(stacked) else 0.0
    found = []
    for i, (text, values) in enumerate(lines):
        for other, earlier in lines[:i]:
            if len(earlier) == len(values) and len(values) and np.allclose(values, earlier, rtol=0,
                                                                           atol=OVERLAP * span):
                found.append((text, other))
                break
    return found


def _note_overlaps(ax, drawn: list) -> None:
    """Say under the panel's title which lines lie on which (their styles differ, but a reader
    should not have to guess why a line seems missing)."""
    two_d = bool(drawn) and np.ndim(drawn[0][1]) == 2
    span = np.ptp([ax.get_xlim(), ax.get_ylim()], axis=1) if two_d else np.ptp(ax.get_ylim())
    pairs = overlaps(drawn, span)
    if pairs:
        text = "; ".join(f"{a} = {b}" for a, b in pairs)
        note = textwrap.fill(f"on each other (within {OVERLAP:.0%} of the axis): {text}", 70)
        ax.set_title(f"{ax.get_title()}\n{note}", fontsize="small")


def _legend(fig, axes, hue: list[str]) -> None:
    """One legend for the figure, below the panels (the hue lines are the same in every panel)."""
    if hue:
        handles, labels = axes.flat[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside lower center", ncol=min(4, len(labels)), fontsize="small",
                   title=", ".join(_short(h) for h in hue), title_fontsize="small")


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


def is_load(x: str | list[str]) -> bool:
    """Whether the knob is a load (an arrival rate), the only knob along which a knee means something."""
    columns = [x] if isinstance(x, str) else list(x)
    return any(column.lower().endswith(LOAD_KNOBS) for column in columns)


def plot_latency_throughput(table: pd.DataFrame, x: str | list[str], *, hue: list[str] | None = None,
                            throughput: str = "throughput_tokens_per_s", latency: str = "itl_p99",
                            title: str | None = None, xlabel: str | None = None, knee: bool | None = None):
    """p99 ITL (or `latency`) against throughput, one curve per hue combination, points in knob
    order and labelled with the knob value (a label that would overprint another, closer than LABEL_GAP, is
    left out: a cluster of points reads as its first label). The knee (knee_index) of each curve is circled when
    `knee` (default: whether the knob is a load, is_load), the curve's throughput spans more than FLAT
    of its mean and the curve rises (`rising`); a flat throughput is drawn flat and said in the title."""
    hue = default_hue(table, x) if hue is None else list(hue)
    thr = seed_stats(table, x, throughput, hue)
    lat = seed_stats(table, x, latency, hue)
    merged = thr.merge(lat, on=hue + ["_knob"], suffixes=("_x", "_y"), sort=False)
    fig = Figure(figsize=(7, 4.8), layout="constrained")
    ax = fig.subplots()
    knee = is_load(x) if knee is None else knee
    circled, drawn, placed = False, [], []
    span = np.array([np.ptp(merged["mean_x"]) or 1.0, np.ptp(merged["mean_y"]) or 1.0]) if len(merged) else None
    for i, (key, rows) in enumerate(_hue_groups(merged, hue)):
        line, = ax.plot(rows["mean_x"], rows["mean_y"], **_style(i), label=_hue_label(hue, key))
        drawn.append((line.get_label(), np.column_stack([rows["mean_x"], rows["mean_y"]])))
        for _, row in rows.iterrows():
            at = np.array([row["mean_x"], row["mean_y"]], dtype=float) / span
            if any(np.hypot(*(at - other)) < LABEL_GAP for other in placed):
                continue  # a label here would overprint one already drawn: the line's order says which it is
            placed.append(at)
            ax.annotate(_fmt(row["_knob"]), (row["mean_x"], row["mean_y"]), textcoords="offset points",
                        xytext=(4, 4 + 8 * (i % 2)), fontsize="x-small", color=line.get_color(), gid="knob_label")
        curve = knee and not _flat(rows["mean_x"]) and rising(rows["mean_x"], rows["mean_y"])
        at = knee_index(rows["mean_x"], rows["mean_y"]) if curve else None
        if at is not None:
            ax.scatter(rows["mean_x"].iloc[at], rows["mean_y"].iloc[at], s=180, facecolors="none",
                       edgecolors=line.get_color(), linewidths=2, zorder=10, gid="knee")
            circled = True
    if circled:
        ax.scatter([], [], s=180, facecolors="none", edgecolors="gray", linewidths=2, label="knee")
    ax.ticklabel_format(axis="x", useOffset=False)
    ax.set_xlabel(label(throughput))
    ax.set_ylabel(label(latency))
    knob_name = xlabel or knob_series(table.head(0), x).name
    note = ""
    if _flat(merged["mean_x"]) and len(merged):  # show the flat throughput as flat: +-FLAT around its mean
        center = float(np.nanmean(merged["mean_x"]))
        ax.set_xlim(center * (1 - FLAT), center * (1 + FLAT))
        note = f"; throughput flat within {FLAT:.0%}: the load sets it, no knee"
    ax.set_title(f"{title or 'sweep'}: {label(latency).split(' (')[0]} vs throughput\n(labels: {knob_name}{note})")
    _note_overlaps(ax, drawn)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        fig.legend(loc="outside lower center", ncol=2, fontsize="small")
    return fig


def wide_range(values) -> bool:
    """Whether finite values are all positive and span a factor of LOG_RANGE or more (a log axis then)."""
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    return len(values) > 1 and values.min() > 0 and values.max() >= LOG_RANGE * values.min()


def rising(x, y) -> bool:
    """Whether a latency-throughput curve rises (more throughput, more latency from its first point to its
    last): only then has it a knee; on a falling or flat curve the 'knee' would circle a turn of noise."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    return len(x) >= 3 and x[-1] > x[0] and y[-1] > y[0]


def _flat(values) -> bool:
    values = np.asarray(values, dtype=float)
    values = values[np.isfinite(values)]
    return len(values) == 0 or np.ptp(values) <= FLAT * abs(values.mean())


def write_sweep_plots(table: pd.DataFrame, out_dir: str | Path, x: str | list[str], metrics: list[str], *,
                      band: Band = "minmax", title: str | None = None) -> list[Path]:
    """Write metrics_vs_knob.png, paired_ratios.png and itl_vs_throughput.png into out_dir; return
    their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = {"metrics_vs_knob.png": plot_metrics(table, x, metrics, band=band, title=title),
               "paired_ratios.png": plot_paired_ratios(table, x, metrics, title=title),
               "itl_vs_throughput.png": plot_latency_throughput(table, x, title=title)}
    paths = []
    for name, fig in figures.items():
        paths.append(write_file_atomic(out / name, lambda tmp, fig=fig: fig.savefig(tmp, dpi=110, format="png")))
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


def _hashable(frame: pd.DataFrame, hue: list[str]) -> pd.DataFrame:
    """Hue columns holding mappings or lists (a grid over policy.dynamic_chunk) as their text, so
    they can be grouped."""
    for column in hue:
        if frame[column].map(lambda v: isinstance(v, (dict, list))).any():
            frame[column] = frame[column].map(lambda v: v if v is None or not isinstance(v, (dict, list)) else _fmt(v))
    return frame


def _hue_label(hue: list[str], key) -> str:
    """'sarathi' for one hue column; 'sarathi, dynamic_chunk={target_chunk: 256}' for several
    (a policy's name by its value alone, other keys by their last part)."""
    key = key if isinstance(key, tuple) else (key,)
    if len(hue) == 1:
        return _fmt(key[0])
    return ", ".join(_fmt(v) if h.endswith(".name") else f"{_short(h)}={_fmt(v)}" for h, v in zip(hue, key))


def _short(column: str) -> str:
    """policy.name -> policy, policy.dynamic_chunk -> dynamic_chunk."""
    parts = column.split(".")
    return parts[-2] if parts[-1] == "name" and len(parts) > 1 else parts[-1]


def _fmt(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and value.startswith("{'"):  # a mapping stored as text (results.parquet)
        return value.replace("'", "")
    if value is None or (np.ndim(value) == 0 and not isinstance(value, (str, dict)) and pd.isna(value)):
        return "null"
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        return str(int(value))
    return str(value)
