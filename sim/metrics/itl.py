"""The inter-token-latency (ITL) distribution of a run, weighted and never expanded per token.

Within runs, the gap of slot k (end of k minus end of the slot before it, step_order.py) is shared
by every run with first < k <= last: its weight (the slot's *coverage*) is a running count of run
starts minus run ends. Each break between two runs of a request adds one gap (first token of the
later run minus last token of the earlier).

Memory: the distribution itself is 8 bytes a gap (weight, step): a gap's length is not kept but read
back from its step (`LocalOrder.gap_at`: the same subtraction, so the same float), except for the
gaps between two runs, kept apart (O(breaks)). Building it scans the steps block by block and sorts
with stable_sort_by_value, each bucket by its lengths read back, so the scratch memory is a block and a
bucket plus O(runs), never a copy of the distribution (sim/metrics/bucket_sort.py). `values`
materialises the lengths (8 bytes a gap, for as long as the caller keeps them); the summary's
percentiles, maximum and stalls read only the few they need (`values_at`).

Percentiles are numpy's default ("linear", Hyndman & Fan type 7), the method of `vllm bench serve`
and SGLang's bench_serving: with the N gaps sorted, percentile q sits at rank h = (N - 1) q / 100,
interpolated between the gaps at ranks floor(h) and floor(h) + 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from cbsim.sim.metrics import step_order
from cbsim.sim.metrics.bucket_sort import split_points, stable_sort_by_value
from cbsim.sim.metrics.recorder import Recorder
from cbsim.sim.metrics.step_order import LocalOrder, index_dtype, is_non_decreasing, step_frame
from cbsim.sim.metrics.token_runs import run_arrays, token_runs

BUCKET = 1 << 16  # gaps per bucket of the sort (about)


@dataclass(frozen=True)
class ITLDistribution:
    """Every inter-token gap of the run, weighted: `weights[i]` gaps of length `values[i]` seconds.

    Sorted by value (stably: equal values keep the order in which the gaps were found). `step[i]`
    is the global step whose end closed the gap (a step within a run, or the first of a later
    run); `values`, `times` and `replica` (how long, when and where each gap ended, to locate
    stalls) are read from the step table on access.
    """

    weights: np.ndarray  # int32
    step: np.ndarray  # int32 (int64 beyond 2**31 steps)
    local: LocalOrder  # the steps' ends and replicas, each replica's steps in its order
    total_tokens: int
    break_at: np.ndarray  # positions of the gaps between two runs of a request, ascending
    break_values: np.ndarray  # their lengths (not a difference of consecutive ends of a replica)

    @property
    def step_end(self) -> np.ndarray:
        return self.local.step_end

    @property
    def step_replica(self) -> np.ndarray:
        return self.local.step_replica

    def values_at(self, index) -> np.ndarray:
        """The lengths (seconds) of the gaps at positions `index` (negative ones count from the end)."""
        index = np.asarray(index, dtype=np.int64)
        index = np.where(index < 0, index + len(self.step), index)
        out = self.local.gap_at(self.step[index])
        k = np.minimum(np.searchsorted(self.break_at, index), max(len(self.break_at) - 1, 0))
        hit = (self.break_at[k] == index) if len(self.break_at) else np.zeros(len(index), dtype=bool)
        out[hit] = self.break_values[k[hit]]
        return out

    @property
    def values(self) -> np.ndarray:
        """Every gap's length (float64, ascending), made block by block on each access."""
        return self.fill_values(np.empty(len(self.step), dtype=np.float64))

    def fill_values(self, out: np.ndarray) -> np.ndarray:
        """`values` written into `out` (one float64 a gap)."""
        for b0 in range(0, len(out), step_order.BLOCK):
            out[b0:b0 + step_order.BLOCK] = self.values_at(np.arange(b0, min(b0 + step_order.BLOCK, len(out))))
        return out

    def count_at_most(self, value: float) -> int:
        """How many positions hold a gap of at most `value` (np.searchsorted(values, value, "right"))."""
        lo, hi = 0, len(self.step)
        while lo < hi:  # bisection: O(log gaps) lengths read back
            mid = (lo + hi) // 2
            if not self.values_at([mid])[0] > value:  # (a NaN value sorts last, as numpy's)
                lo = mid + 1
            else:
                hi = mid
        return lo

    @property
    def times(self) -> np.ndarray:
        return self.step_end[self.step]

    @property
    def replica(self) -> np.ndarray:
        return self.step_replica[self.step]

    @property
    def count(self) -> int:
        return int(self.weights.sum())

    def percentile(self, q):
        """Percentile(s) of every gap, numpy's linear method, q in [0, 100]; NaN when there is no gap."""
        return sorted_percentile(self.weights, self.values_at, q)


