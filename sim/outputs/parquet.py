"""A table written as parquet one row group at a time, and as CSV one block of rows at a time.

`frame.to_parquet` converts the whole frame to an Arrow table first: a copy of every column (and of
the sparse step columns made dense) beside the frame, ~100 bytes a step of a long run's step table.
`write_parquet` converts and writes ROW_GROUP rows at a time, the row groups pyarrow would cut, so the
file is the same one, byte for byte, and the copy is one group's. Either writer takes a pandas frame or
a run's StepTable (sim/metrics/step_table.py: rows made a block at a time, never the whole table).
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa  # pandas' parquet engine (and its string columns' storage): loaded with pandas
import pyarrow.parquet as pq

from cbsim.sim.metrics.step_order import densified

ROW_GROUP = 1 << 20  # rows a group: pyarrow's default (write_table's row_group_size=None)
CSV_ROWS = 1 << 18  # rows a block of CSV


def rows_of(table, lo: int, hi: int) -> pd.DataFrame:
    """Rows lo..hi-1 of a frame or a StepTable, every column dense."""
    return table.rows(lo, hi) if hasattr(table, "rows") else densified(table.iloc[lo:hi])


def write_parquet(frame, path: str | Path) -> None:
    """`frame` (a frame, its sparse columns dense, or a StepTable) as zstd parquet without its index, as
    `densified(frame).to_parquet(path, index=False, compression="zstd")` writes it."""
    if len(frame) <= ROW_GROUP:
        rows_of(frame, 0, len(frame)).to_parquet(path, index=False, compression="zstd")
        return
    writer = None
    try:
        for lo in range(0, len(frame), ROW_GROUP):
            group = pa.Table.from_pandas(rows_of(frame, lo, lo + ROW_GROUP), preserve_index=False)
            if writer is None:
                writer = pq.ParquetWriter(path, group.schema, compression="zstd")
            writer.write_table(group, row_group_size=ROW_GROUP)
            del group  # before the next group is made: one group's columns at a time, not two
    finally:
        if writer is not None:
            writer.close()


def write_csv(frame, path: str | Path) -> None:
    """`frame` (a frame or a StepTable) as CSV without its index, as `frame.to_csv(path, index=False)`
    writes it: CSV_ROWS rows at a time (each value is written on its own, so the blocks join into the
    same text), the header with the first."""
    if not hasattr(frame, "rows"):
        frame.to_csv(path, index=False)
        return
    with open(path, "w", newline="") as handle:
        for lo in range(0, max(len(frame), 1), CSV_ROWS):
            frame.rows(lo, lo + CSV_ROWS).to_csv(handle, index=False, header=lo == 0)
