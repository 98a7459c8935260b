"""Fit the pipeline hand-off's point-to-point send, t = base + S / B, on Vidur's send_recv tables.

Reads shared/data/vidur/data/profiling/network/<node>/send_recv.csv (microsoft/vidur 7d47513, MIT):
medians of a send/recv between two GPUs, `devices_per_node` 2 (one node) or 1 (two nodes). Relative
least squares (minimise sum ((base + S / B) / t - 1)^2), printed with the |error| median and p90;
sim/costmodels/pipeline.py P2P_FIT holds the one-node results. Usage:
    CBSIM_DATA=/work/shared/data python validation/fit_send_recv.py
"""
from __future__ import annotations

import csv
import os
from pathlib import Path

import numpy as np

NODES = ("a100_dgx", "h100_dgx", "a100_pairwise_nvlink", "h100_pairwise_nvlink")


def fit(sizes: np.ndarray, seconds: np.ndarray) -> tuple[float, float]:
    """(base s, bandwidth bytes/s) minimising the relative error."""
    design = np.stack([1.0 / seconds, sizes / seconds], axis=1)
    (base, per_byte), *_ = np.linalg.lstsq(design, np.ones_like(seconds), rcond=None)
    return float(base), float(1.0 / per_byte)


def main() -> None:
    root = Path(os.environ.get("CBSIM_DATA", "/work/shared/data")) / "vidur/data/profiling/network"
    for node in NODES:
        rows = list(csv.DictReader(open(root / node / "send_recv.csv")))
        for per_node, where in (("2", "one node"), ("1", "two nodes")):
            mine = [r for r in rows if r["devices_per_node"] == per_node]
            sizes = np.array([float(r["size"]) for r in mine])
            seconds = np.array([float(r["time_stats.send_recv.median"]) * 1e-3 for r in mine])
            base, bandwidth = fit(sizes, seconds)
            err = np.abs((base + sizes / bandwidth) / seconds - 1.0)
            print(f"{node:22s} {where:9s} rows {len(mine):4d}  base {base * 1e6:6.1f} us  B {bandwidth / 1e9:6.1f} GB/s"
                  f"  |error| median {np.median(err):6.1%} p90 {np.percentile(err, 90):6.1%}")


if __name__ == "__main__":
    main()
