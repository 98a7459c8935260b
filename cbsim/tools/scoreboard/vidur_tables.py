"""Vidur's published per-operator tables (shared/data/vidur, microsoft/vidur @7d47513) as rows the
roofline's kernels are scored on: the four GEMMs of mlp.csv and the single-node all-reduces of
all_reduce.csv. Read by the scoreboard and by validation/fit_gemm_collectives.py (which fits the
GEMM curve and the all-reduce constants on these rows).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from cbsim.sim.costmodels import collectives, gemm_efficiency as ge
from cbsim.sim.costmodels.catalog.lookup import gpu_spec

GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
NODES = {("a100", "nvswitch"): "a100_dgx", ("h100", "nvswitch"): "h100_dgx",
         ("a100", "nvlink_pairwise"): "a100_pairwise_nvlink", ("h100", "nvlink_pairwise"): "h100_pairwise_nvlink"}


def gemm_rows(data: Path, gpu: str) -> pd.DataFrame:
    """One row per (model file, TP, num_tokens, GEMM): M, N, K per GPU and the median seconds."""
    out = []
    for path in sorted((data / "data" / "profiling" / "compute" / gpu).glob("*/*/mlp.csv")):
        frame = pd.read_csv(path)
        tp = frame["num_tensor_parallel_workers"]
        hd = frame["n_embd"] // frame["n_head"]
        q = frame["n_head"] // tp * hd
        kv = np.maximum(1, frame["n_kv_head"] // tp) * hd
        ffn = frame["n_expanded_embd"] // tp
        up = ffn * np.where(frame["use_gated_mlp"].astype(bool), 2, 1)
        shapes = {"attn_pre_proj": (frame["n_embd"], q + 2 * kv), "attn_post_proj": (q, frame["n_embd"]),
                  "mlp_up_proj": (frame["n_embd"], up), "mlp_down_proj": (ffn, frame["n_embd"])}
        for op, (k, n) in shapes.items():
            column = f"time_stats.{op}.median"
            if column not in frame:
                continue
            part = pd.DataFrame({"model": path.parent.name, "tp": tp, "op": op, "M": frame["num_tokens"],
                                 "K": k, "N": n, "seconds": frame[column] * 1e-3})
            out.append(part.dropna())
    return pd.concat(out, ignore_index=True)


def gemm_predicted(rows: pd.DataFrame, gpu: str) -> np.ndarray:
    """The shipped GEMM curve's seconds for every row (GemmCurve.seconds)."""
    curve = ge.gemm_curve(gpu_spec(gpu))
    return np.array([curve.seconds(m, n, k) for m, n, k in rows[["M", "N", "K"]].itertuples(index=False)])


def gemm_errors(rows: pd.DataFrame, gpu: str) -> np.ndarray:
    """|predicted / measured - 1| of the shipped curve, one per row."""
    return np.abs(gemm_predicted(rows, gpu) / rows["seconds"].to_numpy() - 1)


def allreduce_rows(data: Path, node: str) -> pd.DataFrame:
    """Single-node all-reduce medians: columns n, bytes, seconds (duplicates: median, as vidur_data)."""
    frame = pd.read_csv(data / "data" / "profiling" / "network" / node / "all_reduce.csv")
    frame = frame[frame["devices_per_node"] == frame["num_workers"]]
    med = frame.groupby(["num_workers", "size"])["time_stats.all_reduce.median"].median().dropna()
    return pd.DataFrame({"n": med.index.get_level_values(0), "bytes": med.index.get_level_values(1),
                         "seconds": med.to_numpy() * 1e-3})


def allreduce_predicted(rows: pd.DataFrame, gpu: str, topology: str) -> np.ndarray:
    """The shipped all-reduce model's seconds for every row."""
    link = collectives.link_model(gpu, topology)
    return np.array([collectives.allreduce_seconds(float(s), int(n), link, topology)
                     for n, s in rows[["n", "bytes"]].itertuples(index=False)])


def allreduce_errors(rows: pd.DataFrame, gpu: str, topology: str) -> np.ndarray:
    """Signed predicted / measured - 1, one per row."""
    return allreduce_predicted(rows, gpu, topology) / rows["seconds"].to_numpy() - 1
