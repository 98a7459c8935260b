"""Simulator speed: simulated requests per wall-second, microseconds per step, peak memory.

Memory is reported per phase: the event loop's peak RSS, and (on Linux, where the kernel's
high-water mark can be reset) the peak RSS of the metrics phase (step frame, request frame, ITL
distribution, summary: the same calls as cbsim.api.run_experiment, in the same order).

Reference workload (comparable with Vidur's own benchmark of the same setup): N requests whose
(prompt, output) pairs are drawn with replacement from the Azure 2023 conversation trace (Vidur's
processed copy, splitwise_conv.csv: prompt mean 1,155, output mean 211), Poisson arrivals at
1 request/s, sarathi with a 512-token budget, Llama-2-70B TP2 on A100 (the shipped vidur profile).

    python benchmarks/sim_speed.py                    # 10,000 requests
    python benchmarks/sim_speed.py --requests 1000000 # the scale check
    python benchmarks/sim_speed.py --no-fast-forward  # step by step, for the ratio
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from cbsim.api import load_cost_model
from cbsim.policies import make_policy
from cbsim.profiler.specs import model_spec
from cbsim.sim.kv_cache import KVCache
from cbsim.sim.metrics import MetricsConfig, itl_distribution, request_frame, step_frame, summarize
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Request
from cbsim.sim.simulation import simulate

TRACE = "vidur/data/processed_traces/splitwise_conv.csv"


def data_root() -> Path:
    env = os.environ.get("CBSIM_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def make_requests(n: int, seed: int, max_tokens: int) -> list[Request]:
    """Pairs drawn with replacement from the trace rows that fit max_tokens (as Vidur filters)."""
    frame = pd.read_csv(data_root() / TRACE)
    frame = frame[frame["num_prefill_tokens"] + frame["num_decode_tokens"] <= max_tokens]
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, len(frame), size=n)
    prompts = frame["num_prefill_tokens"].to_numpy()[rows]
    outputs = np.maximum(frame["num_decode_tokens"].to_numpy()[rows], 1)
    arrivals = np.cumsum(rng.exponential(1.0, size=n))
    return [Request(i, float(a), int(p), int(o)) for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def proc_status_mb(key: str) -> float:
    """A memory line of /proc/self/status in MB (NaN where /proc is missing: not Linux)."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def reset_peak_rss() -> bool:
    """Restart the kernel's high-water mark (VmHWM) so a phase's own peak can be read (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-fast-forward", action="store_true")
    args = parser.parse_args()
    if not (data_root() / TRACE).exists():
        sys.exit(f"trace not found under {data_root()} (set CBSIM_DATA)")

    model = model_spec("llama-2-70b")
    requests = make_requests(args.requests, args.seed, model.max_model_len)
    # engine none: Vidur simulates the kernels and no serving engine around them, so the setups match
    cost = load_cost_model({"type": "vidur", "gpu": "a100", "model": "llama-2-70b", "tp": 2, "engine": "none"},
                           "llama-2-70b")
    settings = ReplicaSettings(max_model_len=model.max_model_len, fast_forward=not args.no_fast_forward)
    # A100-80GB, TP2: ~ (2 x 80 GiB x 0.9 - 138 GB weights) for KV; use the same sizing as `num_blocks: auto`
    from cbsim.profiler.specs import gpu_spec, kv_cache_blocks
    blocks = kv_cache_blocks(model, gpu_spec("a100"), 2, 16, 0.9)
    rss_before = peak_rss_mb()
    cpu_started = time.process_time()
    started = time.perf_counter()
    recorder, _ = simulate(requests, lambda: make_policy({"name": "sarathi", "token_budget": 512}), cost,
                           lambda: KVCache(blocks, 16, int(0.01 * blocks), False, model.kv_bytes_per_token(2)),
                           settings)
    sim_s = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    rss_sim = peak_rss_mb()
    rss_after_sim = proc_status_mb("VmRSS")
    phase_peak = reset_peak_rss()
    started = time.perf_counter()
    steps = step_frame(recorder)
    table = request_frame(requests, recorder, steps, MetricsConfig())
    summary = summarize(table, steps, recorder, MetricsConfig(), itl=itl_distribution(recorder, requests, steps))
    metrics_s = time.perf_counter() - started
    rss_metrics = proc_status_mb("VmHWM") if phase_peak else float("nan")
    n_steps = recorder.num_steps
    print(f"requests               {len(requests):,}")
    print(f"steps                  {n_steps:,}  (fast-forward {'off' if args.no_fast_forward else 'on'})")
    print(f"simulated time         {summary['makespan']:.0f} s, finished {summary['num_finished']:,}")
    print(f"event loop             {sim_s:.2f} s wall, {cpu_s:.2f} s CPU -> {len(requests) / cpu_s:,.0f} requests/s, "
          f"{cpu_s / n_steps * 1e6:.2f} us/step, {cpu_s / len(requests) * 1e6:.0f} us/request (CPU time)")
    print(f"metrics                {metrics_s:.2f} s")
    print(f"peak RSS               {peak_rss_mb():.0f} MB (before simulating: {rss_before:.0f} MB, "
          f"event loop: {rss_sim:.0f} MB, metrics phase: {rss_metrics:.0f} MB from {rss_after_sim:.0f} MB "
          f"after simulating)")
    print(f"ttft p50/p99           {summary['ttft_p50']:.3f} / {summary['ttft_p99']:.3f} s; "
          f"itl p99 {summary['itl_p99'] * 1e3:.1f} ms; throughput {summary['throughput_tokens_per_s']:.0f} tok/s")


if __name__ == "__main__":
    main()
