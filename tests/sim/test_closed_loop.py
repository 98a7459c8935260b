"""Clients (workloads/clients.py): client timeouts abort requests and free their KV; closed-loop
clients never exceed max_concurrency, wait for replies (think time, multi-turn sessions whose next
prompt holds the previous turns and hits the prefix cache) and stay deterministic."""
from __future__ import annotations

import numpy as np
import pytest
from factories import make_requests

from cbsim.api import run_experiment
from cbsim.core.errors import ConfigError
from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Status
from cbsim.sim.simulation import simulate
from cbsim.workloads import ClientPlan, build_run, parse_workload
from paths import ROOT

SARATHI = {"name": "sarathi", "token_budget": 64, "max_num_seqs": 8}
LINEAR = {"type": "linear", "base": 0.013, "per_token": 0.0007, "per_kv_token": 3e-6}  # times that never tie
FIXED = {"prompt_len": {"type": "fixed", "value": 40}, "output_len": {"type": "fixed", "value": 12}}


def run(requests, clients, *, replicas=1, num_blocks=400, fast_forward=True, prefix=False, policy=SARATHI,
        preemption="recompute", max_model_len=100_000, cost=None):
    settings = ReplicaSettings(max_model_len=max_model_len, fast_forward=fast_forward, swap_bandwidth=1e9,
                               preemption_mode=preemption)
    kvs = []

    def make_kv():
        kvs.append(KVCache(num_blocks, 16, 0, False, 1024.0, prefix_caching=prefix, hash_block_size=16))
        return kvs[-1]

    recorder, pool = simulate(requests, lambda: make_policy(policy), load_cost_model(cost or {"type": "unit"}), make_kv,
                              settings, replicas=replicas, max_time=1e5, clients=clients)
    return pool, kvs


def workload(mapping, seed=0):
    return build_run(parse_workload(mapping), np.random.default_rng(seed))


def in_flight_max(requests) -> int:
    """Most requests between their arrival and completion at once (a leave before an entry at a tie)."""
    events = sorted([(r.arrival, 1) for r in requests] + [(r.completion_time, -1) for r in requests])
    return int(np.max(np.cumsum([e for _, e in events]), initial=0))


def assert_done_once_and_freed(requests, kvs):
    assert all(r.status in (Status.FINISHED, Status.REJECTED) for r in requests)
    assert all((r.status == Status.FINISHED) == (r.completion_time == r.completion_time) for r in requests)
    assert all(r.num_blocks == 0 and r.num_swapped_blocks == 0 for r in requests)
    assert all(kv.free_blocks == kv.num_blocks and kv.host_blocks == 0 for kv in kvs)


# ---------------------------------------------------------------- timeouts
def test_timeout_aborts_a_running_request_at_a_step_boundary_and_frees_its_kv():
    requests = make_requests([(0.0, 40, 100), (0.0, 40, 5)])
    _, kvs = run(requests, ClientPlan(timeout=30.0))
    long, short = requests
    assert short.status == Status.FINISHED
    assert long.status == Status.REJECTED and long.reject_reason.startswith("timeout")
    assert 0 < long.num_output_tokens < 100  # it was decoding when its client gave up
    assert_done_once_and_freed(requests, kvs)


@pytest.mark.parametrize("fast_forward, preemption", [(True, "recompute"), (False, "recompute"), (True, "swap")])
def test_timeouts_under_load_keep_the_invariants(fast_forward, preemption):
    rng = np.random.default_rng(1)
    specs = [(float(t), int(p), int(o)) for t, p, o in
             zip(np.cumsum(rng.exponential(0.5, 60)), rng.integers(10, 200, 60), rng.integers(1, 80, 60))]
    requests = make_requests(specs)
    pool, kvs = run(requests, ClientPlan(timeout=40.0), num_blocks=60, fast_forward=fast_forward,
                    policy={"name": "prefill_first"}, preemption=preemption)
    assert sum(len(replica.preemption_log) for replica in pool)  # the KV cache was tight
    assert_done_once_and_freed(requests, kvs)
    timed_out = [r for r in requests if r.reject_reason.startswith("timeout")]
    assert timed_out and len(timed_out) < len(requests)
    assert all(r.completion_time <= r.arrival + 40.0 for r in requests if r.status == Status.FINISHED)


def test_fast_forward_stops_at_a_deadline():
    outcome = []
    for fast_forward in (True, False):
        requests = make_requests([(0.0, 16, 200), (1.0, 16, 300), (2.0, 16, 50)])
        run(requests, ClientPlan(timeout=120.5), fast_forward=fast_forward)
        outcome.append([(r.status, r.num_output_tokens, r.completion_time) for r in requests])
    assert outcome[0] == outcome[1]


