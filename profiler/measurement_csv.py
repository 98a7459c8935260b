"""The measurement CSV read back (the writing half and the columns are measurements.py): the table
and its metadata, with the checks that name a bad file's row and column, and the rows a fit or a
check may use. Both the fit (fit.py) and the cost check (costcheck.py) load measurements through
here, so neither imports the other for it.
"""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pandas as pd

from cbsim.core import bounds
from cbsim.core.errors import ConfigError

REQUIRED_COLUMNS = ("batch_id", "cls", "source", "prefill", "decode", "layer_s_median")


def load_measurements(csv_path) -> tuple[pd.DataFrame, dict]:
    """The measurement table and its metadata (metadata.json beside the CSV, or <stem>.json)."""
    path = Path(csv_path)
    try:
        frame = pd.read_csv(path, dtype={"prefill": str, "decode": str, "cls": str, "source": str})
    except (ValueError, OSError, pd.errors.ParserError) as err:  # missing, empty, binary, malformed
        raise ConfigError("<file>", "a readable measurement CSV", str(err).splitlines()[0], file=str(path)) from None
    _check_row_widths(path)
    missing = [c for c in REQUIRED_COLUMNS if c not in frame.columns]
    if missing:
        raise ConfigError(missing[0], "a measurement CSV column (" + ", ".join(REQUIRED_COLUMNS) + ")",
                          has_got=False, file=str(path))
    _check_timings(frame, path)
    meta = {}
    for candidate in (path.parent / "metadata.json", path.with_suffix(".json"), path.with_name(path.stem + ".metadata.json")):
        if candidate.exists():
            try:
                meta = bounds.loads(candidate.read_text())
            except (OSError, ValueError) as err:  # not UTF-8, not JSON, nested too deep
                raise ConfigError("<file>", "a JSON object of measurement metadata", str(err), file=str(candidate)) from None
            break
    return frame, meta


def _check_row_widths(path: Path) -> None:
    """Every row has as many fields as the header: a shorter one is a truncated write, which pandas
    would silently fill with NaN."""
    with open(path, newline="", encoding="utf-8") as handle:
        rows = csv.reader(handle)
        header = next(rows, None) or []
        for line, row in enumerate(rows, start=2):
            if row and len(row) != len(header):
                raise ConfigError(f"line {line}", f"{len(header)} fields as in the header (a truncated or "
                                  "extended row)", len(row), file=str(path))


def _check_timings(frame: pd.DataFrame, path: Path) -> None:
    """layer_s_median is a finite time > 0 on every row; the other timing columns, where given, are
    finite and >= 0. The error names the row (CSV line) and the column."""
    for column in ("layer_s_median", "layer_s_p10", "layer_s_p90", "lm_head_s"):
        if column not in frame.columns:
            continue
        values = pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype=np.float64)
        if column == "layer_s_median":
            bad = ~(np.isfinite(values) & (values > 0))
        else:
            bad = ~np.isnan(values) & ~(np.isfinite(values) & (values >= 0))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            expected = "a finite time > 0 (seconds)" if column == "layer_s_median" else "a finite time >= 0 or empty"
            raise ConfigError(f"{column} (row {row}, line {row + 2})", expected, frame[column].iloc[row],
                              file=str(path))


def valid_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows with a finite, positive layer time (a failed or skipped measurement has none)."""
    y = pd.to_numeric(frame["layer_s_median"], errors="coerce")
    return frame[np.isfinite(y) & (y > 0)]
