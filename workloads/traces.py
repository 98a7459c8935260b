"""Readers for real request traces: one function per file format, each returning a TraceData.

Invariant: a reader returns the file's rows as they are (arrival times in seconds from the first
row, lengths as integers, Mooncake's `hash_ids` as tuples) and draws nothing. It drops only rows
that cannot be a request, each counted in `TraceData.dropped` under its rule (`UNREADABLE`): a
missing or non-numeric length or timestamp, an infinite timestamp, a non-integer length, a length
beyond 2**53 tokens. Cleaning (zero lengths), slot spreading, windows, filters and sampling happen
in trace_source.py.

Formats (columns as documented in shared/data/traces/SOURCE.md):
- azure: `TIMESTAMP` (wall-clock string), `ContextTokens`, `GeneratedTokens` (Azure LLM 2023).
- mooncake: JSONL with `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (FAST'25).
- sharegpt / arxiv: `num_prefill_tokens`, `num_decode_tokens` (length statistics, no timestamps).
- vidur: `num_prefill_tokens`, `num_decode_tokens` and, when present, `arrived_at` (seconds).
- users' datasets (ShareGPT JSON, BurstGPT, generic CSV/JSONL, vLLM bench results): datasets.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from cbsim.workloads.datasets import READERS, read_sharegpt_json
from cbsim.workloads.readers import TraceData, numeric_column, read_csv_columns, read_json_lines, json_number, trace_rows
from cbsim.core.errors import ConfigError

TIMED_FORMATS = ("azure", "mooncake", "vidur", "burstgpt", "generic_csv", "generic_jsonl")
LENGTH_ONLY_FORMATS = ("sharegpt", "arxiv", "sharegpt_json", "vllm_bench")
TEXT_FORMATS = ("sharegpt_json",)  # lengths counted from text (workloads/tokens.py)


def read_trace(fmt: str, path: Path, key: str, counter=None, turns: str = "first") -> TraceData:
    """Read `path` in format `fmt`; `key` is the config path named in errors; `counter` (a
    tokens.TokenCounter) counts the tokens of text datasets; `turns` (sharegpt_json): "first" or
    "all" turns of each conversation."""
    if fmt == "sharegpt_json":
        return read_sharegpt_json(path, key, counter, turns)
    if fmt in READERS:
        return READERS[fmt](path, key, counter)
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
    frame = read_csv_columns(path, key, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    try:
        stamps = pd.to_datetime(frame["TIMESTAMP"], format="ISO8601")
    except (ValueError, TypeError) as err:
        raise ConfigError(key, "TIMESTAMP values like '2023-11-16 18:17:03.9799600'", str(err), file=str(path))
    seconds = (stamps - stamps.min()).dt.total_seconds().to_numpy(dtype=np.float64)
    return trace_rows(str(path), seconds, numeric_column(frame, "ContextTokens"), numeric_column(frame, "GeneratedTokens"))


def read_mooncake(path: Path, key: str) -> TraceData:
    """Mooncake FAST'25 JSONL: `timestamp` in ms becomes seconds; `hash_ids` become prefix hashes."""
    def parse(row: dict) -> tuple:
        return (json_number(row, "timestamp"), json_number(row, "input_length"), json_number(row, "output_length"),
                tuple(int(h) for h in row.get("hash_ids", ())))

    rows = read_json_lines(path, key, "UTF-8 JSON lines with timestamp, input_length, output_length, hash_ids", parse)
    stamps, prompts, outputs, hashes = (list(column) for column in zip(*rows)) if rows else ([], [], [], [])
    return trace_rows(str(path), np.asarray(stamps, dtype=np.float64) / 1000.0, prompts, outputs, hashes)


def read_lengths_csv(path: Path, key: str, timed: bool) -> TraceData:
    """Sarathi/Vidur length CSVs; with `timed`, an `arrived_at` column (if present) gives arrivals."""
    frame = read_csv_columns(path, key, ("num_prefill_tokens", "num_decode_tokens"))
    arrival = numeric_column(frame, "arrived_at") if timed and "arrived_at" in frame.columns else None
    return trace_rows(str(path), arrival, numeric_column(frame, "num_prefill_tokens"), numeric_column(frame, "num_decode_tokens"))


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


