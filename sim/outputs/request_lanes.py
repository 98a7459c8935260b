"""Per-request lanes of the Chrome/Perfetto trace: what each request was doing, and when.

One process "requests" (pid REQUESTS_PID) with a track per request (tid = request id, named
"req <id> (<prompt>+<output>)"), holding complete ("X") events in the client's time:
- queue: arrival to first scheduled (front-end delay included when the engine has one);
- prefill: first scheduled to first token (every chunk, and any wait between chunks);
- decode: first token to completion (or to the last token of a request cut or failed);
- transfer <kind>: each KV hop of a P/D hand-off and each swap (the transfers table);
and an instant ("i") event "rejected" for a request rejected before it ran. Only the requests that
arrive before `until` (the end of the last traced step) are drawn, the first `max_requests` of
them by arrival, so the lanes line up with the traced steps and the file stays small.
"""
from __future__ import annotations

import math

import pandas as pd

REQUESTS_PID = 1 << 20  # after every replica's pid


def request_events(requests: pd.DataFrame, transfers: pd.DataFrame | None, until: float, max_requests: int):
    """The lane events of the requests arriving before `until` (seconds), at most `max_requests`."""
    chosen = requests[requests["arrival"] <= until].sort_values(["arrival", "request_id"]).head(max_requests)
    if chosen.empty:
        return
    yield {"ph": "M", "name": "process_name", "pid": REQUESTS_PID, "args": {"name": "requests"}}
    hops = _hops_by_request(transfers, set(chosen["request_id"]))
    for row in chosen.itertuples(index=False):
        yield from _lane(row, hops.get(row.request_id, ()))


def _lane(row, hops):
    rid = int(row.request_id)
    yield {"ph": "M", "name": "thread_name", "pid": REQUESTS_PID, "tid": rid,
           "args": {"name": f"req {rid} ({row.prompt_len}+{row.output_len})"}}
    end = row.completion_time if not math.isnan(row.completion_time) else row.last_token_time
    spans = (("queue", row.arrival, row.first_scheduled), ("prefill", row.first_scheduled, row.first_token_time),
             ("decode", row.first_token_time, end))
    for name, start, stop in spans:
        if not (math.isnan(start) or math.isnan(stop)) and stop >= start:
            yield _span(name, rid, start, stop, {"status": row.status})
    for hop in hops:
        yield _span(f"transfer {hop.kind}", rid, hop.start, hop.end, {"link": hop.link, "bytes": hop.bytes})
    if row.status == "rejected" and math.isnan(row.first_scheduled):
        yield {"ph": "i", "s": "t", "name": "rejected", "pid": REQUESTS_PID, "tid": rid, "ts": _us(row.arrival),
               "args": {"reason": row.reject_reason}}


def _span(name: str, rid: int, start: float, stop: float, args: dict) -> dict:
    return {"ph": "X", "cat": "request", "name": name, "pid": REQUESTS_PID, "tid": rid, "ts": _us(start),
            "dur": _us(stop - start), "args": args}


def _hops_by_request(transfers: pd.DataFrame | None, ids: set) -> dict:
    if transfers is None or transfers.empty:
        return {}
    out: dict = {}
    for hop in transfers[transfers["request_id"].isin(ids)].itertuples(index=False):
        out.setdefault(hop.request_id, []).append(hop)
    return out


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)
