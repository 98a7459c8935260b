"""Plots of one run, written as PNGs (matplotlib Figures on the Agg canvas, drawn once: figure.py).

Plots read the tables metrics.py builds and compute nothing beyond binning for display. Runs of
at most `max_raw_steps` steps on at most MAX_RAW_REPLICAS replicas are drawn step by step (each
step spans its [start, end), one panel per replica); larger runs are aggregated into NUM_BINS
time bins (tokens per second, mean/max step duration, max KV per bin) and the title says so.

With the run's `pools` (P/D: prefill and decode), every replica is named with its pool and a
binned timeline has one panel per pool; with its `transfers` and `handoffs`, a last panel draws
each KV hand-off from its prefill replica to its decode replica (pd_plots.py). With `kv_blocks`
(replica -> blocks of its cache), kv_usage.png draws each cache's capacity and a % axis.
Results.write (cbsim/api.py) passes all four.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib import ticker

from cbsim.sim.metrics import cdf_points, weighted_percentile
from cbsim.sim.outputs.figure import new_figure, save_png, styled, suptitle
from cbsim.sim.outputs.pd_plots import draw_transfers, replica_name
from cbsim.sim.outputs.tier_plot import plot_tiers

NUM_BINS = 500
MAX_RAW_REPLICAS = 4
MAX_LEGEND_REPLICAS = 8
PREFILL, DECODE, STALL = "tab:blue", "tab:orange", "tab:red"
MAX_RAW_STEPS = 20_000
DPI = 110
ON_TOP = 10  # zorder of markers that must stay visible above filled areas and lines


def plot_run(requests_df: pd.DataFrame, steps_df: pd.DataFrame, itl_values: np.ndarray,
             itl_weights: np.ndarray, out_dir, *, stalls: pd.DataFrame | None = None,
             cdf_max_points: int = 2000, max_raw_steps: int = MAX_RAW_STEPS, pools: dict | None = None,
             kv_blocks: dict | None = None, transfers: pd.DataFrame | None = None,
             handoffs: pd.DataFrame | None = None, kv_tiers: pd.DataFrame | None = None) -> list[Path]:
    """Write latency_cdf.png, step_timeline.png and kv_usage.png into `out_dir` (and kv_tiers.png with lower
    KV tiers); return their paths.

    `stalls` (a metrics.stall_events frame) marks stalls on the timeline when given; `pools`,
    `kv_blocks`, `transfers`, `handoffs` and `kv_tiers` (the Results fields of those names) are optional.
    """
    raw = _is_raw(steps_df, max_raw_steps)
    figures = {  # drawn and written one at a time
        "latency_cdf.png": lambda: plot_latency_cdf(requests_df, itl_values, itl_weights, cdf_max_points),
        "step_timeline.png": lambda: plot_step_timeline(steps_df, stalls, raw, pools, transfers, handoffs),
        "kv_usage.png": lambda: plot_kv_usage(steps_df, raw, kv_blocks, pools),
    }
    if kv_tiers is not None and len(kv_tiers):
        figures["kv_tiers.png"] = lambda: plot_tiers(kv_tiers, steps_df, kv_blocks)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return [save_png(draw(), out / name, DPI) for name, draw in figures.items()]


def _is_raw(steps_df, max_raw_steps) -> bool:
    return len(steps_df) <= max_raw_steps and steps_df["replica"].nunique() <= MAX_RAW_REPLICAS


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _time_axis(ax, low: float, high: float) -> None:
    """Log time axis labelled in ms/s; minor ticks (2, 5 per decade) labelled when the span is short."""
    ax.set_xscale("log")
    label = ticker.FuncFormatter(lambda v, _: _fmt_s(v))
    ax.xaxis.set_major_formatter(label)
    ax.xaxis.set_minor_locator(ticker.LogLocator(subs=(2.0, 5.0)))
    ax.xaxis.set_minor_formatter(label if high < 100 * low else ticker.NullFormatter())
    ax.tick_params(axis="x", which="minor", labelsize=7)


def _cdf_panel(ax, values, weights, label, color, max_points) -> None:
    x, y = cdf_points(values, weights, max_points)
    if not (x > 0).any():
        ax.text(0.5, 0.5, f"no {label} values", ha="center", va="center", transform=ax.transAxes)
        return
    ax.step(x[x > 0], y[x > 0], where="post", color=color, label=f"{label} CDF")
    for q, style in ((50, ":"), (90, "-."), (99, "--")):
        v = weighted_percentile(values, weights, q)
        ax.axvline(v, color="gray", linestyle=style, linewidth=1, label=f"p{q} = {_fmt_s(v)}")
    _time_axis(ax, x[x > 0][0], x[-1])
    ax.set_ylim(0, 1.02)
    ax.set_ylabel("fraction ≤ x")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)


@styled
def plot_latency_cdf(requests_df, itl_values, itl_weights, max_points=2000):
    """TTFT CDF over requests and ITL CDF over token gaps, log time axis, p50/p90/p99 marked."""
    fig = new_figure((11, 4))
    left, right = fig.subplots(1, 2)
    ttft = requests_df["ttft"].to_numpy(dtype=np.float64)
    ttft = ttft[~np.isnan(ttft)]
    _cdf_panel(left, ttft, np.ones(len(ttft)), "TTFT", PREFILL, max_points)
    left.set_title(f"Time to first token ({len(ttft)} requests)")
    left.set_xlabel("TTFT (log scale)")
    itl_values, itl_weights = np.asarray(itl_values, dtype=np.float64), np.asarray(itl_weights)
    _cdf_panel(right, itl_values, itl_weights, "ITL", DECODE, max_points)
    right.set_title(f"Inter-token latency ({int(itl_weights.sum())} gaps)")
    right.set_xlabel("ITL (log scale)")
    suptitle(fig, "Latency distributions")
    return fig


def _bars(start, end, height):
    """Outline of one bar per step over [start, end): x and y arrays for fill_between."""
    x = np.column_stack([start, start, end, end]).ravel()
    y = np.column_stack([np.zeros_like(height), height, height, np.zeros_like(height)]).ravel()
    return x, y.astype(np.float64)


def _bins(steps_df):
    """Time bin edges over the run and each step's bin (by its end)."""
    t0, t1 = steps_df["start"].min(), steps_df["end"].max()
    edges = np.linspace(t0, t1 if t1 > t0 else t0 + 1.0, NUM_BINS + 1)
    which = np.clip(np.searchsorted(edges, steps_df["end"].to_numpy(), side="right") - 1, 0, NUM_BINS - 1)
    return edges, which


