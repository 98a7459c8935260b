"""Peak memory of `cbsim run`, phase by phase, at 10k to a million requests (issue 29).

Each row is a fresh Python process that runs what `cbsim run` runs (cbsim.api.run_experiment with an
output folder: workload, event loop, metrics, writing) on benchmarks/sim_speed.py's reference setup as
an experiment (Llama-2-70B TP2 on A100, Vidur's profile without engine overheads, Vidur's 3,328 KV
blocks of 16, sarathi with a 512-token budget and at most 128 sequences, Poisson arrivals at
1 request/s; the prompt and output lengths drawn from the Azure 2023 conversation trace, each
column on its own, so ~0.1 % of the pairs exceed the 4,096-token context and are rejected). The kernel's
high-water mark (VmHWM) is read and reset at each phase's end (Linux), so each phase's own peak is
printed, beside the process's peak and the figures' forked processes' (ru_maxrss of the children).

    python benchmarks/run_memory.py                          # 10,000 and 100,000 requests
    python benchmarks/run_memory.py --requests 1000000       # the million row
    python benchmarks/run_memory.py --requests 10000,1000000 --plots  # figures drawn too

The per-request figures (CPU us and KB a request) show whether the cost is flat from 10k to 1M.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import sim_speed  # benchmarks/sim_speed.py: the reference setup, one copy

PHASES = ("start", "simulate", "metrics", "write")


def experiment(requests: int, out: str, plots: bool) -> dict:
    """The reference setup as an experiment mapping (what a YAML file would hold)."""
    model = sim_speed.model_spec("llama-2-70b")
    trace = {"format": "vidur", "path": str(sim_speed.data_root() / sim_speed.TRACE),
             "max_total_len": model.max_model_len}
    blocks = sim_speed.vidur_slots(model, tp=2) * (4096 // 16)
    return {
        "name": f"reference-{requests}", "seed": 0, "model": "llama-2-70b",
        "cost_model": {"type": "vidur", "gpu": "a100", "model": "llama-2-70b", "tp": 2, "engine": "none"},
        "cluster": {"kv_cache": {"block_size": 16, "num_blocks": blocks, "watermark": 0.01}},
        "policy": {"name": "sarathi", "token_budget": 512, "max_num_seqs": sim_speed.VIDUR_BATCH_CAP},
        "workload": {"num_requests": requests, "arrival": {"type": "poisson", "rate": 1.0},
                     "prompt_len": {"type": "empirical", "trace": trace},
                     "output_len": {"type": "empirical", "trace": trace}},
        "output": {"dir": out, "plots": plots},
    }


def one_row(requests: int, out: str, plots: bool) -> dict:
    """{phase: [wall s, cpu s, peak MB]} of one run in this process, plus the children's peak."""
    from cbsim.api import run_experiment
    from cbsim.sim.outputs.progress import Progress

    marks = {}
    last = [time.perf_counter(), time.process_time()]

    def mark(name: str) -> None:
        now = [time.perf_counter(), time.process_time()]
        marks[name] = [now[0] - last[0], now[1] - last[1], sim_speed.proc_status_mb("VmHWM")]
        sim_speed.reset_peak_rss()
        last[:] = now

    class Phases(Progress):
        """Marks a phase's end where run_experiment names the next one; prints nothing."""

        def say(self, text: str, force: bool = False) -> None:
            if text.startswith("simulated"):
                mark("simulate")
            elif text.startswith("writing tables"):
                mark("metrics")

        def count(self, *args) -> None:
            pass

    mark("start")  # imports of this script and cbsim.api
    result = run_experiment(experiment(requests, out, plots), out_dir=out, progress=Phases(), overwrite=True)
    mark("write")
    marks["children_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    marks["steps"] = result.summary["num_steps"]
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", default="10000,100000", help="comma-separated request counts, one process each")
    parser.add_argument("--plots", action="store_true", help="draw the figures too (forked processes)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_row(int(args.requests), args.child, args.plots)))
        return
    if not (sim_speed.data_root() / sim_speed.TRACE).exists():
        sys.exit(f"trace not found under {sim_speed.data_root()} (set CBSIM_DATA)")
    print(f"{'requests':>10s} {'steps':>11s}  " + "  ".join(f"{p + ' MB':>12s}" for p in PHASES)
          + f"  {'peak MB':>8s} {'KB/request':>10s} {'figures MB':>10s} {'us/request':>10s}")
    for n in (int(x) for x in args.requests.split(",")):
        with tempfile.TemporaryDirectory() as work:
            command = [sys.executable, __file__, "--child", str(Path(work, "out")), "--requests", str(n)]
            text = subprocess.run(command + (["--plots"] if args.plots else []), check=True,
                                  capture_output=True, text=True).stdout
        row = json.loads(text.strip().splitlines()[-1])
        peak = max(row[p][2] for p in PHASES)
        cpu = sum(row[p][1] for p in PHASES[1:])
        base = row["start"][2]
        print(f"{n:10,d} {row['steps']:11,d}  " + "  ".join(f"{row[p][2]:12.0f}" for p in PHASES)
              + f"  {peak:8.0f} {(peak - base) * 1024 / n:10.2f} {row['children_mb']:10.0f} {cpu / n * 1e6:10.1f}")


if __name__ == "__main__":
    main()
