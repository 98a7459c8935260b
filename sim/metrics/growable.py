"""A growable typed column: fast single appends (array.array), bulk appends from numpy, and a
zero-copy numpy view at the end. Compact: 8 bytes a value at most, never a Python object each."""
from __future__ import annotations

from array import array

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
        """Append numpy values, or a list of Python numbers (kept as they are)."""
        if isinstance(values, list):
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
