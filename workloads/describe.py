"""Describe a list of requests: summary statistics and one readable PNG of their shape.

Pure functions of the requests: nothing here draws random numbers or changes a request. The plot
is drawn on a matplotlib Figure with the Agg canvas directly, so it never touches pyplot's global
state or the process-wide backend.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from cbsim.sim.request import Request

PERCENTILES = (50, 90, 99)


def describe_requests(requests: list[Request]) -> dict:
    """Count, duration (s), rate (req/s), arrival CV, and mean/p50/p90/p99/max of prompt and output lengths.

    `arrival_cv` is the coefficient of variation of inter-arrival gaps (1 for Poisson). With prefix
    hashes, `prefix_hit_ratio` is the share of hashed blocks already seen in an earlier request:
    the hit ratio of an unbounded prefix cache replaying the requests in arrival order.
    """
    arrival = np.array([r.arrival for r in requests], dtype=np.float64)
    stats: dict = {"count": len(requests)}
    duration = float(arrival.max() - arrival.min()) if len(arrival) else 0.0
    stats["duration"] = duration
    stats["rate"] = len(arrival) / duration if duration > 0 else float("nan")
    gaps = np.diff(np.sort(arrival))
    stats["arrival_cv"] = float(gaps.std() / gaps.mean()) if len(gaps) and gaps.mean() > 0 else float("nan")
    for name in ("prompt_len", "output_len"):
        stats[name] = _summary(np.array([getattr(r, name) for r in requests], dtype=np.float64))
    if any(r.prefix_hashes for r in requests):
        stats["prefix_hit_ratio"] = _prefix_hit_ratio(requests)
    return stats


def format_description(stats: dict) -> str:
    """A few human-readable lines of `describe_requests` output."""
    lines = [f"{stats['count']} requests over {stats['duration']:.1f} s: {stats['rate']:.3f} req/s, "
             f"inter-arrival CV {stats['arrival_cv']:.2f}"]
    for name in ("prompt_len", "output_len"):
        s = stats[name]
        lines.append(f"{name:<10}  mean {s['mean']:.1f}  " + "  ".join(
            f"{key} {_number(s[key])}" for key in ("p50", "p90", "p99", "max")))
    if "prefix_hit_ratio" in stats:
        lines.append(f"prefix blocks already seen (unbounded cache): {stats['prefix_hit_ratio']:.1%}")
    return "\n".join(lines)


def plot_workload(requests: list[Request], path: str | Path, title: str | None = None) -> Path:
    """Write one PNG: prompt and output length histograms and arrivals per second over time."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    stats = describe_requests(requests)
    fig = Figure(figsize=(13, 4), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    for ax, name, label in ((axes[0], "prompt_len", "prompt length"), (axes[1], "output_len", "output length")):
        _length_histogram(ax, np.array([getattr(r, name) for r in requests]), stats[name], label)
    _arrival_rate(axes[2], np.array([r.arrival for r in requests]), stats)
    fig.suptitle(title or f"{stats['count']} requests, {stats['rate']:.2f} req/s over {stats['duration']:.0f} s")
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def _number(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def _summary(values: np.ndarray) -> dict:
    if len(values) == 0:
        return {k: float("nan") for k in ("mean", "p50", "p90", "p99", "max")}
    p = np.percentile(values, PERCENTILES)
    return {"mean": float(values.mean()), "p50": float(p[0]), "p90": float(p[1]), "p99": float(p[2]),
            "max": float(values.max())}


def _prefix_hit_ratio(requests: list[Request]) -> float:
    seen: set[int] = set()
    hits = total = 0
    for r in sorted(requests, key=lambda r: r.arrival):
        for h in r.prefix_hashes or ():
            hits += h in seen
            seen.add(h)
        total += len(r.prefix_hashes or ())
    return hits / total if total else float("nan")


def _length_histogram(ax, values: np.ndarray, summary: dict, label: str) -> None:
    if len(values) == 0:
        ax.set_title(f"{label}: no requests")
        return
    lo, hi = max(int(values.min()), 1), int(values.max())
    log = hi / lo >= 100  # lengths spanning decades read better on a log axis
    if log:
        bins = np.geomspace(lo, hi + 1, 50)
    elif hi - lo < 50:  # one bar per integer, centred on it
        bins = np.arange(lo - 0.5, hi + 1.5)
    else:
        bins = np.linspace(lo - 0.5, hi + 0.5, 51)
    ax.hist(values, bins=bins, color="tab:blue", alpha=0.8)
    if log:
        ax.set_xscale("log")
    for key, style in (("p50", "-"), ("p99", "--")):
        ax.axvline(summary[key], color="tab:red", linestyle=style, label=f"{key} = {summary[key]:.0f}")
    ax.set_title(f"{label} (mean {summary['mean']:.0f}, max {summary['max']:.0f})")
    ax.set_xlabel(f"{label} (tokens{', log scale' if log else ''})")
    ax.set_ylabel("requests")
    ax.legend(fontsize="small")


def _arrival_rate(ax, arrival: np.ndarray, stats: dict) -> None:
    if len(arrival) == 0:
        ax.set_title("arrivals: none")
        return
    start = float(arrival.min())
    width = _bin_width(stats["duration"])
    edges = np.arange(start, float(arrival.max()) + width + 1e-9, width)
    counts, edges = np.histogram(arrival, bins=edges)
    ax.step(edges[:-1] - start, counts / width, where="post", color="tab:green", linewidth=0.8)
    ax.set_title(f"arrival rate (inter-arrival CV {stats['arrival_cv']:.2f})")
    ax.set_xlabel("time since first arrival (s)")
    ax.set_ylabel(f"requests per second ({width:g} s bins)")
    if np.isfinite(stats["rate"]):
        ax.axhline(stats["rate"], color="black", linestyle="--", linewidth=0.8, label=f"mean {stats['rate']:.2f}/s")
        ax.legend(fontsize="small")


def _bin_width(duration: float) -> float:
    """1 s bins, widened to a round width so that a long run shows at most about 300 bins."""
    for width in (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600):
        if duration / width <= 300:
            return float(width)
    return float(np.ceil(duration / 300 / 3600) * 3600)
