"""pareto.png of `cbsim tune`: goodput per GPU against each SLO metric at capacity, one panel per
metric, every candidate a point coloured by its GPU layout and shaped by its stage, the Pareto front
(more goodput, lower metric) joined and labelled, the chosen deployment starred. Reads only the ranked table (tune_report.ranked_table)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

from cbsim.sim.metrics.summary_units import is_latency  # noqa: E402

MARKERS = ("o", "s", "^", "D", "v", "P", "X", "h")  # one per stage


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
    """One panel per SLO metric (its limit dotted; latencies in ms, as every command prints them). A
    point's colour is its GPU layout (TP x replicas, or the P/D split), its marker the stage that ran
    it (in `stages` order); every point on the Pareto front is labelled with its stage and candidate."""
    ok = table[table["goodput_per_gpu"].notna()]
    order = list(stages or []) + [s for s in ok["stage"].unique() if s not in (stages or [])]
    layouts = list(dict.fromkeys(layout(row) for _, row in ok.iterrows()))
    colours = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(layouts)}
    fig, axes = plt.subplots(1, len(slo), figsize=(5.6 * len(slo), 4.6), squeeze=False)
    for ax, (metric, limit) in zip(axes[0], slo.items()):
        column, scale = f"{metric}_at_capacity", 1e3 if is_latency(metric) else 1.0
        rows = ok[ok[column].notna()]
        xs = (rows[column].astype(float) * scale).tolist()
        ys = rows["goodput_per_gpu"].astype(float).tolist()
        for i, (_, row) in enumerate(rows.iterrows()):
            ax.scatter(xs[i], ys[i], s=34, alpha=0.85, color=colours[layout(row)],
                       marker=MARKERS[order.index(row["stage"]) % len(MARKERS)] if row["stage"] in order else "o")
        ax.axvline(limit * scale, color="crimson", lw=0.8, ls=":")
        front = pareto_front(list(zip(xs, ys)))
        ax.plot([xs[i] for i in front], [ys[i] for i in front], color="0.4", lw=1, ls="--")
        for i in front:
            row = rows.iloc[i]
            ax.annotate(f"{row['stage']}: {row['candidate']}", (xs[i], ys[i]), textcoords="offset points",
                        xytext=(5, 4), fontsize=6.5)
        chosen = [i for i in range(len(rows)) if bool(rows["chosen"].iloc[i])]
        if chosen:
            ax.scatter([xs[i] for i in chosen], [ys[i] for i in chosen], marker="*", s=260, facecolors="none",
                       edgecolors="crimson", linewidths=1.5, zorder=5)
        ax.margins(x=0.1, y=0.1)
        unit = " (ms)" if scale != 1.0 else ""
        ax.set_xlabel(f"{metric} at capacity{unit}")
        ax.set_ylabel("goodput per GPU (req/s)")
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], ls="", marker="o", color=colours[name], label=name) for name in layouts]
    handles += [Line2D([], [], ls="", marker=MARKERS[i % len(MARKERS)], color="0.3", label=f"stage {stage}")
                for i, stage in enumerate(order) if stage in set(ok["stage"])]
    handles += [Line2D([], [], ls="--", color="0.4", label="Pareto front"),
                Line2D([], [], ls=":", color="crimson", label="SLO limit"),
                Line2D([], [], ls="", marker="*", markersize=12, markerfacecolor="none", color="crimson",
                       label="chosen")]
    fig.legend(handles=handles, fontsize=7, loc="center right")
    fig.suptitle(f"{title}: goodput per GPU vs SLO metrics" if title else "goodput per GPU vs SLO metrics")
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    fig.savefig(path, dpi=110, format="png", metadata={"Software": None})  # by its format: a temporary name has no .png
    plt.close(fig)
    return path


def layout(row) -> str:
    """A candidate's GPU layout: 'P2/D1' for a P/D split, else 'TP2 x 2' (tensor parallel x replicas)."""
    if pd.notna(row.get("prefill_gpus")) and pd.notna(row.get("decode_gpus")):
        return f"P{row['prefill_gpus']}/D{row['decode_gpus']}"
    tp = row.get("tp") if pd.notna(row.get("tp")) else 1
    replicas = row.get("replicas") if pd.notna(row.get("replicas")) else 1
    pp = row.get("pp") if pd.notna(row.get("pp", None)) and row.get("pp", 1) != 1 else None
    return f"TP{tp}" + (f" PP{pp}" if pp else "") + f" x {replicas}"
