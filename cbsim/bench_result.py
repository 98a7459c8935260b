"""A run's results in the schema of `vllm bench serve --save-result` (bench.json).

Keys and definitions follow vllm/benchmarks/serve.py (`calculate_metrics`, the `result` dict and
`process_one_metric`), so tools that read vLLM benchmark files read cbsim's:

- `completed`: finished requests; `failed`: requests rejected or left unfinished at the end.
- `duration`: the run's makespan (first arrival to last completion), the benchmark's wall time.
- `request_throughput`, `output_throughput`, `total_token_throughput`: completed requests, their
  output tokens, and their prompt + output tokens, per second of duration.
- `request_goodput`: completed requests meeting every objective of `metrics.slo` per second
  (vLLM's `--goodput ttft:<ms> tpot:<ms>`); null when no objective is set, as in vLLM.
- `{mean,median,std,p<q>}_{ttft,tpot,itl,e2el}_ms`: TTFT and E2EL over completed requests, TPOT
  over completed requests with more than one output token, ITL over every token gap of the run;
  `p<q>` for each q of `metrics.percentiles` (numpy's linear method, as vLLM; std is numpy's
  population std). A metric without a value (no completed request, no gap) is 0, as vLLM writes it.
- With details: per-request `input_lens`, `output_lens`, `ttfts`, `itls` (each request's gaps),
  `latencies`, `start_times` (arrival, seconds from the first) and `errors` (the reject reason),
  one entry per request in id order; failed requests have ttft 0 and no gaps, as in vLLM.

Not written: `date` (outputs are byte-identical run to run), tokenizer and sampling fields.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from cbsim.workloads import parse_workload

from cbsim.sim.metrics.itl import weighted_percentile

LATENCY_KEYS = ("ttft", "tpot", "itl", "e2el")
DONE_COLUMNS = ("prompt_len", "output_tokens", "output_len", "meets_slo", "ttft", "tpot", "e2e")


def bench_result(results, percentiles=(99,), details: bool = False) -> dict:
    """The bench.json dict of a cbsim Results (cbsim/api.py)."""
    cfg, df = results.config, results.requests
    done = df.loc[df["status"] == "finished", list(DONE_COLUMNS)]  # (the columns read, not a copy of every one)
    duration = float(results.summary.get("makespan") or 0.0)
    rate = (lambda count: count / duration if duration > 0 else 0.0)
    prompt, output = int(done["prompt_len"].sum()), int(done["output_tokens"].sum())
    has_slo = cfg.metrics.slo.is_set()
    out = {
        "backend": "cbsim", "endpoint_type": "cbsim", "label": cfg.name, "model_id": _model_name(cfg),
        "num_prompts": len(df), **_arrival_keys(cfg),
        "duration": duration, "completed": len(done), "failed": len(df) - len(done),
        "total_input_tokens": prompt, "total_output_tokens": output,
        "request_throughput": rate(len(done)),
        "request_goodput": rate(int(done["meets_slo"].sum())) if has_slo else None,
        "output_throughput": rate(output), "total_token_throughput": rate(prompt + output),
    }
    if details:
        out.update(_details(results, df))
    samples = {"ttft": done["ttft"], "tpot": done.loc[done["output_len"] > 1, "tpot"], "e2el": done["e2e"]}
    for key in LATENCY_KEYS:
        values, weights = _itl(results.itl) if key == "itl" else (samples[key].dropna().to_numpy(), None)
        again = results.itl.fill_values if key == "itl" else None  # the gaps made again: one array of them
        out.update(latency_stats(key, values, weights, percentiles, again))
    return out


def latency_stats(key: str, values: np.ndarray, weights: np.ndarray | None, percentiles, again=None) -> dict:
    """mean/median/std/p<q> of `values` (seconds, optionally weighted) in ms, under vLLM's key names.
    `again(out)`: writes `values` into `out` once more (the ITL's gaps: then `values` itself is the scratch,
    one array of them instead of two)."""
    values = np.asarray(values, dtype=np.float64)
    weights = np.ones(len(values), np.int64) if weights is None else np.asarray(weights)
    if len(values) == 0 or weights.sum() == 0:
        values, weights, again = np.zeros(1), np.ones(1, np.int64), None  # vLLM: np.mean(x or 0)
    qs = [50.0, *map(float, percentiles)]
    at = weighted_percentile(values, weights, qs)
    # np.average(x, weights=w) is sum(x * w) / sum(w) in float64; spelled out here over one scratch array
    # (the products, then the squared deviations and their products, each in place): the same sums
    total = weights.sum(dtype=np.float64)
    scratch = values if again is not None else np.empty(len(values), dtype=np.float64)
    np.multiply(values, weights, out=scratch, dtype=np.float64)
    mean = float(scratch.sum() / total)
    if again is not None:
        again(scratch)  # the values again, over their products
    np.subtract(values if again is None else scratch, mean, out=scratch)
    np.square(scratch, out=scratch)  # (values - mean) ** 2, in place: numpy squares a power of 2
    np.multiply(scratch, weights, out=scratch, dtype=np.float64)
    std = float(np.sqrt(scratch.sum() / total))
    del scratch
    out = {f"mean_{key}_ms": mean * 1e3, f"median_{key}_ms": float(at[0]) * 1e3, f"std_{key}_ms": std * 1e3}
    for q, value in zip(qs[1:], at[1:]):
        out[f"p{percentile_word(q)}_{key}_ms"] = float(value) * 1e3
    return out


def percentile_word(q: float) -> str:
    """vLLM's spelling of a percentile in a key: 99 -> '99', 99.9 -> '99.9'."""
    return str(int(q)) if int(q) == q else str(q)


def _itl(itl) -> tuple[np.ndarray, np.ndarray]:
    return itl.values, itl.weights


def _model_name(cfg) -> str:
    model = cfg.model
    return model if isinstance(model, str) else getattr(model, "name", str(model))


def _arrival_keys(cfg) -> dict:
    """request_rate (null when the arrivals are not a rate: a trace, a list), burstiness (vLLM's gamma
    shape: 1 for Poisson, 1/cv^2 for gamma gaps) and max_concurrency (workload.max_concurrency; open loop: null)."""
    workload = parse_workload(cfg.workload, "workload")
    arrival = workload.arrival
    rate = getattr(arrival, "rate", None)
    cv = getattr(arrival, "cv", None)
    burstiness = None if rate is None else (1.0 if cv is None else 1.0 / cv ** 2)
    return {"request_rate": rate, "burstiness": burstiness, "max_concurrency": workload.max_concurrency}


def _details(results, df: pd.DataFrame) -> dict:
    """Per-request arrays, one entry per request in id order (vLLM lists every output, failed ones too)."""
    df = df.sort_values("request_id", kind="stable")
    finished = (df["status"] == "finished").to_numpy()
    itls = [np.diff(results.token_times(int(rid))).tolist() if ok else []
            for rid, ok in zip(df["request_id"], finished)]
    ttft = np.where(finished, df["ttft"].to_numpy(), 0.0)
    latency = np.where(finished, df["e2e"].to_numpy(), 0.0)
    start = df["arrival"].to_numpy() - df["arrival"].min() if len(df) else np.zeros(0)
    return {
        "input_lens": df["prompt_len"].astype(int).tolist(),
        "output_lens": np.where(finished, df["output_tokens"], 0).astype(int).tolist(),
        "ttfts": ttft.tolist(), "itls": itls, "latencies": latency.tolist(), "start_times": start.tolist(),
        "errors": ["" if ok else (reason or "unfinished") for ok, reason in zip(finished, df["reject_reason"])],
    }
