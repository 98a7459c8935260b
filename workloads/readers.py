"""What every trace reader shares (traces.py for the public traces, datasets.py for users' files): the
TraceData rows, the rules that drop rows that cannot be a request (UNREADABLE, each counted), and the
CSV, JSON-lines and number parsing that name the file and key on a bad value."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from cbsim.core import bounds
from cbsim.core.errors import ConfigError

MAX_LENGTH = 2 ** 53  # longer "lengths" are corrupt rows (and no longer exact as floats)
UNREADABLE = ("missing or non-numeric value", "infinite timestamp", "length beyond 2**53", "non-integer length")


@dataclass
class TraceData:
    """Rows of a trace as parallel arrays; `arrival` is None for a lengths-only trace."""

    source: str
    prompt_len: np.ndarray
    output_len: np.ndarray
    arrival: np.ndarray | None = None
    prefix_hashes: list[tuple[int, ...]] | None = None
    dropped: dict[str, int] = field(default_factory=dict)  # rule -> rows it removed (only rules that did)
    slot_width: float = 0.0  # width (s) of the arrival slots requests were spread over; 0 if none
    sessions: np.ndarray | None = None  # session number of each row (0, 1, ... by first appearance), if any
    token_lengths: str = "file"  # how lengths were counted: "file", a tokenizer, or the approximation
    tenants: list | None = None  # each row's tenant (a string or None), if the file has the column
    adapters: list | None = None  # each row's LoRA adapter (a string or None), if the file has the column
    mm_inputs: list | None = None  # each row's images ((offset, length) pairs or None, multimodal.py), if any

    def __len__(self) -> int:
        return len(self.prompt_len)

    def take(self, keep: np.ndarray, reason: str) -> "TraceData":
        """The rows where `keep` (a boolean mask or index array) holds; counts the rest under `reason`."""
        index = np.flatnonzero(keep) if keep.dtype == bool else keep
        dropped = dict(self.dropped)
        if len(index) < len(self):
            dropped[reason] = dropped.get(reason, 0) + len(self) - len(index)
        return TraceData(
            source=self.source,
            prompt_len=self.prompt_len[index],
            output_len=self.output_len[index],
            arrival=None if self.arrival is None else self.arrival[index],
            prefix_hashes=None if self.prefix_hashes is None else [self.prefix_hashes[i] for i in index],
            dropped=dropped,
            slot_width=self.slot_width,
            sessions=None if self.sessions is None else self.sessions[index],
            token_lengths=self.token_lengths,
            tenants=None if self.tenants is None else [self.tenants[i] for i in index],
            adapters=None if self.adapters is None else [self.adapters[i] for i in index],
            mm_inputs=None if self.mm_inputs is None else [self.mm_inputs[i] for i in index],
        )


def read_json_lines(path: Path, key: str, expected: str, parse) -> list:
    """`parse(row)` of every non-blank line of a JSON-lines file; a line that is not UTF-8 JSON, or
    that `parse` refuses, is a ConfigError naming the file and `key (line N)`."""
    out = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
                if line.strip():
                    out.append(parse(bounds.loads(line)))
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise ConfigError(f"{key} (line {number})", expected, str(err), file=str(path)) from None
    return out


def trace_rows(source: str, arrival, prompt, output, hashes=None, sessions=None, tenants=None, adapters=None,
          mm_inputs=None) -> TraceData:
    """A TraceData of the rows that can be requests (the others counted under UNREADABLE), lengths
    as integers and arrivals in seconds from the first kept row."""
    prompt, output = np.asarray(prompt, dtype=np.float64), np.asarray(output, dtype=np.float64)
    arrival = None if arrival is None else np.asarray(arrival, dtype=np.float64)
    trace = TraceData(source, prompt, output, arrival, hashes, sessions=sessions, tenants=tenants, adapters=adapters,
                      mm_inputs=mm_inputs)
    for reason, bad in zip(UNREADABLE, (_missing, _infinite_time, _too_long, _fractional)):
        trace = trace.take(~bad(trace), reason)
    trace.prompt_len = trace.prompt_len.astype(np.int64)
    trace.output_len = trace.output_len.astype(np.int64)
    if trace.arrival is not None and len(trace):
        trace.arrival = trace.arrival - trace.arrival.min()
    return trace


def _missing(t: TraceData) -> np.ndarray:
    return np.isnan(t.prompt_len) | np.isnan(t.output_len) | (False if t.arrival is None else np.isnan(t.arrival))


def _infinite_time(t: TraceData) -> np.ndarray:
    return np.zeros(len(t), dtype=bool) if t.arrival is None else np.isinf(t.arrival)


def _too_long(t: TraceData) -> np.ndarray:
    return (np.abs(t.prompt_len) > MAX_LENGTH) | (np.abs(t.output_len) > MAX_LENGTH)


def _fractional(t: TraceData) -> np.ndarray:
    return (t.prompt_len != np.round(t.prompt_len)) | (t.output_len != np.round(t.output_len))


def json_number(row: dict, name: str) -> float:
    """A JSON value as a float: null is missing (NaN), a huge integer is infinite, a numeric string is
    read; other types are errors."""
    value = row[name]
    if value is None:
        return math.nan
    if isinstance(value, str):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} is {value!r}, not a number")
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _is_json(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(64).lstrip()[:1] in (b"[", b"{")


def read_csv_columns(path: Path, key: str, columns: tuple[str, ...]) -> pd.DataFrame:
    try:
        frame = pd.read_csv(path)
    except (ValueError, OSError, pd.errors.ParserError) as err:
        raise ConfigError(key, "a readable CSV file", str(err), file=str(path))
    absent = [c for c in columns if c not in frame.columns]
    if absent:
        hint = " (this file is JSON: a ShareGPT JSON dataset is format sharegpt_json)" if _is_json(path) else ""
        raise ConfigError(key, "a CSV with columns " + ", ".join(columns) + hint, list(frame.columns), file=str(path))
    return frame


def numeric_column(frame: pd.DataFrame, column: str) -> np.ndarray:
    """A column as floats; empty or non-numeric cells become NaN (rows _rows then drops and counts)."""
    return pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype=np.float64)
