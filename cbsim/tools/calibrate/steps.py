"""`cbsim calibrate --steps`: fit the engine terms to measured whole-step times.

For every measured step the base cost model (BASE.yaml's `model:` and `cost_model:`, evaluated at
the row's TP with a zero engine, i.e. kernels only) prices the kernels: gpu_i, and, for a roofline,
the seconds of each kernel class in it (GEMMs, attention, collectives, MoE experts: the change of
gpu_i when that class's factor goes from 1 to 2; one pipeline stage's roofline is linear in each),
so a class factor f_c prices the kernels at gpu_i + sum_c (f_c - 1) t_ic. The engine model (sim/costmodels/engine.py)
turns that and the step's shape into a step time. The terms named in `fit` minimise
sum_i w_i * log(predicted_i / measured_i)^2  (relative error, as symmetric for too fast as for too
slow), by bounded least squares (scipy's trust-region reflective) within each term's physical range
(terms.py) from the base engine's values and from seeded random starts; the best end point wins.
The other terms keep the base engine's values (its structure: overlap, CUDA-graph sizes).

Before the fit, a class factor no row has kernels of (collectives at TP1, MoE on a dense model, any
class on a cost model that does not split them) is refused: left at its base value, with a warning.
After it, identify.py reports from the Jacobian which fitted terms the data pins down. A fit that
cannot run (fewer rows than terms, a prediction that is not finite) is a ConfigError, not a traceback.
The report also records the calibration's domain (GPUs, models, TPs, batch sizes, contexts: domain.py),
so a later prediction outside it is warned about.

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
from cbsim.sim.costmodels.domain import domain_of
from cbsim.sim.costmodels.registry import takes_engine
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.costmodels.engine import (CLASS_TERMS, FRONTEND_TERMS, NO_ENGINE, SWAP_TERMS, TERM_NAMES, Engine,
                                         EngineTerms, load_engine)
from cbsim.profiler.converters.step_table import MeasuredStep
from cbsim.tools.calibrate.identify import droppable, identification, warnings_of
from cbsim.tools.calibrate.terms import SCALE_TERMS, bounds, class_refusals, unit

DEFAULT_FIT = ("host_per_step_s", "host_per_seq_s", "host_per_token_s", "launch_per_layer_s",
               "collective_per_rank_s")
# the numeric terms a step time shows (the front end acts outside the steps: fit it with --serving)
FITTABLE = tuple(n for n in TERM_NAMES if n not in ("overlap", "host_hidden_share", "cuda_graph_max_batch", *FRONTEND_TERMS,
                                                     *SWAP_TERMS))
# the range random starts are drawn from, in optimiser units (terms.py)
START_RANGE = {**{name: (0.7, 1.5) for name in SCALE_TERMS}, "host_per_seq_s": (0, 100), "host_per_token_s": (0, 10),
               "launch_per_layer_s": (0, 0.5), "collective_launch_s": (0, 0.1), "collective_per_rank_s": (0, 0.05)}
STARTS = 8
# the robust fit's loss: soft_l1 with its knee at a 5 % log error, about the run-to-run spread of measured
# step medians (a choice made before scoring any held-out data, not tuned on it)
ROBUST = {"loss": "soft_l1", "f_scale": 0.05}


@dataclass
class KernelRow:
    """A measured step with what the fit needs: kernel seconds and the engine's inputs."""

    step: MeasuredStep
    gpu: float
    layers: int
    tp: int
    classes: tuple = (0.0, 0.0, 0.0, 0.0)  # seconds of gpu in each kernel class (engine.KERNEL_CLASSES)


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
            models[key] = _kernel_models(base, step, model)
        cost, by_class = models[key]
        layers = getattr(cost, "num_layers", None) or cost.model.num_layers
        tp = step.tp or cost.describe().get("tp") or 1
        gpu = cost.step_time(step.shape)
        classes = tuple(c.step_time(step.shape) - gpu for c in by_class) if by_class else KernelRow.classes
        rows.append(KernelRow(step, gpu, int(layers), int(tp), classes))
    return rows


