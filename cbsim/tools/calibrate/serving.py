"""`cbsim calibrate --serving EXP=MEASURED`: fit engine terms so simulations reproduce measured
serving metrics (TTFT, TPOT, ITL, E2E means and percentiles).

Each evaluation of a candidate set of terms simulates every given experiment with
`cost_model.engine` set to those terms and compares every metric present on both sides (the
measured file read by cbsim/tools/compare/measured.py: cbsim's flat JSON, vLLM `bench serve --save-result` or
SGLang `bench_serving`). The objective is the mean squared log ratio simulated / measured. A
handful of terms (by default host_per_step_s, host_per_seq_s and frontend_s, the three that move
ITL, its growth with the batch, and TTFT apart) are searched by Nelder-Mead over t = unit * u^2
(so every host term stays >= 0) and, for the kernel factors (kernel_scale and the per-class
gemm_scale, attention_scale, collective_scale, moe_scale: signed corrections, below or above 1),
over f = exp(u) clipped to their physical range (terms.py), from the base engine's values (or a
typical magnitude), with a wide first simplex and one restart from the best point, for at most
`max_evals` evaluations: with experiments of a few thousand requests that is minutes. Stream latency
and front-end latency shift TTFT and E2E alike and cannot be told apart from these metrics: fit one
of them.

Class factors no case can identify are refused before the search (terms.class_refusals: a cost model
other than roofline, moe_scale on dense models, collective_scale where every case runs on one GPU).
After it, the Jacobian of the log errors at the end point (one more simulation per term, forward
differences) says which terms the metrics identify (identify.py); a simulation whose metrics are not
finite is a one-line ConfigError, not an abort mid-search. The report records the cases' GPUs,
models and TPs as its domain (domain.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import numpy as np
from scipy.optimize import minimize

from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.costmodels.engine import SWAP_TERMS, TERM_NAMES, load_engine

from cbsim.api import run_experiment
from cbsim.tools.compare.compare import experiment_config
from cbsim.core.errors import ConfigError
from cbsim.tools.compare.measured import load_measured, simulated_metrics
from cbsim.tools.calibrate.identify import identification, warnings_of
from cbsim.tools.calibrate.terms import SCALE_BOUNDS, SCALE_TERMS, class_refusals, unit

DEFAULT_FIT = ("host_per_step_s", "host_per_seq_s", "frontend_s")
START = {"host_per_step_s": 1e-3, "host_per_seq_s": 10e-6, "frontend_s": 10e-3, "stream_s": 1e-3}
STEP = 0.05  # forward-difference step in search units for the identification Jacobian


def _pairs(specs, key: str) -> list[tuple[str, str]]:
    """EXP=MEASURED strings -> (experiment, measured) pairs; a clear error for a malformed one."""
    out = []
    for spec in specs:
        exp, sep, meas = spec.partition("=")
        if not sep or not exp or not meas:
            raise ConfigError(key, "EXPERIMENT.yaml=MEASURED.json", spec)
        out.append((exp, meas))
    return out


def load_cases(specs, key: str = "serving"):
    """(experiment config, measured run, notes) for each EXP=MEASURED."""
    cases = []
    for exp, meas in _pairs(specs, key):
        run = load_measured(meas)
        cfg, notes = experiment_config(exp, run, None)
        cases.append((cfg, run, notes))
    return cases


def simulate_metrics(cfg, engine: dict) -> dict:
    """Metrics of one simulation of `cfg` with `cost_model.engine` replaced by `engine`."""
    run_cfg = replace(cfg, cost_model={**cfg.cost_model, "engine": engine}, output=replace(cfg.output, dir=None))
    try:
        results = run_experiment(run_cfg)
    except ConfigError as err:
        raise err.in_file(cfg.source)
    return simulated_metrics(results)


def case_errors(cases, engine: dict) -> list[dict]:
    """Per case: {metric: (measured, simulated, signed relative error)} for the shared metrics."""
    out = []
    for cfg, run, _ in cases:
        sim = simulate_metrics(cfg, engine)
        shared = sorted(k for k in run.metrics if k in sim and sim[k] == sim[k] and sim[k] > 0)
        out.append({k: (run.metrics[k], sim[k], sim[k] / run.metrics[k] - 1.0) for k in shared})
    return out


def calibrate_serving(cases, fit=DEFAULT_FIT, base_engine=None, max_evals: int = 60, holdout=()) -> dict:
    """Search the terms `fit`; returns the engine file's content with per-metric errors."""
    names = tuple(dict.fromkeys(fit))
    bad = [n for n in names if n not in TERM_NAMES or n in ("overlap", "host_hidden_share", "cuda_graph_max_batch",
                                                            "output_lag_steps", *SWAP_TERMS)]
    if bad:
        raise ConfigError("fit", "numeric engine terms (" + ", ".join(TERM_NAMES) + ")", bad[0])
    if max_evals <= len(names) + 1:  # fewer than one simplex: the search would not run at all
        raise ConfigError("--max-evals", f"more than {len(names) + 1} evaluations (one Nelder-Mead simplex of "
                          f"{len(names)} terms)", max_evals)
    base = load_engine(base_engine if base_engine is not None else "none", "engine")
    base_terms = dataclasses.asdict(base.terms)
    refused = _refused(cases, names)
    names = tuple(n for n in names if n not in refused)
    if not names:
        raise ConfigError("fit", "at least one term the measured runs can identify", ", ".join(refused))

    def terms_of(u) -> dict:
        return {**base_terms, **{n: _value(n, x) for n, x in zip(names, u)}}

    evaluations = []

    def residuals(u) -> np.ndarray:
        logs = np.array([np.log1p(e[2]) for case in case_errors(cases, terms_of(u)) for e in case.values()])
        if not len(logs):
            raise ConfigError("serving", "measured metrics that the simulation also reports", "none in common")
        if not np.all(np.isfinite(logs)):
            raise ConfigError("fit", "terms whose simulated metrics are finite (a degenerate fit)", terms_of(u))
        return logs

    def objective(u) -> float:
        value = float(np.mean(np.square(residuals(u))))
        evaluations.append(value)
        return value

    point = np.array([_search_point(n, base_terms[n]) for n in names])
    result = None
    for spread in (1.0, 0.25):  # a wide simplex (the objective steps as the schedule changes), then a restart
        simplex = np.vstack([point] + [point + _spread(n, spread, point[i]) * np.eye(len(point))[i]
                                       for i, n in enumerate(names)])
        budget = max_evals - len(evaluations)
        if budget <= len(point):
            break
        result = minimize(objective, point, method="Nelder-Mead",
                          options={"maxfev": budget, "xatol": 1e-3, "fatol": 1e-7, "initial_simplex": simplex})
        point = result.x
    if result is None:
        raise ConfigError("--max-evals", f"more evaluations than terms ({len(names)})", max_evals)
    terms = terms_of(result.x)
    report = {"type": "engine", "terms": terms, "fitted": list(names), "base_engine": base.name,
              "search": {"method": "Nelder-Mead over t = unit * u^2 (host terms), f = exp(u) (kernel factors)",
                         "evaluations": len(evaluations), "objective": float(result.fun)},
              "errors": {"training": _named(cases, case_errors(cases, terms))},
              "identification": _identify(residuals, result.x, names, refused),
              "domain": _domain(cases)}
    if holdout:
        report["errors"]["holdout"] = _named(holdout, case_errors(holdout, terms))
    return report


