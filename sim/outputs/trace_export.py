"""Chrome trace (JSON object format) of the step table, for Perfetto or chrome://tracing.

One process per replica (pid = replica, named "replica N"), one "X" complete event per step
(ts and dur in microseconds, name like "P512+D12", args with the step's token counts) and a
"C" counter track `kv_blocks_used` per replica sampled at each step's start. Only the first
`max_steps` steps (by global index) are written; `otherData` says how many there were. Given the
request table, a "requests" process follows with a lane per request (request_lanes.py).

Invariant: the file is exactly what `json.dumps` of each event, one per line, would write. The step
events (nearly all of a trace) are formatted column by column instead: a number's JSON text is its
repr (ints, finite floats; anything else goes through json.dumps), so a block of BLOCK steps costs a
few list comprehensions, not a dict and an encoder call per event. Blocks keep memory flat however
long the run.
"""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pandas as pd

from cbsim.sim.outputs.request_lanes import request_events

ARG_COLUMNS = ("prefill_tokens", "decode_tokens", "padding_tokens", "num_seqs", "kv_blocks_used",
               "preemptions", "swap_bytes")
BLOCK = 8192  # steps formatted at a time


def step_name(prefill: int, decode: int, padding: int = 0) -> str:
    """A short label: "P512+D12", "D64", "P2048", "D30+pad2"; "empty" for a step with no rows."""
    parts = [f"P{prefill}"] if prefill else []
    parts += [f"D{decode}"] if decode else []
    parts += [f"pad{padding}"] if padding else []
    return "+".join(parts) or "empty"


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def json_texts(values: list) -> list[str]:
    """Each value as json.dumps writes it: ints and finite floats by their repr (what json.dumps
    writes for them), anything else (bools, NaN, strings, None) through json.dumps itself."""
    kinds = set(map(type, values))
    if kinds <= {int}:
        return list(map(int.__repr__, values))
    if kinds <= {float} and all(map(math.isfinite, values)):
        return list(map(float.__repr__, values))
    return [json.dumps(v) for v in values]


def _metadata(steps: pd.DataFrame):
    for r in sorted(set(steps["replica"].tolist())):
        yield json.dumps({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"replica {r}"}})
        yield json.dumps({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "steps"}})


_STEP = ('{"ph": "X", "cat": "step", "name": "%s", "pid": %s, "tid": 0, "ts": %s, "dur": %s, "args": {'
         + ", ".join(f'"{name}": %s' for name in (*ARG_COLUMNS, "step")) + "}}")
_COUNTER = '{"ph": "C", "name": "kv_blocks_used", "pid": %s, "ts": %s, "args": {"blocks": %s}}'


def _step_lines(block: pd.DataFrame) -> list[str]:
    """The "X" and "C" events of a block of steps, as JSON text (a step name is digits, letters and
    '+' and '.', so it needs no escaping)."""
    cols = {name: block[name].to_numpy().tolist() for name in ("step", "replica", "start", "end", *ARG_COLUMNS)}
    start, end = cols["start"], cols["end"]
    names = [step_name(p, d, pad) for p, d, pad in zip(cols["prefill_tokens"], cols["decode_tokens"],
                                                        cols["padding_tokens"])]
    ts = json_texts([_us(s) for s in start])
    dur = json_texts([_us(e - s) for s, e in zip(start, end)])
    pid = json_texts(cols["replica"])
    args = {name: json_texts(cols[name]) for name in (*ARG_COLUMNS, "step")}
    steps = [_STEP % row for row in zip(names, pid, ts, dur, *args.values())]
    counters = [_COUNTER % row for row in zip(pid, ts, args["kv_blocks_used"])]
    return [line for pair in zip(steps, counters) for line in pair]


def _events(steps: pd.DataFrame):
    """Every step event as a line of JSON: the replicas' names first, then each step's X and C events."""
    yield from _metadata(steps)
    for first in range(0, len(steps), BLOCK):
        yield from _step_lines(steps.iloc[first:first + BLOCK])


def write_chrome_trace(steps_df: pd.DataFrame, path, max_steps: int, requests: pd.DataFrame | None = None,
                       transfers: pd.DataFrame | None = None, max_requests: int = 0) -> int:
    """Write the trace of the first `max_steps` steps of `steps_df` (metrics.step_frame, or a run's
    StepTable) to `path`,
    and with `requests` (the request table) the lanes of up to `max_requests` requests that arrive
    within those steps (request_lanes.py).

    Returns the number of steps written.
    """
    count = max(int(max_steps), 0)  # a StepTable (rows in step order) makes only these rows
    steps = steps_df.rows(0, count) if hasattr(steps_df, "rows") else steps_df.sort_values("step").head(count)
    other = {"steps_total": len(steps_df), "steps_written": len(steps), "truncated": len(steps) < len(steps_df),
             "time_unit": "microseconds"}
    lines = _events(steps)
    if requests is not None and max_requests > 0 and len(steps):
        lanes = request_events(requests, transfers, float(steps["end"].max()), max_requests)
        lines = itertools.chain(lines, map(json.dumps, lanes))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        f.write('{"displayTimeUnit": "ms", "otherData": ' + json.dumps(other) + ', "traceEvents": [\n')
        first = next(lines, None)
        if first is not None:
            f.write(first)
            for chunk in iter(lambda: list(itertools.islice(lines, 4 * BLOCK)), []):
                f.write(",\n" + ",\n".join(chunk))
        f.write("\n]}\n")
    return len(steps)
