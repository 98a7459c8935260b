"""The step table's row order: by replica (ascending), then each replica's own order of its steps.

While a simulation runs, the recorder numbers steps as the replicas record them, so the rows of several
replicas interleave in the order their steps began, or, where a replica fast-forwards a run (sim/fast_forward.py,
sim/prompt_run.py), in the order their runs were committed: a run that outlives another replica's steps puts
its rows after theirs. Neither is a property worth keeping, and the two disagree. So the table's order is
fixed by one rule, applied here, once, when the simulation ends (sim/simulation.py run_cluster): the rows
are grouped by replica, and within a replica keep the order it recorded them (its steps' start order; a
pipelined replica's, the order its micro-batches entered the pipeline), which stepping and runs share.
Row i of the table is global step i, so every step index the run kept (the token runs, and each request's
first scheduled, first token, last token and token-run start steps) is renumbered with the rows.

One replica, or replicas whose rows already come grouped, keep their table as it is (nothing is copied).
The multiset of rows, and every per-replica sequence of rows, are unchanged by the reordering.
"""
from __future__ import annotations

from array import array

import numpy as np

from cbsim.sim.metrics.recorder import STEP_COLUMNS, Recorder
from cbsim.sim.request_table import RequestTable

STEP_FIELDS = ("first_scheduled_step", "first_token_step", "last_token_step", "run_start_step")  # Request fields


def by_replica(recorder: Recorder, requests) -> None:
    """Put `recorder`'s rows in the step table's order (see the module docstring), in place (every reference
    to it stays good), and renumber every step index in `requests` (a list of Request, or a RequestTable) to
    match; with several replicas, the token runs come in the order of their first step (then request id),
    not the order they were closed in. Nothing is copied where the rows are in that order already."""
    replica = recorder.step_column("replica")
    if not len(replica) or bool((replica == replica[0]).all()):
        return
    if bool(np.all(replica[1:] >= replica[:-1])):
        _runs(recorder, recorder, None)
        return
    order = np.argsort(replica, kind="stable")
    renumber = np.empty(len(order), dtype=np.int64)  # old row -> new row
    renumber[order] = np.arange(len(order), dtype=np.int64)
    ordered = _rows(recorder, order, replica[order])
    _runs(recorder, ordered, renumber)
    _requests(requests, renumber)
    recorder.adopt(ordered)


def _rows(recorder: Recorder, order: np.ndarray, replicas: np.ndarray) -> Recorder:
    """A recorder holding `recorder`'s rows in `order`, appended one replica's block at a time (its starts
    kept where they are not its previous row's end, as the recorder keeps them)."""
    table = recorder.step_table()
    columns = {name: table[name][order] for name in STEP_COLUMNS if name != "replica"}
    ordered = Recorder()
    cuts = np.flatnonzero(replicas[1:] != replicas[:-1]) + 1
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(order)]):
        ordered.add_steps(replica=int(replicas[lo]), **{name: column[lo:hi] for name, column in columns.items()})
    return ordered


def _runs(recorder: Recorder, ordered: Recorder, renumber: np.ndarray | None) -> None:
    """`recorder`'s token runs into `ordered`: their steps renumbered (a run's steps are one replica's: still
    first <= last; None: as they are), sorted by first step, then request id."""
    runs = recorder.run_table()
    first, last = runs["first_step"], runs["last_step"]
    if renumber is not None:
        first, last = renumbered(first, renumber), renumbered(last, renumber)
    order = np.lexsort((runs["request_id"], first))
    for name, values in (("run_request", runs["request_id"]), ("run_first_step", first), ("run_last_step", last),
                         ("run_tokens", runs["tokens"])):
        column = array("q")
        column.frombytes(np.ascontiguousarray(values[order], dtype=np.int64).tobytes())
        setattr(ordered, name, column)


def renumbered(steps: np.ndarray, renumber: np.ndarray) -> np.ndarray:
    """Step indices in the new numbering; -1 (none) and an index past the table (a request admitted into a
    step the simulation's end cut before it was recorded) stay as they are."""
    steps = np.asarray(steps, dtype=np.int64)
    valid = (steps >= 0) & (steps < len(renumber))
    return np.where(valid, renumber[np.where(valid, steps, 0)], steps)


def _requests(requests, renumber: np.ndarray) -> None:
    """Every request's STEP_FIELDS in the new numbering."""
    if isinstance(requests, RequestTable):
        requests.renumber_steps(STEP_FIELDS, lambda steps: renumbered(steps, renumber))
        return
    for name in STEP_FIELDS:
        values = renumbered(np.fromiter((getattr(r, name) for r in requests), np.int64, len(requests)), renumber)
        for req, value in zip(requests, values.tolist()):
            setattr(req, name, value)
