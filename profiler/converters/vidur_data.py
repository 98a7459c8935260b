"""Vidur's published profiling tables -> compact JSON profiles for the `vidur` cost model.

Reading the CSVs takes seconds; the cost model must load in milliseconds and must not need the
shared data at run time. So `cbsim vidur-convert` reads the tables once and writes small JSON
files under sim/costmodels/profiles/vidur/ (shipped with the package):
  <gpu>-<model>-tp<N>.json   token operators (mlp.csv medians, ms, per num_tokens), attention
                             (attention.csv medians where a table exists, else a roofline
                             calibrated on the A100 table), TP all-reduce curve, LM-head rule,
                             and provenance (source files, what is measured, what is modelled)
  network/<node>.json        all-reduce medians per message size for each GPU count in a node
Values are kept as published (duplicated keys averaged); smoothing happens at load time.

Data: Vidur (microsoft/vidur, MIT); see shared/data/vidur/SOURCE.md for columns and commits.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import MappingProxyType

import numpy as np
import pandas as pd
from scipy.optimize import nnls

from cbsim.core.data import data_dir as default_data

from cbsim.sim.costmodels.allreduce import table_spec
from cbsim.sim.costmodels.catalog.specs import GPU_PRESETS
from cbsim.sim.costmodels.vidur import PROFILE_DIR

FORMAT = 1
TOKEN_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
             "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")

def _gpu(preset: str, name: str) -> dict:
    spec = GPU_PRESETS[preset]
    return {"name": name, "hbm_bandwidth": spec.hbm_bandwidth, "peak_flops": spec.bf16_flops}


# HBM bytes/s and dense bf16/fp16 FLOP/s of the GPUs Vidur profiled: A100/H100 from specs.py's
# presets; A40 (696 GB/s, 149.7 TFLOP/s) and A30 (933 GB/s, 165 TFLOP/s) from NVIDIA's datasheets.
GPU_SPECS = MappingProxyType({
    "a100": _gpu("a100", "NVIDIA A100-SXM4-80GB"),
    "h100": _gpu("h100", "NVIDIA H100-SXM5-80GB"),
    "a40": {"name": "NVIDIA A40", "hbm_bandwidth": 696e9, "peak_flops": 149.7e12},
    "a30": {"name": "NVIDIA A30", "hbm_bandwidth": 933e9, "peak_flops": 165e12},
})

# short name -> (folder under compute/<gpu>/, decoder layers)
MODELS = MappingProxyType({
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf", 32),
    "llama-2-70b": ("meta-llama/Llama-2-70b-hf", 80),
    "llama-3-8b": ("meta-llama/Meta-Llama-3-8B", 32),
    "llama-3-70b": ("meta-llama/Meta-Llama-3-70B", 80),
    "codellama-34b": ("codellama/CodeLlama-34b-Instruct-hf", 48),
    "qwen-72b": ("Qwen/Qwen-72B", 80),
    "qwen-2-7b": ("Qwen/Qwen-2-7B", 28),
    "internlm-20b": ("internlm/internlm-20b", 60),
    "phi-2": ("microsoft/phi-2", 32),
})

FORK = "third_party/AKafakA-vidur_opt_scheduler"
ATTENTION_TABLES = (  # (gpu, file): geometry is read from the file and must match the model
    ("a100", "history/e2d00e9/data/profiling/a100/attention.csv"),
    ("a30", f"{FORK}/data/profiling/compute/a30/Qwen/Qwen-2-7B/attention.csv"),
)
CALIBRATION_TABLE = ("a100", "history/e2d00e9/data/profiling/a100/attention.csv")

# The set `cbsim vidur-convert` ships: (gpu, model, tp)
SHIPPED = (
    ("a100", "llama-2-70b", 2),
    ("a100", "llama-2-7b", 1),
    ("h100", "llama-2-7b", 1),
    ("a100", "llama-3-8b", 1),
    ("h100", "llama-3-8b", 1),
)
SHIPPED_NETWORKS = ("a100_pairwise_nvlink", "a100_dgx", "h100_pairwise_nvlink", "h100_dgx")


def data_dir(data: str | os.PathLike | None = None) -> Path:
    """The vidur data folder: `data` or the data folder (cbsim.core.data: $CBSIM_DATA, else shared/data beside
    the repository), given as the folder itself or its parent."""
    root = data if data is not None else default_data()
    if root is None:
        raise FileNotFoundError("no data folder: pass --data or set $CBSIM_DATA (e.g. /work/shared/data)")
    root = Path(root)
    for candidate in (root, root / "vidur"):
        if (candidate / "data" / "profiling").is_dir():
            return candidate
    raise FileNotFoundError(f"{root} holds no vidur profiling data (expected data/profiling/ in it or in vidur/)")


def shipped_dir() -> Path:
    """sim/costmodels/profiles/vidur/ inside the installed package."""
    return PROFILE_DIR


def profile_name(gpu: str, model: str, tp: int) -> str:
    return f"{gpu}-{model}-tp{tp}.json"


def _median(name: str) -> str:
    return f"time_stats.{name}.median"


def mlp_path(data: Path, gpu: str, model: str) -> Path:
    folder = MODELS[model][0]
    for base in (data, data / FORK):
        path = base / "data" / "profiling" / "compute" / gpu / folder / "mlp.csv"
        if path.exists():
            return path
    raise FileNotFoundError(f"no mlp.csv for {model} on {gpu} under {data}")


def read_token_ops(path: Path, tp: int) -> dict:
    """Per-operator medians (ms) of one TP degree, by num_tokens; duplicated num_tokens averaged."""
    frame = pd.read_csv(path)
    frame = frame[frame["num_tensor_parallel_workers"] == tp]
    ops = [op for op in TOKEN_OPS if _median(op) in frame.columns]
    frame = frame.dropna(subset=[_median(op) for op in ops] + [_median("emb")])
    if frame.empty:
        raise ValueError(f"{path} has no complete rows for TP {tp}")
    grouped = frame.groupby("num_tokens", sort=True)
    means = grouped[[_median(op) for op in ops] + [_median("emb")]].mean()
    first = frame.iloc[0]
    geometry = {key: int(first[key]) for key in ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size")}
    geometry["head_dim"] = geometry["n_embd"] // geometry["n_head"]
    geometry["use_gated_mlp"] = bool(first["use_gated_mlp"])
    return {
        "num_tokens": [int(t) for t in means.index],
        "ms": {op: means[_median(op)].tolist() for op in ops},
        "emb_ms": means[_median("emb")].tolist(),
        "geometry": geometry,
        "duplicates_averaged": int(len(frame) - len(means)),
    }


def transfer_token_ops(source: dict, target_geometry: dict) -> dict:
    """Token operators of another model on the same GPU, each scaled by its weight-size ratio.

    A GEMM's time scales with its weight matrix in both regimes (memory-bound at few tokens,
    compute-bound at many); elementwise operators scale with the width they touch. Checked on
    A100 (Llama-2-7B -> Llama-3-8B, both measured): sum of operators median -1.6 %, p90 |err| 7.6 %.
    """
    src, dst = source["geometry"], target_geometry
    return {
        "num_tokens": source["num_tokens"],
        "ms": {op: [v * _op_size(op, dst) / _op_size(op, src) for v in values] for op, values in source["ms"].items()},
        "emb_ms": source["emb_ms"],
        "geometry": dict(target_geometry),
        "duplicates_averaged": source["duplicates_averaged"],
    }


def _op_size(op: str, g: dict) -> float:
    hd = g["n_embd"] / g["n_head"]
    sizes = {
        "attn_pre_proj": g["n_embd"] * (g["n_head"] + 2 * g["n_kv_head"]) * hd,
        "attn_post_proj": g["n_embd"] * g["n_head"] * hd,
        "attn_rope": (g["n_head"] + g["n_kv_head"]) * hd,
        "mlp_up_proj": g["n_embd"] * g["n_expanded_embd"] * (2 if g.get("use_gated_mlp", True) else 1),
        "mlp_down_proj": g["n_embd"] * g["n_expanded_embd"],
        "mlp_act": g["n_expanded_embd"],
    }
    return float(sizes.get(op, g["n_embd"]))


def read_attention(path: Path) -> dict:
    """Decode grid (batch x kv) and prefill triangle (chunk x kv, null outside) of medians, ms."""
    frame = pd.read_csv(path)
    dec = frame[~frame["is_prefill"].astype(bool)]
    pre = frame[frame["is_prefill"].astype(bool)]
    dgrid = dec.groupby(["batch_size", "kv_cache_size"])[_median("attn_decode")].mean().unstack()
    if dgrid.isna().any().any():
        raise ValueError(f"{path}: the decode grid is not complete")
    pgrid = pre.groupby(["prefill_chunk_size", "kv_cache_size"])[_median("attn_prefill")].mean().unstack()
    first = frame.iloc[0]
    return {
        "geometry": {"n_embd": int(first["n_embd"]), "n_q_head": int(first["n_q_head"]),
                     "n_kv_head": int(first["n_kv_head"]), "tp": int(first["num_tensor_parallel_workers"]),
                     "block_size": int(first["block_size"]), "max_model_len": int(first["max_model_len"])},
        "backend": str(first["attention_backend"]),
        "decode": {"batch_size": [int(b) for b in dgrid.index], "kv": [int(k) for k in dgrid.columns],
                   "ms": dgrid.to_numpy().tolist()},
        "prefill": {"chunk": [int(c) for c in pgrid.index], "kv": [int(k) for k in pgrid.columns],
                    "ms": [[None if np.isnan(v) else float(v) for v in row] for row in pgrid.to_numpy()]},
    }


def attention_matches(table: dict, geometry: dict, tp: int) -> bool:
    g = table["geometry"]
    return (g["n_embd"], g["n_q_head"], g["n_kv_head"], g["tp"]) == (
        geometry["n_embd"], geometry["n_head"], geometry["n_kv_head"], tp)


def calibrate_roofline(table: dict, gpu: dict) -> dict:
    """Constants of the roofline attention, fitted (relative least squares, non-negative) on a table.

    decode:  t = fixed + kv_bytes / (eff_bw * HBM bandwidth)
    prefill: t = fixed + FLOPs / (eff * peak FLOP/s) + chunk tokens * q heads * per_token_head
    Returns the constants and the fit's median / p90 relative error on the table itself.
    """
    g = table["geometry"]
    tp, hd = g["tp"], g["n_embd"] // g["n_q_head"]
    q_heads, kv_heads = g["n_q_head"] / tp, g["n_kv_head"] / tp
    kv_bytes = 2 * kv_heads * hd * 2
    dec = table["decode"]
    b, k = np.meshgrid(dec["batch_size"], dec["kv"], indexing="ij")
    y = np.asarray(dec["ms"]).ravel() * 1e-3
    x = np.column_stack([np.ones_like(y), (b * k).ravel() * kv_bytes / gpu["hbm_bandwidth"]])
    wd, ed = _relative_nnls(x, y)
    pre = table["prefill"]
    c, h = np.meshgrid(pre["chunk"], pre["kv"], indexing="ij")
    z = np.array([[np.nan if v is None else v for v in row] for row in pre["ms"]]).ravel() * 1e-3
    keep = ~np.isnan(z)
    c, h, z = c.ravel()[keep], h.ravel()[keep], z[keep]
    flops = 4 * q_heads * hd * c * (h + (c + 1) / 2)
    x = np.column_stack([np.ones_like(z), flops / gpu["peak_flops"], c * q_heads])
    wp, ep = _relative_nnls(x, z)
    return {
        "decode_fixed_s": wd[0], "decode_bw_eff": 1.0 / wd[1],
        "prefill_fixed_s": wp[0], "prefill_flop_eff": 1.0 / wp[1], "prefill_per_token_head_s": wp[2],
        "fit_error": {"decode": ed, "prefill": ep},
    }


def _relative_nnls(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, dict]:
    a = x / y[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    w, _ = nnls(a / scale, np.ones(len(y)))
    w = w / scale
    err = np.abs(x @ w / y - 1)
    return w, {"median_abs_rel": float(np.median(err)), "p90_abs_rel": float(np.quantile(err, 0.9))}


def roofline_spec(geometry: dict, tp: int, gpu_name: str, calibration: dict, calibrated_on: str) -> dict:
    gpu = GPU_SPECS[gpu_name]
    q_heads, kv_heads = geometry["n_head"] / tp, geometry["n_kv_head"] / tp
    hd = geometry["head_dim"]
    return {
        "kind": "roofline",
        "hbm_bandwidth": gpu["hbm_bandwidth"], "peak_flops": gpu["peak_flops"],
        "kv_bytes_per_token": 2 * kv_heads * hd * 2,
        "flops_per_pair": 4 * q_heads * hd,
        "q_heads": q_heads,
        **{key: float(calibration[key]) for key in ("decode_fixed_s", "decode_bw_eff", "prefill_fixed_s",
                                                    "prefill_flop_eff", "prefill_per_token_head_s")},
        "calibrated_on": calibrated_on,
        "calibration_error": calibration["fit_error"],
    }


def read_network(data: Path, node: str) -> dict:
    """All-reduce medians (ms) by message bytes, for each GPU count inside one node."""
    rel = f"data/profiling/network/{node}/all_reduce.csv"
    frame = pd.read_csv(data / rel)
    frame = frame[frame["devices_per_node"] == frame["num_workers"]]
    curves = {}
    for workers, group in frame.groupby("num_workers"):
        med = group.groupby("size")[_median("all_reduce")].median().dropna()
        curves[str(int(workers))] = {"bytes": [int(s) for s in med.index], "ms": med.tolist()}
    return {"node": node, "source": f"vidur {rel}", "all_reduce": curves}


def default_node(gpu: str, tp: int) -> str:
    """The measured node of a GPU's usual server: a DGX box (NVSwitch) for the A100/H100 SXM parts.

    Vidur's own default picked the pairwise-NVLink tables up to 4 GPUs; on those nodes a 4-GPU ring
    crosses PCIe (23.6 GB/s on A100), which doubles a TP4 prefill on the NVSwitch boxes the SXM
    parts ship in. Pass `--node <gpu>_pairwise_nvlink` for a node of NVLink-bridged pairs.
    """
    return f"{gpu}_dgx" if gpu in ("a100", "h100") else f"{gpu}_pairwise_nvlink"


def convert(data: Path, gpu: str, model: str, tp: int, node: str | None = None) -> dict:
    """One cost-model profile from the tables (see the module docstring for its sections)."""
    if model not in MODELS:
        raise KeyError(f"unknown model {model!r}; known: {', '.join(sorted(MODELS))}")
    if gpu not in GPU_SPECS:
        raise KeyError(f"unknown GPU {gpu!r}; known: {', '.join(sorted(GPU_SPECS))}")
    notes = []
    ops, ops_source = _token_ops(data, gpu, model, tp, notes)
    geometry = ops["geometry"]
    attention, attention_source = _attention(data, gpu, geometry, tp, notes)
    allreduce = None
    if tp > 1:
        node = node or default_node(gpu, tp)
        allreduce = table_spec(read_network(data, node), tp, geometry["n_embd"])
        notes.append(f"TP all-reduce: 2 per layer, {node} table, {tp} GPUs, bytes = tokens x n_embd x 2")
    notes.append("LM head: mlp_up_proj time at the sampled rows x (vocab/tp) / (up-proj width/tp), "
                 "a weight-size transfer; sampling itself is CPU overhead")
    notes.append("embedding: the measured emb operator, once per step")
    return {
        "type": "vidur",
        "format": FORMAT,
        "gpu": gpu,
        "model": model,
        "tp": tp,
        "num_layers": MODELS[model][1],
        "geometry": geometry,
        "hardware": GPU_SPECS[gpu],
        "token_ops": {"num_tokens": ops["num_tokens"], "ms": ops["ms"], "emb_ms": ops["emb_ms"]},
        "attention": attention,
        "allreduce": allreduce,
        "lm_head": {"kind": "gemm_ratio", "op": "mlp_up_proj",
                    "ratio": geometry["vocab_size"] / (_op_size("mlp_up_proj", geometry) / geometry["n_embd"])},
        "provenance": {
            "data": "Vidur profiling tables (microsoft/vidur, MIT; commits in shared/data/vidur/SOURCE.md)",
            "token_ops": ops_source,
            "attention": attention_source,
            "measured": [s for s, ok in (("token_ops", "measured" in ops_source),
                                         ("attention", attention["kind"] == "table"),
                                         ("allreduce", allreduce is not None)) if ok],
            "notes": notes,
        },
    }


def _token_ops(data: Path, gpu: str, model: str, tp: int, notes: list) -> tuple[dict, str]:
    if _has_mlp(data, gpu, model):
        path = mlp_path(data, gpu, model)
        ops = read_token_ops(path, tp)
        notes.append(f"token ops: {ops['duplicates_averaged']} duplicated num_tokens rows averaged")
        return ops, f"measured: {path.relative_to(data)}, TP {tp} rows, median columns"
    target = read_token_ops(mlp_path(data, _any_gpu_with(data, model), model), tp)["geometry"]
    for donor in MODELS:
        if donor == model or not _has_mlp(data, gpu, donor):
            continue
        path = mlp_path(data, gpu, donor)
        source = read_token_ops(path, tp)
        if source["geometry"]["n_embd"] == target["n_embd"]:
            notes.append(f"token ops of {model} are not published for {gpu}: {donor}'s operators "
                         "scaled by weight-size ratios (transfer_token_ops)")
            ops = transfer_token_ops(source, target)
            return ops, f"transferred: {path.relative_to(data)} (TP {tp}) scaled to {model}'s geometry"
    raise FileNotFoundError(f"no published model on {gpu} with {model}'s hidden size to transfer from")


def _has_mlp(data: Path, gpu: str, model: str) -> bool:
    try:
        mlp_path(data, gpu, model)
        return True
    except FileNotFoundError:
        return False


def _any_gpu_with(data: Path, model: str) -> str:
    for gpu in GPU_SPECS:
        if _has_mlp(data, gpu, model):
            return gpu
    raise FileNotFoundError(f"no mlp.csv for {model} on any GPU")


def _attention(data: Path, gpu: str, geometry: dict, tp: int, notes: list) -> tuple[dict, str]:
    for table_gpu, rel in ATTENTION_TABLES:
        if table_gpu == gpu and (data / rel).exists():
            table = read_attention(data / rel)
            if attention_matches(table, geometry, tp):
                notes.append(f"attention: {table['backend']} table, block {table['geometry']['block_size']}, "
                             f"max_model_len {table['geometry']['max_model_len']}; pair-count scaling beyond it")
                return {"kind": "table", "decode": table["decode"], "prefill": table["prefill"]}, f"measured: {rel}"
    cal_gpu, cal_rel = CALIBRATION_TABLE
    calibration = calibrate_roofline(read_attention(data / cal_rel), GPU_SPECS[cal_gpu])
    notes.append(f"attention: no published table for this model/GPU/TP; roofline with constants calibrated on "
                 f"{cal_rel} ({cal_gpu}) and {gpu}'s datasheet bandwidth and FLOP/s")
    spec = roofline_spec(geometry, tp, gpu, calibration, cal_rel)
    return spec, f"modelled: roofline calibrated on {cal_rel}"


def write_json(obj: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, separators=(",", ":")) + "\n")


def convert_shipped(data: Path, out: Path) -> list[Path]:
    """Write the shipped set (SHIPPED profiles and SHIPPED_NETWORKS) under `out`; returns the files."""
    written = []
    for node in SHIPPED_NETWORKS:
        path = out / "network" / f"{node}.json"
        write_json(read_network(data, node), path)
        written.append(path)
    for gpu, model, tp in SHIPPED:
        path = out / profile_name(gpu, model, tp)
        write_json(convert(data, gpu, model, tp), path)
        written.append(path)
    return written
