"""Per-step efficiency, computed after the run from the step table: the FLOPs and HBM bytes a step
moved, MFU, HBM-bandwidth utilisation, and the seconds it spent in all-reduces.

Invariant: nothing here runs during the simulation. The recorder keeps only integer aggregates of
each step's shape (sim/metrics/recorder.py); the formulas below turn them into model FLOPs and bytes for
the replica's model, and divide by the step's duration and the replica's GPUs' datasheet peaks.
Every column is NaN where it cannot be known (no GPU, a 0 s step, a cost model that does not say
its all-reduce time on more than one GPU).

A step of one replica (all its GPUs together), with T = prefill + decode + padding tokens, P the
prefill attention pairs, D the decode contexts summed, H the prefill histories summed, Tp the
prefill tokens, S = num_seqs - padding (rows that may sample), L layers:

    flops = 2 N T + 2 hidden vocab S + L (a_p P + a_d D + a_k (Tp + H))
    hbm_bytes = W(T) + kv_bytes_per_token (D + Tp + H)
    mfu = flops / (duration peak gpus);  hbm_util = hbm_bytes / (duration bandwidth gpus)

N: parameters one token passes through, less the embedding and LM head (ModelSpec.active_params;
MoE: the top-k experts). The LM head is charged on every row that may sample: an upper bound, as
a prefill chunk that does not end its prompt samples nothing. Attention, per layer: GQA a_p = a_d =
4 heads head_dim, a_k = 0; MLA as vLLM runs it (the roofline's forms): decode absorbed, a_d = 2 heads
(2 kv_lora_rank + qk_rope), prefill naive, a_p = 2 heads (qk_nope + qk_rope + v), plus a_k = 2
kv_lora_rank heads (qk_nope + v) to decompress each key a chunk reads. W(T): every GPU's weights
read once (ModelSpec.weight_bytes x tp), less the embedding table (only T rows are gathered) and,
for MoE, the routed experts a step of T tokens leaves untouched (E (1 - k/E)^T of E per MoE layer in
expectation, as the roofline). KV: K and V of every layer (MLA: the latent, whole on each GPU),
each decode row reading its context, each prefill chunk its history and itself; writes and
activations are not counted. Sliding-window layers cap D at rows x window, P at Tp x window and H at
rows x window (upper bounds, exact when no row crosses the window). Padding rows count as decode
rows: the GPU runs them. The peak is the GEMMs' precision (FP8 for fp8 weights on a GPU with FP8
tensor cores, as the roofline), so MFU compares with the datasheet figure a kernel could reach.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd


COLUMNS = ("flops", "hbm_bytes", "mfu", "hbm_util", "collective_s")
ROWS = 1 << 20  # steps computed at a time (~100 MB of scratch)


@dataclass(frozen=True)
class StepHardware:
    """What one replica's steps ran on."""

    model: object  # a cbsim.sim.costmodels.catalog.specs.ModelSpec
    peak_flops: float  # FLOP/s of one GPU at the GEMMs' precision
    hbm_bandwidth: float  # bytes/s of one GPU
    gpus: int  # GPUs of the replica: tp x pipeline stages (cbsim/replica_gpus.py)
    collective_time: Callable[[float], float] | None = None  # tokens -> all-reduce seconds of a step
    tp: int | None = None  # GPUs one layer is sharded over (None: all `gpus`); stages split the layers


def with_efficiency(steps: pd.DataFrame, hardware: dict) -> pd.DataFrame:
    """`steps` with the COLUMNS after its own: a frame over the same column arrays and the new ones,
    none copied (setting a column on a frame copies its array); `hardware`: replica index ->
    StepHardware or None."""
    columns = {name: steps[name] for name in steps.columns}
    columns.update(efficiency_columns(steps, hardware))
    return pd.DataFrame(columns, copy=False)


def efficiency_columns(steps: pd.DataFrame, hardware: dict) -> dict[str, np.ndarray]:
    """The COLUMNS (float64, one value a step) for each replica's steps by its hardware, computed
    ROWS steps at a time: every formula is per step, so the values are the same, and the scratch (a
    dozen arrays a step) is bounded by the block, not by the run."""
    out = {name: np.full(len(steps), np.nan) for name in COLUMNS}
    replica = steps["replica"].to_numpy()
    groups: dict = {}  # replicas on the same hardware (a colocated cluster: all of them) are computed at once
    for index, hw in hardware.items():
        if hw is not None:
            groups.setdefault(hw, []).append(index)
    for lo in range(0, len(steps), ROWS):
        part, hi = steps.iloc[lo:lo + ROWS], min(lo + ROWS, len(steps))
        for hw, indices in groups.items():
            mine = np.isin(replica[lo:hi], indices)
            if mine.all():
                rows, values = slice(lo, hi), _replica_columns(part, hw)
            elif mine.any():
                rows, values = lo + np.flatnonzero(mine), _replica_columns(part[mine], hw)
            else:
                continue
            for name, column in values.items():
                out[name][rows] = column
    return out


def _replica_columns(s: pd.DataFrame, hw: StepHardware) -> dict[str, np.ndarray]:
    flops, nbytes = step_flops(s, hw.model), step_bytes(s, hw.model, hw.tp or hw.gpus)
    duration = s["duration"].to_numpy(dtype=np.float64)
    busy = np.where(duration > 0, duration, np.nan)
    tokens = _tokens(s)
    return {"flops": flops, "hbm_bytes": nbytes,
            "mfu": flops / (busy * hw.peak_flops * hw.gpus),
            "hbm_util": nbytes / (busy * hw.hbm_bandwidth * hw.gpus),
            "collective_s": _collective(tokens, hw.collective_time, hw.gpus)}


