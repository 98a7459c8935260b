"""Recorder: what happened, kept compactly while the simulation runs; computed on afterwards.

Steps are rows in growable numpy columns, indexed by a global step number (all replicas share
the numbering; each row names its replica).

Output tokens are not stored one by one. A request's tokens come in *runs*: maximal sequences of
consecutive steps of one replica in each of which it produced one token (a decode batch that
keeps it every step is one run; a prefill-only step, a preemption or a move to another replica
ends it). A run is (request id, first step, last step, tokens) and a token's time is the end of
its step, so every token time and every inter-token gap can be reconstructed exactly from the
step table, at a memory cost of one run instead of hundreds of tokens.

Three integer aggregates describe what a step's attention read and computed, for the efficiency
columns computed afterwards (sim/metrics/step_efficiency.py): the decode rows' contexts summed (padding
rows included: they run like decode rows), the prefill rows' histories summed (KV tokens already
cached that each chunk reads), and the prefill rows' causal query-key pairs summed. They are exact
integers; a prefill row (c, h) has c * h + c * (c + 1) / 2 pairs.
"""
from __future__ import annotations

import math
from array import array

import numpy as np

from cbsim.sim.metrics.growable import Column, SparseColumn
from cbsim.sim.request import Request

STEP_COLUMNS = {  # the step table's columns and types, in order
    "replica": np.int16,
    "start": np.float64,
    "end": np.float64,
    "prefill_tokens": np.int32,
    "decode_tokens": np.int32,
    "padding_tokens": np.int32,
    "num_seqs": np.int32,
    "kv_blocks_used": np.int32,
    "preemptions": np.int16,
    "swap_bytes": np.float64,
    "decode_context_tokens": np.int64,  # sum of the decode rows' context lengths (KV tokens they read)
    "prefill_history_tokens": np.int32,  # sum of h over prefill rows (c, h)
    "prefill_attention_pairs": np.int64,  # sum of c * h + c * (c + 1) / 2 over prefill rows
}
AGGREGATES = ("decode_context_tokens", "prefill_history_tokens", "prefill_attention_pairs")  # 0 unless given
# kept as the rows where they are not zero (prefill, padding, preemptions and swaps are in few steps)
SPARSE = ("padding_tokens", "preemptions", "swap_bytes", "prefill_history_tokens", "prefill_attention_pairs")
DENSE = tuple(name for name in STEP_COLUMNS if name not in SPARSE and name != "start")  # 34 bytes a step, declared


