"""Agentic sessions in the simulation (workloads/agentic.py, workloads/clients.py, sim/router.py,
sim/metrics/session_metrics.py).

Property: over random programs (turns, parallel tool calls, sub-agents), policies, cache sizes and
replica counts, every request is sent exactly once and completes or is rejected exactly once, a turn
is sent only after each request it waits for has left plus its delay (turn order, tool gaps,
sub-agents before their parent resumes), every session completes, finished turns emit exactly
output_len tokens, no KV block stays held, no client sends before its time, time never runs
backwards within a request, and fast-forward changes nothing. Then: session affinity keeps each
agent on one replica, KV residency and recompute respond to the cache size, and the per-agent times
add up to the makespan (byte-identical runs: tests/sim/test_determinism.py).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.api import run_experiment
from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Request, Status
from cbsim.sim.router import SessionAffinity
from cbsim.sim.simulation import simulate
from cbsim.workloads import build_run, parse_workload

from test_invariants_prefix import Checked

LINEAR = {"type": "linear", "base": 0.013, "per_token": 0.0007, "per_kv_token": 3e-6}


def agentic_workload(sessions, turns, calls, probability, children, concurrency, seed, timeout=None):
    mapping = {
        "arrival": {"type": "poisson", "rate": 2.0},
        "prompt_len": {"type": "uniform", "min": 8, "max": 60},
        "output_len": {"type": "uniform", "min": 1, "max": 30},
        "agentic": {"sessions": sessions, "system_prompt_len": 32, "turns": {"type": "uniform", "min": 1, "max": turns},
                    "tool_calls": {"type": "uniform", "min": 1, "max": calls},
                    "tool_time": {"type": "lognormal", "median": 0.5, "sigma": 1.0},
                    "tool_result_len": {"type": "uniform", "min": 1, "max": 40},
                    "subagent_probability": probability, "subagent_count": {"type": "uniform", "min": 1, "max": children},
                    "subagent_turns": {"type": "uniform", "min": 1, "max": 3}},
    }
    if concurrency:
        mapping["max_concurrency"] = concurrency
    if timeout:
        mapping["timeout"] = timeout
    return build_run(parse_workload(mapping), np.random.default_rng(seed))


def simulate_sessions(run, policy, num_blocks, replicas, router, fast_forward=True, max_model_len=100_000):
    settings_ = ReplicaSettings(max_model_len=max_model_len, fast_forward=fast_forward, swap_bandwidth=1e9)
    kvs = []

    def make_kv():
        kvs.append(KVCache(num_blocks, 16, 0, False, 1024.0, prefix_caching=True, hash_block_size=16))
        return kvs[-1]

    policies = []

    def checked():  # the KV and prefix-cache invariants on every state a replica plans from
        policies.append(Checked(make_policy(policy)))
        return policies[-1]

    recorder, _ = simulate(run.requests, checked, load_cost_model(LINEAR), make_kv, settings_, replicas=replicas,
                           router=router, max_time=1e6, clients=run.clients)
    return kvs, recorder


POLICY = st.sampled_from([{"name": "sarathi", "token_budget": 256, "max_num_seqs": 8},
                          {"name": "prefill_first"},
                          {"name": "sglang", "token_budget": 512, "chunked_prefill_size": 128}])


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.integers(1, 3), st.sampled_from([0.0, 0.5]), st.integers(1, 3),
       st.sampled_from([None, 1, 3]), st.integers(0, 99), POLICY, st.integers(40, 400), st.integers(1, 3),
       st.sampled_from(["round_robin", "least_loaded", "session_affinity", "prefix_affinity"]),
       st.sampled_from([512, 100_000]), st.sampled_from([None, None, 0.4]))
def test_agentic_invariants(sessions, turns, calls, probability, children, concurrency, seed, policy, blocks,
                            replicas, router, max_model_len, timeout):
    run = agentic_workload(sessions, turns, calls, probability, children, concurrency, seed, timeout)
    plan = run.clients
    planned = {r.id: r.arrival for r in run.requests}
    kvs, recorder = simulate_sessions(run, policy, blocks, replicas, router, max_model_len=max_model_len)
    requests = run.requests
    runs = recorder.run_table()
    emitted = np.bincount(runs["request_id"].astype(np.int64), weights=runs["tokens"], minlength=len(requests))
    steps = recorder.step_table()
    assert (steps["kv_blocks_used"] <= blocks).all()  # never over-committed
    timed_out = any(r.reject_reason.startswith("timeout") for r in requests)  # computed, then dropped
    if not steps["preemptions"].any() and not timed_out:  # tokens conserved: computed + cache hits == needed
        needed = sum(r.prompt_len + r.output_len - 1 for r in requests if r.status == Status.FINISHED)
        hits = sum(kv.prefix.hit_tokens.get(r.id, 0) for kv in kvs for r in requests if r.status == Status.FINISHED)
        assert steps["prefill_tokens"].sum() + steps["decode_tokens"].sum() + hits == needed
    by_id = {r.id: r for r in requests}
    assert all(r.status in (Status.FINISHED, Status.REJECTED) for r in requests)  # each exactly once: its status
    for r in requests:
        if r.status == Status.FINISHED:
            assert r.num_output_tokens == r.output_len == emitted[r.id]  # every token emitted once
            assert r.arrival <= r.first_scheduled <= r.first_token_time <= r.completion_time  # time goes forward
        else:
            assert r.reject_reason
        assert r.num_blocks == 0 and r.num_swapped_blocks == 0
        for pred, delay in plan.waits[r.id]:  # sent only after what it waits for, plus the tool time
            p = by_id[pred]
            left = p.completion_time if p.status == Status.FINISHED else p.arrival
            assert r.arrival >= left + delay - 1e-9 or p.status == Status.REJECTED
            assert r.arrival >= p.arrival + delay - 1e-9
        if not plan.waits[r.id]:
            assert r.arrival >= planned[r.id] - 1e-12  # a session never starts before its planned time
    assert all(kv.free_blocks + kv.prefix.evictable_blocks == kv.num_blocks for kv in kvs)
    if concurrency:  # a client holds a whole session: its sessions never overlap another client's count
        starts = sorted(min(by_id[rid].arrival for rid in s) for s in plan.sessions)
        ends = sorted(max(by_id[rid].completion_time if by_id[rid].status == Status.FINISHED else by_id[rid].arrival
                          for rid in s) for s in plan.sessions)
        events = sorted([(t, 1) for t in starts] + [(t, -1) for t in ends], key=lambda e: (e[0], e[1]))
        assert max(np.cumsum([e for _, e in events])) <= concurrency
    if router == "session_affinity":
        homes = {}
        for r in requests:
            if r.replica >= 0:
                assert homes.setdefault(r.session, r.replica) == r.replica


@settings(max_examples=10, deadline=None)
@given(st.integers(1, 5), st.integers(0, 99), POLICY, st.integers(40, 300))
def test_fast_forward_changes_nothing_with_agentic_sessions(sessions, seed, policy, blocks):
    def outcome(fast_forward):
        run = agentic_workload(sessions, 4, 2, 0.5, 2, None, seed)
        simulate_sessions(run, policy, blocks, 2, "session_affinity", fast_forward=fast_forward)
        return [(r.arrival, r.first_token_time, r.completion_time, r.status, r.replica) for r in run.requests]

    assert outcome(True) == outcome(False)


CONFIG = {
    "name": "agentic", "seed": 7, "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1},
    "policy": {"name": "sarathi"},
    "cluster": {"replicas": 2, "router": "session_affinity", "kv_cache": {"prefix_caching": True}},
    "workload": {"arrival": {"type": "poisson", "rate": 1.0},
                 "prompt_len": {"type": "uniform", "min": 100, "max": 400},
                 "output_len": {"type": "uniform", "min": 20, "max": 200},
                 "agentic": {"sessions": 12, "system_prompt_len": 512, "turns": {"type": "uniform", "min": 2, "max": 6},
                             "tool_calls": {"type": "uniform", "min": 1, "max": 3},
                             "tool_time": {"type": "exponential", "mean": 1.0},
                             "tool_result_len": {"type": "uniform", "min": 50, "max": 400},
                             "subagent_probability": 0.3, "subagent_turns": {"type": "fixed", "value": 2}}},
    "output": {"plots": False, "formats": ["csv", "parquet"]},
}


def with_cluster(**cluster):
    return {**CONFIG, "cluster": {**CONFIG["cluster"], **cluster}}


def test_affinity_keeps_history_resident_and_the_times_add_up(tmp_path):
    res = run_experiment(CONFIG, out_dir=tmp_path / "a")
    s, t = res.summary, res.turns
    assert s["num_sessions"] == 12 and s["num_subagents"] > 0 and s["num_rejected"] == 0
    assert s["session_kv_resident_fraction"] == 1.0 and s["session_recomputed_tokens"] == 0  # room for all
    assert s["session_reusable_tokens"] > 0 and not t["moved"].any()
    agents = res.sessions
    np.testing.assert_allclose(agents["makespan"], agents["serving_time"] + agents["tool_time"]
                               + agents["subagent_wait"], atol=1e-9)
    shares = s["session_serving_share"] + s["session_tool_share"] + s["session_subagent_share"]
    assert abs(shares - 1.0) < 1e-9
    assert set(pd.read_csv(tmp_path / "a" / "sessions.csv")["agent"]) == set(agents["agent"])
    assert len(pd.read_parquet(tmp_path / "a" / "session_turns.parquet")) == len(res.requests)


def test_a_cut_run_times_only_complete_sessions_and_without_a_cache_nothing_is_resident():
    res = run_experiment({**with_cluster(kv_cache={"prefix_caching": False}), "sim": {"max_time": 20.0}})
    s, agents = res.summary, res.sessions
    assert 0 < s["num_sessions_incomplete"] < s["num_sessions"]
    assert agents.loc[~agents["complete"], "makespan"].isna().all()
    done = agents[agents["complete"]]
    np.testing.assert_allclose(done["makespan"], done["serving_time"] + done["tool_time"] + done["subagent_wait"])
    assert min(s["session_serving_share"], s["session_tool_share"], s["session_subagent_share"]) >= 0
    assert s["session_kv_resident_fraction"] == 0.0 and s["session_recomputed_tokens"] == s["session_reusable_tokens"] > 0


def test_round_robin_moves_turns_and_a_small_cache_evicts_history_in_the_gaps():
    moved = run_experiment(with_cluster(router="round_robin")).summary
    assert moved["session_recomputed_moved_tokens"] > 0
    small = run_experiment(with_cluster(replicas=1, kv_cache={"prefix_caching": True, "num_blocks": 400})).summary
    assert small["session_recomputed_tokens"] > 0 and small["session_recomputed_moved_tokens"] == 0
    assert small["session_kv_resident_fraction"] < 1.0



class Replica:  # what the routers read of a replica
    def __init__(self, index, load):
        self.index, self.incoming, self.running = index, [], []
        self.waiting = [Request(100 + index, 0.0, load, 1)]


def test_session_affinity_keeps_a_session_home_and_sends_the_rest_to_the_least_loaded():
    replicas = [Replica(0, 500), Replica(1, 100)]
    router = SessionAffinity(replicas)
    first = Request(0, 0.0, 10, 1, session=7)
    assert router.route(first) is replicas[1]  # least loaded
    replicas[1].waiting.append(Request(99, 0.0, 1000, 1))  # now the busier one
    assert router.route(Request(1, 1.0, 10, 1, session=7)) is replicas[1]  # stays home
    assert router.route(Request(2, 1.0, 10, 1, session=8)) is replicas[0]
    assert router.route(Request(3, 1.0, 10, 1)) is replicas[0] and router.home == {7: replicas[1], 8: replicas[0]}


def test_pd_refuses_agentic_sessions_naming_the_key():
    import pytest

    from cbsim.core.errors import ConfigError

    cluster = {"mode": "pd", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}
    with pytest.raises(ConfigError, match="workload.agentic: expected null with cluster.mode pd"):
        run_experiment({**CONFIG, "cluster": cluster})
