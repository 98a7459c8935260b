"""Per-tenant fairness figures of a run, from the request table (computed after the run).

Invariant: without a `tenant` column (no request carries a tenant) there is nothing here: the
summary gains no key, so runs without tenants summarise exactly as before. With one, requests
without a tenant form one more tenant. Values are JSON numbers or None.

- num_tenants: distinct tenants.
- tenant_jain_index: Jain's fairness index (Jain, Chiu, Hawe, DEC-TR-301, 1984),
  (sum x)^2 / (n sum x^2), over the tenants' normalised throughput x = tokens served / weight,
  counted in the common window where every tenant has work: from the latest tenant's first
  arrival to the earliest tenant's last completion; tokens served = prompt + output tokens of the
  tenant's requests finished in that window. 1 = equal shares; 1/n = one tenant got everything.
  It measures fairness among tenants that are all backlogged in that window (a light tenant that
  asks for little scores low however well it is served). The summary uses weight 1 for all.
- tenant_ttft_p99_worst / tenant_ttft_p99_best: the largest and smallest of the tenants' TTFT p99
  (requests that did not fail).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

NO_TENANT = "<none>"


def tenant_summary(df: pd.DataFrame, weights: dict | None = None) -> dict:
    """The fairness keys above, or {} when the table has no tenant column."""
    if "tenant" not in df.columns:
        return {}
    tenant = df["tenant"].where(df["tenant"].notna(), NO_TENANT).astype(str)
    ok = (df["status"] != "rejected").to_numpy()
    p99 = []
    for _, ttft in df.loc[ok, "ttft"].groupby(tenant[ok], sort=True):
        values = ttft.to_numpy(dtype=np.float64)
        values = values[~np.isnan(values)]
        if len(values):
            p99.append(float(np.percentile(values, 99)))
    return {
        "num_tenants": int(tenant.nunique()),
        "tenant_jain_index": _number(jain_index(_window_shares(df, tenant, weights or {}))),
        "tenant_ttft_p99_worst": _number(max(p99)) if p99 else None,
        "tenant_ttft_p99_best": _number(min(p99)) if p99 else None,
    }


def jain_index(values) -> float:
    """(sum x)^2 / (n sum x^2); NaN for no values or all zero."""
    x = np.asarray(list(values), dtype=np.float64)
    square = float((x * x).sum())
    return float(x.sum() ** 2 / (len(x) * square)) if len(x) and square > 0 else math.nan


def _window_shares(df: pd.DataFrame, tenant: pd.Series, weights: dict) -> list[float]:
    finished = (df["status"] == "finished").to_numpy()
    if not finished.any():
        return []
    groups = df.groupby(tenant, sort=True)
    start = groups["arrival"].min().max()
    done = df["completion_time"].where(finished)
    end = done.groupby(tenant, sort=True).max().min()
    if not end > start:
        return []
    inside = finished & (done >= start).to_numpy() & (done <= end).to_numpy()
    tokens = (df["prompt_len"] + df["output_len"]).where(inside, 0)
    served = tokens.groupby(tenant, sort=True).sum()
    return [float(served[t]) / float(weights.get(t, 1.0)) for t in served.index]


def _number(value):
    return value if value is not None and math.isfinite(value) else None
