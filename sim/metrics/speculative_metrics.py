"""Per-request and run-wide metrics of speculative decoding (sim/speculative.py).

A verify step emits 1 + the accepted drafts at once: the client sees those tokens in one chunk, at
the step's end (their token times are equal). So a request's token runs (token_runs.py) count the
steps that emitted, and the ITL distribution (itl.py) is the distribution of the gaps between
chunks, as `vllm bench serve` measures ITL from a stream whose chunks carry several tokens
(vllm/benchmarks/lib/endpoint_request_func.py: one `itl` entry per chunk received). TPOT stays per
token: (last token time - first token time) / (output_len - 1).

Columns (only in runs that speculate):
- `spec_steps`: the request's verify steps; `accepted_tokens`: draft tokens accepted in them;
- `acceptance_length`: 1 + accepted / verify steps, vLLM's mean acceptance length
  (vllm/v1/spec_decode/metrics.py: 1 + num_accepted_tokens / num_drafts);
- `tokens_per_gap`: output tokens per chunk after the first, (output_tokens - 1) / (chunks - 1).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from cbsim.sim.request_table import request_column as _column


def add_speculative_columns(frame: pd.DataFrame, requests, emissions: np.ndarray) -> None:
    """Add the speculative columns to the request frame (`emissions`: chunks each request received)."""
    steps = _column(requests, "spec_steps", np.int64)
    accepted = _column(requests, "spec_accepted", np.int64)
    frame["spec_steps"] = steps
    frame["accepted_tokens"] = accepted
    with np.errstate(divide="ignore", invalid="ignore"):
        frame["acceptance_length"] = np.where(steps > 0, 1 + accepted / np.maximum(steps, 1), np.nan)
        tokens = frame["output_tokens"].to_numpy()
        frame["tokens_per_gap"] = np.where(emissions > 1, (tokens - 1) / np.maximum(emissions - 1, 1), np.nan)


def speculative_summary(frame: pd.DataFrame) -> dict:
    """Run-wide keys (empty without speculation): the mean acceptance length over every verify step
    of the run (vLLM's definition, pooled), and the mean tokens per gap over every gap."""
    if "spec_steps" not in frame:
        return {}
    steps = int(frame["spec_steps"].sum())
    accepted = int(frame["accepted_tokens"].sum())
    tokens = frame["output_tokens"].to_numpy()
    gaps = (frame["tokens_per_gap"].notna()).to_numpy()
    emissions = np.where(gaps, (tokens - 1) / frame["tokens_per_gap"].to_numpy(), 0)
    return {"spec_steps": steps, "mean_acceptance_length": 1 + accepted / steps if steps else float("nan"),
            "tokens_per_gap": float((tokens[gaps] - 1).sum() / emissions[gaps].sum()) if gaps.any() else float("nan")}