def itl_distribution(recorder: Recorder, requests=(), steps: pd.DataFrame | None = None) -> ITLDistribution:
    """The ITL distribution of a run. Pass `requests` to include runs still open when the run was cut."""
    steps = step_frame(recorder) if steps is None else steps
    local = LocalOrder.of(steps)
    runs = token_runs(local, run_arrays(recorder, requests))
    total_tokens = int(runs.tokens.sum())
    first, last = np.sort(runs.first), np.sort(runs.last)
    broken = np.flatnonzero(~np.isnan(runs.break_gap))
    break_values, break_steps = runs.break_gap[broken], local.steps_at(runs.first[broken])
    del runs, broken

    def gaps():  # every gap in its natural order: within runs slot by slot, then the breaks
        for c0, gap in local.gap_blocks():
            cover = _coverage(first, last, c0, c0 + len(gap))
            inside = np.flatnonzero(cover)
            yield gap[inside], local.steps_at(inside + c0), cover[inside]
        # a break's payload: its index and weight -1 (its length is not read back from a step)
        yield break_values, np.arange(len(break_values)), np.full(len(break_values), -1)

    def length(step, weight):  # a gap's length back from its payload, the float gaps() yielded
        out, within = np.empty(len(step)), weight > 0
        out[within] = local.gap_at(step[within])
        out[~within] = break_values[step[~within]]
        return out

    buckets = -(-(len(local) + len(break_values)) // BUCKET)
    splits = split_points(_sample(local, break_values, 64 * buckets), buckets) if buckets > 1 else np.zeros(0)
    payload = (index_dtype(max(len(local), len(break_values))), index_dtype(len(first)))
    step, weights = stable_sort_by_value(gaps, payload, splits, key=length)
    at = np.flatnonzero(weights < 0)  # the breaks, where the sort put them
    index = step[at]
    step[at], weights[at] = break_steps[index], 1
    return ITLDistribution(weights, step, local, total_tokens, at, break_values[index])


def _coverage(first: np.ndarray, last: np.ndarray, c0: int, c1: int) -> np.ndarray:
    """Per slot k in c0..c1-1: how many runs have a token at k that follows one at k-1 in the same
    run (first < k <= last); `first` and `last` are the runs' slots, each sorted."""
    def below(sorted_slots):  # per k: how many of sorted_slots are < k
        lo, hi = np.searchsorted(sorted_slots, [c0, c1 - 1])
        steps_up = np.bincount(sorted_slots[lo:hi] - (c0 - 1), minlength=c1 - c0)
        return lo + np.cumsum(steps_up)

    return below(first) - below(last)


def _sample(local: LocalOrder, break_values: np.ndarray, size: int) -> np.ndarray:
    """About `size` gaps at evenly spaced slots, and some breaks: where to cut the value range into
    buckets (any cut is correct; a representative one balances the buckets)."""
    slots = np.unique(np.linspace(1, len(local) - 1, size).astype(np.int64)) if len(local) > 1 else np.zeros(0, int)
    within = local.end_at(slots) - local.end_at(slots - 1)
    return np.concatenate([within, break_values[::max(1, len(break_values) // size)]])


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q):
    """numpy.percentile(np.repeat(values, weights), q) (the linear method), without repeating.

    Rank h = (N - 1) q / 100 over the N = sum(weights) expanded values; the values at ranks floor(h)
    and floor(h) + 1 are found on the cumulative weights and interpolated as numpy does. Sorted values
    with positive integer weights (an ITLDistribution) are read in place, block by block.
    """
    values = np.asarray(values, dtype=np.float64)
    weights = np.asarray(weights)
    if len(values) and weights.dtype.kind in "iu" and weights.min() > 0 and is_non_decreasing(values):
        return sorted_percentile(weights, lambda index: values[index], q)
    scalar, q = np.ndim(q) == 0, _percentiles(q)
    keep = weights > 0
    values, weights = values[keep], weights[keep]
    if len(values) == 0:
        return float("nan") if scalar else np.full(len(q), np.nan)
    sort = np.argsort(values, kind="stable")
    cum = np.cumsum(weights[sort])
    at = lambda ranks: values[sort][np.searchsorted(cum, ranks + 1, side="left").clip(0, len(cum) - 1)]
    out = _interpolate(q, int(cum[-1]), at)
    return float(out[0]) if scalar else out


def sorted_percentile(weights: np.ndarray, value_at, q):
    """weighted_percentile of sorted values with positive integer `weights`, reading only the values it
    needs: `value_at(index)` gives the values at an array of positions."""
    scalar, q = np.ndim(q) == 0, _percentiles(q)
    if len(weights):
        out = _interpolate(q, int(weights.sum()), lambda ranks: value_at(_index_at_ranks(weights, ranks)))
    else:
        out = np.full(len(q), np.nan)
    return float(out[0]) if scalar else out


def _percentiles(q) -> np.ndarray:
    q = np.atleast_1d(np.asarray(q, dtype=np.float64))
    if np.any((q < 0) | (q > 100)):
        raise ValueError("percentiles must lie in [0, 100]")
    return q


def _interpolate(q: np.ndarray, count: int, at) -> np.ndarray:
    """numpy's linear percentile of `count` sorted values, `at(ranks)` giving the value at each 0-based rank."""
    h = (q / 100) * (count - 1)
    below = np.floor(h)
    gamma = h - below
    below = below.astype(np.int64)
    a, b = at(below), at(np.minimum(below + 1, count - 1))
    diff = b - a
    return np.where(gamma >= 0.5, b - diff * (1 - gamma), a + diff * gamma)  # numpy's _lerp


def _index_at_ranks(weights: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """The position of each 0-based rank in the expansion of sorted values with positive integer
    `weights`: the cumulative weight is formed one block at a time (exact integers)."""
    target = ranks + 1
    index = np.full(len(ranks), len(weights) - 1)
    pending = np.ones(len(ranks), dtype=bool)
    running = 0
    block = step_order.BLOCK
    for b0 in range(0, len(weights), block):
        cum = np.cumsum(weights[b0:b0 + block], dtype=np.int64) + running
        hit = pending & (cum[-1] >= target)
        index[hit] = b0 + np.searchsorted(cum, target[hit], side="left")
        pending &= ~hit
        if not pending.any():
            break
        running = cum[-1]
    return index


def cdf_points(values: np.ndarray, weights: np.ndarray | None = None, max_points: int = 2000):
    """(x, F(x)) of the empirical CDF, thinned to at most `max_points` points (the last one kept)."""
    values = np.asarray(values, dtype=np.float64)
    weights = np.ones(len(values)) if weights is None else np.asarray(weights, dtype=np.float64)
    keep = ~np.isnan(values) & (weights > 0)
    values, weights = values[keep], weights[keep]
    if len(values) == 0:
        return np.zeros(0), np.zeros(0)
    sort = np.argsort(values, kind="stable")
    x, cum = values[sort], np.cumsum(weights[sort])
    y = cum / cum[-1]
    if len(x) > max_points:
        pick = np.unique(np.searchsorted(y, np.linspace(0, 1, max_points), side="left").clip(0, len(x) - 1))
        x, y = x[pick], y[pick]
    return x, y


def stall_events(dist: ITLDistribution, factor: float) -> pd.DataFrame:
    """Gaps longer than factor x the run's median ITL: time (gap end), length, count, replica."""
    threshold = factor * dist.percentile(50) if dist.count else math.inf
    first = dist.count_at_most(threshold)  # values are sorted
    step = dist.step[first:]
    return pd.DataFrame({"time": dist.step_end[step], "length": dist.values_at(np.arange(first, len(dist.step))),
                         "count": dist.weights[first:], "replica": dist.step_replica[step]})
