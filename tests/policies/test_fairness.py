"""Tenant fairness (policies/fairness.py): fair order, weights, token buckets, the
minimum quantum, deadline slack over lpm; workloads and metrics with tenants; budgets and
completion over random workloads (hypothesis). Unit cost model: one step = one second."""
from collections import deque

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.core.errors import ConfigError
from cbsim.policies import make_policy
from cbsim.policies.batch import BatchBuilder
from cbsim.policies.fairness import FairQueue
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.request import Request, Status
from cbsim.sim.state import SchedulerState
from cbsim.sim.metrics.tenant_metrics import jain_index, tenant_summary
from cbsim.workloads import build_requests, parse_workload

from factories import run_policy
from test_invariants import ENGINE, MAX_MODEL_LEN, WORKLOADS, check_run
from test_prefix import chain_requests, run_prefix
from test_sglang import cached


def flood():
    """Twelve requests of tenant heavy at t = 0, then two of tenant light at t = 0.5."""
    heavy = [Request(i, 0.0, 32, 4, tenant="heavy") for i in range(12)]
    return heavy + [Request(12 + i, 0.5, 32, 4, tenant="light") for i in range(2)]


def ttfts(run, tenant):
    return [r.first_token_time - r.arrival for r in run.requests if r.tenant == tenant]


def test_fair_order_keeps_a_flood_from_delaying_a_light_tenant():
    config = {"name": "sarathi", "token_budget": 32, "max_num_seqs": 4}
    fcfs = run_policy(config, flood())
    fair = run_policy({**config, "queue_policy": "fair"}, flood())
    assert ttfts(fcfs, "light") == [15.5, 17.5]  # behind all twelve heavy prompts
    # light becomes active at t = 1 with its counter lifted to heavy's (VTC), so it ties with heavy's
    # head (which keeps its queue place), then goes before heavy's next prompts
    assert ttfts(fair, "light") == [3.5, 4.5]
    assert max(ttfts(fair, "heavy")) == 18.0 and max(ttfts(fcfs, "heavy")) == 15.0  # heavy pays the 3 steps
    assert all(r.status == Status.FINISHED for r in fair.requests)


def test_weights_two_to_one_give_two_to_one_service_under_contention():
    reqs = [Request(i, 0.0, 32, 1, tenant="ab"[i % 2]) for i in range(60)]  # one 32-token prompt a step
    run = run_policy({"name": "sarathi", "token_budget": 32, "queue_policy": "fair",
                      "tenant_weights": {"a": 2, "b": 1}}, reqs)
    served = [r.tenant for r in sorted(run.requests, key=lambda r: r.completion_time)]
    assert "".join(served[:12]) == "ababaabaabaa"  # start tags a: 0, 16, 32, ...; b: 0, 32, 64, ...
    first30 = [r for r in run.requests if r.completion_time <= 30]
    assert (sum(r.tenant == "a" for r in first30), sum(r.tenant == "b" for r in first30)) == (20, 10)


def test_token_bucket_caps_a_tenants_admitted_tokens_per_second():
    reqs = [Request(i, 0.0, 16, 1, tenant="ab"[i % 2]) for i in range(80)]
    bucket = {"tenant": "a", "rate": 8.0, "burst": 16.0}
    run = run_policy({"name": "sarathi", "token_budget": 32, "queue_policy": "fair", "token_buckets": [bucket]},
                     reqs, trace=True)
    by_id = {r.id: r for r in reqs}
    admitted, b_left = 0, 40
    for now, plan, _ in run.policies[0].plans:
        admitted += sum(by_id[i].prompt_len for i in plan.admitted if by_id[i].tenant == "a")
        b_left -= sum(by_id[i].tenant == "b" for i in plan.admitted)
        if b_left > 0:  # b still waits: the bucket is a hard cap
            assert admitted <= 16 + 8.0 * now
    assert b_left <= 0
    a_by_20 = sum(r.prompt_len for r in reqs if r.tenant == "a" and r.first_scheduled < 20)
    assert a_by_20 == 160  # 16 + 8 x 19 = 168 allowed, ten whole 16-token prompts
    assert all(r.status == Status.FINISHED for r in reqs)  # work-conserving once b has drained