def _kernel_models(base: dict, step: MeasuredStep, model) -> tuple:
    """(the kernels at the step's TP and model, and for a roofline the same with each class doubled)."""
    mapping = dict(base)
    if step.tp is not None:
        mapping["tp"] = step.tp
    spec = model_spec(step.model or model, "model")
    cost = load_cost_model({**mapping, "engine": {}}, spec, "cost_model")  # zero terms: the kernels alone
    if base.get("type") != "roofline":
        return cost, None
    return cost, [load_cost_model({**mapping, "engine": {name: 2.0}}, spec, "cost_model") for name in CLASS_TERMS]


def predict(rows: list[KernelRow], terms: EngineTerms) -> np.ndarray:
    """Step seconds the engine terms give for each row."""
    engines: dict = {}
    out = np.empty(len(rows))
    scales = terms.class_scales
    for i, row in enumerate(rows):
        key = (row.layers, row.tp)
        if key not in engines:
            engines[key] = Engine(terms, "fit").bind(row.layers, row.tp, classes=True)
        gpu = row.gpu + sum((f - 1.0) * t for f, t in zip(scales, row.classes))  # + 0.0 when every f is 1
        out[i] = engines[key].step_of(gpu, row.step.shape)
    return out


def _terms(base: EngineTerms, names, x) -> EngineTerms:
    return dataclasses.replace(base, **{n: float(v) * unit(n) for n, v in zip(names, x)})


def fit_terms(rows: list[KernelRow], base: EngineTerms, names: tuple[str, ...], seed: int = 0,
              robust: bool = False) -> EngineTerms:
    """The terms `names` minimising the weighted squared log error over `rows` (robust: see `solve`)."""
    return solve(rows, base, names, seed, robust)[0]


def solve(rows: list[KernelRow], base: EngineTerms, names: tuple[str, ...], seed: int = 0,
          robust: bool = False) -> tuple:
    """(fitted terms, scipy's result at the best end point); ConfigError when the fit cannot run. With
    `robust`, scipy's soft_l1 loss at ROBUST_SCALE: a log error well beyond it counts about linearly,
    not squared, so a few anomalous steps (a batch that did not fit in memory) do not drag the terms."""
    if len(rows) < len(names):
        raise ConfigError("fit", f"at least as many measured steps as terms ({len(names)})", len(rows))
    measured = np.array([r.step.time_s for r in rows])
    weight = np.sqrt([r.step.weight for r in rows])

    def residual(x):
        out = weight * np.log(predict(rows, _terms(base, names, x)) / measured)
        if not np.all(np.isfinite(out)):
            raise ConfigError("fit", "terms whose predicted step times are finite and > 0 (a degenerate fit)",
                              dict(zip(names, (float(v) * unit(n) for n, v in zip(names, x)))))
        return out

    lower, upper = (np.array(b, dtype=float) for b in zip(*(bounds(n) for n in names)))
    rng = np.random.default_rng(seed)
    starts = [[getattr(base, n) / unit(n) for n in names]]
    for _ in range(STARTS - 1):
        starts.append([rng.uniform(*START_RANGE.get(n, (0, 5))) for n in names])
    best = None
    for x0 in starts:
        res = least_squares(residual, np.clip(x0, lower, np.minimum(upper, 1e12)), bounds=(lower, upper),
                            method="trf", x_scale=1.0, **(ROBUST if robust else {}))
        if best is None or res.cost < best.cost:
            best = res
    return _terms(base, names, best.x), best


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


def cross_validated(rows: list[KernelRow], base: EngineTerms, names, folds: int = 5, seed: int = 0,
                    robust: bool = False) -> np.ndarray:
    """Out-of-fold predictions: each row predicted by terms fitted without its fold."""
    order = np.random.default_rng(seed).permutation(len(rows))
    out = np.empty(len(rows))
    for k in range(min(folds, len(rows))):
        test = order[k::folds]
        train = np.setdiff1d(order, test)
        terms = fit_terms([rows[i] for i in train], base, names, seed, robust)
        out[test] = predict([rows[i] for i in test], terms)
    return out


