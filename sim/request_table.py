"""Requests as columns: a million requests without a million objects.

A `Request` object costs ~700 bytes once a run has filled in its times and steps; a million of them
are most of a long run's memory. A RequestTable keeps every request's fields in typed numpy columns
(~165 bytes a request) and makes a Request object only while its request is in the system:

- the arrival feed asks for the k-th arrival when it delivers it (`arrive(k)`): the table makes the
  object from the input columns and keeps it *live*;
- the feed calls `retire_done()` at every arrival and step start; now and then (amortised O(1)) every
  live request that has finished or been rejected is folded back into the columns (each of its
  fields, exactly) and dropped. Nothing changes a request after it has finished or been rejected, so
  the columns are its final state;
- afterwards `column(name)` gives any Request field as an array (the live requests' current values
  included: a run cut at max_time leaves some), and `table[i]` or iterating makes Request objects again,
  equal field for field to the ones the run used (not the same objects: read them, do not mutate them).

Rows are in any order (id order, as workloads number them); the feed delivers them in arrival order
(`arrive(k)`: the k-th arrival, ties in row order, as a stable sort of a list). Ids are 0..n-1 unless
given. Text-only requests without prefixes, tenants, adapters or images: those stay lists of Request
objects, and so do closed-loop clients and client timeouts (simulate refuses a table there).
"""
from __future__ import annotations

import math
from dataclasses import fields
from operator import attrgetter

import numpy as np

from cbsim.sim.request import Request, Status

INPUTS = {"id": np.int64, "arrival": np.float64, "prompt_len": np.int64, "output_len": np.int64,
          "priority": np.int64}
OBJECT_FIELDS = ("prefix_hashes", "output_hashes", "tenant", "adapter", "mm_inputs", "reject_reason", "session")  # not columns
RESULTS = {  # every other Request field, with its value before the request arrives
    "num_computed_tokens": (np.int64, 0), "num_output_tokens": (np.int64, 0), "status": (np.int8, int(Status.WAITING)),
    "replica": (np.int32, -1), "epoch": (np.int32, 0), "admit_seq": (np.int64, -1), "num_blocks": (np.int64, 0),
    "num_swapped_blocks": (np.int64, 0), "num_preemptions": (np.int32, 0), "first_scheduled": (np.float64, math.nan),
    "first_scheduled_step": (np.int64, -1), "first_token_time": (np.float64, math.nan), "first_token_step": (np.int64, -1),
    "completion_time": (np.float64, math.nan), "last_token_step": (np.int64, -1), "run_start_step": (np.int64, -1),
    "run_tokens": (np.int64, 0), "spec_steps": (np.int64, 0), "spec_accepted": (np.int64, 0),
    "spec_extra": (np.int64, 0),
}
_RESULT_VALUES = attrgetter(*RESULTS)
SWEEP_MIN = 64  # calls of retire_done at least between two sweeps
SWEEP_SHARE = 8  # and at least 1/SWEEP_SHARE of the live requests: a sweep's cost spread over the calls
assert {f.name for f in fields(Request)} == set(INPUTS) | set(OBJECT_FIELDS) | set(RESULTS), "a Request field has no column"


