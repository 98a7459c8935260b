"""Simulator speed: simulated requests per wall-second, microseconds per step, peak memory.

Memory is reported per phase: the event loop's peak RSS, and (on Linux, where the kernel's
high-water mark can be reset) the peak RSS of the metrics phase (request frame, ITL distribution,
summary: the calls of cbsim.api.run_experiment, in its order, over the step columns they read
(StepColumns: a step's replica and end), not over a step frame; run_experiment also builds the frame,
with the efficiency columns, for its steps table).

Reference workload (comparable with Vidur's own benchmark of the same setup): N requests whose
(prompt, output) pairs are drawn with replacement from the Azure 2023 conversation trace (Vidur's
processed copy, splitwise_conv.csv: prompt mean 1,155, output mean 211), Poisson arrivals at
1 request/s, sarathi with a 512-token budget, Llama-2-70B TP2 on A100 (the shipped vidur profile),
a KV cache of 3,328 blocks of 16 tokens as Vidur's memory planner sizes it (vidur_slots), a batch
of at most 128 (Vidur's batch_size_cap), a 1 % watermark, and no
serving-engine overheads (engine: none), as Vidur simulates.

    python benchmarks/sim_speed.py                    # 10,000 requests
    python benchmarks/sim_speed.py --requests 1000000 # the scale check
    python benchmarks/sim_speed.py --no-fast-forward  # step by step, for the ratio
    python benchmarks/sim_speed.py --requests 2000 --opcodes  # Python opcodes executed: deterministic

CPU time on a shared machine varies by 10-25 % between identical runs; `--opcodes` counts the Python
opcodes the event loop executes instead (sys.settrace, ~30x slower, identical on every run and machine
for the same code), which compares two versions of the engine where timing cannot (C work inside
numpy or the interpreter's builtins is not counted).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

from cbsim.api import load_cost_model
from cbsim.policies import make_policy
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.metrics import MetricsConfig, StepColumns, itl_distribution, request_frame, summarize
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request_table import RequestTable
from cbsim.sim.simulation import simulate

TRACE = "vidur/data/processed_traces/splitwise_conv.csv"
VIDUR_BATCH_CAP = 128  # Vidur's batch_size_cap default, the Sarathi scheduler's max batch


def data_root() -> Path:
    env = os.environ.get("CBSIM_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"


def make_requests(n: int, seed: int, max_tokens: int) -> RequestTable:
    """Pairs drawn with replacement from the trace rows that fit max_tokens (as Vidur filters), as
    columns: a Request object exists only while its request is in the system (sim/request_table.py)."""
    frame = pd.read_csv(data_root() / TRACE)
    frame = frame[frame["num_prefill_tokens"] + frame["num_decode_tokens"] <= max_tokens]
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, len(frame), size=n)
    prompts = frame["num_prefill_tokens"].to_numpy()[rows]
    outputs = np.maximum(frame["num_decode_tokens"].to_numpy()[rows], 1)
    arrivals = np.cumsum(rng.exponential(1.0, size=n))
    return RequestTable(arrivals, prompts, outputs)


def vidur_slots(model, tp: int, memory_gib: float = 80.0, margin: float = 0.1, max_request_tokens: int = 4096) -> int:
    """Request slots as Vidur's memory planner sizes them; the KV cache is slots x max_request_tokens
    (base_replica_scheduler.py: num_blocks = max_blocks_per_sequence x get_max_request_slots()), so
    both simulators hold the same cache. Vidur's Sarathi scheduler caps the batch at batch_size_cap
    (128), not at the slots ("for vLLM and its derivatives, we only need to set a loose max batch size").

    microsoft/vidur vidur/scheduler/utils/memory_planner.py @01f216fe: request slots = (80 GiB x
    (1 - memory_margin_fraction 0.1) - 2 bytes x parameters per device) // (2 x 2 bytes x head_dim x
    KV heads per worker x max_request_tokens x layers), each slot max_request_tokens / block_size
    blocks; parameters per device (vidur/utils/param_counter.py): QKV, O and the gated MLP of every
    layer, sharded tp ways (no embeddings). Llama-2-70B TP2 on an A100-80GB: 34.2 B parameters per
    GPU, 13 slots of 4,096 tokens = 3,328 blocks of 16 (cbsim's own `num_blocks: auto` gives 2,358:
    it also counts embeddings and reserves 2 GiB for activations).
    """
    kv_heads = -(-model.num_kv_heads // tp)
    per_layer = model.hidden * model.head_dim * (model.num_heads // tp + 2 * kv_heads)
    per_layer += model.hidden * model.head_dim * (model.num_heads // tp) + 3 * model.hidden * model.intermediate // tp
    free = memory_gib * 1024**3 * (1 - margin) - 2 * per_layer * model.num_layers
    slot = 2 * 2 * model.head_dim * kv_heads * max_request_tokens * model.num_layers
    return int(free // slot)


class OpcodeCounter:
    """Counts the Python opcodes executed while it is entered (sys.settrace with f_trace_opcodes)."""

    def __init__(self):
        self.count = 0

    def _trace(self, frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            self.count += 1
        return self._trace

    def __enter__(self):
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)


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
    parser.add_argument("--opcodes", action="store_true", help="count the Python opcodes the event loop executes")
    args = parser.parse_args()
    if not (data_root() / TRACE).exists():
        sys.exit(f"trace not found under {data_root()} (set CBSIM_DATA)")

    model = model_spec("llama-2-70b")
    requests = make_requests(args.requests, args.seed, model.max_model_len)
    # engine none: Vidur simulates the kernels and no serving engine around them, so the setups match
    cost = load_cost_model({"type": "vidur", "gpu": "a100", "model": "llama-2-70b", "tp": 2, "engine": "none"},
                           "llama-2-70b")
    settings = ReplicaSettings(max_model_len=model.max_model_len, fast_forward=not args.no_fast_forward)
    slots = vidur_slots(model, tp=2)
    blocks = slots * (4096 // 16)
    policy = {"name": "sarathi", "token_budget": 512, "max_num_seqs": VIDUR_BATCH_CAP}
    make_policy(policy)  # imports the policy modules once (~0.1 s): a start-up cost, not the event loop's
    rss_before = peak_rss_mb()
    opcodes = OpcodeCounter() if args.opcodes else None
    cpu_started = time.process_time()
    started = time.perf_counter()
    with opcodes or contextlib.nullcontext():
        recorder, _ = simulate(requests, lambda: make_policy(policy), cost,
                               lambda: KVCache(blocks, 16, int(0.01 * blocks), False, model.kv_bytes_per_token(2)),
                               settings)
    sim_s = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    rss_sim = peak_rss_mb()
    rss_after_sim = proc_status_mb("VmRSS")
    phase_peak = reset_peak_rss()
    started = time.perf_counter()
    steps = StepColumns(recorder)  # the columns the metrics read, made as they read them
    table = request_frame(requests, recorder, steps, MetricsConfig())
    summary = summarize(table, steps, recorder, MetricsConfig(), itl=itl_distribution(recorder, requests, steps))
    metrics_s = time.perf_counter() - started
    rss_metrics = proc_status_mb("VmHWM") if phase_peak else float("nan")
    n_steps = recorder.num_steps
    print(f"requests               {len(requests):,}")
    print(f"KV cache               {blocks:,} blocks of 16 tokens ({slots} slots of 4,096, Vidur's memory planner), "
          f"batch <= {VIDUR_BATCH_CAP}")
    print(f"steps                  {n_steps:,}  (fast-forward {'off' if args.no_fast_forward else 'on'})")
    print(f"simulated time         {summary['makespan']:.0f} s, finished {summary['num_finished']:,}")
    print(f"event loop             {sim_s:.2f} s wall, {cpu_s:.2f} s CPU -> {len(requests) / cpu_s:,.0f} requests/s, "
          f"{cpu_s / n_steps * 1e6:.2f} us/step, {cpu_s / len(requests) * 1e6:.0f} us/request (CPU time)")
    if opcodes is not None:
        print(f"python opcodes         {opcodes.count:,} ({opcodes.count / len(requests):,.0f} a request, "
              f"{opcodes.count / n_steps:,.0f} a step); the times above include the counting")
    print(f"metrics                {metrics_s:.2f} s")
    print(f"peak RSS               {peak_rss_mb():.0f} MB (before simulating: {rss_before:.0f} MB, "
          f"event loop: {rss_sim:.0f} MB, metrics phase: {rss_metrics:.0f} MB from {rss_after_sim:.0f} MB "
          f"after simulating)")
    print(f"ttft p50/p99           {summary['ttft_p50']:.3f} / {summary['ttft_p99']:.3f} s; "
          f"itl p99 {summary['itl_p99'] * 1e3:.1f} ms; throughput {summary['throughput_tokens_per_s']:.0f} tok/s")


if __name__ == "__main__":
    main()
