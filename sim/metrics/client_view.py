"""What the client sees: the engine's front end moves request arrivals and token times.

The simulator runs in the engine's time: a request enters the scheduler `frontend delay` after the
client sent it (HTTP, tokenising the prompt, the hop to the engine core), and a token exists when
its step ends. The client sees each token `stream_s` later (detokenising, IPC, streaming) and, on a
pipelined engine (`output_lag_steps` k), only when the step k steps later on the same replica ends,
while that replica keeps stepping back to back (an engine that goes idle flushes its output).

Invariant: the per-request table's `arrival`, `first_token_time`, `last_token_time`,
`completion_time` and the latencies derived from them (TTFT, TPOT, E2E, normalized latency, the
SLO verdict) are client-side; `first_scheduled`, `queue_delay` (time in the scheduler's queue),
the step table and the interference metrics stay in engine time. The ITL distribution is not
shifted: a constant delay per token leaves every gap unchanged, and a lag of k steps shifts a
token by the duration of steps that the gaps already measure.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from cbsim.sim.metrics.metrics_config import MetricsConfig
from cbsim.sim.metrics.request_metrics import meets_slo
from cbsim.sim.metrics.step_order import LocalOrder
from cbsim.sim.request_table import request_column


def frontend_delays(prompt_len: np.ndarray, terms) -> np.ndarray:
    """Seconds from the client sending each request until it reaches the scheduler."""
    return terms.frontend_s + terms.frontend_per_prompt_token_s * np.asarray(prompt_len, dtype=np.float64)


def shift_arrivals(requests, terms) -> np.ndarray:
    """Move each request's arrival to the scheduler (in place); returns the client arrivals."""
    client = np.fromiter((r.arrival for r in requests), dtype=np.float64, count=len(requests))
    delays = frontend_delays(np.fromiter((r.prompt_len for r in requests), np.int64, len(requests)), terms)
    for req, delay in zip(requests, delays.tolist()):
        req.arrival += delay
    return client


def lag_shift(local: LocalOrder, starts: np.ndarray, step_ids: np.ndarray, lag: int) -> np.ndarray:
    """Seconds from the end of each step in `step_ids` to the end of the step `lag` steps later on
    its replica, following only steps that start when the previous one ends (0 for id -1).
    `starts` is the step start times in slot order (local.take)."""
    out = np.zeros(len(step_ids))
    valid = np.flatnonzero(step_ids >= 0)
    if lag <= 0 or len(valid) == 0:
        return out
    ids = step_ids[valid]
    start_slot = local.slots_of(ids)
    block_end = local.bounds[np.searchsorted(local.replicas, local.step_replica[ids]) + 1]
    ends = local.take(local.step_end)
    slot = start_slot.copy()
    for _ in range(lag):
        nxt = np.minimum(slot + 1, len(ends) - 1)
        ok = (slot + 1 < block_end) & (starts[nxt] <= ends[slot])
        slot = np.where(ok, nxt, slot)
    out[valid] = ends[slot] - ends[start_slot]
    return out


def client_view(frame: pd.DataFrame, steps: pd.DataFrame, requests, client_arrival: np.ndarray, terms,
                config: MetricsConfig) -> pd.DataFrame:
    """The per-request table (rows in `requests` order) as the client sees it."""
    first_step = request_column(requests, "first_token_step", np.int64)
    last_step = request_column(requests, "last_token_step", np.int64)
    first_out = last_out = terms.stream_s
    if terms.output_lag_steps > 0 and len(steps):
        local = LocalOrder.of(steps)
        starts = local.take(np.asarray(steps["start"], dtype=np.float64))
        first_out = first_out + lag_shift(local, starts, first_step, terms.output_lag_steps)
        last_out = last_out + lag_shift(local, starts, last_step, terms.output_lag_steps)
    frame["frontend_delay"] = frame["arrival"].to_numpy() - client_arrival
    frame["arrival"] = client_arrival
    out_len = frame["output_len"].to_numpy()
    frame["tpot"] = frame["tpot"].to_numpy() + (last_out - first_out) / np.maximum(out_len - 1, 1)
    frame["first_token_time"] = first = frame["first_token_time"].to_numpy() + first_out
    frame["last_token_time"] = frame["last_token_time"].to_numpy() + last_out
    frame["completion_time"] = done = frame["completion_time"].to_numpy() + last_out
    frame["ttft"] = first - client_arrival
    frame["e2e"] = done - client_arrival
    frame["normalized_latency"] = (done - client_arrival) / np.maximum(out_len, 1)
    frame["meets_slo"] = meets_slo(frame, config.slo)
    return frame
