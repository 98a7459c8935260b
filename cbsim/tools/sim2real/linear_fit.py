"""Calibrate cbsim's `linear` cost model on recorded engine steps.

step time = base + per_token * tokens + per_seq * sequences + per_kv_token * cached tokens read
(profiler/costmodels/linear.py, whose features these are: tokens = prefill chunk tokens + decode rows,
cached tokens read = each chunk's history h + each decode's context). The coefficients are non-negative
least squares (scipy's nnls) on the seconds themselves, unweighted: a request's latencies are sums of
step times, so the fit should match the mean step time. (Weighting by 1 / time, to minimise relative
error, biased the fit low by half here: on a shared machine a step's noise is a long right tail of
stalls, and relative error punishes overshooting a fast step more than undershooting a stalled one.)
On a CPU engine
cbsim's GPU cost models (roofline, vidur) price kernels this machine does not run: the whole-step times
the recorder measures are fitted directly. A GPU user calibrates the engine terms of a GPU cost model
on the same step table instead (`cbsim calibrate --steps steps.jsonl --cost-model BASE.yaml`).
"""
from __future__ import annotations

import numpy as np
from scipy.optimize import nnls

TERMS = ("base", "per_token", "per_seq", "per_kv_token")


def features(row: dict) -> list[float]:
    prefill, decode = row["prefill"], row["decode"]
    tokens = sum(c for c, _ in prefill) + len(decode)
    reads = sum(h for _, h in prefill) + sum(decode)
    return [1.0, float(tokens), float(len(prefill) + len(decode)), float(reads)]


def fit_linear(rows: list[dict]) -> dict:
    """{"cost_model": {type: linear, ...}, "errors": in-sample relative errors} from step rows."""
    x = np.array([features(r) for r in rows], dtype=np.float64)
    y = np.array([r["time_s"] for r in rows], dtype=np.float64)
    coef, _ = nnls(x, y)
    predicted = x @ coef
    error = np.abs(predicted / y - 1.0)
    return {"cost_model": {"type": "linear", **{name: float(v) for name, v in zip(TERMS, coef)}},
            "steps": len(rows), "median_abs_error": float(np.median(error)),
            "p90_abs_error": float(np.quantile(error, 0.9))}
