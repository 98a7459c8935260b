"""Arrival admission (policies/quotas.py): per-tenant quotas and the overload state
with hysteresis; every rejection carries its reason once and the gate counts it once."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.core.errors import ConfigError
from cbsim.policies import make_policy
from cbsim.sim.admission import REASON_PREFIX
from cbsim.sim.request import Request, Status

from factories import run_policy

POLICIES = ["static", "orca", "prefill_first", "sarathi", "splitfuse", "chunked_only", "sglang"]


def staggered(times, prompt=100, output=1, tenants=None):
    return [Request(i, t, prompt, output, tenant=None if tenants is None else tenants[i])
            for i, t in enumerate(times)]


def gate_of(run):
    return run.policies[0].inner.gate


def test_overload_state_enters_at_enter_and_leaves_only_at_exit():
    """One 100-token prefill per 1 s step. Arrivals every 0.1 s: r0 starts at once, r1-r3 queue, r4
    finds 3 queued and enters the overload state, r5-r9 are rejected with it. At 1.05 s two are
    queued: still overloaded (the band-less queue limit would accept); at 2.05 s one is: it clears."""
    times = [0.1 * i for i in range(10)] + [1.05, 2.05, 2.06]
    reqs = staggered(times)
    policy = {"name": "sarathi", "token_budget": 100, "overload": {"enter_queued": 3, "exit_queued": 1}}
    run = run_policy(policy, reqs, trace=True)
    rejected = [r.id for r in reqs if r.status == Status.REJECTED]
    assert rejected == [4, 5, 6, 7, 8, 9, 10]
    assert all(reqs[i].reject_reason.startswith(f"{REASON_PREFIX} overload") for i in rejected)
    assert reqs[11].status == reqs[12].status == Status.FINISHED
    gate = gate_of(run)
    assert gate.entries == 1 and gate.rejected == {"overload": 7, "quota": 0}
    # SGLang's band-less --max-queued-requests 3 accepts the 1.05 s arrival (2 queued)
    plain = staggered(times)
    run_policy({"name": "sarathi", "token_budget": 100}, plain, settings={"max_queued_requests": 3})
    assert plain[10].status == Status.FINISHED


@pytest.mark.parametrize("overload, reason", [
    ({"enter_queued_tokens": 200, "exit_queued_tokens": 0}, "200 prompt tokens queued"),
    # unit cost: a full 100-token chunk takes 1 s, so 200 queued prompt tokens predict 2 s
    ({"enter_predicted_ttft": 2.0, "exit_predicted_ttft": 0.5}, "2 s to prefill"),
])
def test_overload_by_queued_prompt_tokens_or_their_predicted_ttft(overload, reason):
    reqs = staggered([0.0, 0.1, 0.2, 0.3, 3.5], prompt=100)
    run_policy({"name": "sarathi", "token_budget": 100, "overload": overload}, reqs)
    assert [r.status for r in reqs] == [Status.FINISHED, Status.FINISHED, Status.FINISHED, Status.REJECTED,
                                        Status.FINISHED]
    assert reason in reqs[3].reject_reason


def test_tenant_quota_caps_requests_in_flight_and_other_tenants_pass():
    """Tenant a may have 2 requests waiting or running; its third and fourth arrivals at t = 0 are
    rejected, b's pass; once a's first two finish, a's later request is accepted."""
    tenants = ["a", "a", "a", "b", "a", "b", "a"]
    reqs = staggered([0, 0, 0, 0, 0, 0, 10.0], prompt=10, output=3, tenants=tenants)
    policy = {"name": "sarathi", "token_budget": 64, "tenant_quotas": [{"tenant": "a", "max_requests": 2}]}
    run = run_policy(policy, reqs, trace=True)
    assert [r.status == Status.REJECTED for r in reqs] == [False, False, True, False, True, False, False]
    assert "tenant 'a' has 2 requests in flight (max_requests 2)" in reqs[2].reject_reason
    assert gate_of(run).rejected == {"quota": 2, "overload": 0}