def test_min_quantum_lets_a_tenant_in_while_decodes_fill_the_budget():
    def reqs():
        return [Request(i, 0.0, 8, 50, tenant="heavy") for i in range(8)] + [Request(8, 20.0, 16, 2, tenant="light")]
    config = {"name": "sarathi", "token_budget": 8, "max_num_seqs": 16}
    plain = run_policy({**config, "queue_policy": "fair"}, reqs())
    quantum = run_policy({**config, "queue_policy": "fair", "min_quantum": 4}, reqs(), trace=True)
    light = lambda run: run.requests[8].first_token_time - run.requests[8].arrival  # noqa: E731
    assert light(plain) == 37.0  # eight decodes take the 8-token budget until they finish
    assert light(quantum) == 4.0  # 4 tokens a step: 16 in four steps
    assert [p.scheduled.get(8) for t, p, _ in quantum.policies[0].plans if 20 <= t <= 23] == [4, 4, 4, 4]


def ordered(config, waiting, kv, now):
    policy = make_policy({"name": "sglang", **config})
    state = SchedulerState(kv=kv, max_model_len=100_000, now=now, waiting=deque(waiting))
    return [r.id for r in policy.order(state, BatchBuilder(state, None, 256))]


def test_deadline_slack_overrides_lpm_cache_affinity():
    kv = KVCache(1000, 16, prefix_caching=True)
    cached(kv, 1, 6)
    reqs = chain_requests([(0, 9, 2, 5, 1), (0.5, 1, 6, 5, 1), (0.9, 1, 6, 5, 1)])
    lpm = {"schedule_policy": "lpm", "ttft_deadline": 2.0}
    assert ordered(lpm, reqs, kv, now=1.5) == [1, 2, 0]  # cache-affine: the cold request 0 last
    assert ordered({**lpm, "deadline_slack": 0.4}, reqs, kv, now=1.5) == [1, 2, 0]  # 0.5 s left: not yet
    assert ordered({**lpm, "deadline_slack": 0.6}, reqs, kv, now=1.5) == [0, 1, 2]  # now urgent: first
    assert ordered({**lpm, "deadline_slack": 1.5}, reqs, kv, now=1.5) == [0, 1, 2]  # 1 and 2 urgent too: edf


def test_deadline_slack_serves_a_cold_request_in_a_hot_lpm_stream():
    hot = [(0.2 * i, 1, 16, 20, 10) for i in range(100)]  # as test_sglang's aging test
    specs = hot[:5] + [(1.0, 2, 16, 20, 10)] + hot[5:]  # request 5 is cold
    waits = {}
    for slack in (None, 1.0):
        reqs = chain_requests(specs)
        config = {"name": "sglang", "schedule_policy": "lpm", "max_num_seqs": 2, "ttft_deadline": 3.0,
                  "deadline_slack": slack}
        run_prefix(config, reqs, cost={"type": "linear", "base": 0.1, "per_token": 0.0005})
        assert all(r.status == Status.FINISHED for r in reqs)
        waits[slack] = reqs[5].first_scheduled - reqs[5].arrival
    assert waits[None] > 20.0
    assert waits[1.0] <= 2.0 + 1.5  # first once 1 s from its 3 s deadline, as soon as a slot frees


