"""Piecewise-linear lookup tables with a scalar path and a vectorised path that agree bit for bit.

Invariant: for every table, `at(x)` (plain Python floats, called once per simulated step) and
`many(xs)` (numpy, called for a run of decode steps) evaluate the same expression
`y[i] + (x - x[i]) * slope[i]` with the same operands in the same order, so their results are
identical, not merely close. The segment index is "the last knot at or below x", so a query at a
measured point returns the measured value exactly.

Outside the measured range a curve is flat below its first knot and continues beyond its last
knot along the secant of its upper half (GEMM, attention and all-reduce times all grow linearly
there). `monotone_envelope` turns noisy measurements into non-decreasing ones by a running
maximum; callers keep the raw values when exact reproduction matters more than monotonicity.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Callable

import numpy as np


ROW_CACHE = 4096  # rows a Grid remembers for its vectorised path; cleared when full


def upper_half_index(n: int) -> int:
    """Index of the knot that starts the upper-half secant of an n-knot table (0 when n <= 2)."""
    return max(0, (n - 1) // 2) if n > 2 else 0


def slopes_of(xs: np.ndarray, ys: np.ndarray, tail_slope: float | None = None) -> np.ndarray:
    """Per-segment slopes; the last entry is the tail slope (by default the upper-half secant,
    0 for a single knot)."""
    n = len(xs)
    out = np.zeros(n, dtype=np.float64)
    if n > 1:
        out[:-1] = (ys[1:] - ys[:-1]) / (xs[1:] - xs[:-1])
        m = upper_half_index(n)
        out[-1] = (ys[-1] - ys[m]) / (xs[-1] - xs[m])
    if tail_slope is not None:
        out[-1] = tail_slope
    return out


def isotonic(ys) -> np.ndarray:
    """The non-decreasing sequence closest to `ys` in least squares (pool-adjacent-violators)."""
    values: list[float] = []
    counts: list[int] = []
    for y in np.asarray(ys, dtype=np.float64).tolist():
        values.append(y)
        counts.append(1)
        while len(values) > 1 and values[-2] > values[-1]:
            n = counts[-2] + counts[-1]
            merged = (values[-2] * counts[-2] + values[-1] * counts[-1]) / n
            del values[-1], counts[-1]
            values[-1], counts[-1] = merged, n
    return np.repeat(np.array(values), counts)


def isotonic_table(z) -> np.ndarray:
    """A table non-decreasing along both axes: isotonic along each row, then along each column.

    NaN marks cells that were not measured; the measured cells of every row and of every column
    must form a prefix (a triangle such as chunk x history qualifies). Isotonic regression
    preserves order and lowers a prefix's values when more cells follow, so the column pass keeps
    the rows non-decreasing.
    """
    z = np.array(z, dtype=np.float64)
    for axis in (1, 0):
        view = z if axis == 1 else z.T
        for line in view:
            valid = int(np.count_nonzero(~np.isnan(line)))
            if np.isnan(line[:valid]).any():
                raise ValueError("measured cells of a table line must form a prefix")
            line[:valid] = isotonic(line[:valid])
    return z


class Curve:
    """y(x) through the knots (xs, ys); xs strictly increasing; optional explicit tail slope."""

    __slots__ = ("xs", "ys", "slopes", "x0", "_xs", "_ys", "_slopes")

    def __init__(self, xs, ys, tail_slope: float | None = None):
        xs = np.asarray(xs, dtype=np.float64)
        ys = np.asarray(ys, dtype=np.float64)
        if xs.ndim != 1 or xs.shape != ys.shape or len(xs) == 0:
            raise ValueError("a curve needs two 1-D arrays of the same non-zero length")
        if np.any(np.diff(xs) <= 0):
            raise ValueError("curve knots must be strictly increasing")
        slopes = slopes_of(xs, ys, tail_slope)
        self._xs, self._ys, self._slopes = xs, ys, slopes
        self.xs, self.ys, self.slopes = xs.tolist(), ys.tolist(), slopes.tolist()
        self.x0 = self.xs[0]

    def at(self, x: float) -> float:
        """y at one point (plain Python arithmetic)."""
        if x < self.x0:
            x = self.x0
        i = bisect_right(self.xs, x) - 1
        return self.ys[i] + (x - self.xs[i]) * self.slopes[i]

    def many(self, x: np.ndarray) -> np.ndarray:
        """y at many points; element k equals `at(x[k])` exactly."""
        return interpolate_many(self._xs, self._ys, self._slopes, x)


def interpolate_many(xs: np.ndarray, ys: np.ndarray, slopes: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The vectorised path of a piecewise-linear table (knots, values, per-segment slopes)."""
    x = np.maximum(x, xs[0])
    i = np.searchsorted(xs, x, side="right") - 1
    return ys[i] + (x - xs[i]) * slopes[i]


