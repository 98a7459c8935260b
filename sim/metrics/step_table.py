"""The run's step table, never held whole: each column made when it is read, each block of rows when
it is written.

`step_frame` + `with_efficiency` build the whole table as one pandas frame: besides the recorder's own
buffers (viewed, not copied), eight dense float64 columns a step (`step`, `start`, `duration` and the
five efficiency columns), 64 bytes a step: 830 MB at a million reference requests (12.9 M steps), more
than the rest of `cbsim run` together. A StepTable gives the same table without holding it:

- `table[name]`: one whole column as a pandas Series, made now and not kept (the metrics read a few
  columns once each: a replica's end, the durations, the KV blocks, the efficiency columns);
- `rows(lo, hi)`: the rows lo..hi-1 as a frame of dense columns, every column in the frame's order
  and type, which is what the writers take (parquet by row groups, CSV by blocks, the trace's head);
- `frame()`: the whole frame, exactly `with_efficiency(step_frame(recorder), hardware)` (Results.steps
  builds it when first read, for notebooks and figures).

Invariant: every value is the one the whole frame holds (the same arithmetic on the same numbers:
each efficiency formula is per step, sim/metrics/step_efficiency.py), so every table written from it
is byte for byte the one written from the frame (tests/sim/metrics/test_step_table.py).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from cbsim.sim.metrics.recorder import STEP_COLUMNS, Recorder
from cbsim.sim.metrics.step_efficiency import COLUMNS as EFFICIENCY, efficiency_columns, with_efficiency
from cbsim.sim.metrics.step_order import step_frame

NAMES = ("step", *STEP_COLUMNS, "duration", *EFFICIENCY)
SCRATCH = 1 << 18  # rows made at a time (~60 MB of scratch with the efficiency columns)


class StepTable:
    """The step table of `recorder`'s run, with the efficiency columns for `hardware` (replica index ->
    StepHardware or None), made as it is read (see the module docstring)."""

    def __init__(self, recorder: Recorder, hardware: dict):
        self.recorder, self.hardware = recorder, hardware
        self._start = None  # several replicas: the whole start column, made once (a row's start may be far back)

    def __len__(self) -> int:
        return self.recorder.num_steps

    @property
    def columns(self) -> list[str]:
        return list(NAMES)

    def __contains__(self, name: str) -> bool:
        return name in NAMES

    def __getitem__(self, name: str) -> pd.Series:
        """Column `name`, whole, made now (a view of the recorder's buffer where it can be)."""
        if name not in NAMES:
            raise KeyError(name)
        if name in STEP_COLUMNS and name != "start":
            values = self.recorder.step_rows(name, 0, len(self))
        else:
            values = self._fill((name,), 0, len(self))[name]
        return pd.Series(values, name=name, copy=False)

    def rows(self, lo: int, hi: int) -> pd.DataFrame:
        """Rows lo..hi-1 (clipped to the table) with every column dense, in the frame's order and types."""
        lo, hi = max(lo, 0), min(hi, len(self))
        frame = pd.DataFrame(self._fill(NAMES, lo, max(hi, lo)), copy=False)
        frame.index = pd.RangeIndex(lo, max(hi, lo))
        return frame

    def _fill(self, names, lo: int, hi: int) -> dict[str, np.ndarray]:
        """Columns `names` of rows lo..hi-1, made SCRATCH rows at a time into one array each (the scratch
        of the efficiency formulas, a dozen arrays a row, is a block's)."""
        out = {name: np.empty(hi - lo, dtype=_dtype(name)) for name in names}
        efficiency = any(name in EFFICIENCY for name in names)
        for a in range(lo, hi, SCRATCH):
            b = min(a + SCRATCH, hi)
            base = self._base(a, b, only=None if efficiency or len(names) > 1 else names[0])
            values = {**base, **self._efficiency(base)} if efficiency else base
            for name in names:
                out[name][a - lo:b - lo] = values[name]
        return out

    def blocks(self, size: int = SCRATCH):
        """The rows, `size` at a time, as `rows` frames."""
        for lo in range(0, len(self), size):
            yield self.rows(lo, lo + size)

    def frame(self) -> pd.DataFrame:
        """The whole table as one frame (sparse columns as SparseArrays, as step_frame makes them)."""
        return with_efficiency(step_frame(self.recorder), self.hardware)

    def _base(self, lo: int, hi: int, only: str | None = None) -> dict[str, np.ndarray]:
        """The recorder's columns, `step` and `duration` of rows lo..hi-1 (`only`: that one, and what it needs)."""
        want = NAMES[:len(STEP_COLUMNS) + 2] if only is None else (only,)
        out = {}
        if "step" in want:
            out["step"] = np.arange(lo, hi, dtype=np.int64)
        for name in STEP_COLUMNS:
            if name in want or (name in ("start", "end") and "duration" in want):
                out[name] = self._start_rows(lo, hi) if name == "start" else self.recorder.step_rows(name, lo, hi)
        if "duration" in want:
            out["duration"] = out["end"] - out["start"]
        return {name: out[name] for name in NAMES if name in out and (only is None or name == only)}

    def _start_rows(self, lo: int, hi: int) -> np.ndarray:
        if self.recorder.replicas_seen <= 1:
            return self.recorder.step_rows("start", lo, hi)
        if self._start is None:
            self._start = self.recorder.step_column("start")
        return self._start[lo:hi]

    def _efficiency(self, base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The efficiency columns of the rows `base` holds (every step's own formula: the same values)."""
        return efficiency_columns(pd.DataFrame(base, copy=False), self.hardware)


def _dtype(name: str):
    """The frame's type of column `name`."""
    return STEP_COLUMNS[name] if name in STEP_COLUMNS else np.int64 if name == "step" else np.float64