def test_sglang_fair_order_and_routing_key_by_tenant():
    kv = KVCache(1000, 16)
    reqs = [Request(i, 0.0, 32, 4, tenant=t) for i, t in enumerate("aaab")]
    assert ordered({"schedule_policy": "fair"}, reqs, kv, 0.0) == [0, 3, 1, 2]  # tags a: 0, 32, 64; b: 0
    assert ordered({"schedule_policy": "fair", "tenant_weights": {"b": 0.5}}, reqs, kv, 0.0) == [0, 3, 1, 2]
    policy = make_policy({"name": "sglang", "schedule_policy": "routing_key"})
    running = [Request(9, 0.0, 8, 4, tenant="b")]
    state = SchedulerState(kv=kv, max_model_len=1000, waiting=deque(reqs), running=running)
    assert [r.id for r in policy.order(state, BatchBuilder(state, None, 256))] == [3, 0, 1, 2]


def test_config_errors_and_steadiness():
    for bad in ({"tenant_weights": {"a": 1}}, {"queue_policy": "fair", "tenant_weights": {"a": 0}},
                {"queue_policy": "fair", "min_quantum": -1},
                {"queue_policy": "fair", "token_buckets": [{"tenant": "a", "rate": 0, "burst": 4}]}):
        with pytest.raises(ConfigError):
            make_policy({"name": "sarathi", **bad})
    with pytest.raises(ConfigError, match="deadline_slack"):
        make_policy({"name": "sglang", "deadline_slack": -1})
    assert make_policy({"name": "sarathi"}).steady_when_blocked
    assert not make_policy({"name": "sarathi", "queue_policy": "fair"}).steady_when_blocked
    assert not make_policy({"name": "sglang", "schedule_policy": "lpm", "deadline_slack": 1}).steady_when_blocked


# ---------------------------------------------------------------- workloads and metrics


def test_workloads_carry_tenants():
    explicit = parse_workload({"requests": [{"arrival": 0, "prompt_len": 4, "output_len": 2, "tenant": "x",
                                             "adapter": "lora-1"},
                                            {"arrival": 1, "prompt_len": 4, "output_len": 2}]})
    reqs = build_requests(explicit, np.random.default_rng(0))
    assert [(r.tenant, r.adapter) for r in reqs] == [("x", "lora-1"), (None, None)]
    base = {"num_requests": 400, "arrival": {"type": "poisson", "rate": 4.0},
            "prompt_len": {"type": "fixed", "value": 8}, "output_len": {"type": "uniform", "min": 1, "max": 9}}
    plain = build_requests(parse_workload(base), np.random.default_rng(3))
    mixed = build_requests(parse_workload({**base, "tenants": {"a": 3, "b": 1}}), np.random.default_rng(3))
    again = build_requests(parse_workload({**base, "tenants": {"a": 3, "b": 1}}), np.random.default_rng(3))
    assert [(r.arrival, r.output_len) for r in plain] == [(r.arrival, r.output_len) for r in mixed]  # drawn last
    assert [r.tenant for r in mixed] == [r.tenant for r in again]
    assert 0.65 < sum(r.tenant == "a" for r in mixed) / 400 < 0.85 and all(r.tenant is None for r in plain)
    with pytest.raises(ConfigError, match="tenants"):
        parse_workload({**base, "tenants": {"a": -1}})


@pytest.mark.parametrize("fmt", ["generic_csv", "generic_jsonl"])
def test_generic_traces_read_tenant_and_adapter_columns(tmp_path, fmt):
    rows = [(0.0, 10, 2, "acme", "l1"), (0.5, 12, 3, None, None), (1.0, 8, 1, 7, "l2")]
    if fmt == "generic_csv":
        path = tmp_path / "t.csv"
        pd.DataFrame(rows, columns=["arrival_s", "prompt_len", "output_len", "tenant", "adapter"]).to_csv(
            path, index=False)
    else:
        path = tmp_path / "t.jsonl"
        path.write_text("\n".join(pd.Series(dict(zip(["arrival_s", "prompt_len", "output_len", "tenant", "adapter"],
                                                     r))).to_json() for r in rows))
    cfg = parse_workload({"trace": {"format": fmt, "path": str(path)}})
    reqs = build_requests(cfg, np.random.default_rng(0))
    assert [(r.tenant, r.adapter) for r in reqs] == [("acme", "l1"), (None, None), ("7", "l2")]