def _value(name: str, x: float) -> float:
    """A term's value at search coordinate x: unit * x^2 for host terms, exp(x) in range for factors."""
    if name in SCALE_TERMS:
        return float(np.exp(np.clip(x, *np.log(SCALE_BOUNDS))))
    return float(unit(name) * x * x)


def _search_point(name: str, value: float) -> float:
    """The search coordinate of a start value (a typical magnitude when the base has 0)."""
    if name in SCALE_TERMS:
        return float(np.log(value))
    return float(np.sqrt(max(value, START.get(name, 1e-3)) / unit(name)))


def _spread(name: str, spread: float, x: float) -> float:
    """The first simplex's step along a term: relative for host terms, +-log(1 + spread / 2) for factors."""
    return float(np.log1p(spread / 2)) if name in SCALE_TERMS else spread * x


def _refused(cases, names) -> dict:
    """{class factor: why} for the factors no case can identify (terms.class_refusals)."""
    types = {cfg.cost_model.get("type") for cfg, _, _ in cases}
    models = [model_spec(cfg.model, "model") for cfg, _, _ in cases]
    tps = [int(cfg.cost_model.get("tp", 1) or 1) for cfg, _, _ in cases]
    return class_refusals(names, types.pop() if len(types) == 1 else "mixed", any(m.is_moe for m in models),
                          max(tps))


def _identify(residuals, x: np.ndarray, names, refused: dict) -> dict:
    """identify.identification from a forward-difference Jacobian of the log errors at `x`."""
    base = residuals(x)
    jac = np.column_stack([(residuals(x + STEP * np.eye(len(x))[i]) - base) / STEP for i in range(len(x))])
    lower = [np.log(SCALE_BOUNDS[0]) if n in SCALE_TERMS else -np.inf for n in names]  # host: t = unit u^2
    upper = [np.log(SCALE_BOUNDS[1]) if n in SCALE_TERMS else np.inf for n in names]
    found = identification(jac, names, x, 0.5 * float(np.sum(base ** 2)), lower, upper)
    found["refused"] = refused
    found["warnings"] = [f"{n}: refused: {why}" for n, why in refused.items()] + warnings_of(found)
    return found


def _domain(cases) -> dict:
    """The GPUs, models and TPs of the cases (batch and context are not bounded by a serving fit)."""
    from cbsim.sim.costmodels import load_cost_model

    gpus, models, tps = set(), set(), set()
    for cfg, _, _ in cases:
        described = load_cost_model(cfg.cost_model, model_spec(cfg.model, "model")).describe()
        gpus.add(described.get("gpu"))
        models.add(described.get("model"))
        tps.add(int(described.get("tp") or 1))
    return {"gpu": sorted(g for g in gpus if g), "model": sorted(m for m in models if m), "tp": sorted(tps)}


def _named(cases, errors) -> dict:
    """{experiment file: {metric: {measured, simulated, error}}}."""
    out = {}
    for (cfg, run, notes), case in zip(cases, errors):
        out[f"{cfg.source or cfg.name}={run.source}"] = {
            k: {"measured": m, "simulated": s, "error": e} for k, (m, s, e) in case.items()}
    return out
