"""Measured serving results, read into cbsim's metric names, and the same metrics of a simulated run.

Invariant: a MeasuredRun's `metrics` holds only names from METRICS, each a finite number > 0, with
latencies in seconds and throughputs per second, whatever the file's units were. Its per-request
arrays, when present, are aligned: one entry per successful request, in the order the benchmark
sent them; `itls` is every measured gap of those requests, flattened.

Three formats are read, told apart by their keys (`load_measured`):
- cbsim's flat format: `{"ttft_mean": 0.025, "itl_p99": 0.012, ...}` in seconds;
- `vllm bench serve --save-result` JSON (`mean_ttft_ms`, `median_itl_ms`, `p99_e2el_ms`, ...; per-request
  `input_lens`, `output_lens`, `ttfts`, `itls`, `latencies`, `start_times`, `errors` with `--save-detailed`);
- `python -m sglang.bench_serving --output-file` JSON lines (`mean_e2e_latency_ms`, ...; per-request
  lists with `--output-details`); the last line is read when the file holds several runs.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd

from cbsim.core import bounds
from cbsim.sim.metrics import column_percentiles

from cbsim.core.errors import ConfigError

LATENCIES = ("ttft", "tpot", "itl", "e2e")
STATS = ("mean", "p50", "p90", "p99")
RATES = ("throughput_requests_per_s", "throughput_tokens_per_s")
METRICS = tuple(f"{name}_{stat}" for name in LATENCIES for stat in STATS) + RATES

# Benchmark key pieces: {stat}_{metric}_ms. vLLM calls end-to-end latency e2el, SGLang e2e_latency.
_BENCH_STATS = {"mean": "mean", "median": "p50", "p50": "p50", "p90": "p90", "p99": "p99"}
_BENCH_METRICS = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2e", "e2e_latency": "e2e"}
_BENCH_RATES = {"request_throughput": "throughput_requests_per_s", "output_throughput": "throughput_tokens_per_s"}
_BENCH_KEYS = {"completed", "request_throughput", "output_throughput", "duration", "input_lens", "output_lens"}
_SGLANG_KEYS = {"total_throughput", "accept_length", "total_output_tokens_retokenized", "concurrency"}
_PER_REQUEST = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "errors")

Format = Literal["cbsim", "vllm", "sglang"]


@dataclass
class MeasuredRun:
    """One measured benchmark run, in cbsim's names and units (seconds)."""

    metrics: dict[str, float]  # METRICS name -> value (latencies in s, throughputs per s)
    source: str = ""  # the file it was read from
    format: Format = "cbsim"
    input_lens: np.ndarray | None = None  # prompt tokens per successful request, in send order
    output_lens: np.ndarray | None = None  # output tokens per successful request
    ttfts: np.ndarray | None = None  # seconds, per successful request
    e2e: np.ndarray | None = None  # seconds: the file's latencies, else ttft + the request's gaps
    itls: np.ndarray | None = None  # seconds: every gap of every successful request, flattened
    itl_counts: np.ndarray | None = None  # gaps per successful request: where each one's gaps lie in `itls`
    start_times: np.ndarray | None = None  # seconds since the first send, per successful request
    request_rate: float | None = None  # requests/s the client aimed at; inf: all sent at once
    burstiness: float | None = None  # vLLM: gamma shape of the send gaps (1 = Poisson)
    max_concurrency: int | None = None  # client-side cap on requests in flight
    duration: float | None = None  # seconds the benchmark ran
    num_failed: int = 0  # requests the file lists as failed (left out of the arrays)
    skipped: tuple[str, ...] = ()  # metric keys present but 0 or null: not measured, left out

    @property
    def has_lengths(self) -> bool:
        """Whether per-request prompt and output lengths are known (enough to rebuild the workload)."""
        return self.input_lens is not None and self.output_lens is not None

    @property
    def tpots(self) -> np.ndarray | None:
        """Per-request TPOT in seconds, (e2e - ttft) / (output_len - 1) over requests with > 1 output token."""
        if self.e2e is None or self.ttfts is None or self.output_lens is None:
            return None
        many = self.output_lens > 1
        return (self.e2e[many] - self.ttfts[many]) / (self.output_lens[many] - 1)


def load_measured(path: str | Path) -> MeasuredRun:
    """Read a measured-results file (cbsim flat, vLLM or SGLang JSON, detected by its keys).

    Raises ConfigError naming the file and the key (or `key[row]`) of the first problem.
    """
    file = str(path)
    record, where = _read_record(Path(path))
    fmt = detect_format(record)
    try:
        run = _read_flat(record) if fmt == "cbsim" else _read_bench(record)
    except ConfigError as err:
        raise err.in_file(where) from None
    run.source, run.format = file, fmt
    return run


