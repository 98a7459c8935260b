"""The per-request table: latencies, interference metrics (dec@P, short_P) and the SLO verdict.

Derived from the Request records and the token runs (token_runs.py); a request's output tokens,
last token time and largest gap come from its runs without expanding them.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from cbsim.sim.metrics.metrics_config import MetricsConfig, SLOConfig
from cbsim.sim.metrics.recorder import Recorder
from cbsim.sim.request import Request, Status
from cbsim.sim.request_table import RequestTable, request_column as _column
from cbsim.sim.metrics.speculative_metrics import add_speculative_columns
from cbsim.sim.metrics.step_order import LocalOrder, index_dtype
from cbsim.sim.metrics.token_runs import TokenRuns, in_run_max, run_arrays, token_runs


def _per_request_runs(ids: np.ndarray, local: LocalOrder, runs: TokenRuns):
    """Tokens, last token time and largest gap per request (row order of `ids`)."""
    n = len(ids)
    tokens, last, itl_max = np.zeros(n, np.int64), np.full(n, np.nan), np.full(n, np.nan)
    if len(runs.tokens) == 0:
        return tokens, last, itl_max
    row = _rows_of(ids, runs.request_id)
    starts = np.flatnonzero(np.r_[True, runs.request_id[1:] != runs.request_id[:-1]])
    gap = np.fmax(in_run_max(local, runs), runs.break_gap)
    tokens[row[starts]] = np.add.reduceat(runs.tokens, starts)
    last[row[starts]] = np.maximum.reduceat(runs.t_last, starts)
    itl_max[row[starts]] = np.fmax.reduceat(gap, starts)
    return tokens, last, itl_max


def _rows_of(ids: np.ndarray, request_id: np.ndarray) -> np.ndarray:
    """Row of `ids` holding each of `request_id` (ValueError for an id not in `ids`)."""
    n = len(ids)
    sorter = np.argsort(ids, kind="stable")
    pos = np.searchsorted(ids[sorter], request_id).clip(0, max(n - 1, 0))
    if len(request_id) and (n == 0 or np.any(ids[sorter][pos] != request_id)):
        raise ValueError("a token run belongs to a request that is not in the request list")
    return sorter[pos]


def _short_decodes(ids: np.ndarray, long_mask: np.ndarray, local: LocalOrder, runs: TokenRuns) -> np.ndarray:
    """Per local slot: output tokens short requests produced there, each one's first token excepted
    (it ends that request's own prefill; every later token is decoded by a running request)."""
    n = len(local)
    short = ~long_mask[_rows_of(ids, runs.request_id)]
    opens = np.r_[True, runs.request_id[1:] != runs.request_id[:-1]]  # the run holding a first token
    lo, hi = runs.first[short] + opens[short], runs.last[short] + 1
    keep = lo < hi
    edges = np.zeros(n + 1, dtype=index_dtype(len(runs.tokens) + 1))  # one array over the steps, in place
    np.add.at(edges, lo[keep], 1)
    np.subtract.at(edges, hi[keep], 1)
    return np.cumsum(edges[:n], out=edges[:n])


def _dec_at_p(requests: list[Request], local: LocalOrder, short_decodes: np.ndarray, long_mask: np.ndarray
              ) -> np.ndarray:
    """Per long request: short requests' decode tokens in its prefill window, the steps of its replica
    from first_scheduled_step up to (not including) first_token_step, the step that ends its prefill.

    Tokens produced by that last step appear when the prefill is already done, so a prompt computed
    in one step (orca, static) has an empty window: dec@P = 0, the decodes stalled behind it.
    """
    out = np.full(len(long_mask), np.nan)
    rows = np.flatnonzero(long_mask)
    a = _column(requests, "first_scheduled_step", np.int64)[rows]
    b = _column(requests, "first_token_step", np.int64)[rows]
    ok = (a >= 0) & (b >= a)
    rows, a, b = rows[ok], a[ok], b[ok]
    if len(rows):
        out[rows] = _range_sums(short_decodes, local.slots_of(a), local.slots_upto(a, b, side="left"))
    return out


def _range_sums(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per i: values[lo[i]:hi[i]].sum() as int64 (0 <= lo <= hi <= len(values)), from prefix sums
    taken only at the distinct bounds (np.add.reduceat), never over the whole array."""
    points, where = np.unique(np.concatenate([lo, hi]), return_inverse=True)
    inner = points[points < len(values)]  # strictly increasing, so reduceat sums between them
    head = values[:inner[0]].sum(dtype=np.int64) if len(inner) else values.sum(dtype=np.int64)
    between = np.add.reduceat(values, inner, dtype=np.int64) if len(inner) else np.zeros(0, np.int64)
    prefix = head + np.r_[0, np.cumsum(between)]  # at inner[0], inner[1], ..., then at len(values)
    prefix = prefix[np.minimum(np.arange(len(points)), len(inner))]
    return prefix[where[len(lo):]] - prefix[where[:len(lo)]]


def _short_p(arrival, completion, finished, long_mask, rejected) -> np.ndarray:
    """Per admitted long request: max completion of finished short requests in the system at its
    arrival, minus that arrival (a rejected long request never entered the system: NaN).

    A prefix max over arrival-sorted short requests: if the latest completion among those that
    arrived by `a` is after `a`, that is the max over the ones still in the system.
    """
    out = np.full(len(arrival), np.nan)
    short = ~long_mask & finished
    rows = np.flatnonzero(long_mask & ~rejected)
    if len(rows) == 0 or not short.any():
        return out
    sort = np.argsort(arrival[short], kind="stable")
    short_arrival = arrival[short][sort]
    latest_done = np.maximum.accumulate(completion[short][sort])
    upto = np.searchsorted(short_arrival, arrival[rows], side="right")
    latest = np.where(upto > 0, latest_done[np.maximum(upto - 1, 0)], -np.inf)
    present = latest > arrival[rows]
    out[rows[present]] = latest[present] - arrival[rows[present]]
    return out


def meets_slo(frame: pd.DataFrame, slo: SLOConfig) -> np.ndarray:
    """Finished, and within every objective set; an undefined TPOT or ITL (one token) passes."""
    ok = (frame["status"] == "finished").to_numpy().copy()
    if slo.ttft is not None:
        ok &= frame["ttft"].to_numpy() <= slo.ttft
    for name in ("tpot", "itl_max"):
        limit = getattr(slo, name)
        if limit is not None:
            value = frame[name].to_numpy()
            ok &= np.isnan(value) | (value <= limit)
    return ok


def request_frame(requests: list[Request], recorder: Recorder, steps: pd.DataFrame,
                  config: MetricsConfig | None = None) -> pd.DataFrame:
    """One row per request with its latencies, interference metrics and SLO verdict.

    TPOT is defined once all output_len >= 2 tokens exist; itl_max once two tokens exist;
    e2e and normalized_latency for finished requests; dec_at_p for long requests that got their
    first token, short_p for long requests that were not rejected and found a short one in the system.
    `tenant` and `adapter` columns (a string, or None) exist only when some request has one.
    The frame holds the column arrays built here without copying them (no consolidation).
    """
    config = config or MetricsConfig()
    requests = requests if isinstance(requests, RequestTable) else list(requests)
    ids = _column(requests, "id", np.int64)
    local = LocalOrder.of(steps)
    runs = token_runs(local, run_arrays(recorder, requests))
    emissions, last, itl_max = _per_request_runs(ids, local, runs)  # steps that emitted a token (or several)
    spec_extra = _column(requests, "spec_extra", np.int64)
    speculating = bool(spec_extra.any()) or bool(_column(requests, "spec_steps", np.int64).any())
    tokens = emissions + spec_extra if speculating else emissions
    prompt_len = _column(requests, "prompt_len", np.int64)
    long_mask = prompt_len >= config.long_prompt_threshold
    short_decodes = _short_decodes(ids, long_mask, local, runs)
    del runs
    code = _column(requests, "status", np.int8)
    status = np.array([Status(c).name.lower() for c in range(len(Status))], dtype=object)[code]
    finished, rejected = code == Status.FINISHED, code == Status.REJECTED
    del code
    arrival, out_len = _column(requests, "arrival", np.float64), _column(requests, "output_len", np.int64)
    first_scheduled = _column(requests, "first_scheduled", np.float64)
    first_token = _column(requests, "first_token_time", np.float64)
    completion = np.where(finished, _column(requests, "completion_time", np.float64), np.nan)
    complete = (tokens == out_len) & (out_len >= 2)
    frame = pd.DataFrame({
        "request_id": ids, "arrival": arrival, "prompt_len": prompt_len, "output_len": out_len,
        "priority": _column(requests, "priority", np.int64), "replica": _column(requests, "replica", np.int64),
        "status": status, "first_scheduled": first_scheduled, "first_token_time": first_token,
        "last_token_time": last, "completion_time": completion, "output_tokens": tokens,
        "ttft": first_token - arrival,
        "tpot": np.where(complete, (last - first_token) / np.maximum(out_len - 1, 1), np.nan),
        "e2e": completion - arrival, "queue_delay": first_scheduled - arrival,
        "normalized_latency": (completion - arrival) / np.maximum(out_len, 1),
        "itl_max": itl_max, "num_preemptions": _column(requests, "num_preemptions", np.int64), "is_long": long_mask,
        "dec_at_p": _dec_at_p(requests, local, short_decodes, long_mask),
        "short_p": _short_p(arrival, completion, finished, long_mask, rejected),
        "reject_reason": _column(requests, "reject_reason", object),
    }, copy=False)
    frame["meets_slo"] = meets_slo(frame, config.slo)
    if speculating:  # only in runs that speculate: other tables stay as they were
        add_speculative_columns(frame, requests, emissions)
    for name in ("tenant", "adapter"):  # only where some request has one: other tables stay as they were
        labels = _column(requests, name, object)
        if any(v is not None for v in labels):
            frame[name] = pd.Series(labels, dtype=object)
    return frame
