"""Held-out batches for a profile run, recorded from simulator runs of real schedulers.

A fit is judged on batches it never saw; the ones that matter are those a scheduler actually forms
(a sarathi step at its token budget, a prefill_first prompt batch, long decode batches), not more
grid points. This module simulates a workload under sarathi (token budgets 512 and 2048) and
prefill_first on the roofline model of the target GPU, samples step shapes from each run
(`output.shapes`), keeps those inside the grid's KV and context limits, and writes them in the
profiler's held-out JSONL format (profiler/grid.py), each batch tagged `heldout`. Most simulated
steps are pure decodes, so each run contributes at most `per_class` batches of each class
(decode, prefill, mixed, long; seeded choice), which keeps the mixed batches the targets are
stated for well represented.

    python -m cbsim.profiler.heldout --out profiler/heldout/h200-llama-3-8b.jsonl

regenerates the committed file that profiler/gpu_job.sh measures beside the h200-8b grid. The
simulations are seeded, so the file is reproducible. Needs no torch.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from cbsim.profiler.grid import Batch, make_batch, named_grid, write_batches
from cbsim.profiler.measurements import batch_class

POLICIES = (
    ("sarathi-512", {"name": "sarathi", "token_budget": 512, "max_num_seqs": 256}),
    ("sarathi-2048", {"name": "sarathi", "token_budget": 2048, "max_num_seqs": 256}),
    ("prefill_first", {"name": "prefill_first", "max_num_seqs": 256}),
)
# Azure-conversation-like lengths (prompt median ~1k, output ~200), at a rate that keeps a
# Llama-3-8B H200 replica busy: batches of tens to a few hundred decodes beside the chunks
SAMPLED_SHAPES = 2000  # step shapes sampled from each simulation before the per-class choice
WORKLOAD = {
    "arrival": {"type": "poisson", "rate": 25.0},
    "prompt_len": {"type": "lognormal", "median": 1000, "sigma": 1.0, "max": 7168},
    "output_len": {"type": "lognormal", "median": 200, "sigma": 0.9, "min": 2, "max": 1024},
}


def experiment(policy: dict, model: str, gpu: str, requests: int, shapes: int, seed: int) -> dict:
    """The simulation whose step shapes are sampled (plots and trace off)."""
    return {
        "name": "heldout", "seed": seed, "model": model,
        "cost_model": {"type": "roofline", "gpu": gpu, "tp": 1},
        "cluster": {"kv_cache": {"block_size": 16, "num_blocks": "auto", "gpu_memory_utilization": 0.9}},
        "policy": policy,
        "workload": {"num_requests": requests, **WORKLOAD},
        "output": {"plots": False, "trace": False, "shapes": shapes},
    }


def simulated_batches(model: str = "llama-3-8b", gpu: str = "h200", grid: str = "h200-8b",
                      requests: int = 600, per_class: int = 20, seed: int = 0) -> tuple[list[Batch], int]:
    """(held-out batches from every policy in POLICIES, how many fell outside the grid's limits)."""
    import numpy as np

    from cbsim.api import run_experiment

    limits = named_grid(grid, np.random.default_rng(0))
    rng = np.random.default_rng(seed)
    kept, dropped = [], 0
    for _, policy in POLICIES:
        result = run_experiment(experiment(policy, model, gpu, requests, SAMPLED_SHAPES, seed))
        by_class: dict[str, list[Batch]] = {}
        for shape in result.shapes:
            batch = make_batch(shape.prefill, shape.decode, "heldout")
            if batch.kv_tokens > limits.max_kv_tokens or batch.max_ctx > limits.max_context:
                dropped += 1
                continue
            by_class.setdefault(batch_class(batch.prefill, batch.decode), []).append(batch)
        for cls in sorted(by_class):
            group = by_class[cls]
            picks = sorted(rng.choice(len(group), size=min(per_class, len(group)), replace=False))
            kept += [group[i] for i in picks]
    return kept, dropped


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--gpu", default="h200")
    parser.add_argument("--grid", default="h200-8b", help="whose KV and context limits the batches must keep")
    parser.add_argument("--requests", type=int, default=600, help="requests per simulation")
    parser.add_argument("--per-class", type=int, default=20, help="batches of each class kept per simulation")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    batches, dropped = simulated_batches(args.model, args.gpu, args.grid, args.requests, args.per_class, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_batches(args.out, batches)
    print(f"{len(batches)} held-out batches from {', '.join(name for name, _ in POLICIES)} -> {args.out}"
          + (f" ({dropped} outside the grid's limits dropped)" if dropped else ""))


if __name__ == "__main__":
    main()