def _mark_stalls(ax, stalls, replicas=None) -> None:
    """Red triangles along the bottom of the panel at the end of each stall gap (of `replicas`, or all),
    'xN' above one that ends N requests' gaps at once (a step every decode waited for).
    `ax` should be the topmost axes of the panel (the twin): its artists are drawn above the areas."""
    if stalls is None or len(stalls) == 0:
        return
    mine = stalls if replicas is None else stalls[stalls["replica"].isin(list(replicas))]
    if len(mine):
        ax.plot(mine["time"], np.full(len(mine), 0.04), "^", color=STALL, markersize=7, markeredgecolor="white",
                markeredgewidth=0.6, transform=ax.get_xaxis_transform(), clip_on=False, zorder=ON_TOP,
                label=f"stall ({int(mine['count'].sum())} gaps, longest {_fmt_s(mine['length'].max())})")
        at_once = mine.groupby("time", sort=True)["count"].sum()  # the requests one step stalled together
        for time, count in at_once[at_once > 1].items():
            ax.annotate(f"x{int(count)}", (time, 0.04), xycoords=ax.get_xaxis_transform(), textcoords="offset points",
                        xytext=(0, 6), ha="center", fontsize="x-small", color=STALL, zorder=ON_TOP,
                        annotation_clip=False, gid="stall_count")


