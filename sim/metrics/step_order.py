"""The step table and each replica's own order of its steps.

The step table (`step_frame`) has one row per step, row i = global step i; its recorder columns
are views of the recorder's buffers. `StepColumns` gives its columns one at a time, made when first
read, for the metrics that read only a few (the request frame, the ITL and the summary read a
step's replica and end). A replica's *local order* is its steps sorted by global index;
the local orders of all replicas, one block after another (replicas ascending), number the *slots*.
Each replica's step ends strictly increase along its block (checked, ValueError otherwise).

Memory: when the steps are already grouped by replica (one replica, or replicas in contiguous
blocks) a slot is its global step and nothing is copied; otherwise the order costs one index per
step. Gaps between consecutive step ends are never materialised for the whole run: `gap_blocks`
yields them block by block, so a scan needs scratch memory bounded by BLOCK, not by the run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pandas as pd

from cbsim.sim.metrics.recorder import STEP_COLUMNS, Recorder

BLOCK = 1 << 16  # slots per block of a scan over the steps


class StepColumns:
    """The step table's columns, each made when first read and kept: what a metric that reads a few
    columns takes instead of the whole frame (at a million requests the frame's `step`, `start` and
    `duration` alone are ~300 MB). Read like the frame: `steps["end"]` (a numpy array: a view of the
    recorder's buffer where it can be), `len(steps)` (its rows), `"start" in steps`; `frame()` builds
    step_frame over the same arrays."""

    NAMES = ("step", *STEP_COLUMNS, "duration")

    def __init__(self, recorder: Recorder, sparse: bool = False):
        self.recorder = recorder
        self.sparse = sparse  # the mostly-zero columns as SparseArrays (their non-zero rows only)
        self._made: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str):
        if name not in self._made:
            self._made[name] = self._make(name)
        return self._made[name]

    def _make(self, name: str):
        if name == "step":
            return np.arange(len(self), dtype=np.int64)
        if name == "duration":
            return self["end"] - self["start"]
        if name in STEP_COLUMNS:
            return self.recorder.step_column(name, self.sparse)
        raise KeyError(name)

    def __len__(self) -> int:
        return self.recorder.num_steps

    def __contains__(self, name: str) -> bool:
        return name in self.NAMES

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame({name: self[name] for name in self.NAMES}, copy=False)


def step_frame(recorder: Recorder) -> pd.DataFrame:
    """One row per step: `step` (global index), every recorder column, and `duration` (end - start).
    The mostly-zero columns (recorder.SPARSE) are pandas SparseArrays: they read as the dense columns
    (`to_numpy`, sums, CSV) and hold only their non-zero rows; `densified` makes them plain for parquet."""
    return StepColumns(recorder, sparse=True).frame()


def densified(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with its sparse columns made dense (one column at a time; the others are not copied)."""
    sparse = [name for name, dtype in frame.dtypes.items() if isinstance(dtype, pd.SparseDtype)]
    if not sparse:
        return frame
    return pd.DataFrame({name: frame[name].sparse.to_dense() if name in sparse else frame[name]
                         for name in frame.columns}, copy=False)


def index_dtype(count: int):
    """The narrowest signed integer type that indexes `count` items (int32 below 2**31)."""
    return np.int32 if count < 2**31 else np.int64


def is_non_decreasing(values: np.ndarray) -> bool:
    """values[i] <= values[i+1] everywhere (False at a NaN), checked block by block."""
    last = len(values) - 1
    return all(np.all(values[i + 1:min(i + BLOCK, last) + 1] >= values[i:min(i + BLOCK, last)])
               for i in range(0, max(last, 0), BLOCK))


@dataclass(frozen=True)
class LocalOrder:
    """Steps grouped by replica, in each replica's own order (global index ascending within it).

    Slot k holds global step `order[k]`; `order` is None when slots and global steps coincide.
    Block b (slots bounds[b]..bounds[b+1]-1) is replica replicas[b].
    """

    order: np.ndarray | None
    step_end: np.ndarray  # end of each global step (a view of the step table)
    step_replica: np.ndarray  # replica of each global step (a view of the step table)
    replicas: np.ndarray  # replica of each block, ascending
    bounds: np.ndarray  # first slot of each block, then the number of slots

    @classmethod
    def of(cls, steps: "pd.DataFrame | StepColumns") -> "LocalOrder":
        """From a step_frame or its StepColumns (row i must be global step i); checks that each replica's
        ends increase."""
        replica = np.asarray(steps["replica"])
        end = np.asarray(steps["end"], dtype=np.float64)
        replicas, counts = _count(replica)
        order = None if len(replicas) <= 1 or is_non_decreasing(replica) else _group(replica, replicas, counts)
        local = cls(order, end, replica, replicas, np.r_[0, np.cumsum(counts)].astype(np.int64))
        for _, gap in local.gap_blocks():
            if np.any(gap <= 0):
                raise ValueError("step ends of a replica must strictly increase in step order")
        return local

    def __len__(self) -> int:
        return len(self.step_end)

    def steps_at(self, slots: np.ndarray) -> np.ndarray:
        """Global step index of each slot."""
        return slots if self.order is None else self.order[slots]

    def end_at(self, slots: np.ndarray) -> np.ndarray:
        """End time of each slot's step."""
        return self.step_end[self.steps_at(slots)]

    def slots_of(self, steps: np.ndarray) -> np.ndarray:
        """Slot of each global step."""
        return self.slots_upto(steps, steps, side="left")

    def slots_upto(self, steps: np.ndarray, limit: np.ndarray, side: str = "right") -> np.ndarray:
        """Per i: the first slot of the block of steps[i] (its replica) plus how many of that
        replica's steps have a global index below limit[i] (side="left") or at most limit[i]
        ("right"). With limit = steps and side="left" that is the slot of steps[i]."""
        steps, limit = np.asarray(steps), np.asarray(limit)
        block = np.searchsorted(self.replicas, self.step_replica[steps])
        lo, hi = self.bounds[block], self.bounds[block + 1]
        if self.order is None:  # block b is global steps lo..hi-1
            return np.clip(limit + (side == "right"), lo, hi)
        out = np.empty(len(steps), dtype=np.int64)
        for b in np.unique(block):
            mine = block == b
            start = self.bounds[b]
            out[mine] = start + np.searchsorted(self.order[start:self.bounds[b + 1]], limit[mine], side=side)
        return out

    def gap_at(self, steps: np.ndarray) -> np.ndarray:
        """The gap that ends at each of `steps` (its end minus the end of its replica's step before it),
        the same float that gap_blocks gives for its slot; for steps that are not a replica's first."""
        steps = np.asarray(steps)
        before = steps - 1 if self.order is None else self.order[self.slots_of(steps) - 1]
        return self.step_end[steps] - self.step_end[before]

    def take(self, column: np.ndarray) -> np.ndarray:
        """A per-step column in slot order (the column itself when slots are global steps)."""
        return column if self.order is None else column[self.order]

    def gap_blocks(self) -> Iterator[tuple[int, np.ndarray]]:
        """(c0, gap) for consecutive blocks of BLOCK slots c0..c0+len(gap)-1: gap[i] = end of slot
        c0+i minus end of the slot before it in the same replica, NaN at a replica's first slot."""
        n, size = len(self), BLOCK
        starts = self.bounds[:-1]
        for c0 in range(0, n, size):
            c1 = min(c0 + size, n)
            lo = max(c0 - 1, 0)  # the slot before the block, if any
            ends = self.step_end[lo:c1] if self.order is None else self.step_end[self.order[lo:c1]]
            gap = np.full(c1 - c0, np.nan)
            np.subtract(ends[1:], ends[:-1], out=gap[len(gap) - len(ends) + 1:])
            gap[starts[(starts >= c0) & (starts < c1)] - c0] = np.nan
            yield c0, gap


def _count(replica: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The replicas that have steps (ascending) and how many steps each has, block by block."""
    if len(replica) == 0:
        return np.zeros(0, dtype=replica.dtype), np.zeros(0, dtype=np.int64)
    low = int(replica.min())
    counts = np.zeros(int(replica.max()) - low + 1, dtype=np.int64)
    for g0 in range(0, len(replica), BLOCK):
        counts += np.bincount(replica[g0:g0 + BLOCK].astype(np.int64) - low, minlength=len(counts))
    present = np.flatnonzero(counts)
    return (present + low).astype(replica.dtype), counts[present]


def _group(replica: np.ndarray, replicas: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Global step indices grouped by replica (ascending within each), block by block."""
    order = np.empty(len(replica), dtype=index_dtype(len(replica)))
    cursor = np.r_[0, np.cumsum(counts)[:-1]]
    for g0 in range(0, len(replica), BLOCK):
        block = np.searchsorted(replicas, replica[g0:g0 + BLOCK])
        by_block = np.argsort(block, kind="stable")
        sizes = np.bincount(block, minlength=len(replicas))
        within = np.r_[0, np.cumsum(sizes)[:-1]]
        for b in np.flatnonzero(sizes):
            order[cursor[b]:cursor[b] + sizes[b]] = g0 + by_block[within[b]:within[b] + sizes[b]]
        cursor += sizes
    return order
