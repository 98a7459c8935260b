"""sarathi and splitfuse admit no waiting request into a step that preempts, as vLLM V1's scheduler
(vllm/v1/core/sched/scheduler.py `schedule()`, 00024d31: `if not preempted_reqs and ...:` before the
waiting loop): the room a victim frees is not for a newcomer. Random workloads under tight KV (hypothesis),
every plan traced."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.sim.request import Request, Status
from factories import run_policy

POLICIES = [{"name": "sarathi", "token_budget": 48, "max_num_seqs": 6},
            {"name": "sarathi", "token_budget": 48, "max_num_seqs": 6, "long_prefill_token_threshold": 16},
            {"name": "splitfuse", "token_budget": 48, "max_num_seqs": 6, "min_chunk": 8}]
WORKLOADS = st.lists(st.tuples(st.sampled_from([0.0, 0.0, 0.5, 2.0]), st.integers(4, 120), st.integers(1, 80)),
                     min_size=2, max_size=12)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(range(len(POLICIES))), WORKLOADS, st.integers(12, 40), st.sampled_from(["recompute", "swap"]))
def test_a_preempting_step_admits_nobody(policy, specs, num_blocks, preemption):
    requests, t = [], 0.0
    for i, (gap, prompt, output) in enumerate(specs):
        t += gap
        requests.append(Request(i, t, prompt, output))
    run = run_policy(POLICIES[policy], requests, num_blocks=num_blocks, block_size=4, max_model_len=160,
                     preemption=preemption, trace=True, fast_forward=False)
    plans = [plan for p in run.policies for _, plan, _ in p.plans]
    assert not any(plan.preempted and plan.admitted for plan in plans)
    assert all(r.status in (Status.FINISHED, Status.REJECTED) for r in run.requests)


def test_the_rule_is_exercised():
    """Some plan of this workload preempts while a prompt waits (so the rule above has work to do)."""
    requests = [Request(i, 0.0, 60, 60) for i in range(6)]
    run = run_policy(POLICIES[0], requests, num_blocks=40, block_size=4, max_model_len=160, trace=True,
                     fast_forward=False)
    plans = [plan for p in run.policies for _, plan, _ in p.plans]
    assert any(plan.preempted for plan in plans) and not any(plan.preempted and plan.admitted for plan in plans)
