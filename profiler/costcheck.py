"""How well a cost model predicts measured batches: error table by class and a scatter plot.

The comparison is per decoder layer: the measurement CSV's primary quantity is the median time of
one layer (layer_s_median), and every cost model here exposes `layer_time(shape)` (one layer's
compute: no all-reduce, LM head or CPU overhead), so a `fitted` profile and a `vidur` profile
are judged on the same numbers. Relative error is predicted / measured - 1; the table reports
the median, p90, p95 and max of its absolute value and its mean (signed bias) for each batch
class (decode, prefill, mixed, long) and overall. Rows default to the held-out ones
(source=heldout), or all rows when the file has none.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from cbsim.core import bounds
from cbsim.core.errors import ConfigError

from cbsim.sim.costmodels.fitted import FittedCostModel
from cbsim.sim.costmodels.vidur import VidurCostModel
from cbsim.sim.costmodels.features import shape_of
from cbsim.profiler.measurement_csv import load_measurements, valid_rows

CLASS_ORDER = ("decode", "prefill", "mixed", "long")


def error_table(measured, predicted, classes) -> dict:
    """{class or 'overall': {n, median_abs, p90_abs, p95_abs, max_abs, bias}} of relative errors."""
    measured = np.asarray(measured, dtype=np.float64)
    rel = np.asarray(predicted, dtype=np.float64) / measured - 1.0
    classes = np.asarray(classes).astype(str)
    order = [c for c in CLASS_ORDER if c in classes] + sorted(set(classes) - set(CLASS_ORDER))
    table = {c: _stats(rel[classes == c]) for c in order}
    table["overall"] = _stats(rel)
    return table


def _stats(rel: np.ndarray) -> dict:
    a = np.abs(rel)
    return {"n": int(len(rel)), "median_abs": float(np.median(a)), "p90_abs": float(np.quantile(a, 0.9)),
            "p95_abs": float(np.quantile(a, 0.95)), "max_abs": float(a.max()), "bias": float(rel.mean())}


def format_table(table: dict) -> str:
    """The error table as aligned text, errors in percent."""
    lines = [f"{'class':<10}{'n':>6}{'median':>9}{'p90':>9}{'p95':>9}{'max':>9}{'bias':>9}"]
    for name, s in table.items():
        lines.append(f"{name:<10}{s['n']:>6}{100 * s['median_abs']:>8.2f}%{100 * s['p90_abs']:>8.2f}%"
                     f"{100 * s['p95_abs']:>8.2f}%{100 * s['max_abs']:>8.2f}%{100 * s['bias']:>+8.2f}%")
    return "\n".join(lines)


def load_model(profile_path):
    """The cost model a profile JSON describes (its 'type': fitted or vidur)."""
    path = Path(profile_path)
    try:
        data = bounds.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as err:  # missing, not UTF-8, not JSON
        raise ConfigError("<file>", "a profile JSON (fitted or vidur)", str(err), file=str(path)) from None
    kind = data.get("type") if isinstance(data, dict) else None
    models = {"fitted": FittedCostModel, "vidur": VidurCostModel}
    if kind not in models:
        raise ValueError(f"{path}: profile type {kind!r} is not one of {sorted(models)}")
    return models[kind].from_file(path)


def select_rows(frame: pd.DataFrame, rows: str = "auto") -> tuple[pd.DataFrame, str]:
    """Rows to check: 'heldout', 'grid', 'all', or 'auto' (held-out if any, else all)."""
    if rows == "auto":
        rows = "heldout" if (frame["source"] == "heldout").any() else "all"
    if rows == "all":
        return frame, rows
    return frame[frame["source"] == rows], rows


def predict_layers(model, frame: pd.DataFrame) -> np.ndarray:
    """The model's one-layer seconds for every row's composition."""
    return np.array([model.layer_time(shape_of(p, d)) for p, d in zip(frame["prefill"], frame["decode"])])


def costcheck(profile_path, csv_path, out_png=None, rows: str = "auto") -> tuple[dict, str]:
    """Error table (and optionally a scatter PNG) of a profile against a measurement CSV."""
    frame, _ = load_measurements(csv_path)
    frame = valid_rows(frame)
    model = load_model(profile_path)
    chosen, basis = select_rows(frame, rows)
    if chosen.empty:
        raise ValueError(f"{csv_path}: no {basis} rows to check")
    measured = chosen["layer_s_median"].to_numpy(dtype=np.float64)
    predicted = predict_layers(model, chosen)
    classes = chosen["cls"].astype(str).to_numpy()
    table = error_table(measured, predicted, classes)
    if out_png is not None:
        scatter_png(measured, predicted, classes, out_png, title=f"{Path(profile_path).name} vs {Path(csv_path).name} ({basis} rows)")
    return table, f"{basis} rows of {csv_path}, one layer, relative error (predicted/measured - 1)\n" + format_table(table)


def scatter_png(measured, predicted, classes, path, title: str = "") -> None:
    """Predicted vs measured per-layer seconds, log-log, y = x line (dashed: +-10 %), one colour per class."""
    # lazy: matplotlib (~0.5 s to import) only when a plot is asked for; a Figure on the Agg canvas,
    # no pyplot (no global figure state)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    measured = np.asarray(measured) * 1e6
    predicted = np.asarray(predicted) * 1e6
    classes = np.asarray(classes).astype(str)
    fig = Figure(figsize=(6, 6), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    colours = {"decode": "tab:blue", "prefill": "tab:orange", "mixed": "tab:green", "long": "tab:red"}
    for name in [c for c in CLASS_ORDER if c in classes] + sorted(set(classes) - set(CLASS_ORDER)):
        sel = classes == name
        ax.scatter(measured[sel], predicted[sel], s=10, alpha=0.7, label=f"{name} ({sel.sum()})",
                   color=colours.get(name), zorder=2)
    lo = min(measured.min(), predicted.min()) / 1.2
    hi = max(measured.max(), predicted.max()) * 1.2
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=1, label="y = x", zorder=1)
    for f in (0.9, 1.1):
        ax.plot([lo, hi], [lo * f, hi * f], color="grey", linewidth=0.8, linestyle="--", zorder=1)
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi),
           xlabel="measured layer time (us)", ylabel="predicted layer time (us)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
