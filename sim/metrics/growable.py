"""A growable typed column: fast single appends (array.array), bulk appends from numpy, and a
zero-copy numpy view at the end. Compact: 8 bytes a value at most, never a Python object each.

A *narrow* integer Column stores its values in the narrowest type that has held every one so far
(int8, then int16, int32, int64, up to its declared type): a step's batch size, token counts and
blocks used fit in one or two bytes almost always, so a long run's step table takes ~40 % less memory
while it grows. A value that does not fit widens the column once (one copy of what it holds);
`array()` gives the declared type, widening the buffer to it in place, so a frame still views the
column's own buffer.

A SparseColumn keeps its rows as int32 (int64 once a row passes 2**31 - 1), the index type pandas
gives a SparseArray, so `sparse_array` hands the recorder's own buffers to a frame without copying."""
from __future__ import annotations

from array import array
from bisect import bisect_left
from typing import Callable

import numpy as np

INT32_MAX = 2**31 - 1
TYPECODES = {np.dtype(np.float64): "d", np.dtype(np.int64): "q", np.dtype(np.int32): "i", np.dtype(np.int16): "h",
             np.dtype(np.int8): "b"}
DTYPES = {code: dtype for dtype, code in TYPECODES.items()}
WIDER = ("b", "h", "i", "q")  # integer typecodes, narrowest first
RANGES = {code: (int(np.iinfo(DTYPES[code]).min), int(np.iinfo(DTYPES[code]).max)) for code in WIDER}


class Column:
    """`data` is the array.array a caller may append to directly; `on_widen` is called whenever a
    narrow column replaces it with a wider one (a caller holding `data.append` binds it again)."""

    __slots__ = ("data", "dtype", "on_widen")

    def __init__(self, dtype, narrow: bool = False, on_widen: Callable[[], None] = lambda: None):
        self.dtype = np.dtype(dtype)  # the declared type: what array() gives
        self.data = array("b" if narrow and self.dtype.kind == "i" else TYPECODES[self.dtype])
        self.on_widen = on_widen

    @property
    def stored(self) -> np.dtype:
        """The type the values are held in now (the declared one, or narrower)."""
        return DTYPES[self.data.typecode]

    def append(self, value) -> None:
        self._with_room(lambda: self.data.append(value), lambda: (value, value))

    def extend(self, values) -> None:
        """Append numpy values, a list of Python numbers (kept as they are), or an array.array."""
        if isinstance(values, list):  # (fromlist is presized: extend takes a list item by item, ~2x slower;
            # on an overflow it leaves the array as it was)
            self._with_room(lambda: self.data.fromlist(values), lambda: (min(values), max(values)))
        elif isinstance(values, array) and values.typecode == self.data.typecode:
            self.data.extend(values)
        else:
            values = np.asarray(values)
            if len(values) and self.data.typecode != TYPECODES[self.dtype]:  # a narrow column: they must fit
                self._fit(values)
            self.data.frombytes(np.ascontiguousarray(values, dtype=self.stored).tobytes())

    def fill(self, value, count: int) -> None:
        """Append `count` copies of one value."""
        self._with_room(lambda: self.data.extend(array(self.data.typecode, [value]) * count), lambda: (value, value))

    def set(self, index: int, value) -> None:
        self._with_room(lambda: self.data.__setitem__(index, value), lambda: (value, value))

    def _with_room(self, write: Callable[[], None], bounds: Callable[[], tuple]) -> None:
        """`write()` to the buffer; where a value does not fit it (array.array raises OverflowError and
        writes nothing), widen to the values' `bounds()` (low, high), then write again."""
        try:
            write()
        except OverflowError:
            self._widen(*bounds())
            write()

    def _fit(self, values: np.ndarray) -> None:
        """Widen to hold integer `values`. One reduction where they are not negative: the OR of their
        bits bounds each of them (a run's counts); their min and max otherwise."""
        bits = int(np.bitwise_or.reduce(values))
        if bits < 0:
            self._widen(int(values.min()), int(values.max()))
        elif bits > RANGES[self.data.typecode][1]:
            self._widen(0, bits)

    def _widen(self, low, high) -> None:
        """Hold values from `low` to `high`: the narrowest wider type that does, up to the declared one
        (OverflowError beyond it, as an array.array of that type raises)."""
        code = self.data.typecode
        if code in WIDER:
            for wider in WIDER[WIDER.index(code):WIDER.index(TYPECODES[self.dtype]) + 1]:
                least, most = RANGES[wider]
                if least <= low and high <= most:
                    self._retype(wider)
                    return
        raise OverflowError(f"{low}..{high} does not fit a column of {self.dtype}")

    def _retype(self, code: str) -> None:
        if code != self.data.typecode:
            wider = array(code)
            wider.frombytes(self.array_as_stored().astype(DTYPES[code]).tobytes())
            self.data = wider
            self.on_widen()

    def array_as_stored(self) -> np.ndarray:
        """The values in the type they are held in (a view of the buffer)."""
        return np.frombuffer(self.data, dtype=self.stored) if len(self.data) else np.zeros(0, self.stored)

    def array(self) -> np.ndarray:
        """The values in the declared type: a view of the buffer, widened to that type in place first."""
        self._retype(TYPECODES[self.dtype])
        return self.array_as_stored()

    def __len__(self) -> int:
        return len(self.data)


