"""The measured-vs-simulated CDF figure of `cbsim compare` (a matplotlib Figure on the Agg canvas, no pyplot).

One panel per latency (TTFT, ITL, TPOT, E2E), milliseconds on the x axis; the measured and the
simulated empirical CDFs on the same axes, each side's p50 and p99 marked with a dot. Nothing is computed here
beyond the CDF points.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from cbsim.sim.metrics import cdf_points, weighted_percentile

MEASURED, SIMULATED = "black", "tab:orange"
PANELS = (("ttft", "TTFT", "requests"), ("itl", "ITL", "token gaps"), ("tpot", "TPOT", "requests"),
          ("e2e", "E2E latency", "requests"))


def plot_compare_cdf(result, path: str | Path) -> Path:
    """Write the 2x2 figure of `result` (a CompareResult) to `path`."""
    measured, simulated = measured_samples(result.measured), simulated_samples(result.results)
    fig = Figure(figsize=(12, 8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    for ax, (name, label, unit) in zip(axes.ravel(), PANELS):
        _panel(ax, label, unit, measured.get(name), simulated.get(name), result.rows)
        ax.set_title(f"{label}: {_errors(result.rows, name)}", fontsize=10)
    tool = {"vllm": "vLLM", "sglang": "SGLang", "cbsim": "cbsim flat"}.get(result.measured.format,
                                                                         result.measured.format)
    fig.suptitle(f"Measured ({tool}: {Path(result.measured.source).name}) vs simulated "
                 f"({result.results.config.name}, {result.results.config.policy['name']})")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def measured_samples(run) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per-request (and per-gap) values of a MeasuredRun, as (values, weights) in seconds."""
    out = {}
    for name, values in (("ttft", run.ttfts), ("itl", run.itls), ("tpot", run.tpots), ("e2e", run.e2e)):
        if values is not None and len(values):
            out[name] = (values, np.ones(len(values)))
    return out


def simulated_samples(results) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The same samples of a cbsim run: finished requests (TPOT: > 1 output token), every ITL gap."""
    df = results.requests
    done = df[df["status"] == "finished"]
    out = {}
    for name, column in (("ttft", done["ttft"]), ("tpot", done.loc[done["output_len"] > 1, "tpot"]),
                         ("e2e", done["e2e"])):
        values = column.dropna().to_numpy(dtype=np.float64)
        out[name] = (values, np.ones(len(values)))
    out["itl"] = (np.asarray(results.itl.values, dtype=np.float64), np.asarray(results.itl.weights))
    return out


def _panel(ax, label, unit, measured, simulated, rows) -> None:
    drawn = False
    for sample, who, color, style, width in ((measured, "measured", MEASURED, "-", 2.4),
                                             (simulated, "simulated", SIMULATED, "--", 1.6)):
        if sample is None or not len(sample[0]):
            continue
        values, weights = sample
        x, y = cdf_points(values, weights)
        count = int(np.sum(weights))
        p50, p99 = (weighted_percentile(values, weights, q) * 1e3 for q in (50, 99))
        ax.step(x * 1e3, y, where="post", color=color, linestyle=style, linewidth=width,
                label=f"{who} (n={count:,}): p50 {_ms(p50)}, p99 {_ms(p99)} ms")
        for q, value in ((0.5, p50), (0.99, p99)):
            ax.plot([value], [q], marker="o", color=color, markersize=5, markerfacecolor="white" if who == "simulated"
                    else color)
        drawn = True
    if measured is None:
        ax.text(0.5, 0.5, f"no measured per-request {label}", ha="center", va="center", transform=ax.transAxes,
                color="gray")
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel(f"fraction of {unit} ≤ x")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(loc="best", fontsize=8, title="dots: p50 and p99", title_fontsize=7)


def _ms(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _errors(rows, name: str) -> str:
    """'p50 +3.1%, p99 -12%' for the panel title (the rows present on both sides)."""
    parts = [f"{stat} {_percent(rows[f'{name}_{stat}'].error)}" for stat in ("mean", "p50", "p99")
             if f"{name}_{stat}" in rows]
    return "error of simulated: " + ", ".join(parts) if parts else "no summary metric on both sides"


def _percent(error: float) -> str:
    """A signed error in percent, one decimal; exactly 0.0% when it rounds to zero."""
    text = f"{error * 100:+.1f}%"
    return "0.0%" if text in ("+0.0%", "-0.0%") else text