def _tokens(s: pd.DataFrame) -> np.ndarray:
    """Tokens through the GEMMs: prefill, decode and padding rows."""
    return (s["prefill_tokens"].to_numpy(np.float64) + s["decode_tokens"].to_numpy(np.float64)
            + s["padding_tokens"].to_numpy(np.float64))


def _collective(tokens: np.ndarray, collective_time, gpus: int) -> np.ndarray:
    """collective_time per step, asked once per distinct token count; without one, 0 on one GPU
    (nothing to reduce) and NaN on more."""
    if collective_time is None:
        return np.full(len(tokens), 0.0 if gpus == 1 else np.nan)
    unique, inverse = np.unique(tokens, return_inverse=True)
    return np.array([collective_time(float(t)) for t in unique], dtype=np.float64)[inverse]


# ---------------------------------------------------------------- FLOPs


def step_flops(s: pd.DataFrame, m) -> np.ndarray:
    """Model FLOPs of each step (module docstring): linear layers, LM head, attention."""
    tokens = _tokens(s)
    sampled = s["num_seqs"].to_numpy(np.float64) - s["padding_tokens"].to_numpy(np.float64)
    head = 2.0 * m.hidden * m.vocab
    linear = 2.0 * (m.active_params() - _embedding_and_head(m)) * tokens
    return linear + head * sampled + m.num_layers * _attention_flops(s, m)


def _embedding_and_head(m) -> int:
    return (1 if m.tie_word_embeddings else 2) * m.vocab * m.hidden


def _attention_flops(s: pd.DataFrame, m) -> np.ndarray:
    """One layer's attention FLOPs of each step (sliding-window layers capped, weighted by their share)."""
    pairs, decode, keys = _reads(s, None)
    full = _attention_form(m, pairs, decode, keys)
    if not m.sliding_window:
        return full
    share = m.sliding_layers / m.num_layers
    return (1.0 - share) * full + share * _attention_form(m, *_reads(s, m.sliding_window))


def _attention_form(m, pairs, decode, keys) -> np.ndarray:
    if not m.is_mla:
        return 4.0 * m.num_heads * m.head_dim * (pairs + decode)
    heads = m.num_heads
    absorbed = 2.0 * heads * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
    naive = 2.0 * heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    decompress = 2.0 * m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
    return absorbed * decode + naive * pairs + decompress * keys


def _reads(s: pd.DataFrame, window: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prefill pairs, decode keys, prefill keys read: Tp + H) of each step; with a window, each
    capped at what a query can see (upper bounds: exact when no row crosses the window)."""
    prefill = s["prefill_tokens"].to_numpy(np.float64)
    pairs = s["prefill_attention_pairs"].to_numpy(np.float64)
    decode = s["decode_context_tokens"].to_numpy(np.float64)
    history = s["prefill_history_tokens"].to_numpy(np.float64)
    if window is not None:
        decode_rows = s["decode_tokens"].to_numpy(np.float64) + s["padding_tokens"].to_numpy(np.float64)
        prefill_rows = s["num_seqs"].to_numpy(np.float64) - decode_rows
        pairs = np.minimum(pairs, prefill * window)
        decode = np.minimum(decode, decode_rows * window)
        history = np.minimum(history, prefill_rows * window)
    return pairs, decode, prefill + history


# ---------------------------------------------------------------- bytes


def step_bytes(s: pd.DataFrame, m, gpus: int) -> np.ndarray:
    """HBM bytes each step reads on all the replica's GPUs: weights once, and the KV it attends to.
    `gpus`: the GPUs one layer is sharded over (tp; pipeline stages hold disjoint layers, so they
    add no replicated bytes)."""
    _, decode, keys = _reads(s, None)
    kv = m.kv_bytes_per_token(gpus) * gpus * (decode + keys)
    if m.sliding_window:
        share = m.sliding_layers / m.num_layers
        _, decode_w, keys_w = _reads(s, m.sliding_window)
        kv = (1.0 - share) * kv + share * m.kv_bytes_per_token(gpus) * gpus * (decode_w + keys_w)
    return weights_read(m, gpus, _tokens(s)) + kv


def weights_read(m, gpus: int, tokens: np.ndarray) -> np.ndarray:
    """Weight bytes a step of `tokens` tokens reads over `gpus` GPUs: all of them but the embedding
    table and, for MoE, the routed experts it leaves untouched (uniform top-k routing)."""
    width = 2 if m.weight_dtype in ("fp8", "int4") else m.weight_bits / 8  # the embedding stays 16-bit
    embedding = 0 if m.tie_word_embeddings else m.vocab_per_gpu(gpus) * gpus * m.hidden * width
    whole = float(m.weight_bytes(gpus) * gpus - embedding)
    tokens = np.asarray(tokens, dtype=np.float64)
    if not m.is_moe:
        return np.full(len(tokens), whole)
    e, k = float(m.num_experts), float(m.experts_per_token)
    untouched = e * (1.0 - k / e) ** tokens
    expert = float(m.linear_weight_bytes(m.expert_params(1)))  # int4: with its group scales, as weight_bytes counts
    return whole - m.num_moe_layers * untouched * expert