class SparseColumn:
    """A growable column that is mostly zero: the rows where it is not (ascending) and their values.
    8-12 bytes a non-zero row, nothing for a zero one; `dense(n)` gives the n-row numpy column."""

    __slots__ = ("dtype", "rows", "values", "keep_zeros")

    def __init__(self, dtype, keep_zeros: bool = False):
        self.dtype = np.dtype(dtype)
        self.rows = array("i")  # widened to "q" by _widen when a row does not fit
        self.values = array(TYPECODES[self.dtype])
        self.keep_zeros = keep_zeros  # keep every row put, zeros too (a column of exceptions)

    def put(self, row: int, value) -> None:
        """Row `row`'s value, for a row after every row put so far."""
        if value or self.keep_zeros:
            try:
                self.rows.append(row)
            except OverflowError:
                self._widen()
                self.rows.append(row)
            self.values.append(value)

    def put_many(self, first: int, values) -> None:
        """Rows first, first + 1, ...: `values` (a list or numpy array), after every row put so far."""
        if first + len(values) > INT32_MAX:
            self._widen()
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
            self.rows.frombytes((nonzero + first).astype(self._row_dtype()).tobytes())
            self.values.frombytes(values[nonzero].tobytes())

    def set(self, row: int, value) -> None:
        """Row `row`'s value, whichever row it is (a later row, or one put before: found by bisection)."""
        if row > INT32_MAX:
            self._widen()
        rows = self.rows
        k = bisect_left(rows, row)
        if k < len(rows) and rows[k] == row:
            self.values[k] = value  # a zero kept as a stored zero: dense() reads the same
        elif value or self.keep_zeros:
            rows.insert(k, row)
            self.values.insert(k, value)

    def _widen(self) -> None:
        """Rows as int64 from now on (a run past 2**31 - 1 steps)."""
        if self.rows.typecode != "q":
            self.rows = array("q", self.rows)

    def _row_dtype(self):
        return np.int32 if self.rows.typecode == "i" else np.int64

    def row_array(self) -> np.ndarray:
        """The kept rows, ascending (a view of the column's buffer)."""
        return np.frombuffer(self.rows, dtype=self._row_dtype()) if len(self.rows) else np.zeros(0, np.int32)

    def value_array(self) -> np.ndarray:
        """The kept rows' values (a view of the column's buffer)."""
        return np.frombuffer(self.values, dtype=self.dtype) if len(self.values) else np.zeros(0, self.dtype)

    def scatter(self, out: np.ndarray) -> np.ndarray:
        """`out` with the kept rows' values written over it."""
        if len(self.rows):
            out[self.row_array()] = self.value_array()
        return out

    def dense(self, n: int) -> np.ndarray:
        return self.scatter(np.zeros(n, dtype=self.dtype))

    def sparse_array(self, n: int):
        """The n-row column as a pandas SparseArray with fill value 0 over the column's own buffers
        (no copy: the array.arrays cannot grow while it lives, as for Column.array). A copy only where
        a stored zero (set to 0 after a put) or an int64 row would break SparseArray's int32 index."""
        rows, values = self.row_array(), self.value_array()
        if rows.dtype != np.int32 or not np.all(values):
            keep = np.flatnonzero(values)
            rows, values = rows[keep].astype(np.int32), values[keep]
        return sparse_from_indices(values, rows, n)


def sparse_from_indices(values: np.ndarray, rows: np.ndarray, n: int):
    """A pandas SparseArray (fill value 0) of n rows over `values` at int32 `rows`, without copying."""
    from pandas.arrays import SparseArray  # pandas is the metrics' import, not the engine's

    if hasattr(SparseArray, "from_indices"):  # pandas >= 3.1
        return SparseArray.from_indices(values, rows, n, fill_value=0)
    from pandas._libs.sparse import IntIndex  # before 3.1: the constructor takes the index

    return SparseArray(values, sparse_index=IntIndex(n, rows), fill_value=0, dtype=values.dtype)