def test_tenant_metrics_only_with_tenants():
    from cbsim.api import run_experiment
    base = {"name": "t", "seed": 0, "model": "llama-3-8b", "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1},
            "cluster": {"replicas": 1, "kv_cache": {"block_size": 16, "num_blocks": 2000}},
            "policy": {"name": "sarathi", "token_budget": 512, "queue_policy": "fair"},
            "workload": {"num_requests": 60, "arrival": {"type": "poisson", "rate": 20.0},
                         "prompt_len": {"type": "fixed", "value": 300}, "output_len": {"type": "fixed", "value": 20}},
            "output": {"plots": False, "trace": False}}
    plain = run_experiment(base)
    assert "tenant" not in plain.requests.columns and "num_tenants" not in plain.summary
    tenants = run_experiment({**base, "workload": {**base["workload"], "tenants": {"a": 1, "b": 1}}})
    s = tenants.summary
    assert set(tenants.requests["tenant"]) == {"a", "b"} and s["num_tenants"] == 2
    assert 0.5 <= s["tenant_jain_index"] <= 1.0
    assert s["tenant_ttft_p99_worst"] >= s["tenant_ttft_p99_best"] > 0


def test_jain_index_and_tenant_summary_by_hand():
    assert jain_index([1, 1, 1]) == 1.0 and jain_index([1, 0]) == 0.5 and np.isnan(jain_index([]))
    df = pd.DataFrame({"tenant": ["a", "a", "b"], "status": ["finished"] * 3, "arrival": [0.0, 0.0, 1.0],
                       "completion_time": [2.0, 5.0, 4.0], "prompt_len": [10, 10, 10], "output_len": [5, 5, 5],
                       "ttft": [0.5, 1.0, 3.0]})
    out = tenant_summary(df)  # window [1, 4]: a finished 15 tokens in it (at 2), b 15 (at 4)
    assert out == {"num_tenants": 2, "tenant_jain_index": 1.0, "tenant_ttft_p99_worst": 3.0,
                   "tenant_ttft_p99_best": pytest.approx(0.995)}
    assert tenant_summary(df.drop(columns="tenant")) == {}


# ---------------------------------------------------------------- properties

FAIR_SARATHI = st.builds(
    lambda b, k, p, c, w, q, bucket: {
        "name": "sarathi", "token_budget": b, "max_num_seqs": k, "max_num_partial_prefills": p,
        "max_long_partial_prefills": 1, "chunk_size": c, "strict_fcfs": False, "queue_policy": "fair",
        "tenant_weights": {"t0": w, "t1": 1.0}, "min_quantum": q,
        "token_buckets": [{"tenant": "t1", "rate": bucket, "burst": 200.0}] if bucket else None},
    st.integers(1, 96), st.integers(1, 8), st.integers(1, 3), st.one_of(st.none(), st.integers(1, 64)),
    st.sampled_from([0.5, 1.0, 3.0]), st.integers(0, 8), st.sampled_from([None, 5.0, 40.0]))


def tenant_requests(specs):
    t, out = 0.0, []
    for i, (gap, prompt, output, prio) in enumerate(specs):
        t += gap
        out.append(Request(i, round(t, 3), prompt, output, priority=prio, tenant=f"t{prio}" if prio < 2 else None))
    return out


@settings(max_examples=60, deadline=None)
@given(FAIR_SARATHI, WORKLOADS, ENGINE)
def test_fair_sarathi_keeps_budgets_and_finishes_every_request_once(policy, specs, engine):
    run = run_policy(policy, tenant_requests(specs), trace=True, max_model_len=MAX_MODEL_LEN, **engine)
    check_run(run, policy, engine)  # budgets every step, each request finished once or rejected, KV released
    cap = policy["chunk_size"]
    for _, plan, _ in run.policies[0].plans:
        assert cap is None or all(n <= cap for rid, n in plan.scheduled.items() if rid in plan.admitted)


