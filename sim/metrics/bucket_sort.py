"""A stable sort by value of a stream of records, with scratch memory bounded by a bucket.

The records come as chunks (values, *payload) from a function that can produce them twice. The
value range is cut into buckets at `splits` (pass 1 counts each bucket); pass 2 drops every record
into its bucket's slice of the output, in stream order; each bucket is then sorted stably in place.
Buckets follow value order and keep stream order inside, so the result equals
np.argsort(all_values, kind="stable") applied to every column, while the extra memory beyond the
outputs is one chunk plus one bucket, never a second copy of the whole stream.

With `key`, the values are not kept: a bucket's values are recomputed from its payload when it is
sorted (`key(*payload)` must give each record's value back exactly), so the outputs are the payload
columns only (the ITL distribution keeps its gaps' steps, not their lengths: sim/metrics/itl.py).

`split_points` picks splits from a sample so buckets hold about equal shares, and isolates every
split value in a bucket of its own: a value repeated in a large share of records (a cost model
with a constant step time) then fills an already sorted bucket instead of one huge mixed bucket.
"""
from __future__ import annotations

from typing import Callable, Iterable

import numpy as np


def split_points(sample: np.ndarray, buckets: int) -> np.ndarray:
    """Sorted bucket boundaries for about `buckets` equal shares of values like `sample`."""
    sample = np.asarray(sample, dtype=np.float64)
    sample = np.sort(sample[~np.isnan(sample)])
    if buckets <= 1 or len(sample) == 0:
        return np.zeros(0)
    cuts = np.unique(sample[(np.arange(1, buckets) * len(sample)) // buckets])
    return np.unique(np.concatenate([cuts, np.nextafter(cuts, np.inf)]))


def stable_sort_by_value(chunks: Callable[[], Iterable[tuple]], payload_dtypes, splits: np.ndarray,
                         key: Callable[..., np.ndarray] | None = None) -> tuple:
    """(values, *payload) of every record that `chunks()` yields, stably sorted by value; with `key`,
    (*payload) only, each bucket sorted by key(*its payload) (see the module docstring).

    `chunks()` must yield the same records each time it is called; each chunk is a tuple of equal
    length arrays, float64 values first. Payload column j is returned with dtype payload_dtypes[j].
    """
    num_buckets = len(splits) + 1
    counts = np.zeros(num_buckets, dtype=np.int64)
    for values, *_ in chunks():
        counts += np.bincount(np.searchsorted(splits, values, side="right"), minlength=num_buckets)
    total = int(counts.sum())
    out = ([] if key else [np.empty(total, dtype=np.float64)]) + [np.empty(total, dtype=d) for d in payload_dtypes]
    cursor = np.r_[0, np.cumsum(counts)[:-1]]
    for chunk in chunks():
        bucket = np.searchsorted(splits, chunk[0], side="right")
        by_bucket = np.argsort(bucket, kind="stable")
        sizes = np.bincount(bucket, minlength=num_buckets)
        starts = np.r_[0, np.cumsum(sizes)[:-1]]
        dest = np.repeat(cursor - starts, sizes) + np.arange(len(bucket))
        for column, source in zip(out, chunk[1:] if key else chunk):
            column[dest] = source[by_bucket]
        cursor += sizes
    bounds = np.r_[0, np.cumsum(counts)]
    value_of = key or (lambda values, *payload: values)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        _sort_slice(out, slice(lo, hi), value_of)
    return tuple(out)


def _sort_slice(columns: list[np.ndarray], part: slice, value_of) -> None:
    values = value_of(*(column[part] for column in columns))
    if len(values) < 2 or np.all(values[1:] >= values[:-1]):
        return
    order = np.argsort(values, kind="stable")
    for column in columns:
        column[part] = column[part][order]