class Recorder:
    """Steps are kept compactly (~21 bytes a step): the dense columns, the integer ones narrow while they
    grow (growable.Column: a batch's counts fit in a byte or two), the mostly-zero ones as their
    non-zero rows (SparseColumn), and a step's start only where it is not the end of its replica's
    previous step (a busy replica starts each step when the last one ends); `step_table` gives every
    column whole, in its declared type, and `step_column` one of them."""

    def __init__(self):
        self.dense = {name: Column(STEP_COLUMNS[name], narrow=True, on_widen=self._bind) for name in DENSE}
        self.sparse = {name: SparseColumn(STEP_COLUMNS[name]) for name in SPARSE}
        self._bind()
        self._puts = [column.put for column in self.sparse.values()]  # in SPARSE order
        self._end = self.dense["end"].data
        self._starts = SparseColumn(np.float64, keep_zeros=True)  # row -> start, where not the previous end
        self._last = {}  # replica -> its latest row
        self.run_request = array("q")
        self.run_first_step = array("q")
        self.run_last_step = array("q")
        self.run_tokens = array("q")

    @property
    def replicas_seen(self) -> int:
        """How many replicas have a step."""
        return len(self._last)

    @property
    def num_steps(self) -> int:
        return len(self._end)

    def add_step(self, replica: int, start: float, end: float, prefill_tokens: int, decode_tokens: int,
                 padding_tokens: int, num_seqs: int, kv_blocks_used: int, preemptions: int,
                 swap_bytes: float, decode_context_tokens: int = 0, prefill_history_tokens: int = 0,
                 prefill_attention_pairs: int = 0) -> int:
        """Append one step row; returns its global step index (called once per simulated step)."""
        index = len(self._end)
        self._start_at(index, replica, start)
        a = self._appends  # in DENSE order; spelled out, this runs once per step
        try:
            a[0](replica), a[1](end), a[2](prefill_tokens), a[3](decode_tokens), a[4](num_seqs), a[5](kv_blocks_used)
            a[6](decode_context_tokens)
        except OverflowError:  # a value too wide for a narrow column so far: widen it (rare, see growable.py)
            self._append_widening(index, (replica, end, prefill_tokens, decode_tokens, num_seqs, kv_blocks_used,
                                          decode_context_tokens))
        if padding_tokens or preemptions or swap_bytes or prefill_history_tokens or prefill_attention_pairs:
            p = self._puts  # in SPARSE order
            p[0](index, padding_tokens), p[1](index, preemptions), p[2](index, swap_bytes)
            p[3](index, prefill_history_tokens), p[4](index, prefill_attention_pairs)
        return index

    def adopt(self, other: "Recorder") -> None:
        """Take over `other`'s rows and runs (its columns, rebound to this recorder's appends and widening
        hook): one object, as if it had recorded them so (sim/row_order.py re-orders a run's rows so)."""
        state = vars(self)
        state.clear()
        state.update(vars(other))
        for column in self.dense.values():
            column.on_widen = self._bind
        self._bind()

    def _bind(self) -> None:
        """The dense columns' appends, in DENSE order (bound again whenever a narrow column widens)."""
        self._appends = [column.data.append for column in self.dense.values()]

    def _append_widening(self, index: int, values: tuple) -> None:
        """Row `index`'s dense values (in DENSE order) in the columns that do not hold it yet, widening
        the one that overflowed."""
        for column, value in zip(self.dense.values(), values):
            if len(column) == index:
                column.append(value)

    def _start_at(self, index: int, replica: int, start: float) -> None:
        """Row `index` of `replica` starts at `start`: kept only where that is not its previous row's end.
        A row's end is written once (NaN until set_end), so an end read here is final: a start read
        from it later is the same float."""
        previous = self._last.get(replica)
        if previous is None or not start == self._end[previous]:
            self._starts.put(index, start)
        self._last[replica] = index

    def set_end(self, step: int, end: float) -> None:
        """Close a step row opened at the step's start (its end is known only when it finishes)."""
        if not math.isnan(self._end[step]):
            raise RuntimeError(f"step {step} was closed twice")
        self._end[step] = end

    def set_start(self, step: int, start: float) -> None:
        """Move the start of the row just added (a pipelined batch's pass through its last stage)."""
        self._starts.set(step, start)

    def set_preemptions(self, step: int, count: int) -> None:
        self.sparse["preemptions"].set(step, count)

    def add_steps(self, **rows) -> int:
        """Append many step rows at once (scalars broadcast; an aggregate left out is 0); returns the
        first new index."""
        first = self._append_rows(len(rows["start"]), rows)
        self._starts_of(first, rows["replica"], rows["start"], rows["end"])
        return first

    def add_run(self, replica: int, ends, **rows) -> int:
        """Append a run of one replica's steps that follow each other: step k from ends[k] to ends[k + 1]
        (a list or numpy array); the other columns as add_steps takes them. Returns the first new index."""
        rows["replica"], rows["end"] = replica, ends[1:]
        first = self._append_rows(len(ends) - 1, rows)
        if len(ends) > 1:
            self._start_at(first, replica, ends[0])  # the others start where the step before ended
            self._last[replica] = first + len(ends) - 2
        return first

    def _append_rows(self, count: int, rows: dict) -> int:
        """The dense and sparse columns of `count` new rows; returns the first new index."""
        first = len(self._end)
        if not count:
            return first
        for name, column in self.dense.items():  # once per fast-forwarded run: the columns' arrays directly
            value = rows.get(name, 0) if name in AGGREGATES else rows[name]
            if isinstance(value, (list, np.ndarray, array)):
                column.extend(value)
            else:
                column.fill(value, count)  # (array repetition: a list of count values cost ~30 ns a value)
        for name, column in self.sparse.items():
            value = rows.get(name, 0) if name in AGGREGATES else rows[name]
            if isinstance(value, (list, np.ndarray)):
                column.put_many(first, value)
            elif value:
                column.put_many(first, [value] * count)  # (a scalar 0, the usual case, keeps nothing)
        return first

    def _starts_of(self, first: int, replica, start, end) -> None:
        """The starts of rows first.. (appended already), kept where they are not the previous end."""
        if not len(start):
            return
        if not np.isscalar(replica):  # rows of several replicas (a test's table): row by row
            for k, (r, s) in enumerate(zip(np.asarray(replica).tolist(), np.asarray(start).tolist())):
                self._start_at(first + k, r, s)
            return
        count = len(start)
        self._start_at(first, replica, start[0])
        later = (np.flatnonzero(start[1:] != end[:-1]) + 1).tolist() if isinstance(start, np.ndarray) else \
            [k for k in range(1, count) if not start[k] == end[k - 1]]
        for k in later:
            self._starts.put(first + k, start[k])
        self._last[replica] = first + count - 1

    def token(self, req: Request, step: int, previous_step: int) -> None:
        """Note that `req` produced one token in `step`; `previous_step` is its replica's last step."""
        if req.run_tokens and req.last_token_step == previous_step:
            req.run_tokens += 1
        else:
            self.close_run(req)
            req.run_start_step = step
            req.run_tokens = 1
        req.last_token_step = step

    def tokens_bulk(self, reqs, first_step: int, last_step: int) -> None:
        """Every request in `reqs` produced a token in each of the consecutive steps first..last."""
        count = last_step - first_step + 1
        for req in reqs:
            # the caller guarantees each request's run reaches first_step - 1
            req.run_tokens += count
            req.last_token_step = last_step

    def closed_runs(self, request_ids, first_steps, last_steps, tokens) -> None:
        """Append closed runs in bulk, in order (int64 arrays alike): what close_run records, one by one, for
        a pipelined replica's decode run (sim/pipeline_run.py)."""
        for column, values in ((self.run_request, request_ids), (self.run_first_step, first_steps),
                               (self.run_last_step, last_steps), (self.run_tokens, tokens)):
            column.frombytes(np.asarray(values, np.int64).tobytes())

    def close_run(self, req: Request) -> None:
        """End the request's open run, if any (on a break, a preemption or its completion)."""
        if req.run_tokens:
            self.run_request.append(req.id)
            self.run_first_step.append(req.run_start_step)
            self.run_last_step.append(req.last_token_step)
            self.run_tokens.append(req.run_tokens)
            req.run_tokens = 0

    def add_run_record(self, request_id: int, first_step: int, last_step: int, tokens: int) -> None:
        """A token run closed elsewhere (a prompt run's commit, in the order stepping closes them)."""
        self.run_request.append(request_id)
        self.run_first_step.append(first_step)
        self.run_last_step.append(last_step)
        self.run_tokens.append(tokens)

    def step_table(self, sparse: bool = False) -> dict[str, np.ndarray]:
        """Every column whole, in STEP_COLUMNS order (dense ones are views of the recorder's buffers);
        with `sparse`, the SPARSE columns as pandas SparseArrays (their non-zero rows only)."""
        return {name: self.step_column(name, sparse) for name in STEP_COLUMNS}

    def step_column(self, name: str, sparse: bool = False) -> np.ndarray:
        """One column whole, in its declared type: a dense one is a view of the recorder's buffer (widened
        to that type in place), `start` is computed, a SPARSE one is made dense (a SparseArray with `sparse`)."""
        if name == "start":
            return self._start_column(self.dense["end"].array(), self.dense["replica"].array())
        if name in self.sparse:
            column = self.sparse[name]
            return column.sparse_array(self.num_steps) if sparse else column.dense(self.num_steps)
        return self.dense[name].array()

    def step_rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Rows lo..hi-1 of one column, in its declared type, as `step_column(name)[lo:hi]` holds them, made
        for these rows alone: a narrow column's buffer is not widened, a sparse one not made dense whole.
        `start` of several replicas is the one exception (each row's start may be another replica's
        row away): the whole column is computed, and the rows taken from it."""
        if name == "start":
            if self.replicas_seen > 1:
                return self.step_column("start")[lo:hi]
            end = self.dense["end"].array_as_stored()
            start = np.empty(hi - lo, dtype=np.float64)
            start[1:] = end[lo:hi][:-1]
            if lo > 0 and hi > lo:
                start[0] = end[lo - 1]  # (row 0 of a replica has a kept start, scattered below)
            return _scatter_rows(self._starts, start, lo, hi)
        if name in self.sparse:
            return _scatter_rows(self.sparse[name], np.zeros(hi - lo, dtype=self.sparse[name].dtype), lo, hi)
        return self.dense[name].array_as_stored()[lo:hi].astype(STEP_COLUMNS[name], copy=False)

    def _start_column(self, end: np.ndarray, replica: np.ndarray) -> np.ndarray:
        """Each row's start: the one kept, or the end of its replica's previous row."""
        n = len(end)
        start = np.empty(n, dtype=np.float64)
        if n and (replica == replica[0]).all():
            start[1:] = end[:-1]
        elif n:
            order = np.argsort(replica, kind="stable")  # each replica's rows, in order
            start[order[1:]] = end[order[:-1]]  # (a replica's first row has a kept start)
        return self._starts.scatter(start)

    def run_table(self) -> dict[str, np.ndarray]:
        return {
            "request_id": np.frombuffer(self.run_request, dtype=np.int64) if self.run_request else np.zeros(0, np.int64),
            "first_step": np.frombuffer(self.run_first_step, dtype=np.int64) if self.run_first_step else np.zeros(0, np.int64),
            "last_step": np.frombuffer(self.run_last_step, dtype=np.int64) if self.run_last_step else np.zeros(0, np.int64),
            "tokens": np.frombuffer(self.run_tokens, dtype=np.int64) if self.run_tokens else np.zeros(0, np.int64),
        }


def _scatter_rows(column, out: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """`out` (rows lo..hi-1) with the values `column` (a SparseColumn) keeps in those rows written over it."""
    rows = column.row_array()
    a, b = np.searchsorted(rows, (lo, hi))
    out[rows[a:b] - lo] = column.value_array()[a:b]
    return out
