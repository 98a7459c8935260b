"""Per-request pairing of simulated and measured requests, and warm-up exclusion, for `cbsim compare`.

Pairing. A measured file with per-request details (vLLM `--save-result --save-detailed`: `input_lens`,
`output_lens`, `ttfts`, `itls`; SGLang `--output-details`) lists its successful requests in send order;
measured request i is simulated request i (request_id i) when the simulated run holds the same requests in
the same order: the experiment replays the measured ones (no workload of its own: compare.measured_workload
keeps their order), or its own workload has the same prompt and output lengths, request by request. Each
pair has a signed error (simulated - measured) / measured per latency (TTFT, TPOT, E2E); the distribution
(median signed error, p90 of |error|) stands beside the aggregate rows because an aggregate can hide it:
requests simulated too fast and too slow cancel in a mean or a percentile. A pair counts where the
simulated request finished and both values are > 0 (TPOT: more than one output token).

Warm-up. `Warmup(requests=N)` drops the first N requests in send order, `Warmup(seconds=S)` those the
client sent in the first S seconds (the measured `start_times`), from both sides before the latency
metrics, as BLIS's observe/replay does; when paired, the simulated side drops the same requests (by
index), else those that arrived in the first S seconds or its first N. They still ran: they load the
server that the kept requests see. Throughputs are whole-run numbers in the measured file, so with a
warm-up they are not compared.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from cbsim.core.errors import ConfigError
from cbsim.tools.compare.measured import MeasuredRun, latency_stats

PAIRED = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class Warmup:
    """Requests left out of the metrics: the first `requests` sent, or those sent in the first `seconds`."""

    requests: int = 0
    seconds: float = 0.0

    def __post_init__(self):
        if isinstance(self.requests, bool) or not isinstance(self.requests, int) or self.requests < 0:
            raise ConfigError("--warmup", "a number of requests >= 0", self.requests)
        if not (isinstance(self.seconds, (int, float)) and math.isfinite(self.seconds) and self.seconds >= 0):
            raise ConfigError("--warmup-s", "a finite number of seconds >= 0", self.seconds)
        if self.requests and self.seconds:
            raise ConfigError("--warmup", "--warmup or --warmup-s, not both", (self.requests, self.seconds))

    def __bool__(self) -> bool:
        return bool(self.requests or self.seconds)

    def describe(self) -> str:
        return f"the first {self.requests} requests" if self.requests else f"requests sent in the first {self.seconds:g} s"


@dataclass(frozen=True)
class PairErrors:
    """One latency's per-request errors over `pairs` pairs: the median signed relative error, the p90 of
    its absolute value, and the median signed difference in seconds."""

    pairs: int
    median: float
    p90_abs: float
    median_diff: float


def measured_frame(run: MeasuredRun) -> pd.DataFrame:
    """The measured successful requests, one row each in send order: lengths, start, TTFT, TPOT, E2E (s)."""
    n = len(run.input_lens)
    nan = np.full(n, np.nan)

    def given(values):
        return nan if values is None else np.asarray(values, dtype=np.float64)

    frame = pd.DataFrame({"prompt_len": run.input_lens, "output_len": run.output_lens,
                          "start": given(run.start_times), "ttft": given(run.ttfts), "e2e": given(run.e2e)})
    many = frame["output_len"] > 1
    frame["tpot"] = np.where(many, (frame["e2e"] - frame["ttft"]) / (frame["output_len"] - 1).clip(lower=1), np.nan)
    return frame


def simulated_frame(results) -> pd.DataFrame:
    """The simulated requests in request_id order; TTFT, TPOT and E2E only where they finished."""
    df = results.requests.sort_values("request_id").reset_index(drop=True)
    done = df["status"] == "finished"
    frame = df[["request_id", "arrival", "prompt_len", "output_len"]].copy()
    for name in PAIRED:
        frame[name] = df[name].where(done)
    frame.loc[frame["output_len"] <= 1, "tpot"] = np.nan
    return frame


def pairing(run: MeasuredRun, simulated: pd.DataFrame) -> tuple[bool, str]:
    """Whether measured request i is simulated request i, and why not when not (for the notes)."""
    if not run.has_lengths or run.ttfts is None:
        return False, "no per-request pairing: the measured file has no per-request ttfts and lengths " \
                      "(vLLM --save-result --save-detailed, SGLang --output-details)"
    same = (len(simulated) == len(run.input_lens)
            and np.array_equal(simulated["request_id"].to_numpy(), np.arange(len(simulated)))
            and np.array_equal(simulated["prompt_len"].to_numpy(), run.input_lens)
            and np.array_equal(simulated["output_len"].to_numpy(), run.output_lens))
    if not same:
        return False, "no per-request pairing: the experiment's workload is not the measured requests in their " \
                      "order (leave `workload` out to replay them)"
    return True, f"per-request pairing: measured request i is simulated request i ({len(simulated)} requests)"


def kept_measured(run: MeasuredRun, frame: pd.DataFrame, warmup: Warmup) -> np.ndarray:
    """Which measured requests count after `warmup` (a boolean mask in send order)."""
    if warmup.seconds:
        if run.start_times is None:
            raise ConfigError("--warmup-s", "a measured file with per-request start_times (vLLM --save-detailed); "
                              "use --warmup N requests", warmup.seconds)
        keep = frame["start"].to_numpy() >= warmup.seconds
    else:
        keep = np.arange(len(frame)) >= warmup.requests
    if not keep.any():
        raise ConfigError("--warmup" if warmup.requests else "--warmup-s",
                          f"a warm-up that leaves some of the {len(frame)} measured requests", warmup.describe())
    return keep


def kept_simulated(frame: pd.DataFrame, warmup: Warmup) -> np.ndarray:
    """Which simulated requests count after `warmup` when they are not paired: by their own arrival order."""
    if warmup.seconds:
        return frame["arrival"].to_numpy() - frame["arrival"].min() >= warmup.seconds
    order = np.argsort(frame["arrival"].to_numpy(), kind="stable")
    keep = np.zeros(len(frame), dtype=bool)
    keep[order[warmup.requests:]] = True
    return keep


def measured_metrics(run: MeasuredRun, frame: pd.DataFrame, keep: np.ndarray) -> dict[str, float]:
    """The measured latencies over the kept requests (seconds), from the per-request data."""
    out = latency_stats({name: frame.loc[keep, name] for name in PAIRED})
    if run.itls is not None and run.itl_counts is not None:
        gaps = run.itls[np.repeat(keep, run.itl_counts)]
        out.update(latency_stats({"itl": pd.Series(gaps)}))
    return out


def simulated_metrics_kept(results, frame: pd.DataFrame, keep: np.ndarray) -> dict[str, float]:
    """The simulated latencies over the kept requests (seconds); ITL over their token gaps."""
    out = latency_stats({name: frame.loc[keep, name] for name in PAIRED})
    finished = frame.loc[keep & frame["ttft"].notna().to_numpy(), "request_id"]
    gaps = [np.diff(results.token_times(int(rid))) for rid in finished]
    out.update(latency_stats({"itl": pd.Series(np.concatenate(gaps) if gaps else np.zeros(0))}))
    return out


def request_errors(measured: pd.DataFrame, simulated: pd.DataFrame, keep: np.ndarray) -> dict[str, PairErrors]:
    """Each paired latency's per-request error distribution over the kept pairs (index i with index i)."""
    out = {}
    for name in PAIRED:
        m, s = measured[name].to_numpy(), simulated[name].to_numpy()
        ok = keep & np.isfinite(m) & np.isfinite(s) & (m > 0) & (s > 0)
        if ok.any():
            error = (s[ok] - m[ok]) / m[ok]
            out[name] = PairErrors(int(ok.sum()), float(np.median(error)), float(np.percentile(np.abs(error), 90)),
                                   float(np.median(s[ok] - m[ok])))
    return out
