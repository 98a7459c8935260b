"""kv_tiers.png: what each lower KV tier holds over time, and what is restored from it (sim/kv/tiers.py).

Top, one panel per tier: its blocks in use (summed over replicas, a step function from each sample: a
sample is taken at each step start where a tier changed) in % of its capacity (dashed: 100 %), the
GPU's KV blocks in use beside the first (the steps table's kv_blocks_used). Bottom: the blocks restored
from each tier per second, in 60 time bins: when the tiers serve the hits the GPU lost.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from cbsim.sim.outputs.figure import new_figure

BINS = 60


def plot_tiers(occupancy: pd.DataFrame, steps_df: pd.DataFrame, kv_blocks: dict | None):
    tiers = list(dict.fromkeys(occupancy["tier"]))
    fig = new_figure((11, 2.4 + 2.0 * len(tiers)))
    axes = np.atleast_1d(fig.subplots(len(tiers) + 1, 1, sharex=True))
    end = float(steps_df["end"].max()) if len(steps_df) else 0.0
    for ax, tier in zip(axes, tiers):
        rows = occupancy[occupancy["tier"] == tier]
        capacity = int(rows.groupby("replica")["capacity_blocks"].first().sum())
        total = _summed(rows, "blocks", end)
        ax.step(total.index, 100.0 * total.to_numpy() / max(capacity, 1), where="post", linewidth=1.2,
                label=f"{tier} tier ({capacity:,} blocks)")
        if ax is axes[0] and kv_blocks:
            used = steps_df.groupby("start")["kv_blocks_used"].sum()
            ax.plot(used.index, 100.0 * used.to_numpy() / sum(kv_blocks.values()), linewidth=0.8, alpha=0.6,
                    color="grey", label=f"GPU ({sum(kv_blocks.values()):,} blocks)")
        ax.axhline(100.0, color="black", linestyle="--", linewidth=0.8)
        ax.set_ylabel("% of capacity")
        ax.set_ylim(0, 110)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    _restore_rates(axes[-1], occupancy, tiers, end)
    axes[0].set_title("KV tiers: blocks held over time (cpu: prefix units and swapped requests)")
    axes[-1].set_xlabel("simulated time (s)")
    return fig


def _restore_rates(ax, occupancy: pd.DataFrame, tiers: list, end: float) -> None:
    """Blocks restored per second from each tier, per time bin (from the cumulative restored_blocks)."""
    edges = np.linspace(0.0, max(end, 1e-9), BINS + 1)
    width = edges[1] - edges[0]
    for tier in tiers:
        total = _summed(occupancy[occupancy["tier"] == tier], "restored_blocks", end)
        at_edges = np.interp(edges, total.index.to_numpy(dtype=float), total.to_numpy(dtype=float), left=0.0)
        ax.step(edges[:-1], np.diff(at_edges) / width, where="post", linewidth=1.2, label=f"from {tier}")
    ax.set_ylabel("blocks restored / s")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)


def _summed(rows: pd.DataFrame, column: str, end: float) -> pd.Series:
    """`column` summed over replicas at every sample time (each replica's last value carried on)."""
    wide = rows.pivot_table(index="time", columns="replica", values=column, aggfunc="last").ffill().fillna(0)
    total = wide.sum(axis=1)
    if len(total) and end > total.index[-1]:
        total.loc[end] = total.iloc[-1]
    return total