FAIR_SGLANG = st.builds(
    lambda b, k, order, slack: {"name": "sglang", "token_budget": b, "max_num_seqs": k, "chunked_prefill_size": b,
                                "schedule_policy": order, "deadline_slack": slack, "ttft_deadline": 2.0},
    st.integers(16, 96), st.integers(1, 8), st.sampled_from(["fair", "fcfs", "routing_key"]),
    st.sampled_from([None, 0.5, 3.0]))


@settings(max_examples=40, deadline=None)
@given(FAIR_SGLANG, WORKLOADS, ENGINE)
def test_fair_sglang_keeps_budgets_and_finishes_every_request_once(policy, specs, engine):
    run = run_policy(policy, tenant_requests(specs), trace=True, max_model_len=MAX_MODEL_LEN, **engine)
    check_run(run, {**policy, "chunk_size": None}, engine)


@settings(max_examples=30, deadline=None)
@given(FAIR_SARATHI, WORKLOADS, ENGINE)
def test_fast_forward_changes_nothing_under_fair(policy, specs, engine):
    fast = run_policy(policy, tenant_requests(specs), max_model_len=MAX_MODEL_LEN, fast_forward=True, **engine)
    slow = run_policy(policy, tenant_requests(specs), max_model_len=MAX_MODEL_LEN, fast_forward=False, **engine)
    for a, b in zip(fast.requests, slow.requests):
        assert (a.status, a.first_token_time, a.completion_time) == (b.status, b.first_token_time, b.completion_time)


# ---------------------------------------------------------------- fair order beyond sarathi and sglang

OTHERS = {
    "prefill_first": {"name": "prefill_first", "token_budget": 36, "max_num_seqs": 4},  # whole prompts: 32 + 4 - 1
    "splitfuse": {"name": "splitfuse", "token_budget": 32, "max_num_seqs": 4},
    "chunked_only": {"name": "chunked_only", "token_budget": 32, "chunk_size": 32, "max_num_seqs": 4},
}


@pytest.mark.parametrize("name", sorted(OTHERS))
def test_fair_order_serves_a_light_tenant_before_a_flood_under_every_policy(name):
    config = OTHERS[name]
    fcfs = run_policy(config, flood())
    fair = run_policy({**config, "queue_policy": "fair"}, flood())
    light_fcfs, light_fair = ttfts(fcfs, "light"), ttfts(fair, "light")
    assert max(light_fair) < min(light_fcfs) / 2  # behind no more than a couple of heavy prompts
    assert all(r.status == Status.FINISHED for r in fair.requests)


FAIR_OTHERS = st.builds(
    lambda name, b, k, w, q, bucket: {
        **OTHERS[name], "token_budget": b, "max_num_seqs": k, "queue_policy": "fair",
        "tenant_weights": {"t0": w, "t1": 1.0}, "min_quantum": q,
        "token_buckets": [{"tenant": "t1", "rate": bucket, "burst": 200.0}] if bucket else None},
    st.sampled_from(sorted(OTHERS)), st.integers(16, 96), st.integers(1, 8), st.sampled_from([0.5, 1.0, 3.0]),
    st.integers(0, 8), st.sampled_from([None, 5.0, 40.0]))


@settings(max_examples=60, deadline=None)
@given(FAIR_OTHERS, WORKLOADS, ENGINE)
def test_fair_prefill_first_splitfuse_chunked_only_keep_budgets_and_finish_every_request_once(policy, specs, engine):
    if policy["name"] == "chunked_only":
        policy = {**policy, "chunk_size": policy["token_budget"]}
    run = run_policy(policy, tenant_requests(specs), trace=True, max_model_len=MAX_MODEL_LEN, **engine)
    check_run(run, policy, engine)


