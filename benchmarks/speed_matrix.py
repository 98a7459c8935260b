"""Simulator speed per configuration: CPU microseconds per request of the event loop, and the ratio to the
benchmark's (issue 29).

Every row runs benchmarks/sim_speed.py's reference workload (Vidur's request list: pairs drawn from the
Azure 2023 conversation trace, Poisson arrivals at 1 request/s; Vidur's Llama-2-70B TP2 A100 profile
without engine overheads; Vidur's KV cache of 3,328 blocks of 16, a batch of at most 128, a 1 % watermark)
and changes one thing:

    benchmark          sarathi, 512-token budget, one replica (sim_speed.py's run)
    splitfuse          splitfuse, same budget
    orca               orca (whole prompts, iteration-level)
    prefill_first      vLLM V0's default: prompts first, decodes in steps of their own
    reserve_full       sarathi with the KV cache's reserve_full_prompt (Vidur's own admission rule)
    pd_1p1d            P/D: one prefill (sarathi) and one decode replica, p2p link
    rr_4               4 replicas, round_robin (arrivals 4x as fast: the same load per replica)
    least_loaded_4     4 replicas, least_loaded (likewise)
    sglang_lpm         sglang, schedule_policy lpm, radix prefix cache (no shared prefixes on this list)
    pp_2               sarathi on 2 pipeline stages (the vidur profile split as vLLM splits the layers)

Rows are run in rounds, each round every row once in the order above (alternated: a slow minute of a
shared machine falls on every row alike); each row's figure is the median over rounds of CPU seconds
(time.process_time) per request, and its ratio the median over rounds of (row / the benchmark of the same
round). The spread printed beside it is (max - min) / median over rounds: the machine's noise.

    python benchmarks/speed_matrix.py                 # 10,000 requests, 3 rounds
    python benchmarks/speed_matrix.py --requests 100000 --rounds 2
    python benchmarks/speed_matrix.py --rows benchmark,sglang_lpm --profile sglang_lpm  # cProfile one row

Vidur: `--vidur-us N` takes Vidur's own CPU microseconds per request on this list (its benchmark run with
the same trace, profile and cache, measured beside this script on the same machine) and prints each row's
ratio to it. The script does not drive Vidur itself (not done: Vidur is not installed here), and says so
when `import vidur` works.
"""
from __future__ import annotations

import argparse
import cProfile
import importlib.util
import pstats
import statistics
import sys
import time
from dataclasses import replace

import sim_speed  # benchmarks/sim_speed.py: the reference workload, one copy
from cbsim.api import load_cost_model
from cbsim.policies import make_policy
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.pd import PDSettings, PoolParts, simulate_pd
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request_table import RequestTable
from cbsim.sim.simulation import simulate

TP = 2
SARATHI = {"name": "sarathi", "token_budget": 512, "max_num_seqs": sim_speed.VIDUR_BATCH_CAP}


class Row:
    """One configuration: the policy, and what differs from the benchmark."""

    def __init__(self, name, policy=SARATHI, replicas=1, router="round_robin", pd=False, pp=1,
                 reserve_full_prompt=False, prefix_caching=False):
        self.name, self.policy, self.replicas, self.router = name, policy, replicas, router
        self.pd, self.pp = pd, pp
        self.reserve_full_prompt, self.prefix_caching = reserve_full_prompt, prefix_caching


ROWS = [
    Row("benchmark"),
    Row("splitfuse", {**SARATHI, "name": "splitfuse"}),
    Row("orca", {"name": "orca", "max_num_seqs": sim_speed.VIDUR_BATCH_CAP}),
    Row("prefill_first", {"name": "prefill_first", "max_num_seqs": sim_speed.VIDUR_BATCH_CAP}),
    Row("reserve_full", reserve_full_prompt=True),
    Row("pd_1p1d", pd=True),
    Row("rr_4", replicas=4),
    Row("least_loaded_4", replicas=4, router="least_loaded"),
    Row("sglang_lpm", {"name": "sglang", "schedule_policy": "lpm", "max_num_seqs": sim_speed.VIDUR_BATCH_CAP},
        prefix_caching=True),
    Row("pp_2", pp=2),
]