def _tokens_panel(ax, x, prefill, decode, stalls, unit: str, title: str, replicas=None) -> None:
    """Prefill tokens filled on the left axis, decode tokens as a line on a right axis of their own
    (prefill chunks are often 10-100x the decode count, so one axis would flatten the decodes).
    Stalls are marked on the right axis, which is drawn above the prefill area and the decode line."""
    right = ax.twinx()
    ax.fill_between(x, 0, prefill, step="post", color=PREFILL, alpha=0.7, linewidth=0, label=f"prefill {unit}")
    right.step(x, decode, where="post", color=DECODE, linewidth=1.2, label=f"decode {unit} (right axis)")
    ax.set_ylim(0, max(1.0, float(np.max(prefill, initial=0))) * 1.3)  # headroom for the legend
    right.set_ylim(0, max(1.0, float(np.max(decode, initial=0))) * 1.3)
    ax.set_ylabel(f"prefill {unit}", color=PREFILL)
    right.set_ylabel(f"decode {unit}", color=DECODE)
    ax.set_title(title)
    _mark_stalls(right, stalls, replicas)
    handles = ax.get_legend_handles_labels()[0] + right.get_legend_handles_labels()[0]
    right.legend(handles, [h.get_label() for h in handles], loc="upper left", ncol=3, fontsize=8)


def _groups(steps_df, raw: bool, pools: dict | None) -> list[tuple[str, list]]:
    """(name, replicas) of each token panel: a replica each when raw, else a pool each (P/D) or all."""
    if raw:
        return [(replica_name(r, pools).capitalize(), [r]) for r in sorted(steps_df["replica"].unique())]
    if pools and len(pools) > 1:
        return [(f"{name.capitalize()} pool ({len(members)} replica{'s' * (len(members) != 1)})", list(members))
                for name, members in pools.items()]
    return [("All replicas", sorted(steps_df["replica"].unique()))]


@styled
def plot_step_timeline(steps_df: pd.DataFrame, stalls=None, raw: bool = True, pools: dict | None = None,
                       transfers: pd.DataFrame | None = None, handoffs: pd.DataFrame | None = None):
    """Prefill vs decode tokens over time (stalls marked), a panel per replica (raw) or per pool,
    the KV hand-offs of a P/D run (when `handoffs` is given), and step duration on a last panel."""
    groups = _groups(steps_df, raw, pools)
    pd_run = handoffs is not None and pools is not None and len(pools) > 1
    rows = len(groups) + 1 + pd_run
    fig = new_figure((11, 2.6 * rows))
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)
    axes, dur = axes[:, 0], axes[-1, 0]
    edges, which = (None, None) if raw or not len(steps_df) else _bins(steps_df)
    for ax, (name, members) in zip(axes, groups):
        s = steps_df[steps_df["replica"].isin(members)]
        if raw:
            start, end = s["start"].to_numpy(), s["end"].to_numpy()
            x, p = _bars(start, end, s["prefill_tokens"].to_numpy())
            _, d = _bars(start, end, s["decode_tokens"].to_numpy())
            _tokens_panel(ax, x, p, d, stalls, "tokens per step", f"{name}: tokens in each step ({len(s)} steps)",
                          members)
            dur.plot(start, s["duration"] * 1e3, ".", markersize=3, label=name.lower())
        elif len(s):
            mine = which[steps_df["replica"].isin(members).to_numpy()]
            width, x = edges[1] - edges[0], edges[:-1]
            p = np.bincount(mine, s["prefill_tokens"].to_numpy(), NUM_BINS) / width
            d = np.bincount(mine, s["decode_tokens"].to_numpy(), NUM_BINS) / width
            _tokens_panel(ax, x, p, d, stalls, "tokens/s",
                          f"{name}: tokens per second ({len(s)} steps in {NUM_BINS} time bins)", members)
    if pd_run:
        draw_transfers(axes[len(groups)], steps_df, pools, transfers, handoffs, raw)
    if raw:
        dur.set_title("Step duration (one dot per step, at its start)")
    elif len(steps_df):
        _binned_duration(dur, steps_df, edges, which)
    dur.set_ylabel("duration (ms)")
    dur.set_xlabel("simulated time (s)")
    dur.grid(True, alpha=0.3)
    if len(steps_df):
        dur.legend(loc="upper right", fontsize=8)
    return fig