def test_tenant_quota_caps_tokens_in_flight():
    reqs = staggered([0, 0, 0], prompt=40, output=10, tenants=["a", "a", "a"])
    run_policy({"name": "orca", "tenant_quotas": [{"tenant": "a", "max_tokens": 120}]}, reqs)
    assert [r.status for r in reqs] == [Status.FINISHED, Status.FINISHED, Status.REJECTED]
    assert "100 tokens in flight, + 50 would exceed max_tokens 120" in reqs[2].reject_reason


@pytest.mark.parametrize("bad, key", [
    ({"overload": {}}, "enter_queued"),
    ({"overload": {"enter_queued": 3, "exit_queued": 3}}, "exit_queued"),
    ({"overload": {"enter_queued_tokens": 10, "exit_queued_tokens": 11}}, "exit_queued_tokens"),
    ({"overload": {"enter_predicted_ttft": 1.0, "exit_predicted_ttft": 1.0}}, "exit_predicted_ttft"),
    ({"overload": {"enter_predicted_ttft": 0}}, "enter_predicted_ttft"),
    ({"tenant_quotas": [{"tenant": "a"}]}, "max_requests"),
    ({"tenant_quotas": [{"tenant": "a", "max_requests": 0}]}, "max_requests"),
    ({"tenant_quotas": [{"tenant": "a", "max_requests": 1}, {"tenant": "a", "max_tokens": 9}]}, "tenant_quotas"),
])
def test_bad_admission_options_name_the_key(bad, key):
    with pytest.raises(ConfigError, match=key):
        make_policy({"name": "sarathi", **bad})


WORKLOAD = st.lists(st.tuples(st.floats(0, 6, allow_nan=False), st.integers(1, 80), st.integers(1, 8),
                              st.sampled_from(["a", "b", None])), min_size=1, max_size=30)


@settings(max_examples=60, deadline=None)
@given(WORKLOAD, st.sampled_from(POLICIES), st.integers(1, 4), st.integers(1, 6), st.booleans(),
       st.sampled_from([None, 1.5, 4.0]))
def test_quotas_and_overload_hold_and_count_each_rejection_once(specs, name, max_requests, enter, tokens_cap, ttft):
    specs = sorted(specs, key=lambda s: s[0])
    reqs = [Request(i, a, p, o, tenant=t) for i, (a, p, o, t) in enumerate(specs)]
    quota = {"tenant": "a", "max_requests": max_requests}
    if tokens_cap:
        quota["max_tokens"] = 200
    policy = {"name": name, "token_budget": 128, "tenant_quotas": [quota],
              "overload": {"enter_queued": enter, "exit_queued": enter - 1}}
    if ttft is not None:
        policy["overload"].update(enter_predicted_ttft=ttft, exit_predicted_ttft=ttft / 2)
    run = run_policy(policy, reqs, trace=True, num_blocks=400, block_size=8, max_model_len=256)
    assert all(r.status in (Status.FINISHED, Status.REJECTED) for r in reqs)
    accepted = [r for r in reqs if r.status == Status.FINISHED]
    for r in accepted:  # at each accepted arrival, tenant a's requests in flight (itself included) fit the quota
        if r.tenant == "a":
            live = [q for q in accepted if q.tenant == "a" and q.arrival <= r.arrival < q.completion_time]
            assert len(live) <= max_requests
            if tokens_cap:
                assert sum(q.prompt_len + q.output_len for q in live) <= 200
    gated = [r for r in reqs if r.reject_reason.startswith(f"{REASON_PREFIX} overload")
             or r.reject_reason.startswith(f"{REASON_PREFIX} tenant quota")]
    gate = gate_of(run)
    assert sum(gate.rejected.values()) == len(gated)
    assert gate.rejected["quota"] == sum("tenant quota" in r.reject_reason for r in gated)