class Grid:
    """z(a, b) on a full rectangular grid: linear in a between rows, then linear in b along the row.

    Beyond the last row, z grows in proportion to a; beyond the last column, by a * s per unit
    of b, s being the last row's upper-half secant divided by its a. For decode attention (a =
    batch rows, b = mean context) both say: time grows with the KV tokens read, B x context.
    The vectorised path fixes `a` and varies `b` (a decode run: constant batch, growing context).
    """

    __slots__ = ("a", "b", "z", "a_slopes", "a0", "b0", "_a", "_b", "_z", "_a_slopes", "_s", "_rows", "_cells")

    def __init__(self, a, b, z):
        a = np.asarray(a, dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        z = np.asarray(z, dtype=np.float64)
        if z.shape != (len(a), len(b)) or len(a) == 0 or len(b) == 0:
            raise ValueError("grid values must have shape (len(a), len(b))")
        if np.any(np.diff(a) <= 0) or np.any(np.diff(b) <= 0):
            raise ValueError("grid axes must be strictly increasing")
        a_slopes = np.stack([slopes_of(a, z[:, j]) for j in range(len(b))], axis=1)
        self._a, self._b, self._z, self._a_slopes = a, b, z, a_slopes
        self.a, self.b, self.z, self.a_slopes = a.tolist(), b.tolist(), z.tolist(), a_slopes.tolist()
        self.a0, self.b0 = self.a[0], self.b[0]
        self._s = float(slopes_of(b, z[-1])[-1]) / self.a[-1]
        self._rows: dict[float, tuple[np.ndarray, np.ndarray]] = {}
        self._cells: dict[float, Callable[[float], float]] = {}  # a -> its row, b -> z (the scalar path)

    def _row_index(self, a: float) -> tuple[int, float]:
        """(row, offset) for a row between knots, or (-1, a / a_last) beyond the last row."""
        if a < self.a0:
            a = self.a0
        if a > self.a[-1]:
            return -1, a / self.a[-1]
        i = bisect_right(self.a, a) - 1
        return i, a - self.a[i]

    def _cell(self, i: int, da: float, j: int) -> float:
        if i < 0:
            return self.z[-1][j] * da
        return self.z[i][j] + da * self.a_slopes[i][j]

    def at(self, a: float, b: float) -> float:
        """z at one point (plain Python arithmetic; the row at `a` is remembered, as it is pure in a)."""
        return (self._cells.get(a) or self.row(a))(b)

    def row(self, a: float, per: int | None = None, outer: tuple[float, float, float] | None = None):
        """b -> z(a, b) for one a, remembered (a decode run's a is its batch size, which takes few values):
        the row's values at the b knots and the slope of each segment and beyond the last knot. With
        `per`: x -> k * (c + (0.0 + z(a, x / per))) + d, `outer` = (k, c, d) (default: z itself) -- a batch's
        context sum -> the time at its mean, composed as a cost model composes the term into a step's
        time, written out: one call a step; not remembered here (the caller keeps it)."""
        known = self._cells.get(a) if per is None else None
        if known is not None:
            return known
        if len(self._cells) >= ROW_CACHE:
            self._cells.clear()
        i, da = self._row_index(a)
        knots, b0 = self.b, self.b0
        cells = [self._cell(i, da, j) for j in range(len(knots))]
        slopes = [(cells[j + 1] - cells[j]) / (knots[j + 1] - knots[j]) for j in range(len(cells) - 1)]
        slopes.append((a if a > self.a0 else self.a0) * self._s)

        def at(b: float) -> float:
            if b < b0:
                b = b0
            j = bisect_right(knots, b) - 1
            return cells[j] + (b - knots[j]) * slopes[j]

        if per is None:
            self._cells[a] = at
            return at
        k, c, d = outer if outer is not None else (1.0, 0.0, 0.0)  # (1, 0, 0): z exactly (z is never -0.0)

        def composed(x: float) -> float:  # k * (c + (0.0 + at(x / per))) + d, written out
            b = x / per
            if b < b0:
                b = b0
            j = bisect_right(knots, b) - 1
            return k * (c + (0.0 + (cells[j] + (b - knots[j]) * slopes[j]))) + d

        return composed

    def many(self, a: float, b: np.ndarray) -> np.ndarray:
        """z(a, b[k]) for fixed a; element k equals `at(a, b[k])` exactly."""
        row = self._rows.get(a)
        if row is None:
            row = self._rows[a] = self._row_at(a)
        return interpolate_many(self._b, row[0], row[1], b)

    def _row_at(self, a: float) -> tuple[np.ndarray, np.ndarray]:
        """(values at the b knots, per-segment slopes) of the row at `a`: pure in a, so remembered
        (a decode run's a is its batch size, which takes few values)."""
        if len(self._rows) >= ROW_CACHE:
            self._rows.clear()
        i, da = self._row_index(a)
        row = self._z[-1] * da if i < 0 else self._z[i] + da * self._a_slopes[i]
        return row, slopes_of(self._b, row, tail_slope=(a if a > self.a0 else self.a0) * self._s)


class RaggedRows:
    """z(a, b) where row a_i is measured for b in its own knots (a triangle such as chunk x history).

    Within a row: linear in b; beyond the row's last knot the value is scaled by `grow(a, b) /
    grow(a, b_last)`. Between rows: linear in a; beyond the last row: scaled by `grow` in a. Below
    the first row: the first row. Scalar path only (prefill attention never runs vectorised).
    """

    __slots__ = ("a", "rows", "grow")

    def __init__(self, a, rows: list[tuple[np.ndarray, np.ndarray]], grow):
        self.a = [float(x) for x in a]
        if len(self.a) == 0 or any(y <= x for x, y in zip(self.a, self.a[1:])):
            raise ValueError("row keys must be strictly increasing and non-empty")
        self.rows = [Curve(b, z) for b, z in rows]
        self.grow = grow

    def _row(self, i: int, a: float, b: float) -> float:
        curve = self.rows[i]
        last = curve.xs[-1]
        if b <= last:
            return curve.at(b)
        return curve.ys[-1] * (self.grow(a, b) / self.grow(a, last))

    def at(self, a: float, b: float) -> float:
        """z at one point."""
        if a <= self.a[0]:
            return self._row(0, self.a[0], b)
        i = bisect_right(self.a, a) - 1
        if i == len(self.a) - 1:
            ai = self.a[i]
            return self._row(i, ai, b) * (self.grow(a, b) / self.grow(ai, b))
        a0, a1 = self.a[i], self.a[i + 1]
        z0 = self._row(i, a0, b)
        z1 = self._row(i + 1, a1, b)
        return z0 + (a - a0) * ((z1 - z0) / (a1 - a0))