def _binned_duration(ax, steps_df, edges, which) -> None:
    x = edges[:-1]
    ms = steps_df["duration"].to_numpy() * 1e3
    count = np.bincount(which, minlength=NUM_BINS)
    mean = np.bincount(which, ms, NUM_BINS) / np.maximum(count, 1)
    top = np.full(NUM_BINS, np.nan)
    np.fmax.at(top, which, ms)
    used = count > 0
    ax.plot(x[used], top[used], "-", color="tab:gray", linewidth=0.8, label="max per bin")
    ax.plot(x[used], mean[used], "-", color="tab:green", linewidth=1.2, label="mean per bin")
    ax.set_title("Step duration (per time bin)")


@styled
def plot_kv_usage(steps_df: pd.DataFrame, raw: bool = True, kv_blocks: dict | None = None, pools: dict | None = None):
    """KV blocks in use over time, one line per replica (max per time bin for large runs).

    With `kv_blocks` (replica -> blocks of its cache): a dashed capacity line and a right axis in %
    of capacity when every cache has the same size; otherwise each replica in % of its own cache."""
    fig = new_figure((11, 3.5))
    ax = fig.subplots()
    replicas = sorted(steps_df["replica"].unique())
    sizes = {int(r): kv_blocks[r] for r in replicas if kv_blocks and kv_blocks.get(r)}
    same = len(set(sizes.values())) == 1 and len(sizes) == len(replicas)
    percent = bool(sizes) and not same  # unequal caches: each in % of its own
    edges, which = (None, None) if raw else _bins(steps_df)
    for r in replicas:
        mask = (steps_df["replica"] == r).to_numpy()
        s = steps_df[mask]
        value = s["kv_blocks_used"].to_numpy(dtype=np.float64) * (100.0 / sizes[r] if percent else 1.0)
        label = replica_name(r, pools) if len(replicas) <= MAX_LEGEND_REPLICAS else None
        if raw:  # a step's value over [start, end); the line breaks where the replica idles
            start, end = s["start"].to_numpy(), s["end"].to_numpy()
            idle = np.r_[False, start[1:] > end[:-1]]
            nan = np.where(idle, np.nan, start)
            x = np.column_stack([nan, start, end]).ravel()
            y = np.column_stack([np.where(idle, np.nan, value), value, value]).ravel()
            ax.plot(x, y, linewidth=1, label=label)
        else:
            top = np.full(NUM_BINS, np.nan)
            np.fmax.at(top, which[mask], value)
            used = ~np.isnan(top)
            ax.step(edges[:-1][used], top[used], where="post", linewidth=1, label=label)
    _kv_capacity(ax, sizes, same, percent, steps_df)
    ax.set_title("KV cache blocks in use" + (" (gaps: replica idle)" if raw else f" (max per time bin, {NUM_BINS} bins)"))
    ax.set_xlabel("simulated time (s)")
    ax.grid(True, alpha=0.3)
    if len(replicas) <= MAX_LEGEND_REPLICAS and len(steps_df):
        ax.legend(loc="center right", fontsize=8)
    return fig


def _kv_capacity(ax, sizes: dict, same: bool, percent: bool, steps_df) -> None:
    """The capacity line, the y label(s) and the % axis of kv_usage."""
    if not sizes:
        ax.set_ylabel("blocks used")
        ax.set_ylim(bottom=0)
        return
    capacity = 100.0 if percent else float(next(iter(sizes.values())))
    text = "capacity (100 % of each cache)" if percent else f"capacity ({int(capacity):,} blocks per replica)"
    ax.axhline(capacity, color="black", linestyle="--", linewidth=1.2, label=text, gid="kv_capacity")
    ax.set_ylim(0, capacity * 1.08)
    if percent:
        ax.set_ylabel("% of the replica's KV blocks used")
        return
    ax.set_ylabel("blocks used")
    pct = ax.secondary_yaxis("right", functions=(lambda b: b * 100.0 / capacity, lambda q: q * capacity / 100.0))
    pct.set_ylabel("% of capacity")
    if len(steps_df):
        peak = steps_df["kv_blocks_used"].max() * 100.0 / capacity
        ax.set_title(f"peak {peak:.3g} % of capacity", loc="right", fontsize=9)
