"""Token runs located in the replicas' local order (step_order.py).

A request's tokens are *runs* (recorder.py): a run covers consecutive local positions f..l of one
replica, one token per step, token time = the step's end. Invariants checked (ValueError on a
broken record): a run lies on one replica, tokens == l - f + 1, and runs of one request do not
overlap in time. Nothing here expands runs into tokens except `token_times` (one request).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cbsim.sim.metrics.recorder import Recorder
from cbsim.sim.request_table import RequestTable
from cbsim.sim.metrics.step_order import LocalOrder, index_dtype, step_frame


@dataclass(frozen=True)
class TokenRuns:
    """Every token run, sorted by (request, time), located in the local order."""

    request_id: np.ndarray
    first: np.ndarray  # local slot of the run's first token
    last: np.ndarray  # local slot of its last token
    tokens: np.ndarray
    t_first: np.ndarray
    t_last: np.ndarray
    break_gap: np.ndarray  # gap from the same request's previous run; NaN on a request's first run


def run_arrays(recorder: Recorder, requests=()) -> dict[str, np.ndarray]:
    """The recorder's closed runs plus the still-open run of each request (a run cut short)."""
    table = recorder.run_table()
    if isinstance(requests, RequestTable):
        tokens = requests.column("run_tokens")
        rows = np.flatnonzero(tokens > 0)
        extra = np.column_stack([requests.column(name)[rows].astype(np.int64)
                                 for name in ("id", "run_start_step", "last_token_step", "run_tokens")])
    else:
        open_runs = [(r.id, r.run_start_step, r.last_token_step, r.run_tokens) for r in requests if r.run_tokens > 0]
        extra = np.array(open_runs, dtype=np.int64).reshape(-1, 4)
    if not len(extra):
        return table
    return {name: np.concatenate([table[name], extra[:, j]])
            for j, name in enumerate(("request_id", "first_step", "last_step", "tokens"))}


def token_runs(local: LocalOrder, runs: dict[str, np.ndarray]) -> TokenRuns:
    """Locate runs in the local order and check the run invariants."""
    first_step, last_step, tokens = runs["first_step"], runs["last_step"], runs["tokens"]
    if len(tokens) and (first_step.min() < 0 or last_step.max() >= len(local)):
        raise ValueError("a token run refers to a step that is not in the step table")
    slot = index_dtype(len(local))
    first, last = local.slots_of(first_step).astype(slot), local.slots_of(last_step).astype(slot)
    bad = (local.step_replica[first_step] != local.step_replica[last_step]) | (last - first + 1 != tokens)
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"token run {i} of request {runs['request_id'][i]} is not "
                         f"{tokens[i]} consecutive steps of one replica")
    t_first, t_last = local.step_end[first_step], local.step_end[last_step]
    sort = np.lexsort((t_first, runs["request_id"]))
    rid, t_first, t_last = runs["request_id"][sort], t_first[sort], t_last[sort]
    break_gap = np.full(len(rid), np.nan)
    same = rid[1:] == rid[:-1]
    break_gap[1:][same] = t_first[1:][same] - t_last[:-1][same]
    if np.any(break_gap <= 0):
        raise ValueError("two token runs of one request overlap in time")
    return TokenRuns(rid, first[sort], last[sort], tokens[sort], t_first, t_last, break_gap)


def in_run_max(local: LocalOrder, runs: TokenRuns) -> np.ndarray:
    """Largest within-run gap of each run (NaN for a one-token run), without expanding tokens.

    A run's gaps are those of its slots first+1..last; the steps are scanned block by block, each
    run taking the max over its part of the block (reduceat over (start, stop) index pairs).
    """
    out = np.full(len(runs.first), np.nan)
    multi = np.flatnonzero(runs.last > runs.first)
    lo, hi = runs.first[multi] + 1, runs.last[multi] + 1  # the run's gaps: slots lo..hi-1
    by_start = np.argsort(lo, kind="stable")  # keeps the unused in-between spans short
    multi, lo, hi = multi[by_start], lo[by_start], hi[by_start]
    span = int((hi - lo).max()) if len(multi) else 0  # a run reaching slot c0 starts after c0 - span
    for c0, gap in local.gap_blocks() if len(multi) else ():
        c1 = c0 + len(gap)
        window = np.searchsorted(lo, c0 - span, side="right")
        mine = window + np.flatnonzero(hi[window:np.searchsorted(lo, c1)] > c0)
        if len(mine) == 0:
            continue
        bounds = np.empty(2 * len(mine), dtype=np.int64)
        bounds[0::2] = np.maximum(lo[mine], c0) - c0
        bounds[1::2] = np.minimum(hi[mine], c1) - c0
        np.fmax.at(out, multi[mine], np.fmax.reduceat(np.append(gap, np.nan), bounds)[0::2])
    return out


def token_times(recorder: Recorder, request_id: int) -> np.ndarray:
    """All token times of one request (closed runs), in order; for tests and notebooks."""
    local = LocalOrder.of(step_frame(recorder))
    table = recorder.run_table()
    mine = table["request_id"] == request_id
    runs = token_runs(local, {name: column[mine] for name, column in table.items()})
    slots = [np.arange(f, l + 1) for f, l in zip(runs.first, runs.last)]
    return local.end_at(np.concatenate(slots)) if slots else np.zeros(0)
