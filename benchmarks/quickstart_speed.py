"""Where `cbsim run experiments/quickstart.yaml` spends its time, phase by phase (issue 12).

Each run is a fresh Python process (imports included, as the CLI pays them) that times, in wall and
CPU seconds: importing the CLI, loading the config, the run (workload, simulation, metrics), and each
of the three output jobs Results.write runs: the files (config, tables, summary, bench.json, trace),
the plots (latency CDF, step timeline, KV usage) and the dashboard, one after another, with matplotlib
imported first (its own line). Results.write runs the two figure jobs in forked processes beside the
files where a CPU is free (sim/outputs/side_by_side.py), so on an idle machine with three CPUs the
write takes about the longest of the three jobs, not their sum; both sums are printed. The median
over `--runs` processes is reported.

    python benchmarks/quickstart_speed.py            # 3 runs
    python benchmarks/quickstart_speed.py --runs 5
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

PHASES = ("import", "config", "run", "matplotlib", "files", "plots", "dashboard")


def one_run(experiment: str, out: str) -> dict:
    """{phase: (wall, cpu)} of one quickstart in this process."""
    marks = [(time.perf_counter(), time.process_time())]
    out_times = {}

    def mark(name):
        marks.append((time.perf_counter(), time.process_time()))
        out_times[name] = (marks[-1][0] - marks[-2][0], marks[-1][1] - marks[-2][1])

    import cbsim.cli.app  # noqa: F401
    mark("import")
    from pathlib import Path

    from cbsim.api import run_experiment
    from cbsim.config import load_config
    cfg = load_config(experiment)
    mark("config")
    res = run_experiment(cfg)
    mark("run")
    import cbsim.sim.outputs.dashboard  # noqa: F401
    import cbsim.sim.outputs.plots  # noqa: F401
    mark("matplotlib")
    target = Path(out)
    target.mkdir(parents=True, exist_ok=True)
    res._write_files(target, lambda text: None, target)
    mark("files")
    res._write_plots(target)
    mark("plots")
    res._write_dashboards(target)
    mark("dashboard")
    out_times["simulation"] = (res.summary["sim_wall_seconds"], float("nan"))
    return out_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--experiment", default="experiments/quickstart.yaml")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_run(args.experiment, args.child)))
        return
    runs = []
    with tempfile.TemporaryDirectory() as out:
        for _ in range(args.runs):
            text = subprocess.run([sys.executable, __file__, "--child", out, "--experiment", args.experiment],
                                  check=True, capture_output=True, text=True).stdout
            runs.append(json.loads(text.strip().splitlines()[-1]))
    median = {k: [statistics.median(r[k][i] for r in runs) for i in (0, 1)] for k in (*PHASES, "simulation")}
    print(f"{'phase':<12}{'wall s':>8}{'cpu s':>8}   (median of {args.runs}; load {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs)")
    for name in (*PHASES[:3], "simulation", *PHASES[3:]):
        wall, cpu = median[name]
        print(f"{name:<12}{wall:>8.2f}{cpu:>8.2f}")
    serial = sum(median[k][0] for k in PHASES)
    side = sum(median[k][0] for k in PHASES[:4]) + max(median[k][0] for k in PHASES[4:])
    print(f"{'total':<12}{serial:>8.2f}   one after another; {side:.2f} with the figures beside the files")


if __name__ == "__main__":
    main()
