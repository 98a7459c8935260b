"""Fit F(x) from profiler measurements into a `fitted` profile JSON.

    layer(x) = g(T) + gp(Tp) + a1h Ph + a1n Pn + a2 Kp + b1 Kd + b2 n_dec + b3 n_pref + k   (features.py)
    F(x)     = L (layer(x) + allreduce(T)) + lm_head(rows) + step_overhead

Ph = sum c h and Pn = sum c (c + 1) / 2 split the causal attention pairs P (format 1 had one rate
for P): new-token pairs and history pairs run at different rates. g and gp are piecewise linear
over the same knots; gp, over the tokens padded to whole GEMM tiles (Tp), is the staircase of the
tile steps. The tile is chosen by cross-validation among candidates (`tiles`, default
none/64/128/256; select_tile): the lowest out-of-fold mean squared relative error on the grid
rows, where a tile must beat 'none' by more than one standard error, so data without steps (CPU
timings) keeps no gp. Every candidate's out-of-fold errors are recorded in
provenance.tile_selection.

All coefficients are non-negative (scipy.optimize.nnls) and the least squares are weighted by
1/y, so the fit minimises relative error, as the simulator's users judge it. Only rows with
source=grid (and not flagged beyond the device's ceilings) are fitted; held-out rows
(source=heldout, recorded from simulator runs) are used only to report errors, and when there
are none a k-fold split of the grid rows stands in. Residual quantiles of log(measured /
predicted), out of fold, give the prediction intervals and the noise the simulator can sample.

Measurement CSV contract: one row per batch with batch_id, cls, source, prefill ("c:h;c:h"),
decode ("ctx;ctx"), layer_s_median (seconds, one layer), lm_head_s, graph, flagged, ...;
metadata.json beside it. Features are recomputed from the composition strings.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
from scipy.optimize import nnls

import cbsim
from cbsim.core.atomic import write_file_atomic
from cbsim.core.errors import ConfigError

from cbsim.profiler.costcheck import error_table
from cbsim.sim.costmodels.allreduce import analytic_spec, table_spec
from cbsim.sim.costmodels.vidur import PROFILE_DIR as VIDUR_PROFILES
from cbsim.sim.costmodels.features import (LINEAR_FEATURES, choose_knots, design_matrix, padded_segments, padded_token_column,
                       table_aggregates)
from cbsim.profiler.measurement_csv import REQUIRED_COLUMNS, load_measurements, valid_rows  # noqa: F401 (fit.load_measurements)

DERIVED_CHECKS = {  # CSV column -> recomputed feature
    "num_tokens": "tokens", "attn_pairs": "pairs", "prefill_kv_read": "prefill_kv",
    "decode_kv_read": "decode_kv", "num_decode": "num_decode", "num_seqs": "num_seqs", "sum_ch": "pairs_history",
}
DEFAULT_TILES = (None, 64, 128, 256)  # GEMM tile candidates for the step term; None: no step term
FORMAT = 2  # profile format: 2 adds the tile step term and splits the attention pairs (1: one pair rate)
PROBS = np.linspace(0.0, 1.0, 101)


def with_features(frame: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, int]]:
    """The frame plus recomputed feature columns (f_tokens, f_pairs, ...); and, per derived CSV
    column present, how many rows disagree with the recomputed value."""
    cols = table_aggregates(frame["prefill"].tolist(), frame["decode"].tolist())
    out = frame.copy()
    for name, values in cols.items():
        out[f"f_{name}"] = values
    mismatches = {}
    for column, feature in DERIVED_CHECKS.items():
        if column in frame.columns:
            given = pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype=np.float64)
            mismatches[column] = int(np.sum(~np.isclose(given, cols[feature], rtol=1e-6, atol=0.5)))
    return out, mismatches


def select_graph(frame: pd.DataFrame, graph: Literal["prefer", "eager"]) -> pd.DataFrame:
    """One row per batch: `prefer` takes the CUDA-graph row of a batch when there is one, `eager`
    only eager rows. Without a graph column every row is kept."""
    if "graph" not in frame.columns:
        return frame
    is_graph = frame["graph"].fillna(0).astype(int) == 1
    if graph == "eager":
        return frame[~is_graph]
    if graph != "prefer":
        raise ValueError(f"graph must be 'prefer' or 'eager', not {graph!r}")
    has_graph = set(frame.loc[is_graph, "batch_id"])
    return frame[is_graph | ~frame["batch_id"].isin(has_graph)]


def columns_of(frame: pd.DataFrame) -> dict[str, np.ndarray]:
    """The feature columns of a frame returned by with_features, keyed as in features.Aggregates."""
    return {c[2:]: frame[c].to_numpy(dtype=np.float64) for c in frame.columns if c.startswith("f_")}


def relative_nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative w minimising sum(((x @ w - y) / y) ** 2); columns rescaled for conditioning."""
    a = x / y[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    w, _ = nnls(a / scale, np.ones(len(y)), maxiter=50 * x.shape[1])
    return w / scale


def fit_layer(cols: dict[str, np.ndarray], y: np.ndarray, knots, tile: int | None = None) -> np.ndarray:
    """Weights of the design matrix (features.design_matrix's columns) for layer seconds y."""
    x, _ = design_matrix(cols, knots, tile)
    return relative_nnls(x, y)


def out_of_fold(cols: dict[str, np.ndarray], y: np.ndarray, knots, folds: int, tile: int | None = None) -> np.ndarray:
    """Predictions for every row from a fit on the other folds (row i is in fold i mod folds)."""
    x, _ = design_matrix(cols, knots, tile)
    fold = np.arange(len(y)) % folds
    pred = np.empty(len(y))
    for f in range(folds):
        test = fold == f
        pred[test] = x[test] @ relative_nnls(x[~test], y[~test])
    return pred


def parse_tiles(items) -> tuple[int | None, ...]:
    """Tile candidates from strings or numbers: 'none' (no step term) or a positive integer."""
    out = []
    for item in items:
        text = str(item).strip().lower()
        if item is None or text == "none":
            out.append(None)
        elif text.isdigit() and int(text) > 0:
            out.append(int(text))
        else:
            raise ConfigError("tiles", "'none' or a positive integer number of tokens", item)
    if not out:
        raise ConfigError("tiles", "at least one tile candidate", "")
    return tuple(dict.fromkeys(out))


def tile_label(tile: int | None) -> str:
    return "none" if tile is None else str(tile)


def select_tile(cols: dict[str, np.ndarray], y: np.ndarray, knots, candidates, folds: int
                ) -> tuple[int | None, np.ndarray, dict]:
    """The step term's tile, by cross-validation on the grid rows.

    Each candidate is scored by the mean squared relative error of its out-of-fold predictions
    (the fit's own loss). The best tile is the one with the lowest; it is kept only if it beats
    'none' (when 'none' is a candidate) by more than one standard error of its own score, so data
    without steps keeps the smaller family (the one-standard-error rule). A tile with Tp = T on
    every row adds nothing and is skipped. Returns (tile, its out-of-fold predictions, a record of
    every candidate's out-of-fold errors for the provenance)."""
    tokens = cols["tokens"]
    scores, scored = {}, {}
    for tile in candidates:
        if tile is not None and np.array_equal(padded_token_column(tokens, tile), tokens):
            scores[tile_label(tile)] = {"skipped": "Tp = T on every grid row"}
            continue
        pred = out_of_fold(cols, y, knots, folds, tile)
        sq = (pred / y - 1) ** 2
        scored[tile] = (float(sq.mean()), float(sq.std(ddof=1) / np.sqrt(len(sq))), pred)
        rel = np.sqrt(sq)
        scores[tile_label(tile)] = {"rms": float(np.sqrt(sq.mean())), "mse": scored[tile][0],
                                    "mse_se": scored[tile][1], "median_abs": float(np.median(rel)),
                                    "p95_abs": float(np.quantile(rel, 0.95))}
    if not scored:
        raise ConfigError("tiles", "a candidate that changes some grid row's padded tokens (or 'none')",
                          ",".join(scores))
    tiles = [t for t in scored if t is not None]
    chosen = min(tiles, key=lambda t: scored[t][0]) if tiles else None
    if None in scored and (chosen is None or scored[None][0] <= scored[chosen][0] + scored[chosen][1]):
        chosen = None
    record = {"candidates": [tile_label(t) for t in candidates], "chosen": tile_label(chosen),
              "criterion": f"out-of-fold mean squared relative error of the grid rows ({folds} folds); "
                           "a tile must beat 'none' by more than one standard error",
              "out_of_fold": scores}
    return chosen, scored[chosen][2], record


def fit_lm_head(num_rows: np.ndarray, seconds: np.ndarray) -> dict:
    """LM head seconds = const + per_row * sampled rows (relative NNLS); zero when not measured."""
    keep = np.isfinite(seconds) & (seconds > 0)
    if not keep.any():
        return {"const": 0.0, "per_row": 0.0, "rows_fitted": 0}
    x = np.column_stack([np.ones(keep.sum()), num_rows[keep]])
    w = relative_nnls(x, seconds[keep])
    err = np.abs(x @ w / seconds[keep] - 1)
    return {"const": float(w[0]), "per_row": float(w[1]), "rows_fitted": int(keep.sum()),
            "median_abs_rel": float(np.median(err))}


def noise_floor(frame: pd.DataFrame) -> dict:
    """Spread of repeated anchor batches (same composition): median |y / group median - 1|; and
    the median within-point spread (p90 - p10) / (2 median) over all rows that report it."""
    out = {}
    anchors = frame[frame["source"] == "anchor"]
    if len(anchors):
        y = anchors["layer_s_median"]
        med = y.groupby([anchors["prefill"].fillna(""), anchors["decode"].fillna("")]).transform("median")
        out["anchor_median_abs_rel"] = float(np.median(np.abs(y / med - 1)))
        out["anchor_rows"] = int(len(anchors))
    if {"layer_s_p10", "layer_s_p90"} <= set(frame.columns):
        spread = (frame["layer_s_p90"] - frame["layer_s_p10"]) / (2 * frame["layer_s_median"])
        out["repeat_half_spread_median"] = float(np.nanmedian(spread))
    return out


def fit_profile(frame: pd.DataFrame, metadata: dict, *, csv_path=None, num_layers: int | None = None,
                tp: int | None = None, hidden: int | None = None, model: str | None = None,
                gpu: str | None = None, step_overhead: float | None = None, graph: Literal["prefer", "eager"] = "prefer",
                folds: int = 5, network: str | None = None, allreduce_bandwidth: float | None = None,
                allreduce_latency: float = 10e-6, min_rows: int = 8, tiles=DEFAULT_TILES) -> dict:
    """A `fitted` profile (a JSON-able dict) from measurements; see the module docstring."""
    num_layers = num_layers or _meta(metadata, "num_layers", "num_hidden_layers", "n_layers")
    if not num_layers:
        raise ConfigError("num_layers", "the model's layer count (--num-layers, or num_layers in metadata.json)", None)
    tp = int(tp or _tp(metadata))
    gpu = gpu or _gpu_name(metadata)
    overhead, overhead_source = _step_overhead(step_overhead, metadata, csv_path)
    chosen = select_graph(frame, graph)
    rows, mismatches = with_features(valid_rows(chosen))
    none = pd.Series(False, index=rows.index)
    flagged = rows["flagged"].fillna(0).astype(int).astype(bool) if "flagged" in rows.columns else none
    grid = rows[(rows["source"] == "grid") & ~flagged]
    if len(grid) < 2 * len(LINEAR_FEATURES):
        raise ConfigError("source", f"at least {2 * len(LINEAR_FEATURES)} unflagged grid rows to fit", len(grid))
    y = grid["layer_s_median"].to_numpy(dtype=np.float64)
    cols = columns_of(grid)
    knots = choose_knots(cols["tokens"], min_rows=min_rows)
    candidates = parse_tiles(tiles)
    widest = max(len(knots) + len(padded_segments(knots, t)) + len(LINEAR_FEATURES) for t in candidates)
    folds = max(2, min(folds, len(grid) // widest))
    tile, oof, selection = select_tile(cols, y, knots, candidates, folds)
    weights = fit_layer(cols, y, knots, tile)
    _, names = design_matrix(cols, knots, tile)
    log_res = np.log(y / oof)
    lm_rows = rows[rows["source"] == "grid"]
    lm_seconds = pd.to_numeric(lm_rows.get("lm_head_s", pd.Series(np.nan, index=lm_rows.index)), errors="coerce")
    return {
        "type": "fitted",
        "format": FORMAT,
        "model": model or _model_name(metadata),
        "gpu": gpu,
        "num_layers": int(num_layers),
        "tp": tp,
        "knots": [float(k) for k in knots],
        "tile": tile,
        "coefficients": {name: float(w) for name, w in zip(names, weights)},
        "lm_head": fit_lm_head(lm_rows["f_num_seqs"].to_numpy(float), lm_seconds.to_numpy(float)),
        "step_overhead": overhead,
        "allreduce": _allreduce(tp, metadata, hidden, gpu, network, allreduce_bandwidth, allreduce_latency),
        "residuals": {"space": "log(measured/predicted), out of fold", "probs": PROBS.tolist(),
                      "quantiles": np.quantile(log_res, PROBS).tolist()},
        "provenance": {**_provenance(csv_path, metadata, graph, rows, grid, flagged, mismatches, folds,
                                     len(chosen) - len(rows)), "step_overhead": overhead_source,
                       "tile_selection": selection},
        "validation": _validation(rows, grid, knots, tile, weights, log_res, folds),
    }


def _step_overhead(given, metadata, csv_path) -> tuple[float, str]:
    if given is not None:
        return float(given), "given"
    if _meta(metadata, "step_overhead_s") is not None:
        return float(_meta(metadata, "step_overhead_s")), "metadata step_overhead_s"
    measured = measured_step_overhead(csv_path)
    if measured is not None:
        return measured, "median plan_s of overhead.csv"
    return 0.0, "none measured"


def _validation(rows, grid, knots, tile, weights, log_res, folds) -> dict:
    """Errors on held-out rows (or, without any, the out-of-fold errors of the grid rows)."""
    heldout = rows[rows["source"] == "heldout"]
    if len(heldout):
        x, _ = design_matrix(columns_of(heldout), knots, tile)
        measured, predicted = heldout["layer_s_median"].to_numpy(float), x @ weights
        classes, basis = heldout["cls"].to_numpy(str), "heldout"
    else:
        measured = grid["layer_s_median"].to_numpy(float)
        predicted = measured / np.exp(log_res)
        classes, basis = grid["cls"].to_numpy(str), f"{folds}-fold cross-validation of grid rows"
    lo, hi = np.exp(np.quantile(log_res, [0.05, 0.95]))
    ratio = measured / predicted
    return {
        "basis": basis,
        "layer_error": error_table(measured, predicted, classes),
        "interval_90_coverage": float(np.mean((ratio >= lo) & (ratio <= hi))),
        "noise_floor": noise_floor(rows),
    }


def _allreduce(tp, metadata, hidden, gpu, network, bandwidth, latency):
    if tp <= 1:
        return None
    hidden = hidden or _meta(metadata, "hidden", "hidden_size", "n_embd")
    if not hidden:
        raise ConfigError("hidden", "the model's hidden size for the TP all-reduce (--hidden or metadata)", None)
    if network == "analytic" or bandwidth is not None:
        if bandwidth is None:
            raise ConfigError("allreduce_bandwidth", "a bus bandwidth in bytes/s for the analytic all-reduce", None)
        return analytic_spec(tp, int(hidden), bandwidth, latency)
    node = network or _default_node(gpu, tp)
    path = VIDUR_PROFILES / "network" / f"{node}.json"
    if not path.exists():
        raise ConfigError("network", "a shipped network table (a100_dgx, a100_pairwise_nvlink, h100_dgx, "
                          "h100_pairwise_nvlink) or 'analytic' with a bandwidth", node)
    try:
        return table_spec(json.loads(path.read_text()), tp, int(hidden))
    except KeyError as err:
        raise ConfigError("tp", str(err.args[0]), tp) from None


def _default_node(gpu: str | None, tp: int) -> str:
    """The measured node closest to the GPU the profile was measured on (H200: H100's NVLink 4)."""
    name = (gpu or "").lower()
    family = "h100" if ("h100" in name or "h200" in name) else "a100" if "a100" in name else None
    if family is None:
        raise ConfigError("network", f"a network table for GPU {gpu!r}: pass --network NODE or an analytic bandwidth", gpu)
    return f"{family}_dgx"


def _meta(meta: dict, *keys):
    """The first of `keys` set at the top level of the metadata or under its 'model' mapping."""
    scopes = [meta] + [meta[k] for k in ("model", "model_config") if isinstance(meta.get(k), dict)]
    for scope in scopes:
        for key in keys:
            if scope.get(key) is not None:
                return scope[key]
    return None


def _model_name(meta: dict) -> str:
    if isinstance(meta.get("model"), str):
        return meta["model"]
    return str(_meta(meta, "model_name", "name") or "unknown")


def _tp(meta: dict) -> int:
    """TP degree from the metadata, or from a shard name such as 'llama-3-70b-tp2'; else 1."""
    tp = _meta(meta, "tp", "tensor_parallel_size", "tp_size")
    if tp:
        return int(tp)
    match = re.search(r"-tp(\d+)$", _model_name(meta))
    return int(match.group(1)) if match else 1


def _gpu_name(meta: dict) -> str:
    gpu = meta.get("gpu")
    if gpu is None and isinstance(meta.get("environment"), dict):
        gpu = meta["environment"].get("gpu")
    if isinstance(gpu, dict):
        gpu = gpu.get("name")
    return str(gpu or "unknown")


def measured_step_overhead(csv_path) -> float | None:
    """Median CPU planning seconds per step from overhead.csv (batch_id, plan_s) beside the CSV."""
    if csv_path is None:
        return None
    path = Path(csv_path).parent / "overhead.csv"
    if not path.exists():
        return None
    plan = pd.to_numeric(pd.read_csv(path).get("plan_s"), errors="coerce").dropna()
    return float(plan.median()) if len(plan) else None


def _provenance(csv_path, metadata, graph, rows, grid, flagged, mismatches, folds, invalid) -> dict:
    out = {"fit_date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "cbsim_version": cbsim.__version__, "metadata": metadata, "graph_rows": graph, "folds": folds,
           "rows": {"grid_fitted": int(len(grid)), "flagged_excluded": int(flagged.sum()),
                    "invalid_excluded": int(invalid),
                    **{f"source_{k}": int(v) for k, v in rows["source"].value_counts().items()}},
           "derived_column_mismatches": mismatches}
    if csv_path is not None:
        path = Path(csv_path)
        out["csv"] = str(path.resolve())
        out["csv_sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def write_profile(profile: dict, path) -> None:
    """Write a profile as indented JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, lambda tmp: tmp.write_text(json.dumps(profile, indent=1) + "\n"))
