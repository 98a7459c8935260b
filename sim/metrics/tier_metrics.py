"""Lower-KV-tier metrics (sim/kv/tiers.py): where prefix hits came from, restore time, tier occupancy.

Summary keys (only in runs with cluster.kv_cache.tiers), over the requests that were admitted:
- `kv_tier_gpu_hit_rate`: prompt tokens their first admission found on the GPU / their prompt tokens;
- `kv_tier_<tier>_hit_rate`, `kv_tier_<tier>_restored_tokens`: the same for the tokens restored from
  tier <tier> (cpu, ssd, remote); prefix_hit_rate (prefix_metrics.py) is the GPU's and every tier's together;
- `kv_tier_restore_stall_seconds`: seconds steps lasted beyond their compute waiting for restores and
  write_back stores (summed over replicas); `kv_tier_restore_ttft_share`: of the TTFT of the requests that
  restored, the share their admission step's wait took;
- `kv_tier_<tier>_capacity_blocks`, `kv_tier_<tier>_peak_blocks`: the tier's size and the most it held
  (cpu: with swapped requests), each summed over replicas; `kv_tier_<tier>_written_bytes`: bytes stored into it;
  `kv_tier_dropped_units`: prefix units the last tier let go.

The request table gains `restore_wait` (restore_wait_column): the seconds a request's admission step
waited on its restores, inside its TTFT (NaN where it restored nothing).

The occupancy frame (kv_tiers table: time, replica, tier, blocks, capacity_blocks, restored_blocks) holds
each tier's blocks, and the blocks restored from it so far, from each step start at which either changed,
for the plot (sim/outputs/tier_plot.py).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from cbsim.sim.metrics.summary import json_number


def tier_summary(requests_df: pd.DataFrame, replicas) -> dict:
    """The summary keys above (empty without tiers)."""
    tiered = [r for r in replicas if r.tiering is not None]
    if not tiered:
        return {}
    names = [t.name for t in tiered[0].tiering.store.tiers]
    restored = np.zeros(len(names), dtype=np.int64)
    per_request: dict[int, list[int]] = {}
    for replica in tiered:
        for rid, tokens in replica.tiering.store.restored_tokens.items():
            per_request.setdefault(rid, tokens)
    ids = requests_df["request_id"].to_numpy()
    admitted = ~np.isnan(requests_df["first_scheduled"].to_numpy(dtype=np.float64))
    for rid in ids[admitted]:
        if int(rid) in per_request:
            restored += per_request[int(rid)]
    prompt = int(requests_df["prompt_len"].to_numpy()[admitted].sum())
    cached = int(requests_df["cached_tokens"].to_numpy()[admitted].sum()) if "cached_tokens" in requests_df else 0
    out = {"kv_tier_gpu_hit_rate": json_number((cached - int(restored.sum())) / prompt) if prompt else None}
    for i, name in enumerate(names):
        out[f"kv_tier_{name}_hit_rate"] = json_number(int(restored[i]) / prompt) if prompt else None
        out[f"kv_tier_{name}_restored_tokens"] = int(restored[i])
    out["kv_tier_restore_stall_seconds"] = json_number(sum(r.tiering.restore_stall for r in tiered))
    out["kv_tier_restore_ttft_share"] = _ttft_share(requests_df, tiered)
    occupancy = tier_occupancy(replicas)
    for i, name in enumerate(names):
        stores = [r.tiering.store for r in tiered]
        out[f"kv_tier_{name}_capacity_blocks"] = int(sum(s.tiers[i].capacity_blocks for s in stores))
        rows = occupancy[occupancy["tier"] == name]
        out[f"kv_tier_{name}_peak_blocks"] = int(rows.groupby("replica")["blocks"].max().sum()) if len(rows) else 0
        out[f"kv_tier_{name}_written_bytes"] = json_number(sum(
            s.written_units[i] * s.unit_blocks * r.kv.block_bytes for s, r in zip(stores, tiered)))
    out["kv_tier_dropped_units"] = int(sum(r.tiering.store.dropped_units for r in tiered))
    return out


def restore_wait_column(request_ids: np.ndarray, replicas) -> np.ndarray:
    """Per request: seconds the steps that admitted it with restored units waited beyond their forward (NaN for
    a request that restored nothing): the restore time inside its TTFT."""
    stall: dict[int, float] = {}
    for replica in replicas:
        if replica.tiering is not None:
            for rid, seconds in replica.tiering.request_stall.items():
                stall[rid] = stall.get(rid, 0.0) + seconds
    return np.fromiter((stall.get(int(rid), np.nan) for rid in request_ids), dtype=np.float64,
                       count=len(request_ids))


def _ttft_share(requests_df: pd.DataFrame, replicas) -> float | None:
    """Summed restore wait over summed TTFT of the requests that restored and got a first token."""
    waits = requests_df["restore_wait"] if "restore_wait" in requests_df else pd.Series(
        restore_wait_column(requests_df["request_id"].to_numpy(), replicas), index=requests_df.index)
    frame = requests_df[waits.notna() & requests_df["ttft"].notna()]
    if not len(frame):
        return None
    total = float(frame["ttft"].sum())
    return json_number(float(waits[frame.index].sum()) / total) if total > 0 else None


def tier_occupancy(replicas) -> pd.DataFrame:
    """One row per (sample, tier): time, replica, tier, blocks held, the tier's capacity, blocks restored from
    it since the run began."""
    rows = []
    for replica in replicas:
        if replica.tiering is None:
            continue
        store = replica.tiering.store
        for time, blocks, restored in replica.tiering.occupancy:
            for tier, held, units in zip(store.tiers, blocks, restored):
                rows.append((time, replica.index, tier.name, held, tier.capacity_blocks, units * store.unit_blocks))
    return pd.DataFrame(rows, columns=["time", "replica", "tier", "blocks", "capacity_blocks", "restored_blocks"])
