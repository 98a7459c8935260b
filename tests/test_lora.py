"""vLLM's --max-loras (policies/lora.py): a step serves at most max_loras LoRA adapters; a waiting
request whose adapter does not fit is skipped, later ones may start, base-model requests never wait."""
from __future__ import annotations

import pytest
from factories import run_policy
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.errors import ConfigError
from cbsim.policies import make_policy
from cbsim.sim.request import Request, Status

SARATHI = {"name": "sarathi", "token_budget": 64, "max_num_seqs": 8}


def requests(specs):
    """(arrival, prompt, output, adapter) -> Requests, ids in order."""
    return [Request(i, a, p, o, adapter=ad) for i, (a, p, o, ad) in enumerate(specs)]


def first_steps(run):
    """request id -> the index of the plan that first scheduled it."""
    seen = {}
    for index, (_, plan, _) in enumerate(run.policies[0].plans):
        for rid in plan.scheduled:
            seen.setdefault(rid, index)
    return seen


def test_a_request_whose_adapter_does_not_fit_is_skipped_and_later_ones_start():
    reqs = requests([(0.0, 8, 6, "a"), (0.5, 8, 2, "b"), (0.5, 8, 2, "a"), (0.5, 8, 2, None)])
    run = run_policy({**SARATHI, "max_loras": 1}, reqs, trace=True)
    first = first_steps(run)
    # step 0 admits 0 (adapter a); at t=1 the 'b' request is skipped, 'a' and the base one join
    assert first[2] == first[3] == 1 and first[1] > first[2]
    assert first[1] > max(i for i, (_, plan, _) in enumerate(run.policies[0].plans) if 0 in plan.scheduled)
    assert all(r.status == Status.FINISHED for r in reqs)
    unlimited = first_steps(run_policy(SARATHI, requests([(0.0, 8, 6, "a"), (0.5, 8, 2, "b"), (0.5, 8, 2, "a"),
                                                             (0.5, 8, 2, None)]), trace=True))
    assert unlimited[1] == 1  # without the limit 'b' joins at once


ADAPTERS = st.sampled_from([None, "a", "b", "c"])
WORKLOAD = st.lists(st.tuples(st.floats(0, 3, allow_nan=False), st.integers(1, 60), st.integers(1, 12), ADAPTERS),
                    min_size=1, max_size=14)


@settings(max_examples=60, deadline=None)
@given(WORKLOAD, st.integers(1, 3), st.integers(8, 96), st.booleans())
def test_no_step_serves_more_adapters_than_max_loras(specs, max_loras, budget, fair):
    specs = sorted(specs)
    policy = {**SARATHI, "token_budget": budget, "max_loras": max_loras}
    if fair:
        policy["queue_policy"] = "fair"
    reqs = requests(specs)
    run = run_policy(policy, reqs, trace=True, num_blocks=400, block_size=4)
    adapter = {r.id: r.adapter for r in reqs}
    for _, plan, _ in run.policies[0].plans:
        served = {adapter[rid] for rid in plan.scheduled} - {None}
        assert len(served) <= max_loras
    assert all(r.status == Status.FINISHED for r in reqs)


def test_max_loras_must_be_positive():
    with pytest.raises(ConfigError, match="max_loras"):
        make_policy({"name": "sarathi", "max_loras": 0})
