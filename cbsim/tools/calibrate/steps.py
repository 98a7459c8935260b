"""`cbsim calibrate --steps`: fit the engine terms to measured whole-step times.

For every measured step the base cost model (BASE.yaml's `model:` and `cost_model:`, evaluated at
the row's TP with a zero engine, i.e. kernels only) prices the kernels: gpu_i. The engine model
(sim/costmodels/engine.py) turns gpu_i and the step's shape into a step time. The terms named
in `fit` minimise  sum_i w_i * log(predicted_i / measured_i)^2  (relative error, as symmetric for
too fast as for too slow), by bounded least squares (scipy's trust-region reflective) from the
base engine's values and from seeded random starts; the best end point wins. The other terms keep
the base engine's values (its structure: overlap, CUDA-graph sizes).

Errors are reported by step class (prefill, decode, mixed) and by TP: in sample, 5-fold
cross-validated (seeded folds), and leave-one-TP-out when the table holds several TPs (the terms
fitted without a TP predict it).
"""
from __future__ import annotations

import dataclasses
import hashlib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

from cbsim.core.errors import ConfigError
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.costmodels.registry import takes_engine
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.costmodels.engine import (FRONTEND_TERMS, NO_ENGINE, TERM_NAMES, Engine, EngineTerms,
                                              load_engine)
from cbsim.profiler.converters.step_table import MeasuredStep

DEFAULT_FIT = ("host_per_step_s", "host_per_seq_s", "host_per_token_s", "launch_per_layer_s",
               "collective_per_rank_s")
# the numeric terms a step time shows (the front end acts outside the steps: fit it with --serving)
FITTABLE = tuple(n for n in TERM_NAMES if n not in ("overlap", "cuda_graph_max_batch", *FRONTEND_TERMS))
# each term's unit in the optimiser (conditioning) and the range random starts are drawn from
UNITS = {"host_per_seq_s": 1e-6, "host_per_prefill_s": 1e-6, "host_per_token_s": 1e-6,
         "frontend_per_prompt_token_s": 1e-6, "kernel_scale": 1.0}
START_RANGE = {"kernel_scale": (0.7, 1.5), "host_per_seq_s": (0, 100), "host_per_token_s": (0, 10),
               "launch_per_layer_s": (0, 0.5), "collective_launch_s": (0, 0.1), "collective_per_rank_s": (0, 0.05)}
STARTS = 8


@dataclass
class KernelRow:
    """A measured step with what the fit needs: kernel seconds and the engine's inputs."""

    step: MeasuredStep
    gpu: float
    layers: int
    tp: int


def kernel_rows(steps: list[MeasuredStep], model, cost_model: dict) -> list[KernelRow]:
    """Price every step's kernels with the base cost model at the step's TP (and model)."""
    base = {k: v for k, v in cost_model.items() if k not in ("engine", "cpu_overhead")}
    if not takes_engine(base):
        raise ConfigError("cost_model.type", "a cost model with an engine (roofline, vidur, fitted)", base.get("type"))
    models: dict = {}
    rows = []
    for step in steps:
        key = (step.tp, step.model)
        if key not in models:
            mapping = {**base, "engine": {}}  # an engine of zero terms: the kernels alone
            if step.tp is not None:
                mapping["tp"] = step.tp
            spec = model_spec(step.model or model, "model")
            models[key] = load_cost_model(mapping, spec, "cost_model")
        cost = models[key]
        layers = getattr(cost, "num_layers", None) or cost.model.num_layers
        tp = step.tp or cost.describe().get("tp") or 1
        rows.append(KernelRow(step, cost.step_time(step.shape), int(layers), int(tp)))
    return rows


def predict(rows: list[KernelRow], terms: EngineTerms) -> np.ndarray:
    """Step seconds the engine terms give for each row."""
    engines: dict = {}
    out = np.empty(len(rows))
    for i, row in enumerate(rows):
        key = (row.layers, row.tp)
        if key not in engines:
            engines[key] = Engine(terms, "fit").bind(row.layers, row.tp)
        out[i] = engines[key].step_of(row.gpu, row.step.shape)
    return out


def _terms(base: EngineTerms, names, x) -> EngineTerms:
    return dataclasses.replace(base, **{n: float(v) * UNITS.get(n, 1e-3) for n, v in zip(names, x)})


