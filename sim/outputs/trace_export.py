"""Chrome trace (JSON object format) of the step table, for Perfetto or chrome://tracing.

One process per replica (pid = replica, named "replica N"), one "X" complete event per step
(ts and dur in microseconds, name like "P512+D12", args with the step's token counts) and a
"C" counter track `kv_blocks_used` per replica sampled at each step's start. Only the first
`max_steps` steps (by global index) are written; `otherData` says how many there were. Given the
request table, a "requests" process follows with a lane per request (request_lanes.py).
Events are written one per line, so memory stays flat however long the run.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pandas as pd

from .request_lanes import request_events

ARG_COLUMNS = ("prefill_tokens", "decode_tokens", "padding_tokens", "num_seqs", "kv_blocks_used",
               "preemptions", "swap_bytes")


def step_name(prefill: int, decode: int, padding: int = 0) -> str:
    """A short label: "P512+D12", "D64", "P2048", "D30+pad2"; "empty" for a step with no rows."""
    parts = [f"P{prefill}"] if prefill else []
    parts += [f"D{decode}"] if decode else []
    parts += [f"pad{padding}"] if padding else []
    return "+".join(parts) or "empty"


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _events(steps: pd.DataFrame):
    cols = {name: steps[name].tolist() for name in ("step", "replica", "start", "end", *ARG_COLUMNS)}
    for r in sorted(set(cols["replica"])):
        yield {"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"replica {r}"}}
        yield {"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "steps"}}
    for i in range(len(steps)):
        args = {name: cols[name][i] for name in ARG_COLUMNS}
        args["step"] = cols["step"][i]
        pid, start = cols["replica"][i], cols["start"][i]
        name = step_name(args["prefill_tokens"], args["decode_tokens"], args["padding_tokens"])
        yield {"ph": "X", "cat": "step", "name": name, "pid": pid, "tid": 0, "ts": _us(start),
               "dur": _us(cols["end"][i] - start), "args": args}
        yield {"ph": "C", "name": "kv_blocks_used", "pid": pid, "ts": _us(start),
               "args": {"blocks": args["kv_blocks_used"]}}


def write_chrome_trace(steps_df: pd.DataFrame, path, max_steps: int, requests: pd.DataFrame | None = None,
                       transfers: pd.DataFrame | None = None, max_requests: int = 0) -> int:
    """Write the trace of the first `max_steps` steps of `steps_df` (metrics.step_frame) to `path`,
    and with `requests` (the request table) the lanes of up to `max_requests` requests that arrive
    within those steps (request_lanes.py).

    Returns the number of steps written.
    """
    steps = steps_df.sort_values("step").head(max(int(max_steps), 0))
    other = {"steps_total": len(steps_df), "steps_written": len(steps), "truncated": len(steps) < len(steps_df),
             "time_unit": "microseconds"}
    events = _events(steps)
    if requests is not None and max_requests > 0 and len(steps):
        events = itertools.chain(events, request_events(requests, transfers, float(steps["end"].max()), max_requests))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write('{"displayTimeUnit": "ms", "otherData": ' + json.dumps(other) + ', "traceEvents": [\n')
        for i, event in enumerate(events):
            f.write((",\n" if i else "") + json.dumps(event))
        f.write("\n]}\n")
    return len(steps)
