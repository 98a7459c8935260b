"""Metrics computed after a run from the Recorder and the Request records (numpy + pandas).

Nothing here touches the simulation; everything is derived from the recorder's step rows and
token runs and from the Request records. Memory stays near what the results hold: the step
scans go block by block (step_order.BLOCK) and frames take their column arrays without copying.
This module is the one import point; each concept lives in its own file:

- metrics_config.py   MetricsConfig, SLOConfig (the experiment's `metrics:` section)
- step_order.py       step_frame, LocalOrder (each replica's steps in its own order)
- token_runs.py       TokenRuns located in that order, run invariants, token_times
- itl.py              the weighted ITL distribution, weighted percentiles, CDF points, stalls
- bucket_sort.py      the stable sort by value the ITL distribution is built with
- request_metrics.py  request_frame (latencies, dec@P, short_P, SLO verdict)
- summary.py          summarize (the flat JSON-ready summary)
- pool_metrics.py     preemptions, transfers, P/D hand-offs, pool utilisation and queues
- prefix_metrics.py   prefix-cache hits and evictions
- recorder.py         Recorder: the compact step rows and token runs the engine writes while it runs
- growable.py         the growable typed columns the recorder keeps
- step_efficiency.py  FLOPs, HBM bytes, MFU and collective time per step
- tenant_metrics.py   per-tenant latency and fairness
- client_view.py      what the client sees (front-end delays moved onto the times)
- bench_result.py     bench.json in vllm bench serve's schema
"""
from __future__ import annotations

from .itl import ITLDistribution, cdf_points, itl_distribution, stall_events, weighted_percentile
from .metrics_config import MetricsConfig, SLOConfig
from .pool_metrics import (PREEMPTION_COLUMNS, TRANSFER_COLUMNS, handoff_frame, level_series, pool_summary,
                           preemption_frame, recovery_summary, time_average, transfer_frame)
from .prefix_metrics import cached_token_column, prefix_summary, readmit_hit_column
from .request_metrics import request_frame
from .step_order import LocalOrder, step_frame
from .summary import column_percentiles, json_number, summarize
from .token_runs import TokenRuns, run_arrays, token_runs, token_times

__all__ = [
    "ITLDistribution", "LocalOrder", "MetricsConfig", "PREEMPTION_COLUMNS", "SLOConfig", "TRANSFER_COLUMNS",
    "TokenRuns", "cached_token_column", "cdf_points", "column_percentiles", "handoff_frame", "itl_distribution",
    "json_number", "level_series", "pool_summary", "preemption_frame", "prefix_summary", "readmit_hit_column", "recovery_summary",
    "request_frame", "run_arrays", "stall_events", "step_frame", "summarize", "time_average", "token_runs",
    "token_times", "transfer_frame", "weighted_percentile",
]
