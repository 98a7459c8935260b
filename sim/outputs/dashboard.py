"""The operator dashboard: one multi-panel PNG of the time series a serving engineer watches.

Panels (time on every x axis, shared):
- requests waiting and running (P/D: also the hand-offs holding prefill KV, or on their way);
- tokens waiting (prompt tokens queued) and KV tokens held;
- scheduled prefill vs decode tokens per step, and the prompts in the batch (requests prefilling: the
  batch's requests less its decode tokens, which would otherwise draw the decode line again);
- step latency of steps with prefill vs decode-only steps (median and max per time bin);
- KV blocks used and free (evictable when the cache reports it; P/D prefill: held for hand-off);
- preemptions and recomputed tokens; prefix-cache hit tokens (only when the run reports them);
- TTFT, ITL and TPOT p50/p99 over a trailing window (TPOT at each request's completion);
- MFU and HBM-bandwidth utilisation, and the share of step time in all-reduces (the steps table's
  efficiency columns, sim/metrics/step_efficiency.py; mean per bin weighted by step duration).

Nothing here is recorded during the run: queue levels are rebuilt from each request's times
(arrival, first step, completion; P/D: prefill done, landing, first decode step) as level
series, per-step values are binned into NUM_BINS time bins, and optional columns (evictable
blocks, prefix hits) are looked up by name so that the dashboard works with or without them.
`write_dashboards` writes dashboard.png for the whole run and, for P/D, one per pool.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from cbsim.sim.metrics import level_series, weighted_percentile
from cbsim.sim.outputs.figure import grid, new_figure, save_png, styled

NUM_BINS = 200
DPI = 100
# the fixed layout (inches): room for six-character tick labels and an axis label on each side of a
# panel (twin axes on the right), a title over each row and the figure's title on top
LAYOUT = dict(left=0.8, right=0.6, top=0.75, bottom=0.6, wgap=1.3, hgap=0.5)
WINDOW_BINS = 10  # the sliding percentile window spans this many bins
COLORS = {"waiting": "tab:red", "running": "tab:green", "moving": "tab:purple", "prefill": "tab:blue",
          "decode": "tab:orange", "p50": "tab:blue", "p99": "tab:red", "free": "tab:gray"}


@dataclass
class PoolView:
    """What one dashboard shows: the steps of some replicas and the request intervals that matter there."""

    title: str
    steps: pd.DataFrame
    levels: dict  # label -> (enter times, leave times, weights or None): request counts over time
    waiting_tokens: tuple  # (enter, leave, prompt tokens) of the waiting requests
    ttft: tuple  # (times, values) of the requests' first tokens
    itl: tuple  # (times, values, weights) of the token gaps on these replicas
    kv_capacity: int  # KV blocks over the pool's replicas
    unit_tokens: float  # tokens one KV block (kv_blocks_used's unit) holds: fewer for sliding-window units
    preemptions: pd.DataFrame
    extra_kv: tuple | None = None  # (label, enter, leave, blocks): KV held outside waiting/running
    prefix_hits: tuple | None = None  # (times, tokens)
    itl_title: str = "ITL"  # the prefill pool of a P/D run shows its hand-off times there instead
    tpot: tuple = (np.zeros(0), np.zeros(0))  # (completion times, TPOT) of the requests decoded here
    block_size: int = 16  # tokens of an all-layer block (cluster.kv_cache.block_size)


def write_dashboards(results, out_dir) -> list[Path]:
    """dashboard.png for the whole run, plus dashboard_<pool>.png per pool of a P/D run."""
    out = Path(out_dir)
    views = [("dashboard.png", whole_view(results))]
    if results.handoffs is not None:
        views += [(f"dashboard_{pool}.png", pool_view(results, pool)) for pool in ("prefill", "decode")]
    return [save_png(plot_dashboard(view), out / name, DPI) for name, view in views]


# ---------------------------------------------------------------- views


def _itl_on(results, replicas) -> tuple:
    itl = results.itl
    mine = np.isin(itl.replica, list(replicas))
    return itl.times[mine], itl.values[mine], itl.weights[mine]


def _first_token(req: pd.DataFrame) -> tuple:
    done = req["ttft"].notna()
    return req.loc[done, "first_token_time"].to_numpy(), req.loc[done, "ttft"].to_numpy()


def _tpot(req: pd.DataFrame) -> tuple:
    done = req["tpot"].notna() & req["completion_time"].notna()
    return req.loc[done, "completion_time"].to_numpy(), req.loc[done, "tpot"].to_numpy()


def _prefix_hits(steps: pd.DataFrame, req: pd.DataFrame) -> tuple | None:
    """Prefix-cache hit tokens, if the run reports them (a step column, else a request column)."""
    for name in steps.columns:
        if "hit" in name and "token" in name:
            return steps["start"].to_numpy(), steps[name].to_numpy(dtype=np.float64)
    for name in req.columns:
        if ("hit" in name or "cached" in name) and "token" in name:
            ok = req["first_scheduled"].notna()
            return req.loc[ok, "first_scheduled"].to_numpy(), req.loc[ok, name].to_numpy(dtype=np.float64)
    return None


def _replicas(count: int) -> str:
    return "1 replica" if count == 1 else f"{count} replicas"


def _unit_tokens(results) -> float:
    """Tokens a KV block of the step table holds (a sliding window's units hold fewer: sim/kv/cache.py)."""
    return results.kv_unit_tokens or results.config.cluster.kv_cache.block_size


def _capacity(results, replicas) -> int:
    return int(sum(results.kv_blocks.get(i, 0) for i in replicas)) if results.kv_blocks else 0


def whole_view(results) -> PoolView:
    """Every replica; a request waits from arrival to its first step and runs until it completes."""
    req = results.requests[results.requests["status"] != "rejected"]
    end = req["completion_time"]
    replicas = sorted(results.steps["replica"].unique())
    return PoolView(
        f"{results.config.name}: {_replicas(len(replicas))}", results.steps,
        {"waiting": (req["arrival"], req["first_scheduled"], None),
         "running": (req["first_scheduled"], end, None)},
        (req["arrival"], req["first_scheduled"], req["prompt_len"]), _first_token(req),
        _itl_on(results, replicas), _capacity(results, replicas), _unit_tokens(results),
        results.preemptions, None, _prefix_hits(results.steps, req), tpot=_tpot(req),
        block_size=results.config.cluster.kv_cache.block_size)


def pool_view(results, pool: str) -> PoolView:
    """One pool of a P/D run. Prefill: waits from arrival to its first step, runs until its prompt
    is done, then holds KV until it leaves. Decode: reserved until landed, waits until its first
    step there, runs until it completes."""
    replicas = results.pools[pool]
    steps = results.steps[results.steps["replica"].isin(replicas)]
    req = results.requests[results.requests["status"] != "rejected"]
    moved = req["prefilled"].notna()
    if pool == "prefill":
        done = req["prefilled"].where(moved, req["completion_time"])
        levels = {"waiting": (req["arrival"], req["first_scheduled"], None),
                  "running": (req["first_scheduled"], done, None),
                  "holding KV for hand-off": (req["prefilled"], req["released_src"], None)}
        waiting = (req["arrival"], req["first_scheduled"], req["prompt_len"])
        h = results.handoffs
        extra = ("held for hand-off", h["prefilled"], h["released_src"], h["prefill_blocks"])
        ttft = _first_token(req)
        left = h["released_src"].notna()  # the prefill pool produces no token gaps: show hand-off times
        itl = (h.loc[left, "released_src"].to_numpy(), h.loc[left, "prefill_kv_held"].to_numpy(), None)
        itl_title = "Hand-off: prompt done until its KV left"
    else:
        req = req[moved]
        levels = {"waiting": (req["landed"], req["decode_admitted"], None),
                  "running": (req["decode_admitted"], req["completion_time"], None),
                  "on the way (room reserved)": (req["reserved"], req["landed"], None)}
        waiting = (req["landed"], req["decode_admitted"], req["prompt_len"])
        extra = None
        ttft = _first_token(req)
        itl, itl_title = _itl_on(results, replicas), "ITL"
    preemptions = results.preemptions[results.preemptions["replica"].isin(replicas)]
    tpot = _tpot(req) if pool == "decode" else (np.zeros(0), np.zeros(0))  # no token gaps on the prefill pool
    return PoolView(f"{results.config.name}: {pool} pool ({_replicas(len(replicas))})", steps, levels, waiting, ttft,
                    itl, _capacity(results, replicas), _unit_tokens(results), preemptions,
                    extra, _prefix_hits(steps, req), itl_title, tpot, results.config.cluster.kv_cache.block_size)


# ---------------------------------------------------------------- binning helpers


def _edges(view: PoolView) -> np.ndarray:
    times = [view.steps["start"].to_numpy(), view.steps["end"].to_numpy()]
    times += [np.asarray(t, dtype=np.float64) for t, _, _ in view.levels.values()]
    times = np.concatenate(times)
    times = times[np.isfinite(times)]
    t0, t1 = (times.min(), times.max()) if len(times) else (0.0, 1.0)
    return np.linspace(t0, t1 if t1 > t0 else t0 + 1.0, NUM_BINS + 1)


def _level_mean(edges, enter, leave, weights=None) -> np.ndarray:
    """The time average of a level series over each bin (exact: the level is constant between events)."""
    times, level = level_series(enter, leave, weights, end=edges[-1])
    if len(times) == 0:
        return np.zeros(NUM_BINS)
    area = np.concatenate([[0.0], np.cumsum(level[:-1] * np.diff(times))])  # integral up to each event
    return np.diff(np.interp(edges, times, area, left=0.0)) / np.diff(edges)


def _bin(edges, times) -> np.ndarray:
    return np.clip(np.searchsorted(edges, times, side="right") - 1, 0, NUM_BINS - 1)


def _per_bin(edges, times, values, how: str) -> np.ndarray:
    """mean / max / p50 of `values` by the bin of `times`; NaN where a bin is empty."""
    which = _bin(edges, np.asarray(times, dtype=np.float64))
    values = np.asarray(values, dtype=np.float64)
    out = np.full(NUM_BINS, np.nan)
    count = np.bincount(which, minlength=NUM_BINS)
    if how == "mean":
        return np.where(count > 0, np.bincount(which, values, NUM_BINS) / np.maximum(count, 1), np.nan)
    if how == "max":
        np.fmax.at(out, which, values)
        return out
    order = np.lexsort((values, which))
    bounds = np.searchsorted(which[order], np.arange(NUM_BINS + 1))
    for b in np.flatnonzero(count):
        chunk = values[order][bounds[b]:bounds[b + 1]]
        out[b] = chunk[(len(chunk) - 1) // 2]
    return out


def _sliding(edges, times, values, weights=None) -> tuple[np.ndarray, np.ndarray]:
    """p50 and p99 over a trailing window of WINDOW_BINS bins, at each bin's end."""
    times = np.asarray(times, dtype=np.float64)
    order = np.argsort(times, kind="stable")
    times, values = times[order], np.asarray(values, dtype=np.float64)[order]
    weights = np.ones(len(values)) if weights is None else np.asarray(weights)[order]
    width = WINDOW_BINS * (edges[1] - edges[0])
    hi = np.searchsorted(times, edges[1:], side="right")
    lo = np.searchsorted(times, edges[1:] - width, side="right")
    p50, p99 = np.full(NUM_BINS, np.nan), np.full(NUM_BINS, np.nan)
    for b in np.flatnonzero(hi > lo):
        p50[b], p99[b] = weighted_percentile(values[lo[b]:hi[b]], weights[lo[b]:hi[b]], [50, 99])
    return p50, p99


# ---------------------------------------------------------------- panels


def _requests_panel(ax, view, edges, x):
    colors = iter([COLORS["waiting"], COLORS["running"], COLORS["moving"]])
    for label, (enter, leave, weights) in view.levels.items():
        ax.step(x, _level_mean(edges, enter, leave, weights), where="post", color=next(colors), label=label)
    ax.set_title("Requests waiting / running (time average per bin)")
    ax.set_ylabel("requests")


def _tokens_panel(ax, view, edges, x):
    enter, leave, tokens = view.waiting_tokens
    ax.step(x, _level_mean(edges, enter, leave, tokens), where="post", color=COLORS["waiting"],
            label="waiting prompt tokens")
    if len(view.steps):
        ax.step(x, _per_bin_total(edges, view.steps, "kv_blocks_used") * view.unit_tokens, where="post",
                color=COLORS["running"], label="KV tokens held (blocks used x tokens a block)")
    ax.set_title("Tokens waiting / held")
    ax.set_ylabel("tokens")


def _per_bin_total(edges, steps, column) -> np.ndarray:
    """Sum over replicas of each replica's max of `column` in the bin (carried forward when idle)."""
    total = np.zeros(NUM_BINS)
    for _, s in steps.groupby("replica"):
        top = _per_bin(edges, s["start"], s[column], "max")
        total += pd.Series(top).ffill().fillna(0.0).to_numpy()
    return total


def _scheduled_panel(ax, view, edges, x):
    s = view.steps
    right = ax.twinx()
    ax.fill_between(x, 0, np.nan_to_num(_per_bin(edges, s["start"], s["prefill_tokens"], "mean")), step="post",
                    color=COLORS["prefill"], alpha=0.6, linewidth=0, label="prefill tokens / step")
    right.step(x, _per_bin(edges, s["start"], s["decode_tokens"], "mean"), where="post", color=COLORS["decode"],
               label="decode tokens / step (right)")
    prompts = (s["num_seqs"] - s["decode_tokens"]).clip(lower=0)  # a decoding request adds one token
    right.step(x, _per_bin(edges, s["start"], prompts, "mean"), where="post", color=COLORS["running"],
               linewidth=0.8, linestyle="--", label="prompts / step: requests prefilling (right)")
    ax.set_ylim(0, max(1.0, float(np.nanmax(np.r_[s["prefill_tokens"].to_numpy(dtype=float), 0]))) * 1.05)
    ax.set_title("Batch: scheduled tokens and prompts per step (mean per bin)")
    ax.set_ylabel("prefill tokens", color=COLORS["prefill"])
    right.set_ylabel("decode tokens / prompts", color=COLORS["decode"])
    right.set_ylim(0, max(1.0, float(np.nanmax(np.r_[s["num_seqs"].to_numpy(dtype=float), 0]))) * 1.05)
    return right


def _latency_panel(ax, view, edges, x):
    """Steps that run any prefill vs decode-only steps: median (solid) and max (thin) per bin."""
    s = view.steps
    prefill = s["prefill_tokens"].to_numpy() > 0
    counts = []
    for label, mine, color in (("with prefill", prefill, COLORS["prefill"]),
                               ("decode only", ~prefill, COLORS["decode"])):
        part = s[mine]
        counts.append(f"{int(mine.sum()):,} {label}")
        if not len(part):
            continue
        ms = part["duration"] * 1e3
        ax.step(x, _per_bin(edges, part["start"], ms, "p50"), where="post", color=color, label=f"{label}: median")
        ax.step(x, _per_bin(edges, part["start"], ms, "max"), where="post", color=color, linewidth=0.6,
                alpha=0.6, label=f"{label}: max")
    ax.set_title(f"Step latency, prefill vs decode-only steps ({'; '.join(counts)})")
    ax.set_ylabel("ms")


def _kv_panel(ax, view, edges, x):
    """Used, free (and evictable, held for hand-off) in % of the pool's blocks (blocks if unknown)."""
    capacity = view.kv_capacity
    scale = 100.0 / capacity if capacity else 1.0
    used = _per_bin_total(edges, view.steps, "kv_blocks_used")
    ax.step(x, used * scale, where="post", color=COLORS["running"], label="used (max per bin)")
    if capacity:
        ax.step(x, (capacity - used) * scale, where="post", color=COLORS["free"], label="free")
    evictable = [c for c in view.steps.columns if "evictable" in c]
    if evictable:
        ax.step(x, _per_bin_total(edges, view.steps, evictable[0]) * scale, where="post", color=COLORS["moving"],
                label="evictable")
    if view.extra_kv is not None:
        label, enter, leave, blocks = view.extra_kv
        ax.step(x, _level_mean(edges, enter, leave, blocks) * scale, where="post", color=COLORS["decode"],
                label=f"{label} (time average)")
    peak = f"; peak used {np.nanmax(np.r_[used, 0]) * scale:.3g}%" if capacity else ""
    unit = "" if view.unit_tokens == view.block_size else f" of {view.unit_tokens:g} tokens: sliding-window units"
    ax.set_title(f"KV cache ({capacity:,} blocks{unit}{peak})" if capacity else "KV cache blocks")
    ax.set_ylabel("% of blocks" if capacity else "blocks")
    if capacity:
        ax.set_ylim(0, 105)


def _preemption_panel(ax, view, edges, x):
    p = view.preemptions  # the log: it also holds evictions that ran no step (P/D decode side)
    counts = np.bincount(_bin(edges, p["time"]), minlength=NUM_BINS) if len(p) else np.zeros(NUM_BINS)
    # one stepped area, not a bar per bin: the same picture with one artist instead of NUM_BINS
    ax.fill_between(edges, 0, np.r_[counts, counts[-1]], step="post", color=COLORS["p99"], alpha=0.6, linewidth=0,
                    label="preemptions")
    right = ax.twinx()
    recomputed = np.bincount(_bin(edges, p["time"]), p["recomputed_tokens"], NUM_BINS) if len(p) else np.zeros(NUM_BINS)
    right.step(x, recomputed, where="post", color=COLORS["prefill"], label="recomputed tokens (right)")
    right.set_ylim(0, max(1.0, float(recomputed.max())) * 1.05)
    swaps = p[p["mode"] == "swap"] if len(p) else p
    ax.set_title(f"Preemptions ({len(p)}; {len(swaps)} swapped out, {swaps['swapped_bytes'].sum() / 1e9:.3g} GB) "
                 f"and recomputed tokens ({int(p['recomputed_tokens'].sum()) if len(p) else 0})")
    ax.set_ylabel("preemptions per bin")
    return right


def _prefix_panel(ax, view, edges, x):
    times, tokens = view.prefix_hits
    ax.step(x, np.bincount(_bin(edges, times), tokens, NUM_BINS), where="post", color=COLORS["running"],
            label="prefix hit tokens per bin")
    ax.set_title("Prefix-cache hits")
    ax.set_ylabel("tokens")


def _weighted_per_bin(edges, steps, column) -> np.ndarray:
    """Duration-weighted mean of a step column per bin (NaN where no step with a value starts)."""
    values = steps[column].to_numpy(dtype=np.float64)
    weights = steps["duration"].to_numpy(dtype=np.float64)
    ok = np.isfinite(values) & np.isfinite(weights)
    which = _bin(edges, steps["start"].to_numpy(dtype=np.float64)[ok])
    total = np.bincount(which, weights[ok], NUM_BINS)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, np.bincount(which, values[ok] * weights[ok], NUM_BINS) / total, np.nan)


def _efficiency_panel(ax, view, edges, x):
    """MFU and HBM-bandwidth utilisation (and all-reduce share when priced), in % per bin."""
    s = view.steps
    if "mfu" not in s or not np.isfinite(s["mfu"].to_numpy(dtype=np.float64)).any():
        ax.text(0.5, 0.5, "no GPU known for these steps", ha="center", va="center", transform=ax.transAxes)
        ax.set_title("Step efficiency")
        return
    shares = {"MFU": s["mfu"], "HBM": s["hbm_util"]}
    if np.nan_to_num(s["collective_s"].to_numpy(dtype=np.float64)).any():
        shares["all-reduce (% of step time)"] = s["collective_s"] / s["duration"]
    frame = s[["start", "duration"]].assign(**{k: v.to_numpy() for k, v in shares.items()})
    colors = iter([COLORS["prefill"], COLORS["decode"], COLORS["moving"]])
    means = []
    for label in shares:
        ax.step(x, _weighted_per_bin(edges, frame, label) * 100, where="post", color=next(colors), label=label)
        ok = np.isfinite(frame[label]) & (frame["duration"] > 0)
        mean = np.average(frame.loc[ok, label], weights=frame.loc[ok, "duration"]) if ok.any() else np.nan
        means.append(f"{label.split(' (')[0]} {mean * 100:.3g}%")
    ax.set_title("Step efficiency (busy-time mean: " + ", ".join(means) + ")")
    ax.set_ylabel("% of peak" if len(shares) == 2 else "% of peak / of time")
    ax.set_ylim(0, 105)


def time_unit(seconds) -> tuple[float, str]:
    """(scale, unit) to show latencies given in seconds: ms below 1 s, else s."""
    finite = np.asarray(seconds, dtype=np.float64)
    finite = finite[np.isfinite(finite)]
    return (1.0, "s") if len(finite) and finite.max() >= 1.0 else (1e3, "ms")


def _percentile_panel(ax, edges, x, series, title):
    """p50 and p99 over a trailing window; `series` values are in seconds, shown in ms or s."""
    times, values, *weights = series
    unit = "ms"
    if len(times) == 0:
        ax.text(0.5, 0.5, "none on these replicas", ha="center", va="center", transform=ax.transAxes)
    else:
        p50, p99 = _sliding(edges, times, values, weights[0] if weights else None)
        scale, unit = time_unit(p99)
        ax.step(x, p50 * scale, where="post", color=COLORS["p50"], label="p50")
        ax.step(x, p99 * scale, where="post", color=COLORS["p99"], label="p99")
    ax.set_title(f"{title} (trailing window of {WINDOW_BINS * (edges[1] - edges[0]):.3g} s)")
    ax.set_ylabel(unit)


@styled
def plot_dashboard(view: PoolView):
    """The dashboard figure of one view (the caller writes it: figure.save_png)."""
    edges = _edges(view)
    x = edges[:-1]
    panels = [lambda ax: _requests_panel(ax, view, edges, x), lambda ax: _tokens_panel(ax, view, edges, x),
              lambda ax: _scheduled_panel(ax, view, edges, x), lambda ax: _latency_panel(ax, view, edges, x),
              lambda ax: _kv_panel(ax, view, edges, x), lambda ax: _preemption_panel(ax, view, edges, x),
              lambda ax: _percentile_panel(ax, edges, x, view.ttft, "TTFT"),
              lambda ax: _percentile_panel(ax, edges, x, view.itl, view.itl_title),
              lambda ax: _percentile_panel(ax, edges, x, view.tpot, "TPOT at completion"),
              lambda ax: _efficiency_panel(ax, view, edges, x)]
    if view.prefix_hits is not None:
        panels.insert(6, lambda ax: _prefix_panel(ax, view, edges, x))
    rows = (len(panels) + 1) // 2
    fig = new_figure((15, 3.1 * rows), bleed=0.0)
    axes = grid(fig, rows, 2, sharex=True, squeeze=False, **LAYOUT)
    for ax, draw in zip(axes.ravel(), panels):
        right = draw(ax)
        handles = ax.get_legend_handles_labels()[0] + (right.get_legend_handles_labels()[0] if right else [])
        if handles:
            ax.legend(handles, [h.get_label() for h in handles], loc="best", fontsize=8, framealpha=0.8)
        if ax.get_ylim()[0] != 0:
            ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    for ax in axes.ravel()[len(panels):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("simulated time (s)")
    fig.suptitle(f"{view.title}: {len(view.steps)} steps in {NUM_BINS} time bins of {edges[1] - edges[0]:.3g} s",
                 fontsize=12, y=1 - 0.25 / fig.get_size_inches()[1])
    return fig
