"""A table written as parquet one row group at a time.

`frame.to_parquet` converts the whole frame to an Arrow table first: a copy of every column (and of
the sparse step columns made dense) beside the frame, ~100 bytes a step of a long run's step table.
`write_parquet` converts and writes ROW_GROUP rows at a time, the row groups pyarrow would cut, so the
file is the same one, byte for byte, and the copy is one group's.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow as pa  # pandas' parquet engine (and its string columns' storage): loaded with pandas
import pyarrow.parquet as pq

from cbsim.sim.metrics.step_order import densified

ROW_GROUP = 1 << 20  # rows a group: pyarrow's default (write_table's row_group_size=None)


def write_parquet(frame: pd.DataFrame, path: str | Path) -> None:
    """`frame` (its sparse columns dense) as zstd parquet without its index, as
    `densified(frame).to_parquet(path, index=False, compression="zstd")` writes it."""
    if len(frame) <= ROW_GROUP:
        densified(frame).to_parquet(path, index=False, compression="zstd")
        return
    writer = None
    try:
        for lo in range(0, len(frame), ROW_GROUP):
            group = pa.Table.from_pandas(densified(frame.iloc[lo:lo + ROW_GROUP]), preserve_index=False)
            if writer is None:
                writer = pq.ParquetWriter(path, group.schema, compression="zstd")
            writer.write_table(group, row_group_size=ROW_GROUP)
    finally:
        if writer is not None:
            writer.close()