# ---------------------------------------------------------------- closed loop
def test_closed_loop_never_exceeds_max_concurrency():
    wl = workload({"num_requests": 40, "max_concurrency": 3, "think_time": 2.0, **FIXED})
    _, kvs = run(wl.requests, wl.clients, replicas=2)
    assert in_flight_max(wl.requests) == 3
    assert_done_once_and_freed(wl.requests, kvs)
    # a client's next request leaves after its previous reply
    assert sorted(r.arrival for r in wl.requests)[:3] == [0.0, 0.0, 0.0]


def test_concurrency_with_a_rate_sends_at_the_later_of_rate_and_free_client():
    wl = workload({"num_requests": 10, "max_concurrency": 1, "arrival": {"type": "constant", "rate": 100.0},
                   **FIXED})
    run(wl.requests, wl.clients)
    order = sorted(wl.requests, key=lambda r: r.arrival)
    assert [r.id for r in order] == list(range(10))
    assert all(b.arrival == a.completion_time for a, b in zip(order, order[1:]))  # the rate is faster


def test_multi_turn_session_next_prompt_holds_the_previous_turn_and_hits_the_cache():
    wl = workload({"num_requests": 6, "max_concurrency": 2, "think_time": 1.0, **FIXED,
                   "shared_prefix": {"mode": "multi_turn", "turns": 3, "num_prefixes": 0, "hash_block_size": 16}})
    first, second = (wl.requests[i] for i in wl.clients.sessions[0][:2])
    assert second.prompt_len == first.prompt_len + first.output_len + 40
    assert second.prefix_hashes[:len(first.prefix_hashes)] == first.prefix_hashes
    _, kvs = run(wl.requests, wl.clients, prefix=True)
    assert second.arrival >= first.completion_time  # sent after the reply
    # its first turn's full computed blocks, output included (vLLM caches computed output blocks; the last
    # sampled token is never computed): 40 + 12 - 1 = 51 tokens, 3 blocks
    assert kvs[0].prefix.hit_tokens[second.id] == ((first.prompt_len + first.output_len - 1) // 16) * 16


def test_closed_loop_experiment_hits_the_prefix_cache_and_is_deterministic():
    cfg = {"name": "closed", "seed": 3, "model": "llama-3-8b", "cost_model": {"type": "roofline", "gpu": "h100"},
           "cluster": {"replicas": 2, "kv_cache": {"block_size": 16, "num_blocks": 3000, "prefix_caching": True}},
           "policy": {"name": "sarathi", "token_budget": 512, "max_num_seqs": 32},
           "workload": {"num_requests": 24, "max_concurrency": 4, "think_time": 0.2, "timeout": 30.0,
                        "prompt_len": {"type": "uniform", "min": 100, "max": 400},
                        "output_len": {"type": "uniform", "min": 10, "max": 60},
                        "shared_prefix": {"mode": "multi_turn", "turns": 3, "num_prefixes": 0,
                                          "hash_block_size": 16}}}
    a, b = run_experiment(cfg), run_experiment(cfg)
    assert a.requests.equals(b.requests)
    assert a.summary == {**b.summary, "sim_wall_seconds": a.summary["sim_wall_seconds"]}
    assert in_flight_max_table(a.requests) <= 4
    later_turns = a.requests.loc[a.requests["cached_tokens"] > 0]
    assert len(later_turns) >= 8 and a.summary["num_timed_out"] == 0


@pytest.mark.parametrize("replicas", [1, 3])
def test_closed_loop_fast_forward_changes_nothing_with_a_roofline_model(replicas):
    cfg = {"name": "ff", "seed": 1, "model": "llama-3-8b", "cost_model": {"type": "roofline", "gpu": "h100"},
           "cluster": {"replicas": replicas, "kv_cache": {"block_size": 16, "num_blocks": 4000}},
           "policy": {"name": "sarathi", "token_budget": 512, "max_num_seqs": 64},
           "workload": {"num_requests": 150, "max_concurrency": 12, "think_time": 0.3, "timeout": 0.8,
                        "prompt_len": {"type": "lognormal", "median": 800, "sigma": 1.0, "max": 4000},
                        "output_len": {"type": "uniform", "min": 20, "max": 200}}}
    fast = run_experiment(cfg)
    slow = run_experiment({**cfg, "sim": {"fast_forward": False}})
    assert fast.requests.equals(slow.requests)
    assert fast.summary["num_timed_out"] > 0


def in_flight_max_table(table) -> int:
    events = sorted([(t, 1) for t in table["arrival"]] + [(t, -1) for t in table["completion_time"]])
    return int(np.max(np.cumsum([e for _, e in events])))


def test_clients_config_errors_are_named():
    for bad, key in (({"max_concurrency": 0}, "max_concurrency"), ({"timeout": -1}, "timeout"),
                     ({"think_time": 1.0}, "think_time")):
        with pytest.raises(ConfigError, match=rf"workload\.{key}"):
            parse_workload({"num_requests": 4, "arrival": {"type": "poisson", "rate": 1.0}, **FIXED, **bad})


def test_pd_clusters_refuse_clients_by_name():
    import yaml

    cfg = yaml.safe_load(open(ROOT / "experiments" / "pd_vs_colocated.yaml"))
    cfg["workload"] = {**cfg["workload"], "num_requests": 10, "timeout": 5.0}
    with pytest.raises(ConfigError, match=r"workload\.timeout: expected null with cluster\.mode pd"):
        run_experiment(cfg)


# ---------------------------------------------------------------- property: random clients keep the invariants
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@pytest.mark.slow
@given(n=st.integers(1, 30), concurrency=st.one_of(st.none(), st.integers(1, 6)), think=st.sampled_from([0.0, 3.0]),
       timeout=st.one_of(st.none(), st.floats(5.0, 200.0)), turns=st.integers(1, 3), replicas=st.integers(1, 2),
       blocks=st.integers(12, 80), preemption=st.sampled_from(["recompute", "swap"]), seed=st.integers(0, 50),
       cost=st.sampled_from([None, LINEAR]))
def test_random_clients_keep_the_invariants(n, concurrency, think, timeout, turns, replicas, blocks, preemption, seed,
                                            cost):
    mapping = {"num_requests": n, "max_concurrency": concurrency, "think_time": think if concurrency else 0.0,
               "timeout": timeout, "prompt_len": {"type": "uniform", "min": 1, "max": 120},
               "output_len": {"type": "uniform", "min": 1, "max": 60},
               "shared_prefix": {"mode": "multi_turn", "turns": turns, "num_prefixes": 0, "hash_block_size": 16,
                                 "think_time": 2.0}}
    if concurrency is None:
        mapping["arrival"] = {"type": "poisson", "rate": 0.5}
    outcomes = []
    for fast_forward in (True, False):
        wl = workload(mapping, seed)
        if wl.clients is None:
            wl.clients = ClientPlan()
        pool, kvs = run(wl.requests, wl.clients, replicas=replicas, num_blocks=blocks, fast_forward=fast_forward,
                        policy={"name": "prefill_first"}, preemption=preemption, max_model_len=16 * blocks, cost=cost)
        assert_done_once_and_freed(wl.requests, kvs)
        if concurrency is not None:  # the feed counts every request in flight, failed ones included
            feed = pool[0].on_leave.__self__
            assert feed.max_in_flight <= concurrency and feed.in_flight == 0 and feed.index == n
        if timeout is not None:
            assert all(r.completion_time <= r.arrival + timeout for r in wl.requests if r.status == Status.FINISHED)
        outcomes.append([(r.status, r.arrival, r.completion_time, r.num_output_tokens) for r in wl.requests])
    assert outcomes[0] == outcomes[1]  # fast-forward changes nothing, deadlines and client sends included


def test_sharegpt_all_turns_in_a_closed_loop_hit_the_prefix_cache(tmp_path):
    import json

    turn = {"from": "human", "value": "x" * 400}  # 100 tokens by the approximation
    reply = {"from": "gpt", "value": "y" * 400}
    (tmp_path / "chats.json").write_text(json.dumps([{"conversations": [turn, reply, turn, reply]}] * 3))
    wl = workload({"trace": {"format": "sharegpt_json", "path": str(tmp_path / "chats.json"), "turns": "all",
                             "hash_block_size": 16}, "max_concurrency": 2})
    assert [r.prompt_len for r in wl.requests] == [100, 300] * 3
    _, kvs = run(wl.requests, wl.clients, prefix=True)
    second = [wl.requests[s[1]] for s in wl.clients.sessions]
    assert all(r.arrival >= wl.requests[s[0]].completion_time for r, s in zip(second, wl.clients.sessions))
    assert [kvs[0].prefix.hit_tokens[r.id] for r in second] == [96, 96, 96]


def test_timed_out_requests_count_in_no_latency_percentile():
    """Like vllm bench serve: a failed (timed-out) request's TTFT, though it had a first token, is left out."""
    data = {"name": "t", "model": "tiny", "cost_model": LINEAR, "policy": SARATHI,
            "cluster": {"kv_cache": {"num_blocks": 400}},
            "workload": {"num_requests": 20, "arrival": {"type": "all_at_once"}, "timeout": 0.5, **FIXED},
            "output": {"plots": False}}
    results = run_experiment(data)
    df = results.requests
    failed = (df["status"] == "rejected") & df["ttft"].notna()
    assert failed.any()  # some timed out after their first token
    kept = df.loc[df["status"] != "rejected", "ttft"].dropna().to_numpy()
    assert results.summary["ttft_p99"] == pytest.approx(np.percentile(kept, 99))
