"""pareto.png of `cbsim tune`: goodput per GPU against each SLO metric at capacity, one panel per
metric, every candidate a point, the Pareto front (more goodput, lower metric) joined, the chosen
deployment starred. Reads only the ranked table (tune_report.ranked_table)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both: lower x and higher y (x ascending)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], -points[i][1]))
    front, best_y = [], float("-inf")
    for i in order:
        if points[i][1] > best_y:
            front.append(i)
            best_y = points[i][1]
    return front


def pareto_plot(table: pd.DataFrame, slo: dict[str, float], path: Path, title: str = "",
                stages: list[str] | None = None) -> Path:
    """One panel per SLO metric (its limit dashed), points coloured by the stage that ran them
    (in `stages` order)."""
    ok = table[table["goodput_per_gpu"].notna()]
    order = list(stages or []) + [s for s in ok["stage"].unique() if s not in (stages or [])]
    fig, axes = plt.subplots(1, len(slo), figsize=(5.2 * len(slo), 4.2), squeeze=False)
    for ax, (metric, limit) in zip(axes[0], slo.items()):
        column = f"{metric}_at_capacity"
        rows = ok[ok[column].notna()]
        xs, ys = rows[column].astype(float).tolist(), rows["goodput_per_gpu"].astype(float).tolist()
        for stage in order:
            group = rows[rows["stage"] == stage]
            if len(group):
                ax.scatter(group[column], group["goodput_per_gpu"], s=28, alpha=0.8, label=stage)
        ax.axvline(limit, color="crimson", lw=0.8, ls=":", label="SLO limit")
        front = pareto_front(list(zip(xs, ys)))
        ax.plot([xs[i] for i in front], [ys[i] for i in front], color="0.4", lw=1, ls="--", label="Pareto front")
        chosen = rows[rows["chosen"]]
        if len(chosen):
            ax.scatter(chosen[column], chosen["goodput_per_gpu"], marker="*", s=260, color="crimson",
                       edgecolor="black", zorder=5, label="chosen")
            ax.annotate(str(chosen["candidate"].iloc[0]), (chosen[column].iloc[0], chosen["goodput_per_gpu"].iloc[0]),
                        textcoords="offset points", xytext=(-8, 8), ha="right", fontsize=8)
        ax.margins(x=0.08, y=0.08)
        ax.set_xlabel(f"{metric} at capacity (s)" if not metric.startswith(("num_", "throughput")) else metric)
        ax.set_ylabel("goodput per GPU (req/s)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(f"{title}: goodput per GPU vs SLO metrics" if title else "goodput per GPU vs SLO metrics")
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png", metadata={"Software": None})  # by its format: a temporary name has no .png
    plt.close(fig)
    return path
