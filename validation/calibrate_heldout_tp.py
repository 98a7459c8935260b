"""Held-out TP check of `cbsim calibrate --steps`: fit on Splitwise's TP2 + TP8 steps, predict TP4.

    python validation/calibrate_heldout_tp.py --csv perf_model.csv [--gpu a100|h100] [--engine ENGINE]
                                              [--drop-unidentified] [--robust]

The CSV is Splitwise's whole profiling database (Mutinifni/splitwise-sim data/perf_model.csv @3780880,
MIT; Llama-2-70B at TP2, TP4 and TP8 on A100-80GB and H100-80GB under vLLM as of 2023): the project
ships its A100 TP2/TP8 rows only (shared/data/measured), so TP4 must come from there. For each term set
(the default host terms; they plus one kernel factor; they plus the per-class factors) it fits the
roofline on the GPU's TP2 + TP8 rows, prints the terms the data did not identify, and the median
|error| of the held-out TP4 rows by phase, next to the uncalibrated base engine's (--engine, default
none: kernels only; vllm-2023-a100 to score that preset).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from cbsim.profiler.converters.splitwise import read_splitwise
from cbsim.sim.costmodels.engine import CLASS_TERMS, load_engine
from cbsim.tools.calibrate.steps import DEFAULT_FIT, calibrate_steps, kernel_rows, predict

SETS = {"host terms": DEFAULT_FIT, "+ kernel_scale": DEFAULT_FIT + ("kernel_scale",),
        "+ class factors": DEFAULT_FIT + CLASS_TERMS}


def held_out(rows, predicted) -> dict:
    """Median |error| by phase of the TP4 rows."""
    out = {}
    for kind in ("decode", "prefill"):
        idx = [i for i, r in enumerate(rows) if r.step.kind == kind]
        rel = predicted[idx] / np.array([rows[i].step.time_s for i in idx]) - 1
        out[kind] = (float(np.median(np.abs(rel))), float(np.median(rel)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", type=Path, required=True)
    parser.add_argument("--gpu", default="a100")
    parser.add_argument("--engine", default="none", help="base engine: its uncalibrated errors are printed first")
    parser.add_argument("--robust", action="store_true", help="the robust loss (calibrate --robust)")
    parser.add_argument("--drop-unidentified", action="store_true", help="refit without the terms the data does "
                        "not identify (calibrate --drop-unidentified)")
    args = parser.parse_args()
    steps = [s for s in read_splitwise(args.csv)[0] if s.gpu == args.gpu and s.model == "llama-2-70b"]
    train = [s for s in steps if s.tp in (2, 8)]
    test = [s for s in steps if s.tp == 4]
    cost = {"type": "roofline", "gpu": args.gpu}
    rows = kernel_rows(test, "llama-2-70b", cost)
    base = load_engine(args.engine)
    print(f"{args.gpu}: {len(train)} TP2+TP8 steps fitted, {len(test)} TP4 steps held out")
    for label, table in [(f"uncalibrated ({args.engine})", held_out(rows, predict(rows, base.terms)))] + [
            (label, None) for label in SETS]:
        if table is None:
            report = calibrate_steps(train, "llama-2-70b", cost, SETS[label], args.engine,
                                     drop_unidentified=args.drop_unidentified, robust=args.robust)
            from cbsim.sim.costmodels.engine import EngineTerms
            table = held_out(rows, predict(rows, EngineTerms(**report["terms"])))
            warn = report["identification"]["warnings"]
            fitted = ", ".join(f"{n}={report['terms'][n]:.4g}" for n in report["fitted"])
        else:
            warn, fitted = [], ""
        print(f"  {label:<28} TP4 decode {table['decode'][0]:6.1%} (bias {table['decode'][1]:+.1%})   "
              f"prefill {table['prefill'][0]:6.1%} (bias {table['prefill'][1]:+.1%})")
        if fitted:
            print(f"    {fitted}")
        for line in warn:
            print(f"    warning: {line}")


if __name__ == "__main__":
    main()
