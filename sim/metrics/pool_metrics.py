"""Preemption recovery, KV transfers and P/D pools, from logs the run keeps on the side.

Each replica's preemption log and host link, the P/D links' transfer logs and hand-off records
(sim/kv/link.py, sim/pd.py). A *level series* is a step function over time (how many requests
wait, how many KV blocks are held): values change only at event times, and at equal times
decreases come before increases.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from cbsim.sim.metrics.summary import column_percentiles, json_number


PREEMPTION_COLUMNS = ("time", "replica", "request_id", "mode", "recomputed_tokens", "swapped_bytes")
TRANSFER_COLUMNS = ("link", "request_id", "kind", "bytes", "submitted", "start", "end", "lane")


def preemption_frame(replicas) -> pd.DataFrame:
    """One row per preemption of any replica: when, which request, recompute or swap, the tokens
    whose KV it dropped (recompute) and the bytes it swapped out (swap), in time order."""
    rows = [row for replica in replicas for row in replica.preemption_log]
    frame = pd.DataFrame(rows, columns=list(PREEMPTION_COLUMNS))
    return frame.sort_values(["time", "replica"], kind="stable").reset_index(drop=True)


def transfer_frame(links) -> pd.DataFrame:
    """One row per transfer booked on `links` (sim/kv/link.py), with `queued` (wait for a lane) and
    `duration` (on the lane)."""
    rows = [(t.link, t.request_id, t.kind, t.nbytes, t.submitted, t.start, t.end, t.lane)
            for link in links for t in link.log]
    frame = pd.DataFrame(rows, columns=list(TRANSFER_COLUMNS))
    frame["queued"] = frame["start"] - frame["submitted"]
    frame["duration"] = frame["end"] - frame["start"]
    return frame


def recovery_summary(preemptions: pd.DataFrame, host_transfers: pd.DataFrame) -> dict:
    """Recomputed tokens (KV dropped by recompute preemptions: exactly the extra prefill work) and
    bytes moved over the host links (swap-outs and swap-ins), for every preemption mode."""
    mode = preemptions["mode"]
    return {
        "num_recomputed_tokens": int(preemptions["recomputed_tokens"].sum()),
        "swapped_bytes": float(host_transfers["bytes"].sum()),
        "num_recompute_preemptions": int((mode == "recompute").sum()),
        "num_swap_preemptions": int((mode == "swap").sum()),
    }


def handoff_frame(records) -> pd.DataFrame:
    """One row per P/D hand-off (sim/pd.py HandOff), in prefill order, with derived waits:
    backpressure_wait (ready to move, until decode room was reserved: from the prefill in p2p
    mode, from the end of the first hop in pool mode), link_queue (waits for a lane, all hops),
    transfer_time (time on the lanes, all hops), prefill_kv_held (prefill done until the
    prefill-side KV was freed), cached_on_decode (prompt tokens the decode replica had cached:
    not transferred)."""
    rows = []
    for rec in records:
        ready = rec.in_pool if not math.isnan(rec.in_pool) else rec.prefilled
        rows.append({
            "request_id": rec.req.id, "prefill_replica": rec.src.index,
            "decode_replica": rec.dst.index if rec.dst is not None else -1,
            "prefilled": rec.prefilled, "prefill_blocks": rec.prefill_blocks, "reserved": rec.reserved,
            "released_src": rec.released_src, "in_pool": rec.in_pool, "landed": rec.landed,
            "decode_admitted": rec.decode_admitted, "backpressure_wait": rec.reserved - ready,
            "link_queue": sum(h.queued for h in rec.hops) if rec.hops else math.nan,
            "transfer_time": sum(h.end - h.start for h in rec.hops) if rec.hops else math.nan,
            "prefill_kv_held": rec.released_src - rec.prefilled, "cached_on_decode": rec.cached_on_decode,
        })
    columns = ["request_id", "prefill_replica", "decode_replica", "prefilled", "prefill_blocks", "reserved",
               "released_src", "in_pool", "landed", "decode_admitted", "backpressure_wait", "link_queue",
               "transfer_time", "prefill_kv_held", "cached_on_decode"]
    return pd.DataFrame(rows, columns=columns)


def level_series(enter, leave, weights=None, end: float = math.inf) -> tuple[np.ndarray, np.ndarray]:
    """(times, level): how much of `weights` (default 1 each) is inside [enter, leave) right after
    each event time. A NaN leave means "still inside at `end`"; a NaN enter is never inside."""
    enter = np.asarray(enter, dtype=np.float64)
    leave = np.asarray(leave, dtype=np.float64)
    weights = np.ones(len(enter)) if weights is None else np.asarray(weights, dtype=np.float64)
    inside = ~np.isnan(enter)
    enter, leave, weights = enter[inside], np.where(np.isnan(leave[inside]), end, leave[inside]), weights[inside]
    times = np.concatenate([enter, leave])
    deltas = np.concatenate([weights, -weights])
    order = np.lexsort((deltas, times))
    times, level = times[order], np.cumsum(deltas[order])
    finite = np.isfinite(times)
    return times[finite], level[finite]


def time_average(times: np.ndarray, level: np.ndarray, t0: float, t1: float) -> float:
    """Mean of a level series over [t0, t1] (0 before its first event)."""
    if t1 <= t0 or len(times) == 0:
        return math.nan if t1 <= t0 else 0.0
    edges = np.clip(np.append(times, t1), t0, t1)
    return float(np.sum(level * np.diff(edges)) / (t1 - t0))


def _queue_summary(prefix: str, enter, leave, t0: float, t1: float) -> dict:
    times, level = level_series(enter, leave, end=t1)
    return {f"{prefix}_queue_mean": json_number(time_average(times, level, t0, t1)),
            f"{prefix}_queue_max": json_number(level.max()) if len(level) else 0}


def busy_time(steps) -> pd.Series:
    """Each replica's busy seconds: its steps' durations summed (pandas' group sum, indexed by replica).
    A run computes it before the request frame exists (a lower peak) and hands it to pool_summary."""
    return pd.DataFrame({"replica": steps["replica"], "duration": steps["duration"]}).groupby("replica")["duration"].sum()


def pool_summary(steps: pd.DataFrame, requests: pd.DataFrame, pools: dict[str, list[int]],
                 handoffs: pd.DataFrame | None = None, transfers: pd.DataFrame | None = None,
                 busy: pd.Series | None = None) -> dict:
    """Per-pool utilisation (busy step time / makespan, averaged over the pool's replicas) and
    waiting-queue length (time average and max); with P/D hand-offs, the transfer, link-queue and
    backpressure distributions and the KV held on the prefill side while waiting to move.

    `busy`: busy_time(steps), where it was computed already.
    Queues: the prefill (or only) pool holds a request from its arrival to its first step; the
    decode pool from its landing to its first step there.
    """
    t0 = float(requests["arrival"].min()) if len(requests) else 0.0
    t1 = float(np.nanmax(np.r_[steps["end"].to_numpy(), t0]))
    span = t1 - t0
    busy = busy_time(steps) if busy is None else busy
    out = {}
    for name, indices in pools.items():
        used = np.array([busy.get(i, 0.0) for i in indices])
        out[f"{name}_replicas"] = len(indices)
        out[f"{name}_utilization"] = json_number(used.mean() / span) if span > 0 else None
    admitted = (requests["status"] != "rejected").to_numpy()  # two columns of those rows, not every column
    entry = "prefill" if "prefill" in pools else next(iter(pools))
    out.update(_queue_summary(entry, requests["arrival"][admitted], requests["first_scheduled"][admitted], t0, t1))
    if handoffs is None:
        return out
    out.update(_queue_summary("decode", handoffs["landed"], handoffs["decode_admitted"], t0, t1))
    for name in ("transfer_time", "link_queue", "backpressure_wait", "prefill_kv_held"):
        for q, v in zip((50, 99), column_percentiles(handoffs[name], (50, 99))):
            out[f"{name}_p{q}"] = v
        out[f"{name}_max"] = json_number(handoffs[name].max())
    times, held = level_series(handoffs["prefilled"], handoffs["released_src"], handoffs["prefill_blocks"], end=t1)
    out["prefill_kv_held_blocks_max"] = json_number(held.max()) if len(held) else 0
    out["prefill_kv_held_blocks_mean"] = json_number(time_average(times, held, t0, t1))
    out["num_handoffs"] = len(handoffs)
    out["kv_transfer_bytes"] = float(transfers["bytes"].sum()) if transfers is not None else None
    return out
