"""A growable typed column: fast single appends (array.array), bulk appends from numpy, and a
zero-copy numpy view at the end. Compact: 8 bytes a value at most, never a Python object each."""
from __future__ import annotations

from array import array
from bisect import bisect_left

import numpy as np

TYPECODES = {np.dtype(np.float64): "d", np.dtype(np.int64): "q", np.dtype(np.int32): "i", np.dtype(np.int16): "h"}


class Column:
    __slots__ = ("data", "dtype")

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.data = array(TYPECODES[self.dtype])

    def append(self, value) -> None:
        self.data.append(value)

    def extend(self, values) -> None:
        """Append numpy values, a list of Python numbers (kept as they are), or an array.array."""
        if isinstance(values, list) or (isinstance(values, array) and values.typecode == self.data.typecode):
            self.data.extend(values)
        else:
            self.data.frombytes(np.ascontiguousarray(values, dtype=self.dtype).tobytes())

    def fill(self, value, count: int) -> None:
        """Append `count` copies of one value."""
        self.data.extend(array(self.data.typecode, [value]) * count)

    def set(self, index: int, value) -> None:
        self.data[index] = value

    def array(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=self.dtype) if len(self.data) else np.zeros(0, self.dtype)

    def __len__(self) -> int:
        return len(self.data)


class SparseColumn:
    """A growable column that is mostly zero: the rows where it is not (ascending) and their values.
    12-16 bytes a non-zero row, nothing for a zero one; `dense(n)` gives the n-row numpy column."""

    __slots__ = ("dtype", "rows", "values", "keep_zeros")

    def __init__(self, dtype, keep_zeros: bool = False):
        self.dtype = np.dtype(dtype)
        self.rows = array("q")
        self.values = array(TYPECODES[self.dtype])
        self.keep_zeros = keep_zeros  # keep every row put, zeros too (a column of exceptions)

    def put(self, row: int, value) -> None:
        """Row `row`'s value, for a row after every row put so far."""
        if value or self.keep_zeros:
            self.rows.append(row)
            self.values.append(value)

    def put_many(self, first: int, values) -> None:
        """Rows first, first + 1, ...: `values` (a list or numpy array), after every row put so far."""
        if isinstance(values, list):  # a short run's values: plain Python beats numpy's per-call cost
            kept = [(first + k, v) for k, v in enumerate(values) if v or self.keep_zeros]
            if kept:
                rows, values = zip(*kept)
                self.rows.extend(rows)
                self.values.extend(values)
            return
        values = np.asarray(values, dtype=self.dtype)
        nonzero = np.arange(len(values)) if self.keep_zeros else np.flatnonzero(values)
        if len(nonzero):
            self.rows.frombytes((nonzero + first).astype(np.int64).tobytes())
            self.values.frombytes(values[nonzero].tobytes())

    def set(self, row: int, value) -> None:
        """Row `row`'s value, whichever row it is (a later row, or one put before: found by bisection)."""
        rows = self.rows
        k = bisect_left(rows, row)
        if k < len(rows) and rows[k] == row:
            self.values[k] = value  # a zero kept as a stored zero: dense() reads the same
        elif value or self.keep_zeros:
            rows.insert(k, row)
            self.values.insert(k, value)

    def scatter(self, out: np.ndarray) -> np.ndarray:
        """`out` with the kept rows' values written over it."""
        if len(self.rows):
            out[np.frombuffer(self.rows, dtype=np.int64)] = np.frombuffer(self.values, dtype=self.dtype)
        return out

    def dense(self, n: int) -> np.ndarray:
        return self.scatter(np.zeros(n, dtype=self.dtype))

    def sparse_array(self, n: int):
        """The n-row column as a pandas SparseArray with fill value 0 (it keeps the non-zero rows only;
        made from the dense column, which lives only for the call)."""
        from pandas.arrays import SparseArray  # pandas is the metrics' import, not the engine's

        return SparseArray(self.dense(n), fill_value=0)
