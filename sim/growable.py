"""A growable 1-D numpy column: amortised O(1) appends, one contiguous array at the end."""
from __future__ import annotations

import numpy as np


class Column:
    __slots__ = ("data", "size")

    def __init__(self, dtype, capacity: int = 1024):
        self.data = np.empty(capacity, dtype=dtype)
        self.size = 0

    def _reserve(self, extra: int) -> None:
        need = self.size + extra
        if need > len(self.data):
            grown = np.empty(max(need, 2 * len(self.data)), dtype=self.data.dtype)
            grown[: self.size] = self.data[: self.size]
            self.data = grown

    def append(self, value) -> None:
        if self.size == len(self.data):
            self._reserve(1)
        self.data[self.size] = value
        self.size += 1

    def extend(self, values) -> None:
        values = np.asarray(values)
        self._reserve(len(values))
        self.data[self.size : self.size + len(values)] = values
        self.size += len(values)

    def fill(self, value, count: int) -> None:
        """Append `count` copies of one value."""
        self._reserve(count)
        self.data[self.size : self.size + count] = value
        self.size += count

    def array(self) -> np.ndarray:
        return self.data[: self.size]

    def __len__(self) -> int:
        return self.size
