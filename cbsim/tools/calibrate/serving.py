"""`cbsim calibrate --serving EXP=MEASURED`: fit engine terms so simulations reproduce measured
serving metrics (TTFT, TPOT, ITL, E2E means and percentiles).

Each evaluation of a candidate set of terms simulates every given experiment with
`cost_model.engine` set to those terms and compares every metric present on both sides (the
measured file read by cbsim/tools/compare/measured.py: cbsim's flat JSON, vLLM `bench serve --save-result` or
SGLang `bench_serving`). The objective is the mean squared log ratio simulated / measured. A
handful of terms (by default host_per_step_s, host_per_seq_s and frontend_s, the three that move
ITL, its growth with the batch, and TTFT apart) are searched by Nelder-Mead over t = unit * u^2
(so every term stays >= 0), from the base engine's values (or a typical magnitude), with a wide
first simplex and one restart from the best point, for at most `max_evals` evaluations:
with experiments of a few thousand requests that is minutes. Stream latency and front-end
latency shift TTFT and E2E alike and cannot be told apart from these metrics: fit one of them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import numpy as np
from scipy.optimize import minimize

from cbsim.sim.costmodels.engine import TERM_NAMES, load_engine

from cbsim.api import run_experiment
from cbsim.tools.compare.compare import experiment_config
from cbsim.core.errors import ConfigError
from cbsim.tools.compare.measured import load_measured, simulated_metrics

DEFAULT_FIT = ("host_per_step_s", "host_per_seq_s", "frontend_s")
UNITS = {"host_per_seq_s": 1e-6, "host_per_prefill_s": 1e-6, "host_per_token_s": 1e-6,
         "frontend_per_prompt_token_s": 1e-6, "kernel_scale": 1.0}
START = {"host_per_step_s": 1e-3, "host_per_seq_s": 10e-6, "frontend_s": 10e-3, "stream_s": 1e-3,
         "kernel_scale": 1.0}


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
    names = tuple(fit)
    bad = [n for n in names if n not in TERM_NAMES or n in ("overlap", "cuda_graph_max_batch", "output_lag_steps")]
    if bad:
        raise ConfigError("fit", "numeric engine terms (" + ", ".join(TERM_NAMES) + ")", bad[0])
    if max_evals <= len(names) + 1:  # fewer than one simplex: the search would not run at all
        raise ConfigError("--max-evals", f"more than {len(names) + 1} evaluations (one Nelder-Mead simplex of "
                          f"{len(names)} terms)", max_evals)
    base = load_engine(base_engine if base_engine is not None else "none", "engine")
    base_terms = dataclasses.asdict(base.terms)
    units = [UNITS.get(n, 1e-3) for n in names]

    def terms_of(u) -> dict:
        return {**base_terms, **{n: float(unit * x * x) for n, unit, x in zip(names, units, u)}}

    evaluations = []

    def objective(u) -> float:
        errors = case_errors(cases, terms_of(u))
        logs = [np.log1p(e[2]) for case in errors for e in case.values()]
        if not logs:
            raise ConfigError("serving", "measured metrics that the simulation also reports", "none in common")
        value = float(np.mean(np.square(logs)))
        evaluations.append(value)
        return value

    point = np.array([np.sqrt(max(base_terms[n], START.get(n, 1e-3)) / unit) for n, unit in zip(names, units)])
    result = None
    for spread in (1.0, 0.25):  # a wide simplex (the objective steps as the schedule changes), then a restart
        simplex = np.vstack([point] + [point + spread * point[i] * np.eye(len(point))[i] for i in range(len(point))])
        budget = max_evals - len(evaluations)
        if budget <= len(point):
            break
        result = minimize(objective, point, method="Nelder-Mead",
                          options={"maxfev": budget, "xatol": 1e-3, "fatol": 1e-7, "initial_simplex": simplex})
        point = result.x
    terms = terms_of(result.x)
    report = {"type": "engine", "terms": terms, "fitted": list(names), "base_engine": base.name,
              "search": {"method": "Nelder-Mead over t = unit * u^2", "evaluations": len(evaluations),
                         "objective": float(result.fun)},
              "errors": {"training": _named(cases, case_errors(cases, terms))}}
    if holdout:
        report["errors"]["holdout"] = _named(holdout, case_errors(holdout, terms))
    return report


def _named(cases, errors) -> dict:
    """{experiment file: {metric: {measured, simulated, error}}}."""
    out = {}
    for (cfg, run, notes), case in zip(cases, errors):
        out[f"{cfg.source or cfg.name}={run.source}"] = {
            k: {"measured": m, "simulated": s, "error": e} for k, (m, s, e) in case.items()}
    return out