def detect_format(record: dict) -> Format:
    """'vllm' or 'sglang' for a benchmark's JSON (keys in milliseconds, `completed`, ...), else 'cbsim'."""
    keys = set(record)
    if not (any(k.endswith("_ms") for k in keys) or keys & _BENCH_KEYS):
        return "cbsim"
    sglang = any("e2e_latency" in k for k in keys) or keys & _SGLANG_KEYS
    return "sglang" if sglang else "vllm"


def simulated_metrics(results) -> dict[str, float]:
    """METRICS of a cbsim Results, computed the way the benchmarks compute them.

    TTFT and E2E over finished requests; TPOT over finished requests with more than one output token
    (vLLM and SGLang leave single-token requests out); ITL over every token gap of the run
    (results.itl, weighted). Percentiles are numpy's linear method, like the run summary and the benchmarks. Throughputs are the
    summary's. Metrics without a value (no finished request, no gap) are left out.
    """
    df = results.requests
    done = df[df["status"] == "finished"]
    out = latency_stats({"ttft": done["ttft"], "tpot": done.loc[done["output_len"] > 1, "tpot"], "e2e": done["e2e"]})
    itl = results.itl
    if itl.count:
        out["itl_mean"] = float(np.dot(itl.values, itl.weights) / itl.count)
        out.update(zip(("itl_p50", "itl_p90", "itl_p99"), (float(v) for v in itl.percentile([50, 90, 99]))))
    for name in RATES:
        if results.summary.get(name) is not None:
            out[name] = float(results.summary[name])
    return {name: out[name] for name in METRICS if out.get(name) is not None}


def latency_stats(samples: dict[str, pd.Series]) -> dict[str, float]:
    """`{name}_mean`, `_p50`, `_p90`, `_p99` of each latency's samples (seconds, NaN left out; numpy's linear
    percentiles, as the run summary and the benchmarks); nothing for a latency without samples."""
    out: dict[str, float] = {}
    for name, column in samples.items():
        column = column.dropna()
        if len(column):
            out[f"{name}_mean"] = float(column.mean())
            out.update(zip((f"{name}_p50", f"{name}_p90", f"{name}_p99"), column_percentiles(column)))
    return out


def _read_record(path: Path) -> tuple[dict, str]:
    """The JSON object of the file (the last line of a JSON-lines file) and how errors name it."""
    file = str(path)
    if not path.is_file():
        raise ConfigError("<file>", "an existing file of measured results (JSON)", file)
    text = path.read_text()
    if not text.strip():
        raise ConfigError("<file>", "a JSON object of measured results (the file is empty)", has_got=False, file=file)
    try:
        record, where = bounds.loads(text), file
    except json.JSONDecodeError as whole:
        lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
        for k, (number, line) in enumerate(lines):
            try:
                record = bounds.loads(line)
            except json.JSONDecodeError as err:
                if k == 0:  # not JSON lines either: report the whole file's error
                    raise ConfigError("<file>", f"valid JSON ({whole})", has_got=False, file=file) from None
                raise ConfigError("<file>", f"JSON lines, one object a line (line {number}: {err})",
                                  has_got=False, file=file) from None
        where = f"{file} (line {lines[-1][0]}, the last run)"
    if not isinstance(record, dict):
        raise ConfigError("<root>", "a JSON object of metrics", type(record).__name__, file=where)
    return record, where


def _read_flat(record: dict) -> MeasuredRun:
    if not record:
        raise ConfigError("<root>", f"at least one metric ({', '.join(METRICS)})", has_got=False)
    metrics = {}
    for key, value in record.items():
        if key not in METRICS:
            raise ConfigError(key, f"a known metric name, one of {', '.join(METRICS)}", has_got=False)
        unit = "per second" if key in RATES else "seconds"
        metrics[key] = _number(key, value, f"a finite number > 0 ({unit})", lambda v: v > 0)
    return MeasuredRun(metrics)