# ---------------------------------------------------------------- strict token buckets

def bucket_state(waiting, running=(), now=0.0):
    state = SchedulerState(kv=KVCache(1000, 16, 0, False, 1.0), max_model_len=4096, now=now)
    state.waiting = deque(waiting)
    state.running = list(running)
    return state


@pytest.mark.parametrize("name", ["sarathi", "splitfuse", "prefill_first", "chunked_only"])
def test_a_strict_bucket_leaves_its_tenant_idle_until_it_refills(name):
    """Tenant a: 8 tokens/s, burst 16, 16-token prompts. At t = 0 one prompt empties the bucket; at
    t = 1 (the first one gone) it holds 8: strict mode plans nothing and names t = 2, when it holds
    16 again; work-conserving admits the prompt at once; at t = 2 strict admits it."""
    options = {"name": name, "token_budget": 64, "queue_policy": "fair",
               "token_buckets": [{"tenant": "a", "rate": 8.0, "burst": 16.0}]}
    for mode, at_one in (("strict", None), ("work_conserving", [1])):
        policy = make_policy({**options, "token_bucket_mode": mode})
        r0, r1 = (Request(i, 0.0, 16, 4, tenant="a") for i in range(2))
        first = policy.schedule(bucket_state([r0, r1]))
        assert first.admitted == (0,) and first.idle_until is None
        later = policy.schedule(bucket_state([r1], now=1.0))
        assert list(later.admitted) == (at_one or [])
        if mode == "strict":
            assert later.is_empty and later.idle_until == pytest.approx(2.0)
            assert policy.schedule(bucket_state([r1], now=2.0)).admitted == (1,)


def test_strict_buckets_reject_a_prompt_larger_than_the_burst():
    reqs = [Request(0, 0.0, 40, 2, tenant="a"), Request(1, 0.0, 40, 2, tenant="b")]
    run_policy({"name": "sarathi", "queue_policy": "fair", "token_bucket_mode": "strict",
                "token_buckets": [{"tenant": "a", "rate": 8.0, "burst": 16.0}]}, reqs)
    assert reqs[0].status == Status.REJECTED and "burst 16" in reqs[0].reject_reason
    assert reqs[1].status == Status.FINISHED


def replica_honours_idle_until() -> bool:
    import inspect

    from cbsim.sim import replica
    return "idle_until" in inspect.getsource(replica)


@pytest.mark.skipif(not replica_honours_idle_until(), reason="sim/replica.py does not read StepPlan.idle_until "
                    "yet (the lead wires it: sleep until then, or until an arrival wakes the replica)")
def test_strict_bucket_end_to_end_the_replica_sleeps_until_the_refill():
    reqs = [Request(i, 0.0, 16, 1, tenant="a") for i in range(3)]
    run_policy({"name": "sarathi", "token_budget": 64, "queue_policy": "fair", "token_bucket_mode": "strict",
                "token_buckets": [{"tenant": "a", "rate": 8.0, "burst": 16.0}]}, reqs)
    assert [r.first_scheduled for r in reqs] == [0.0, 2.0, 4.0]  # 16 tokens every 2 s, the replica idle between


def test_a_request_in_flight_under_pp_keeps_its_service_counted_once():
    # PP hides a request from `running` while its micro-batch is in flight (state.in_flight); the fair
    # queue must not count it as having left and then count it again when it returns
    req = Request(0, 0.0, 100, 10, tenant="a")
    req.num_computed_tokens = 100
    queue = FairQueue()
    kv = KVCache(100, 16)
    for running, in_flight in (([req], ()), ([], (req,)), ([req], ()), ([], (req,))):
        queue.observe(SchedulerState(kv, 1000, running=running, in_flight=in_flight))
        assert queue.counter["a"] == 100  # its service, once, whether it is in flight or not
