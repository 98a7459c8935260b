"""Metrics computed after a run from the Recorder and the Request records (numpy + pandas).

Nothing here touches the simulation; everything is derived from the recorder's step rows and
token runs and from the Request records. Memory stays near what the results hold: the step
scans go block by block (step_order.BLOCK) and frames take their column arrays without copying.
This package is the one import point (`from cbsim.sim.metrics import summarize`); each concept lives in
its own file, loaded when first used:

- metrics_config.py   MetricsConfig, SLOConfig (the experiment's `metrics:` section)
- step_order.py       step_frame, StepColumns (its columns one at a time), densified, LocalOrder (each replica's steps in its own order)
- step_table.py       StepTable: a run's step table never held whole (a column when read, a block of rows when written)
- token_runs.py       TokenRuns located in that order, run invariants, token_times
- itl.py              the weighted ITL distribution, weighted percentiles, CDF points, stalls
- bucket_sort.py      the stable sort by value the ITL distribution is built with
- request_metrics.py  request_frame (latencies, dec@P, short_P, SLO verdict)
- summary.py          summarize (the flat JSON-ready summary)
- pool_metrics.py     preemptions, transfers, P/D hand-offs, pool utilisation and queues
- prefix_metrics.py   prefix-cache hits and evictions
- session_metrics.py  agentic sessions: per-turn and per-agent tables, KV residency between turns
- tier_metrics.py     lower KV tiers: hits and restores per tier, restore time in TTFT, occupancy
- recorder.py         Recorder: the compact step rows and token runs the engine writes while it runs
- growable.py         the growable typed columns the recorder keeps
- step_efficiency.py  FLOPs, HBM bytes, MFU and collective time per step
- tenant_metrics.py   per-tenant latency and fairness
- client_view.py      what the client sees (front-end delays moved onto the times)
- bench_result.py     bench.json in vllm bench serve's schema
- unfinished.py       rejections by reason, and what sim.max_time cut
"""
from __future__ import annotations

import importlib

# name -> the module of this package that defines it. Loaded on first use (PEP 562), so the engine
# can import the recorder and a config can import MetricsConfig without pulling in pandas.
_HOME = {
    "ITLDistribution": "itl", "cdf_points": "itl", "itl_distribution": "itl", "stall_events": "itl",
    "weighted_percentile": "itl",
    "MetricsConfig": "metrics_config", "SLOConfig": "metrics_config",
    "PREEMPTION_COLUMNS": "pool_metrics", "TRANSFER_COLUMNS": "pool_metrics", "handoff_frame": "pool_metrics",
    "busy_time": "pool_metrics", "level_series": "pool_metrics", "pool_summary": "pool_metrics", "preemption_frame": "pool_metrics",
    "recovery_summary": "pool_metrics", "time_average": "pool_metrics", "transfer_frame": "pool_metrics",
    "cached_token_column": "prefix_metrics", "prefix_summary": "prefix_metrics",
    "readmit_hit_column": "prefix_metrics",
    "turn_frame": "session_metrics", "session_frame": "session_metrics", "session_summary": "session_metrics",
    "restore_wait_column": "tier_metrics", "tier_occupancy": "tier_metrics", "tier_summary": "tier_metrics",
    "request_frame": "request_metrics",
    "StepTable": "step_table", "LocalOrder": "step_order", "step_frame": "step_order", "StepColumns": "step_order", "densified": "step_order",
    "column_percentiles": "summary", "json_number": "summary", "summarize": "summary",
    "cut_warning": "unfinished", "mark_cut": "unfinished", "rejection_summary": "unfinished",
    "TokenRuns": "token_runs", "run_arrays": "token_runs", "token_runs": "token_runs", "token_times": "token_runs",
}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)


def __dir__() -> list[str]:
    return __all__
