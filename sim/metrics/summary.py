"""The run summary: a flat, JSON-ready dict of percentiles, rates and interference figures.

Values are plain int/float, None where a metric is undefined (no finished request, no long
request, ...). Request-column percentiles use numpy's linear method, like the ITL (sim/metrics/itl.py).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from cbsim.sim.metrics.speculative_metrics import speculative_summary
from cbsim.sim.metrics.itl import ITLDistribution, itl_distribution, stall_events
from cbsim.sim.metrics.metrics_config import MetricsConfig
from cbsim.sim.metrics.recorder import Recorder
from cbsim.sim.metrics.tenant_metrics import tenant_summary


def json_number(value):
    """A JSON-safe number: int stays int, NaN/inf/None become None."""
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    value = float(value)
    return value if math.isfinite(value) else None


def column_percentiles(column: pd.Series, qs=(50, 90, 99)) -> list:
    """Percentiles (numpy's linear method, as sim/metrics/itl.py) of a column's non-NaN values, JSON-ready
    (None each when all are NaN)."""
    values = column.to_numpy(dtype=np.float64)
    values = values[~np.isnan(values)]
    if len(values) == 0:
        return [None] * len(qs)
    return [json_number(v) for v in np.percentile(values, qs)]


def summarize(requests_df: pd.DataFrame, steps_df: pd.DataFrame, recorder: Recorder,
              config: MetricsConfig | None = None, itl: ITLDistribution | None = None) -> dict:
    """Flat JSON-ready summary (None where undefined: no finished request, no long request, ...).

    Latency percentiles are over requests where the metric is defined; ITL over every gap.
    Throughput counts the output tokens of finished requests over makespan = last completion -
    first arrival; goodput and slo_attainment are null when metrics.slo sets no objective. Stalls are ITL gaps above stall_factor x the ITL median: how many gaps, their
    summed length and the longest. short_p_undefined counts long requests without a short_P.
    num_preemptions sums the requests' counters. Tenant fairness keys (sim/metrics/tenant_metrics.py) appear
    only when requests carry tenants. Pass `itl` (itl_distribution with the requests)
    to include runs still open at a cut; otherwise it is rebuilt from the recorder's closed runs.
    """
    config = config or MetricsConfig()
    itl = itl_distribution(recorder, steps=steps_df) if itl is None else itl
    df = requests_df
    out = _latency_summary(df, itl)
    out.update(_rate_summary(df, config.slo.is_set()))
    out.update(_interference_summary(df, itl, config.stall_factor))
    out.update(num_preemptions=int(df["num_preemptions"].sum()), num_rejected=int((df["status"] == "rejected").sum()),
               num_finished=int((df["status"] == "finished").sum()), num_requests=len(df), num_steps=len(steps_df))
    out.update(tenant_summary(df))  # only when requests carry tenants
    out.update({k: json_number(v) for k, v in speculative_summary(df).items()})  # only when requests speculate
    return out


def _latency_summary(df: pd.DataFrame, itl: ITLDistribution) -> dict:
    """Request-latency percentiles over the requests that did not fail (a timed-out request may have
    a first token; like vllm bench serve, failed requests count in no latency), ITL over every gap."""
    out = {}
    kept = (df["status"] != "rejected").to_numpy()  # each column's rows, not a copy of every column
    for name, qs in (("ttft", (50, 90, 99)), ("tpot", (50, 90, 99)), ("e2e", (50, 99)), ("queue_delay", (50, 99))):
        for q, v in zip(qs, column_percentiles(df[name][kept], qs)):
            out[f"{name}_p{q}"] = v
    for q, v in zip((50, 90, 99), itl.percentile([50, 90, 99])):
        out[f"itl_p{q}"] = json_number(v)
    out["itl_max"] = json_number(itl.values_at([-1])[0]) if len(itl.step) else None  # sorted: the last
    return out


def _rate_summary(df: pd.DataFrame, has_slo: bool) -> dict:
    """Throughputs and makespan; goodput and SLO attainment only where an objective is set (else null,
    as vllm bench serve's request_goodput without --goodput)."""
    finished = df["status"] == "finished"
    makespan = df.loc[finished, "completion_time"].max() - df["arrival"].min() if finished.any() else math.nan
    per_s = 1.0 / makespan if makespan > 0 else math.nan
    return {
        "throughput_tokens_per_s": json_number(df.loc[finished, "output_len"].sum() * per_s),
        "throughput_requests_per_s": json_number(finished.sum() * per_s),
        "goodput_requests_per_s": json_number(df["meets_slo"].sum() * per_s) if has_slo else None,
        "slo_attainment": json_number(df["meets_slo"].mean() if len(df) else math.nan) if has_slo else None,
        "makespan": json_number(makespan),
    }


def _interference_summary(df: pd.DataFrame, itl: ITLDistribution, stall_factor: float) -> dict:
    long = df.loc[df["is_long"], ["dec_at_p", "short_p"]]  # two columns, not every column of the long rows
    stalls = stall_events(itl, stall_factor)
    return {
        "dec_at_p_mean": json_number(long["dec_at_p"].mean()),
        "dec_at_p_min": json_number(long["dec_at_p"].min()),
        "short_p_mean": json_number(long["short_p"].mean()),
        "short_p_max": json_number(long["short_p"].max()),
        "short_p_undefined": int(long["short_p"].isna().sum()),
        "num_long_requests": len(long),
        "num_stalls": int(stalls["count"].sum()),
        "stall_seconds_total": json_number((stalls["length"] * stalls["count"]).sum()),
        "stall_max": json_number(stalls["length"].max()) if len(stalls) else None,
    }


def usage_summary(steps_df: pd.DataFrame, kv_blocks: dict) -> dict:
    """KV usage and step efficiency over the run, each weighted by step duration (busy time).

    kv_usage_mean / kv_usage_p99: blocks used over the replica's cache (a fraction; the p99 is the
    usage the busy time stays at or below 99 % of the time); mfu_mean, hbm_util_mean: the mean of
    the step columns (sim/metrics/step_efficiency.py), so total FLOPs over total peak FLOPs of the busy time;
    collective_share: all-reduce seconds over busy seconds. None where undefined (no step, no known
    GPU or cache size, a cost model that does not price all-reduces)."""
    duration = steps_df["duration"].to_numpy(dtype=np.float64)
    usage = _kv_usage(steps_df, kv_blocks or {})
    out = {"kv_usage_mean": _weighted_mean(usage, duration), "kv_usage_p99": _weighted_quantile(usage, duration, 0.99)}
    del usage
    for key, column in (("mfu_mean", "mfu"), ("hbm_util_mean", "hbm_util"), ("collective_share", "collective_s")):
        values = steps_df[column].to_numpy(dtype=np.float64) if column in steps_df else np.full(len(duration), np.nan)
        if column == "collective_s":
            with np.errstate(divide="ignore", invalid="ignore"):
                values = values / duration
        out[key] = _weighted_mean(values, duration)
    return out


def _kv_usage(steps_df: pd.DataFrame, kv_blocks: dict) -> np.ndarray:
    """Each step's blocks used over its replica's cache (NaN where the cache size is unknown), in one
    array beside the frame's columns."""
    replica = np.asarray(steps_df["replica"])
    capacity = np.full(len(replica), np.nan)
    for index, blocks in kv_blocks.items():  # (the values Series.map gives, without its Series)
        capacity[replica == index] = np.nan if blocks is None else blocks
    np.copyto(capacity, np.nan, where=~(capacity > 0))
    return np.divide(steps_df["kv_blocks_used"].to_numpy(dtype=np.float64), capacity, out=capacity)


def _finite(values: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """The values and weights where both are finite and the weight positive (the arrays themselves
    where that is everywhere); None where it is nowhere."""
    ok = np.isfinite(values) & np.isfinite(weights) & (weights > 0)
    if not ok.any():  # no step at all (every request rejected) included
        return None
    return (values, weights) if ok.all() else (values[ok], weights[ok])


def _weighted_mean(values: np.ndarray, weights: np.ndarray):
    kept = _finite(values, weights)
    return json_number(np.average(kept[0], weights=kept[1])) if kept is not None else None


def _weighted_quantile(values: np.ndarray, weights: np.ndarray, q: float):
    """The smallest value whose cumulative weight reaches q of the total (inverted CDF)."""
    kept = _finite(values, weights)
    if kept is None:
        return None
    values, weights = kept
    # the weights in the values' stable order, summed in that order: written over the order itself, a block
    # at a time (one array a step fewer); the value at sorted position k is then the k-th smallest
    cumulative = np.argsort(values, kind="stable").view(np.float64)
    order = cumulative.view(np.int64)
    for lo in range(0, len(order), 1 << 16):
        cumulative[lo:lo + (1 << 16)] = weights[order[lo:lo + (1 << 16)]]
    np.cumsum(cumulative, out=cumulative)
    k = int(np.searchsorted(cumulative, q * cumulative[-1], side="left"))
    del cumulative, order
    return json_number(np.partition(values, k)[k])