class RequestTable:
    """n requests as columns, rows in id order, delivered in arrival order (see the module docstring)."""

    def __init__(self, arrival, prompt_len, output_len, ids=None, priority=None):
        n = len(arrival)
        given = {"id": np.arange(n) if ids is None else ids, "arrival": arrival, "prompt_len": prompt_len,
                 "output_len": output_len, "priority": np.zeros(n) if priority is None else priority}
        self._columns = {name: np.ascontiguousarray(given[name], dtype=dtype) for name, dtype in INPUTS.items()}
        if any(len(c) != n for c in self._columns.values()):
            raise ValueError("RequestTable: every column needs one value per request")
        self._order = self._arrival_order()
        for name, (dtype, start) in RESULTS.items():
            self._columns[name] = np.full(n, start, dtype=dtype)
        self._reasons: dict[int, str] = {}  # row -> reject_reason, where one was given
        self._live: dict[int, Request] = {}  # row -> the object of a request in the system
        self._calls_to_sweep = SWEEP_MIN

    def __len__(self) -> int:
        return len(self._columns["arrival"])

    def __getitem__(self, row: int) -> Request:
        """Row `row`'s request: its live object, or a copy made from the columns (not kept: a copy of a
        request that has not arrived is not the object the run will use)."""
        if row < 0:
            row += len(self)
        req = self._live.get(row)
        return self._copy(row) if req is None else req

    def __iter__(self):
        return (self[row] for row in range(len(self)))

    def _arrival_order(self) -> np.ndarray | None:
        """Rows in arrival order (a stable sort); None when that is row order."""
        arrival = self._columns["arrival"]
        if np.all(arrival[1:] >= arrival[:-1]):
            return None
        return np.argsort(arrival, kind="stable")

    def shift_arrivals(self, delays: np.ndarray) -> np.ndarray:
        """Each request reaches the scheduler `delays` later than it was sent (before the run); returns
        the send times. The arrival order follows the new times."""
        if self._live:
            raise RuntimeError("RequestTable: arrivals move only before the run")
        sent = self._columns["arrival"]
        self._columns["arrival"] = sent + np.asarray(delays, dtype=np.float64)
        self._order = self._arrival_order()
        return sent

    def arrive(self, k: int) -> Request:
        """The k-th arrival's request, made live as it arrives (the feed calls this in arrival order)."""
        row = k if self._order is None else int(self._order[k])
        req = self._live.get(row)
        if req is None:
            c = self._columns
            req = self._live[row] = Request(c["id"].item(row), c["arrival"].item(row), c["prompt_len"].item(row),
                                            c["output_len"].item(row), priority=c["priority"].item(row))
        return req

    def _copy(self, row: int) -> Request:
        values = {name: column[row].item() for name, column in self._columns.items()}
        values["status"] = Status(values["status"])
        for name in ("first_scheduled", "first_token_time", "completion_time"):
            if math.isnan(values[name]):
                values[name] = math.nan  # the default object itself, as a fresh Request holds
        return Request(**values, reject_reason=self._reasons.get(row, ""))

    def retire_done(self, force: bool = False) -> None:
        """Fold the live requests that have finished or been rejected into the columns. The feed calls this
        at every arrival and step start; it sweeps once every max(SWEEP_MIN, live / SWEEP_SHARE) calls
        (O(SWEEP_SHARE) a call in all; a finished request retires within that many calls), or now with
        `force`."""
        self._calls_to_sweep -= 1
        if not force and self._calls_to_sweep > 0:
            return
        live = self._live
        done = [row for row, req in live.items() if req.status >= Status.FINISHED]
        if done:
            reqs = [live.pop(row) for row in done]
            # one C call a request; float64 holds every field exactly (integers below 2**53)
            values = np.array([_RESULT_VALUES(req) for req in reqs], dtype=np.float64)
            rows = np.array(done, dtype=np.int64)
            for j, name in enumerate(RESULTS):
                self._columns[name][rows] = values[:, j]
            self._reasons.update((row, req.reject_reason) for row, req in zip(done, reqs) if req.reject_reason)
        self._calls_to_sweep = max(SWEEP_MIN, len(live) // SWEEP_SHARE)

    def column(self, name: str) -> np.ndarray:
        """Field `name` of every request, in row order: the table's own column where no request is live
        (no copy: a frame built on it shares its memory; the run is over when metrics read it)."""
        if name == "reject_reason":
            return np.array([self._reasons.get(row, "") for row in range(len(self))], dtype=object)
        if name in OBJECT_FIELDS:  # prefixes, tenants, adapters, images, sessions: a table holds none
            return np.full(len(self), None, dtype=object)
        values = self._columns[name]
        live = [(row, getattr(req, name)) for row, req in self._live.items()] if name in RESULTS else []
        if not live:
            return values
        values = values.copy()
        for row, value in live:
            values[row] = value
        return values

    def renumber_steps(self, names, renumber) -> None:
        """Fields `names` (step indices) of every request, live or retired, through `renumber` (an array of
        indices to an array of indices; sim/row_order.py gives the step table its order after the run)."""
        for name in names:
            self._columns[name] = renumber(self._columns[name])
        live = list(self._live.values())
        for name in names:
            values = renumber(np.array([getattr(req, name) for req in live], dtype=np.int64)).tolist()
            for req, value in zip(live, values):
                setattr(req, name, value)

    def done_count(self) -> int:
        """Requests that have finished or been rejected."""
        retired = int(np.count_nonzero(self._columns["status"] >= Status.FINISHED))
        return retired + sum(1 for req in self._live.values() if req.status >= Status.FINISHED)

    @classmethod
    def of(cls, requests: list[Request]) -> "RequestTable":
        """A table of fresh requests (for tests and conversions); refuses what a table cannot hold."""
        for req in requests:
            if any(getattr(req, name) for name in OBJECT_FIELDS) or req.status != Status.WAITING:
                raise ValueError(f"request {req.id}: a RequestTable holds fresh text-only requests "
                                 "(no prefix hashes, tenant, adapter, images or progress)")
        column = {name: [getattr(r, name) for r in requests] for name in INPUTS}
        return cls(column["arrival"], column["prompt_len"], column["output_len"], column["id"], column["priority"])


def request_column(requests, name: str, dtype) -> np.ndarray:
    """Field `name` of every request in `requests` (a list of Request, or a RequestTable) as `dtype`."""
    if isinstance(requests, RequestTable):
        return requests.column(name).astype(dtype, copy=False)
    return np.fromiter((getattr(r, name) for r in requests), dtype=dtype, count=len(requests))
