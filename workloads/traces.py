"""Readers for real request traces: one function per file format, each returning a TraceData.

Invariant: a reader returns the file's rows as they are (arrival times in seconds from the first
row, lengths as integers, Mooncake's `hash_ids` as tuples); it drops nothing and draws nothing.
Cleaning (zero lengths), slot spreading, windows, filters and sampling happen in trace_source.py.

Formats (columns as documented in shared/data/traces/SOURCE.md):
- azure: `TIMESTAMP` (wall-clock string), `ContextTokens`, `GeneratedTokens` (Azure LLM 2023).
- mooncake: JSONL with `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (FAST'25).
- sharegpt / arxiv: `num_prefill_tokens`, `num_decode_tokens` (length statistics, no timestamps).
- vidur: `num_prefill_tokens`, `num_decode_tokens` and, when present, `arrived_at` (seconds).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from cbsim.errors import ConfigError

TIMED_FORMATS = ("azure", "mooncake", "vidur")
LENGTH_ONLY_FORMATS = ("sharegpt", "arxiv")


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
        )


def read_trace(fmt: str, path: Path, key: str) -> TraceData:
    """Read `path` in format `fmt`; `key` is the config path named in errors."""
    if fmt == "azure":
        return read_azure(path, key)
    if fmt == "mooncake":
        return read_mooncake(path, key)
    if fmt in LENGTH_ONLY_FORMATS:
        return read_lengths_csv(path, key, timed=False)
    if fmt == "vidur":
        return read_lengths_csv(path, key, timed=True)
    raise ConfigError(key, "one of " + ", ".join(TIMED_FORMATS + LENGTH_ONLY_FORMATS), fmt)


def read_azure(path: Path, key: str) -> TraceData:
    """Azure LLM inference trace 2023 (Splitwise): timestamps become seconds from the first row."""
    frame = _read_csv(path, key, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    try:
        stamps = pd.to_datetime(frame["TIMESTAMP"], format="ISO8601")
    except (ValueError, TypeError) as err:
        raise ConfigError(key, "TIMESTAMP values like '2023-11-16 18:17:03.9799600'", str(err), file=str(path))
    seconds = (stamps - stamps.min()).dt.total_seconds().to_numpy(dtype=np.float64)
    prompts, outputs = _ints(frame, "ContextTokens", path, key), _ints(frame, "GeneratedTokens", path, key)
    return TraceData(str(path), prompts, outputs, seconds)


def read_mooncake(path: Path, key: str) -> TraceData:
    """Mooncake FAST'25 JSONL: `timestamp` in ms becomes seconds; `hash_ids` become prefix hashes."""
    stamps, prompts, outputs, hashes = [], [], [], []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                stamps.append(float(row["timestamp"]))
                prompts.append(int(row["input_length"]))
                outputs.append(int(row["output_length"]))
                hashes.append(tuple(int(h) for h in row.get("hash_ids", ())))
            except (ValueError, KeyError, TypeError) as err:
                raise ConfigError(key, "JSON lines with timestamp, input_length, output_length, hash_ids",
                                  f"line {number}: {err}", file=str(path))
    seconds = np.asarray(stamps, dtype=np.float64) / 1000.0
    if len(seconds):
        seconds -= seconds.min()
    return TraceData(str(path), np.asarray(prompts, dtype=np.int64), np.asarray(outputs, dtype=np.int64),
                     seconds, hashes)


def read_lengths_csv(path: Path, key: str, timed: bool) -> TraceData:
    """Sarathi/Vidur length CSVs; with `timed`, an `arrived_at` column (if present) gives arrivals."""
    frame = _read_csv(path, key, ("num_prefill_tokens", "num_decode_tokens"))
    arrival = None
    if timed and "arrived_at" in frame.columns:
        arrival = frame["arrived_at"].to_numpy(dtype=np.float64)
        if len(arrival):
            arrival = arrival - arrival.min()
    prompts = _ints(frame, "num_prefill_tokens", path, key)
    outputs = _ints(frame, "num_decode_tokens", path, key)
    return TraceData(str(path), prompts, outputs, arrival)


def detect_slot_width(seconds: np.ndarray) -> float:
    """Width of coarse arrival slots, or 0 if the timestamps are not slotted.

    A trace is slotted when its distinct timestamps hold two or more requests each on average;
    the slot width is then the median gap between consecutive distinct timestamps (about 3 s in
    the Mooncake conversation trace).
    """
    distinct = np.unique(seconds)
    if len(distinct) < 2 or len(seconds) < 2 * len(distinct):
        return 0.0
    return float(np.median(np.diff(distinct)))


def spread_slots(seconds: np.ndarray, width: float, rng: np.random.Generator) -> np.ndarray:
    """Move each arrival uniformly within [t, t + width): requests of one slot no longer arrive together."""
    if width <= 0 or len(seconds) == 0:
        return seconds
    return seconds + rng.uniform(0.0, width, len(seconds))


def _read_csv(path: Path, key: str, columns: tuple[str, ...]) -> pd.DataFrame:
    try:
        frame = pd.read_csv(path)
    except (ValueError, OSError, pd.errors.ParserError) as err:
        raise ConfigError(key, "a readable CSV file", str(err), file=str(path))
    absent = [c for c in columns if c not in frame.columns]
    if absent:
        raise ConfigError(key, "a CSV with columns " + ", ".join(columns), list(frame.columns), file=str(path))
    return frame


def _ints(frame: pd.DataFrame, column: str, path: Path, key: str) -> np.ndarray:
    try:
        return frame[column].to_numpy(dtype=np.int64)
    except (ValueError, TypeError):
        raise ConfigError(key, f"whole numbers in column {column}", "missing or non-integer values",
                          file=str(path)) from None