def fit_terms(rows: list[KernelRow], base: EngineTerms, names: tuple[str, ...], seed: int = 0) -> EngineTerms:
    """The terms `names` minimising the weighted squared log error over `rows`."""
    measured = np.array([r.step.time_s for r in rows])
    weight = np.sqrt([r.step.weight for r in rows])

    def residual(x):
        return weight * np.log(predict(rows, _terms(base, names, x)) / measured)

    lower = [0.05 if n == "kernel_scale" else 0.0 for n in names]
    upper = [20.0 if n == "kernel_scale" else np.inf for n in names]
    rng = np.random.default_rng(seed)
    starts = [[getattr(base, n) / UNITS.get(n, 1e-3) for n in names]]
    for _ in range(STARTS - 1):
        starts.append([rng.uniform(*START_RANGE.get(n, (0, 5))) for n in names])
    best = None
    for x0 in starts:
        res = least_squares(residual, np.clip(x0, lower, [u if np.isfinite(u) else 1e12 for u in upper]),
                            bounds=(lower, upper), method="trf", x_scale=1.0)
        if best is None or res.cost < best.cost:
            best = res
    return _terms(base, names, best.x)


def error_table(rows: list[KernelRow], predicted: np.ndarray) -> dict:
    """Absolute relative errors by step class and by TP: n, median, mean, max, signed median."""
    rel = predicted / np.array([r.step.time_s for r in rows]) - 1.0
    groups = defaultdict(list)
    for i, row in enumerate(rows):
        groups["all"].append(i)
        groups[row.step.kind].append(i)
        groups[f"tp{row.tp}"].append(i)
    out = {}
    for name, idx in groups.items():
        r = rel[idx]
        out[name] = {"n": len(idx), "median_abs": float(np.median(np.abs(r))), "mean_abs": float(np.mean(np.abs(r))),
                     "max_abs": float(np.max(np.abs(r))), "median_signed": float(np.median(r))}
    return out


def cross_validated(rows: list[KernelRow], base: EngineTerms, names, folds: int = 5, seed: int = 0) -> np.ndarray:
    """Out-of-fold predictions: each row predicted by terms fitted without its fold."""
    order = np.random.default_rng(seed).permutation(len(rows))
    out = np.empty(len(rows))
    for k in range(min(folds, len(rows))):
        test = order[k::folds]
        train = np.setdiff1d(order, test)
        terms = fit_terms([rows[i] for i in train], base, names, seed)
        out[test] = predict([rows[i] for i in test], terms)
    return out


def leave_one_tp_out(rows: list[KernelRow], base: EngineTerms, names, seed: int = 0) -> np.ndarray | None:
    """Each TP's rows predicted by terms fitted on the other TPs (None with one TP)."""
    tps = sorted({r.tp for r in rows})
    if len(tps) < 2:
        return None
    out = np.empty(len(rows))
    for tp in tps:
        test = [i for i, r in enumerate(rows) if r.tp == tp]
        terms = fit_terms([r for r in rows if r.tp != tp], base, names, seed)
        out[test] = predict([rows[i] for i in test], terms)
    return out


def calibrate_steps(steps: list[MeasuredStep], model, cost_model: dict, fit=DEFAULT_FIT,
                    base_engine=None, seed: int = 0) -> dict:
    """Fit the engine terms `fit` to `steps`; returns the engine file's content (terms, errors)."""
    names = tuple(fit)
    bad = [n for n in names if n not in FITTABLE]
    if bad:
        raise ConfigError("fit", "terms among " + ", ".join(FITTABLE), bad[0])
    base = load_engine(base_engine if base_engine is not None else "none", "engine")
    base_terms = base.terms if base is not NO_ENGINE else EngineTerms()
    rows = kernel_rows(steps, model, cost_model)
    terms = fit_terms(rows, base_terms, names, seed)
    errors = {"in_sample": error_table(rows, predict(rows, terms)),
              "kernels_only": error_table(rows, np.array([r.gpu for r in rows])),
              "cross_validated_5fold": error_table(rows, cross_validated(rows, base_terms, names, seed=seed))}
    loo = leave_one_tp_out(rows, base_terms, names, seed)
    if loo is not None:
        errors["leave_one_tp_out"] = error_table(rows, loo)
    return {"type": "engine", "terms": dataclasses.asdict(terms), "fitted": list(names),
            "base_engine": base.name, "base_cost_model": {"model": model if isinstance(model, str) else str(model),
                                                          "cost_model": cost_model},
            "errors": errors}


def file_digest(path) -> dict:
    """Name, size and sha256 of a data file, for an engine file's provenance."""
    data = Path(path).read_bytes()
    return {"file": str(path), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
