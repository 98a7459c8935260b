"""Prefix-cache metrics: per-request cached prompt tokens and the run's hit rate and evictions."""
from __future__ import annotations

import numpy as np
import pandas as pd

from cbsim.sim.metrics.summary import json_number


def cached_token_column(request_ids: np.ndarray, kv_caches) -> np.ndarray:
    """Per request (in `request_ids` order): prompt tokens its first admission found in a replica's
    prefix cache (on P/D: its prefill replica's; 0 without prefix caching, or for a request never
    admitted)."""
    hits: dict[int, int] = {}
    for kv in kv_caches:
        if kv.prefix is not None:
            for rid, tokens in kv.prefix.hit_tokens.items():
                hits.setdefault(rid, tokens)
    return np.fromiter((hits.get(int(rid), 0) for rid in request_ids), dtype=np.int64, count=len(request_ids))


def readmit_hit_column(request_ids: np.ndarray, kv_caches) -> np.ndarray:
    """Per request: prompt tokens its re-admissions after recompute preemptions found cached (summed
    over re-admissions and replicas)."""
    hits: dict[int, int] = {}
    for kv in kv_caches:
        if kv.prefix is not None:
            for rid, tokens in kv.prefix.readmit_hit_tokens.items():
                hits[rid] = hits.get(rid, 0) + tokens
    return np.fromiter((hits.get(int(rid), 0) for rid in request_ids), dtype=np.int64, count=len(request_ids))


def prefix_summary(requests_df: pd.DataFrame, kv_caches) -> dict:
    """prefix_hit_tokens (sum of `cached_tokens`), prefix_hit_rate (those / prompt tokens of the
    requests that were admitted; None without prefix caching or admissions), prefix_readmit_hit_tokens
    (hits of re-admissions after recompute preemptions, apart) and evicted_blocks."""
    caches = [kv.prefix for kv in kv_caches if kv.prefix is not None]
    if "cached_tokens" in requests_df:
        cached = requests_df["cached_tokens"].to_numpy()
    else:
        cached = cached_token_column(requests_df["request_id"].to_numpy(), kv_caches)
    admitted = ~np.isnan(requests_df["first_scheduled"].to_numpy(dtype=np.float64))
    prompt = int(requests_df["prompt_len"].to_numpy()[admitted].sum())
    hit = int(cached[admitted].sum())
    return {
        "prefix_hit_tokens": hit,
        "prefix_hit_rate": json_number(hit / prompt) if caches and prompt else None,
        "prefix_readmit_hit_tokens": int(sum(sum(cache.readmit_hit_tokens.values()) for cache in caches)),
        "evicted_blocks": int(sum(cache.evicted_blocks for cache in caches)),
    }
