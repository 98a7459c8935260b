"""Fit (or check) the roofline's GEMM curve and all-reduce model on Vidur's published tables.

    python validation/fit_gemm_collectives.py [--data /work/shared/data] [--check]

Prints the fitted constants of sim/costmodels/gemm_efficiency.py (CONSTANTS) and
collectives.py (CALIBRATION) and their errors; with --check, only the errors of the constants in
those modules (what their docstrings report). The row readers live in
cbsim/tools/scoreboard/vidur_tables.py (the scoreboard scores the same rows).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import least_squares

from cbsim.sim.costmodels import collectives, gemm_efficiency as ge
from cbsim.sim.costmodels.catalog.lookup import gpu_spec
from cbsim.profiler.converters.vidur_data import data_dir
from cbsim.tools.scoreboard.vidur_tables import (GEMM_OPS, NODES, allreduce_errors, allreduce_rows,  # noqa: F401
                                                 gemm_errors, gemm_rows)


def gemm_predict(rows: pd.DataFrame, t0: float, c: float, e_mem: float, spec) -> np.ndarray:
    m, n, k = (rows[key].to_numpy(float) for key in ("M", "N", "K"))
    compute = 2.0 * ge.TILE * np.ceil(m / ge.TILE) * n * k / (spec.bf16_flops * c)
    memory = (k * n + m * (k + n)) * 2.0 / (spec.hbm_bandwidth * e_mem)
    return t0 + np.maximum(compute, memory)


def fit_gemm(rows: pd.DataFrame, gpu: str) -> tuple[float, float, float]:
    spec, y = gpu_spec(gpu), rows["seconds"].to_numpy()
    res = least_squares(lambda p: np.log(gemm_predict(rows, p[0] * 1e-6, p[1], p[2], spec) / y),
                        [5.0, 0.7, 0.8], bounds=([0, 0.1, 0.1], [50, 1.0, 1.0]))
    return res.x[0] * 1e-6, res.x[1], res.x[2]


def fit_allreduce(rows: pd.DataFrame, topology: str) -> collectives.LinkModel:
    def residual(p):
        link = collectives.LinkModel(p[0] * 1e-6, p[1] * 1e-6, p[2] * 1e9, p[3] * 1e9)
        pred = [collectives.allreduce_seconds(float(s), int(n), link, topology)
                for n, s in rows[["n", "bytes"]].itertuples(index=False)]
        return np.log(np.array(pred) / rows["seconds"].to_numpy())
    res = least_squares(residual, [20, 1, 100, 20], bounds=([0, 0, 1, 1], [200, 50, 1000, 1000]))
    p = res.x
    return collectives.LinkModel(p[0] * 1e-6, p[1] * 1e-6, p[2] * 1e9, p[3] * 1e9)


def allreduce_table(rows: pd.DataFrame, err: np.ndarray) -> dict:
    """Median / p90 |error| by GPUs and message band (< 1 MiB, 1-16 MiB, >= 16 MiB)."""
    out = {}
    bands = (("<1MiB", 0, 1 << 20), ("1-16MiB", 1 << 20, 16 << 20), (">=16MiB", 16 << 20, 1 << 62))
    for n in sorted(rows["n"].unique()):
        for name, lo, hi in bands:
            keep = ((rows["n"] == n) & (rows["bytes"] >= lo) & (rows["bytes"] < hi)).to_numpy()
            if keep.any():
                e = np.abs(err[keep])
                out[f"n{n} {name}"] = (float(np.median(e)), float(np.quantile(e, 0.9)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="vidur data folder (default $CBSIM_DATA)")
    parser.add_argument("--check", action="store_true", help="only report the shipped constants' errors")
    args = parser.parse_args()
    data = data_dir(args.data or "/work/shared/data")
    for gpu in ("a100", "h100"):
        rows = gemm_rows(data, gpu)
        err = gemm_errors(rows, gpu)
        print(f"GEMM {gpu}: {len(rows)} rows, shipped median {np.median(err):.3f} p90 {np.quantile(err, .9):.3f}")
        if not args.check:
            print("  fitted (t0, c, e_mem):", [round(v, 9) for v in fit_gemm(rows, gpu)])
    for (gpu, topology), node in NODES.items():
        rows = allreduce_rows(data, node)
        err = allreduce_errors(rows, gpu, topology)
        print(f"all-reduce {node}: median {np.median(np.abs(err)):.3f} p90 {np.quantile(np.abs(err), .9):.3f}")
        print("  " + json.dumps({k: [round(a, 3), round(b, 3)] for k, (a, b) in allreduce_table(rows, err).items()}))
        if not args.check:
            print("  fitted:", fit_allreduce(rows, topology))


if __name__ == "__main__":
    main()