class Setup:
    """The parts every row shares: the model, the request columns, the KV cache size."""

    def __init__(self, requests: int, seed: int):
        self.model = model_spec("llama-2-70b")
        table = sim_speed.make_requests(requests, seed, self.model.max_model_len)
        self.columns = [table.column(name) for name in ("arrival", "prompt_len", "output_len")]
        self.blocks = sim_speed.vidur_slots(self.model, tp=TP) * (4096 // 16)

    def requests(self, replicas: int) -> RequestTable:
        """A fresh copy of the list (a run consumes its table); arrivals `replicas` x as fast."""
        arrivals, prompts, outputs = self.columns
        return RequestTable(arrivals / replicas, prompts, outputs)

    def cost(self, pp: int):
        config = {"type": "vidur", "gpu": "a100", "model": "llama-2-70b", "tp": TP, "engine": "none"}
        return load_cost_model({**config, "pp": pp} if pp > 1 else config, "llama-2-70b")

    def make_kv(self, row: Row):
        blocks, bytes_per_token = self.blocks, self.model.kv_bytes_per_token(TP)
        return lambda: KVCache(blocks, 16, int(0.01 * blocks), row.reserve_full_prompt, bytes_per_token,
                               prefix_caching=row.prefix_caching)

    def run(self, row: Row) -> tuple[float, int]:
        """(CPU seconds of the event loop, steps) of one run of `row`."""
        requests = self.requests(row.replicas)
        cost = self.cost(row.pp)
        settings = ReplicaSettings(max_model_len=self.model.max_model_len)
        policy = row.policy
        make_policy(policy)  # the policy modules imported before the clock starts
        started = time.process_time()
        if row.pd:
            pool = PoolParts(1, lambda: make_policy(policy), cost, self.make_kv(row), settings)
            decode = replace(pool, settings=replace(settings, runs_end_before_horizon=True))
            recorder, _, _ = simulate_pd(requests, pool, decode,
                                         PDSettings(bytes_per_token=self.model.kv_bytes_per_token(TP)))
        else:
            recorder, _ = simulate(requests, lambda: make_policy(policy), cost, self.make_kv(row), settings,
                                   replicas=row.replicas, router=row.router)
        return time.process_time() - started, recorder.num_steps


def vidur_available() -> bool:
    return importlib.util.find_spec("vidur") is not None


def measure(setup: Setup, rows: list[Row], rounds: int) -> dict[str, list[float]]:
    """{row: [CPU seconds per request, one a round]}, rows alternated within each round."""
    times: dict[str, list[float]] = {row.name: [] for row in rows}
    n = len(setup.columns[0])
    for k in range(rounds):
        for row in rows:
            seconds, steps = setup.run(row)
            times[row.name].append(seconds / n)
            print(f"  round {k + 1} {row.name:16s} {seconds / n * 1e6:8.1f} us/request  {steps:,} steps",
                  file=sys.stderr, flush=True)
    return times


def report(times: dict[str, list[float]], vidur_us: float | None = None) -> None:
    """Each row's median us/request, its spread over rounds, its ratio to the benchmark (the median of the
    rounds' ratios) and, given Vidur's us/request, how many times less CPU than Vidur it uses."""
    base = times.get("benchmark")
    vidur = f" {'Vidur / row':>12s}" if vidur_us else ""
    print(f"{'configuration':16s} {'us/request':>10s} {'spread':>7s} {'x benchmark':>12s}{vidur}")
    for name, values in times.items():
        median = statistics.median(values)
        spread = (max(values) - min(values)) / median
        ratio = statistics.median(v / b for v, b in zip(values, base)) if base else float("nan")
        vidur = f" {vidur_us / (median * 1e6):11.1f}x" if vidur_us else ""
        print(f"{name:16s} {median * 1e6:10.1f} {spread:7.0%} {ratio:11.2f}x{vidur}")


def profile(setup: Setup, row: Row, top: int = 25) -> None:
    """cProfile of one run of `row`: the functions by own time."""
    profiler = cProfile.Profile()
    profiler.runcall(setup.run, row)
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="", help="comma-separated row names (default: all; the benchmark "
                        "always runs, for the ratio)")
    parser.add_argument("--profile", default="", help="print a cProfile of this row instead of timing")
    parser.add_argument("--vidur-us", type=float, default=None, help="Vidur's CPU us per request on this list, "
                        "measured beside this script: each row's ratio to it is printed")
    args = parser.parse_args()
    if not (sim_speed.data_root() / sim_speed.TRACE).exists():
        sys.exit(f"trace not found under {sim_speed.data_root()} (set CBSIM_DATA)")
    by_name = {row.name: row for row in ROWS}
    wanted = [name for name in args.rows.split(",") if name]
    unknown = [name for name in [*wanted, *filter(None, [args.profile])] if name not in by_name]
    if unknown:
        sys.exit(f"unknown rows {unknown}; rows: {', '.join(by_name)}")
    setup = Setup(args.requests, args.seed)
    if args.profile:
        profile(setup, by_name[args.profile])
        return
    rows = [by_name["benchmark"], *(by_name[n] for n in wanted if n != "benchmark")] if wanted else ROWS
    print(f"{args.requests:,} requests, {args.rounds} rounds alternated; CPU time of the event loop")
    report(measure(setup, rows, args.rounds), args.vidur_us)
    if vidur_available() and args.vidur_us is None:
        print("vidur is importable, but this script does not drive it: give its us/request with --vidur-us")


if __name__ == "__main__":
    main()
