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

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from cbsim.core.errors import ConfigError

TIMED_FORMATS = ("azure", "mooncake", "vidur", "burstgpt", "generic_csv", "generic_jsonl")
LENGTH_ONLY_FORMATS = ("sharegpt", "arxiv", "sharegpt_json", "vllm_bench")
TEXT_FORMATS = ("sharegpt_json",)  # lengths counted from text (workloads/tokens.py)
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


def read_trace(fmt: str, path: Path, key: str, counter=None, turns: str = "first") -> TraceData:
    """Read `path` in format `fmt`; `key` is the config path named in errors; `counter` (a
    tokens.TokenCounter) counts the tokens of text datasets; `turns` (sharegpt_json): "first" or
    "all" turns of each conversation."""
    from cbsim.workloads.datasets import READERS, read_sharegpt_json  # users' datasets (datasets.py builds on this module)

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
    frame = _read_csv(path, key, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"))
    try:
        stamps = pd.to_datetime(frame["TIMESTAMP"], format="ISO8601")
    except (ValueError, TypeError) as err:
        raise ConfigError(key, "TIMESTAMP values like '2023-11-16 18:17:03.9799600'", str(err), file=str(path))
    seconds = (stamps - stamps.min()).dt.total_seconds().to_numpy(dtype=np.float64)
    return _rows(str(path), seconds, _numbers(frame, "ContextTokens"), _numbers(frame, "GeneratedTokens"))


def read_mooncake(path: Path, key: str) -> TraceData:
    """Mooncake FAST'25 JSONL: `timestamp` in ms becomes seconds; `hash_ids` become prefix hashes."""
    def parse(row: dict) -> tuple:
        return (_json_number(row, "timestamp"), _json_number(row, "input_length"), _json_number(row, "output_length"),
                tuple(int(h) for h in row.get("hash_ids", ())))

    rows = read_json_lines(path, key, "UTF-8 JSON lines with timestamp, input_length, output_length, hash_ids", parse)
    stamps, prompts, outputs, hashes = (list(column) for column in zip(*rows)) if rows else ([], [], [], [])
    return _rows(str(path), np.asarray(stamps, dtype=np.float64) / 1000.0, prompts, outputs, hashes)


def read_json_lines(path: Path, key: str, expected: str, parse) -> list:
    """`parse(row)` of every non-blank line of a JSON-lines file; a line that is not UTF-8 JSON, or
    that `parse` refuses, is a ConfigError naming the file and `key (line N)`."""
    out = []
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
                if line.strip():
                    out.append(parse(json.loads(line)))
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise ConfigError(f"{key} (line {number})", expected, str(err), file=str(path)) from None
    return out


def read_lengths_csv(path: Path, key: str, timed: bool) -> TraceData:
    """Sarathi/Vidur length CSVs; with `timed`, an `arrived_at` column (if present) gives arrivals."""
    frame = _read_csv(path, key, ("num_prefill_tokens", "num_decode_tokens"))
    arrival = _numbers(frame, "arrived_at") if timed and "arrived_at" in frame.columns else None
    return _rows(str(path), arrival, _numbers(frame, "num_prefill_tokens"), _numbers(frame, "num_decode_tokens"))


def _rows(source: str, arrival, prompt, output, hashes=None, sessions=None, tenants=None, adapters=None,
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


def _json_number(row: dict, name: str) -> float:
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


def _is_json(path: Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(64).lstrip()[:1] in (b"[", b"{")


def _read_csv(path: Path, key: str, columns: tuple[str, ...]) -> pd.DataFrame:
    try:
        frame = pd.read_csv(path)
    except (ValueError, OSError, pd.errors.ParserError) as err:
        raise ConfigError(key, "a readable CSV file", str(err), file=str(path))
    absent = [c for c in columns if c not in frame.columns]
    if absent:
        hint = " (this file is JSON: a ShareGPT JSON dataset is format sharegpt_json)" if _is_json(path) else ""
        raise ConfigError(key, "a CSV with columns " + ", ".join(columns) + hint, list(frame.columns), file=str(path))
    return frame


def _numbers(frame: pd.DataFrame, column: str) -> np.ndarray:
    """A column as floats; empty or non-numeric cells become NaN (rows _rows then drops and counts)."""
    return pd.to_numeric(frame[column], errors="coerce").to_numpy(dtype=np.float64)
