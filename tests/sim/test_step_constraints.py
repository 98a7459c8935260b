"""Every constraint family at once (vLLM V1's schedule(), arrival admission), over every policy
(hypothesis): token and sequence budgets, the encoder budget (exact accounting, compute and cache),
LoRA adapters per step, tenant quotas and the overload state at arrival; every request finishes once
or is rejected with a reason."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.sim.request import Request, Status

from test_encoder_budget import POLICIES, cached, needed, run_snapshots


@st.composite
def requests(draw):
    out = []
    for i in range(draw(st.integers(1, 16))):
        prompt = draw(st.integers(1, 80))
        images = []
        if draw(st.booleans()):
            start = draw(st.integers(0, prompt - 1))
            images.append((start, draw(st.integers(1, min(20, prompt - start)))))
        out.append(Request(i, draw(st.floats(0, 8, allow_nan=False)), prompt, draw(st.integers(1, 6)),
                           tenant=draw(st.sampled_from(["a", "b", None])),
                           adapter=draw(st.sampled_from(["x", "y", "z", None])), mm_inputs=tuple(images) or None))
    out.sort(key=lambda r: r.arrival)
    for i, r in enumerate(out):
        r.id = i
    return out


@settings(max_examples=80, deadline=None)
@given(requests(), st.sampled_from(POLICIES), st.integers(24, 96), st.integers(1, 6), st.integers(1, 2),
       st.integers(2, 8), st.integers(20, 40))
def test_all_constraints_hold_together(reqs, name, budget, seqs, max_loras, max_requests, encoder_budget):
    if name in ("static", "orca"):
        budget = max(budget, 85)  # whole prompts: prompt + output - 1 fits a step
    policy = {"name": name, "token_budget": budget, "max_num_seqs": seqs, "max_loras": max_loras,
              "lora_residency": {"adapter_bytes": 1e6, "pcie_bandwidth_gb_s": 1.0},
              "encoder": {"seconds_per_token": 0.001, "max_num_encoder_input_tokens": encoder_budget},
              "tenant_quotas": [{"tenant": "a", "max_requests": max_requests}],
              "overload": {"enter_queued": 6, "exit_queued": 2}}
    if name == "chunked_only":
        policy["chunk_size"] = budget
    run = run_snapshots(policy, reqs, num_blocks=60, block_size=8, max_model_len=128)
    adapter = {r.id: r.adapter for r in reqs}
    for before, plan in run.steps:
        assert sum(plan.scheduled.values()) <= budget
        assert len(plan.scheduled) + len(plan.padding) <= seqs
        assert len({adapter[rid] for rid in plan.scheduled} - {None}) <= max_loras
        encoded = sum(needed(before[rid][2].mm_inputs or (), before[rid][0], n, before[rid][1] == Status.RUNNING)
                      for rid, n in plan.scheduled.items())
        assert plan.encoder_tokens == encoded <= encoder_budget
        held = sum(cached(req.mm_inputs or (), c) for rid, (c, s, req) in before.items()
                   if s == Status.RUNNING and rid not in plan.preempted)
        assert held + encoded <= encoder_budget  # the cache defaults to the compute budget
    for r in reqs:
        assert r.status in (Status.FINISHED, Status.REJECTED)
        assert (r.status == Status.REJECTED) == bool(r.reject_reason)
        if r.status == Status.FINISHED:
            assert r.num_output_tokens == r.output_len
    accepted_a = [r for r in reqs if r.tenant == "a" and r.status == Status.FINISHED]
    for r in accepted_a:
        assert sum(q.arrival <= r.arrival < q.completion_time for q in accepted_a) <= max_requests
