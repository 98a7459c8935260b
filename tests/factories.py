"""Small factories for tests: requests, a traced policy, and one-call simulations on CPU."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Request
from cbsim.sim.simulation import simulate


class CheckedPolicy:
    """Wraps a policy; runs `check()` before every plan (cluster-wide invariants of P/D tests)."""

    def __init__(self, inner, check):
        self.inner, self.check = inner, check
        self.name, self.config = inner.name, inner.config
        self.steady_when_blocked = inner.steady_when_blocked
        self.steady_chunks = getattr(inner, "steady_chunks", None)  # fast-forwarded steps are not planned

    def schedule(self, state):
        self.check()
        return self.inner.schedule(state)

    def reject_reason(self, req, state):
        return self.inner.reject_reason(req, state)


def make_requests(specs) -> list[Request]:
    """Requests from (arrival, prompt_len, output_len[, priority]) tuples, ids in order."""
    return [Request(i, float(s[0]), int(s[1]), int(s[2]), priority=int(s[3]) if len(s) > 3 else 0)
            for i, s in enumerate(specs)]


class TracedPolicy:
    """Wraps a policy and keeps every plan it returned (with the time it was asked)."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.config = inner.config
        self.steady_when_blocked = inner.steady_when_blocked
        self.steady_chunks = getattr(inner, "steady_chunks", None)  # fast-forwarded steps are not planned
        self.plans = []

    def schedule(self, state):
        plan = self.inner.schedule(state)
        decoding = {r.id for r in list(state.running) + list(state.waiting)
                    if r.num_output_tokens > 0 and r.need == 1}
        self.plans.append((state.now, plan, decoding))
        return plan

    def reject_reason(self, req, state):
        return self.inner.reject_reason(req, state)


@dataclass
class Run:
    requests: list
    recorder: object
    replicas: list
    policies: list = field(default_factory=list)


def run_policy(policy: dict, requests: list[Request], *, cost: dict | None = None, num_blocks: int = 10_000,
               block_size: int = 16, watermark_blocks: int = 0, max_model_len: int = 100_000,
               preemption: str = "recompute", victim: str = "last_admitted", fast_forward: bool = True,
               replicas: int = 1, router: str = "round_robin", trace: bool = False,
               reserve_full_prompt: bool = False, max_time: float = 1e5, settings: dict | None = None) -> Run:
    """Simulate `requests` under one policy on CPU (unit cost model unless `cost` is given).

    `max_time` bounds simulated time, so a scheduling livelock makes a test fail (requests left
    unfinished) instead of hanging it. `settings`: further ReplicaSettings fields."""
    cost_model = load_cost_model(cost or {"type": "unit"})
    policies = []

    def new_policy():
        p = make_policy(policy)
        if trace:
            p = TracedPolicy(p)
            policies.append(p)
        return p

    replica_settings = ReplicaSettings(preemption_mode=preemption, victim=victim, max_model_len=max_model_len,
                                       fast_forward=fast_forward, swap_bandwidth=1e9, **(settings or {}))
    recorder, pool = simulate(requests, new_policy, cost_model,
                              lambda: KVCache(num_blocks, block_size, watermark_blocks, reserve_full_prompt, 1024.0),
                              replica_settings, replicas=replicas, router=router, max_time=max_time)
    return Run(requests, recorder, pool, policies)


def run_pd_cluster(requests, prefill, decode, link=None, check=None, max_time=None):
    """Simulate a P/D cluster (sim/pd.py PoolParts for each pool; default link: 0.5 s latency, 10 B/s,
    1 byte a token); `check(replicas, cluster)` runs before every plan. Returns (recorder, replicas,
    cluster)."""
    import simpy

    from cbsim.sim.pd import PDSettings, build_pd
    from cbsim.sim.metrics.recorder import Recorder
    from cbsim.sim.simulation import ArrivalFeed, run_cluster

    env, recorder = simpy.Environment(), Recorder()
    feed = ArrivalFeed(env, requests)
    replicas, cluster = build_pd(env, recorder, feed, prefill, decode,
                                 link or PDSettings(latency=0.5, bandwidth=10.0, bytes_per_token=1.0))
    if check is not None:
        for replica in replicas:
            replica.policy = CheckedPolicy(replica.policy, lambda: check(replicas, cluster))
    run_cluster(env, feed, replicas, cluster.prefill, "round_robin", max_time, busy=lambda: not cluster.is_idle)
    return recorder, replicas, cluster


# A run of a few requests on the linear cost model, in a second: the experiment the CLI tests change.
TINY_EXPERIMENT = {
    "name": "tiny", "seed": 3, "cost_model": {"type": "linear", "base": 0.01, "per_token": 1e-4},
    "cluster": {"kv_cache": {"num_blocks": 400}}, "policy": {"name": "sarathi", "token_budget": 128},
    "workload": {"num_requests": 5, "arrival": {"type": "poisson", "rate": 20.0},
                 "prompt_len": {"type": "fixed", "value": 100}, "output_len": {"type": "fixed", "value": 5}},
    "output": {"plots": False},
}


def cli(*args):
    """`cbsim ARGS` in this process (typer's runner), every argument as text."""
    from typer.testing import CliRunner

    from cbsim.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args])


def write_experiment(folder, data: dict, name: str = "exp.yaml"):
    """`data` as a YAML experiment file in `folder`; its path."""
    import yaml

    path = folder / name
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    return path


def assert_user_error(result, *needles):
    """Exit code 2, one line on stderr naming every needle, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    text = result.output.strip()
    assert text.startswith("error: ") and "\n" not in text and "Traceback" not in text, text
    for needle in needles:
        assert str(needle) in text, (needle, text)


def assert_same_run(one, other) -> None:
    """Two runs ((requests, recorder), e.g. stepped and fast-forwarded) gave the same requests' times,
    the same step table and every token at the same step."""
    for a, b in zip(one[0], other[0]):
        assert (a.status, a.first_token_time, a.completion_time, a.num_preemptions, a.first_scheduled,
                a.first_scheduled_step, a.first_token_step) == \
            (b.status, b.first_token_time, b.completion_time, b.num_preemptions, b.first_scheduled,
             b.first_scheduled_step, b.first_token_step), a.id
    steps, other_steps = one[1].step_table(), other[1].step_table()
    for name in steps:
        assert np.array_equal(steps[name], other_steps[name], equal_nan=True), name  # a step cut by max_time: NaN end
    for name, column in one[1].run_table().items():  # every token's step, hence its time
        assert np.array_equal(column, other[1].run_table()[name]), name



# The roofline as priced before issue 28 (NCCL all-reduces, unpadded decode-only CUDA graphs, prefill attention at
# the full rate): what the tests that pin older step times bit for bit compare against.
PRE_ISSUE_28 = {"engine": {"preset": "vllm-v1", "custom_all_reduce_max_bytes": 0, "cuda_graph_padding": False,
                           "cuda_graph_piecewise": False, "fused_moe_exposed": 0.0}, "prefill_occupancy": False}


def pre_issue_28(mapping: dict) -> dict:
    """A roofline mapping with issue 28's kernel and execution-mode changes switched off (default engine vllm-v1)."""
    engine = mapping.get("engine", "vllm-v1")
    assert engine == "vllm-v1", engine
    return {**mapping, **PRE_ISSUE_28}