def leave_one_tp_out(rows: list[KernelRow], base: EngineTerms, names, seed: int = 0,
                     robust: bool = False) -> np.ndarray | None:
    """Each TP's rows predicted by terms fitted on the other TPs (None with one TP)."""
    tps = sorted({r.tp for r in rows})
    if len(tps) < 2:
        return None
    out = np.empty(len(rows))
    for tp in tps:
        test = [i for i, r in enumerate(rows) if r.tp == tp]
        terms = fit_terms([r for r in rows if r.tp != tp], base, names, seed, robust)
        out[test] = predict([rows[i] for i in test], terms)
    return out


def calibrate_steps(steps: list[MeasuredStep], model, cost_model: dict, fit=DEFAULT_FIT,
                    base_engine=None, seed: int = 0, drop_unidentified: bool = False, robust: bool = False) -> dict:
    """Fit the engine terms `fit` to `steps`; returns the engine file's content (terms, errors). With
    `drop_unidentified`, the terms the fit leaves unidentified (identify.droppable) are refused and the
    rest refitted, until every fitted term moves some step on its own; `robust`: the soft_l1 loss (solve)."""
    names = tuple(dict.fromkeys(fit))
    bad = [n for n in names if n not in FITTABLE]
    if bad:
        raise ConfigError("fit", "terms among " + ", ".join(FITTABLE), bad[0])
    if not steps:
        raise ConfigError("steps", "at least one measured step", 0)
    base = load_engine(base_engine if base_engine is not None else "none", "engine")
    base_terms = base.terms if base is not NO_ENGINE else EngineTerms()
    rows = kernel_rows(steps, model, cost_model)
    refused = _refused(rows, names, cost_model)
    while True:
        names = tuple(n for n in names if n not in refused)
        if not names:
            raise ConfigError("fit", "at least one term the measured steps can identify", ", ".join(refused))
        terms, best = solve(rows, base_terms, names, seed, robust)
        found = identification(best.jac, names, best.x, best.cost, *zip(*(bounds(n) for n in names)))
        drop = droppable(found, names) if drop_unidentified else {}
        if not drop:
            break
        refused.update(drop)
    found["refused"] = refused
    found["warnings"] = [f"{n}: refused: {why}" for n, why in refused.items()] + warnings_of(found)
    errors = {"in_sample": error_table(rows, predict(rows, terms)),
              "kernels_only": error_table(rows, np.array([r.gpu for r in rows])),
              "cross_validated_5fold": error_table(rows, cross_validated(rows, base_terms, names, seed=seed,
                                                                         robust=robust))}
    loo = leave_one_tp_out(rows, base_terms, names, seed, robust)
    if loo is not None:
        errors["leave_one_tp_out"] = error_table(rows, loo)
    return {"type": "engine", "terms": dataclasses.asdict(terms), "fitted": list(names),
            "base_engine": base.name, "base_cost_model": {"model": model if isinstance(model, str) else str(model),
                                                          "cost_model": cost_model},
            "errors": errors, "identification": found, "domain": domain_of([r.step for r in rows], model),
            "loss": ROBUST if robust else {"loss": "linear"}}


def _refused(rows: list[KernelRow], names, cost_model: dict) -> dict:
    """{class factor: why} for the factors among `names` no row has kernels of (terms.class_refusals, or
    every row's seconds in that class zero)."""
    out = class_refusals(names, cost_model.get("type"), True, max(r.tp for r in rows))  # the rows say the rest
    for i, name in enumerate(CLASS_TERMS):
        if name in names and name not in out and not any(r.classes[i] for r in rows):
            out[name] = "no measured step has kernels of this class"
    return out


def file_digest(path) -> dict:
    """Name, size and sha256 of a data file, for an engine file's provenance."""
    data = Path(path).read_bytes()
    return {"file": str(path), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