def _read_bench(record: dict) -> MeasuredRun:
    metrics, skipped = {}, []
    keys = [(f"{word}_{src}_ms", f"{name}_{stat}", 1000.0) for word, stat in _BENCH_STATS.items()
            for src, name in _BENCH_METRICS.items()]
    keys += [(key, name, 1.0) for key, name in _BENCH_RATES.items()]
    for key, name, per_unit in keys:
        if key not in record:
            continue
        if record[key] is None or record[key] == 0:  # the benchmark did not measure it (no stream, no tokenizer)
            skipped.append(key)
            continue
        unit = "milliseconds" if per_unit != 1.0 else "per second"
        metrics[name] = _number(key, record[key], f"a finite number >= 0 ({unit})", lambda v: v >= 0) / per_unit
    metrics = {name: metrics[name] for name in METRICS if name in metrics}
    run = MeasuredRun(metrics, skipped=tuple(skipped), **_traffic(record), **_per_request(record))
    if not metrics and not run.has_lengths:
        raise ConfigError("<root>", "a benchmark result with latency metrics (mean_ttft_ms, ...) or per-request "
                          "lists (input_lens, output_lens)", has_got=False)
    return run


def _traffic(record: dict) -> dict:
    """request_rate (a number, 'inf' or Infinity), burstiness, max_concurrency, duration."""
    out = {}
    rate = record.get("request_rate")
    if isinstance(rate, str) and rate.strip().lower() in ("inf", "infinity"):
        rate = math.inf
    if rate is not None:
        out["request_rate"] = _number("request_rate", rate, "a rate > 0 or 'inf'", lambda v: v > 0, finite=False)
    if record.get("burstiness") is not None:
        out["burstiness"] = _number("burstiness", record["burstiness"], "a number > 0", lambda v: v > 0)
    if record.get("duration") is not None:
        out["duration"] = _number("duration", record["duration"], "a finite number > 0 (seconds)", lambda v: v > 0)
    cap = record.get("max_concurrency")
    if cap is not None:
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise ConfigError("max_concurrency", "an integer >= 1 or null", cap)
        out["max_concurrency"] = cap
    return out


def _per_request(record: dict) -> dict:
    """The aligned per-request arrays of the successful requests (none without input_lens/output_lens)."""
    lists = {key: record[key] for key in _PER_REQUEST if record.get(key) is not None}
    if "input_lens" not in lists or "output_lens" not in lists:
        return {}
    n = len(lists["input_lens"]) if isinstance(lists["input_lens"], list) else 0
    for key, value in lists.items():
        if not isinstance(value, list) or len(value) != n:
            got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
            raise ConfigError(key, f"a list with one entry per request ({n}, like input_lens)", got)
    errors = lists.get("errors", [""] * n)
    ok = [i for i in range(n) if not errors[i] and lists["output_lens"][i] != 0]

    def column(key, expected, check, dtype=np.float64):
        return _column(lists[key], ok, key, expected, check, dtype)

    out = {"num_failed": n - len(ok),
           "input_lens": column("input_lens", "an integer >= 1 (prompt tokens)", _is_length, np.int64),
           "output_lens": column("output_lens", "an integer >= 1 (output tokens)", _is_length, np.int64)}
    if "ttfts" in lists:
        out["ttfts"] = column("ttfts", "a finite number > 0 (seconds)", _positive)
    if "itls" in lists:
        gaps = [_column(lists["itls"][i], None, f"itls[{i}]", "a finite number >= 0 (seconds)", _non_negative)
                for i in ok]
        out["itls"] = np.concatenate(gaps) if gaps else np.zeros(0)
        out["itl_counts"] = np.array([len(g) for g in gaps], dtype=np.int64)
        if "ttfts" in out:
            out["e2e"] = out["ttfts"] + np.array([g.sum() for g in gaps], dtype=np.float64)
    if "latencies" in lists:
        out["e2e"] = column("latencies", "a finite number > 0 (seconds)", _positive)
    if "start_times" in lists:
        starts = column("start_times", "a finite number (seconds)", math.isfinite)
        out["start_times"] = starts - starts.min() if len(starts) else starts
    return out


def _column(values, rows, name: str, expected: str, check, dtype=np.float64) -> np.ndarray:
    """`values` at `rows` (all when None), each checked; an error names `name[row]`."""
    if not isinstance(values, list):
        raise ConfigError(name, "a list", type(values).__name__)
    rows = range(len(values)) if rows is None else rows
    for i in rows:
        value = values[i]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not check(value):
            raise ConfigError(f"{name}[{i}]", expected, value)
    return np.asarray([values[i] for i in rows], dtype=dtype)


def _number(key: str, value, expected: str, check, finite: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(key, expected, value)
    if (finite and not math.isfinite(value)) or math.isnan(value) or not check(value):
        raise ConfigError(key, expected, value)
    return float(value)


def _positive(value) -> bool:
    return math.isfinite(value) and value > 0


def _non_negative(value) -> bool:
    return math.isfinite(value) and value >= 0


def _is_length(value) -> bool:
    return float(value).is_integer() and value >= 1
