"""Replica mechanics: stale step entries, rejection, preemption modes and victims, KV admission."""
import simpy

from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.metrics.recorder import Recorder
from cbsim.sim.replica import Replica, ReplicaSettings
from cbsim.sim.request import Status

from factories import make_requests, run_policy


def test_a_stale_step_cannot_complete_a_preempted_request():
    env = simpy.Environment()
    replica = Replica(env, 0, make_policy({"name": "sarathi"}), load_cost_model({"type": "unit"}),
                      KVCache(100, 16), Recorder(), ReplicaSettings(max_model_len=1000), lambda: float("inf"))
    (req,) = make_requests([(0, 10, 1)])
    replica.enqueue(req)
    replica._take_arrivals(0.0)
    plan = replica.policy.schedule(replica.state)
    replica.begin(plan, 0.0)
    replica._preempt(req)  # e.g. evicted by an event between the step's start and end
    replica.state.running.remove(req)
    replica.commit(plan, 1.0)
    assert req.num_output_tokens == 0 and req.num_computed_tokens == 0
    assert req.status == Status.PREEMPTED and req.epoch == 1


def test_requests_that_can_never_run_are_rejected_with_a_reason():
    reqs = make_requests([(0, 900, 200), (0, 100, 10), (0, 400, 10)])
    run = run_policy({"name": "sarathi"}, reqs, max_model_len=1000, num_blocks=20, block_size=16)
    assert reqs[0].status == Status.REJECTED and "max_model_len" in reqs[0].reject_reason
    assert reqs[2].status == Status.REJECTED and "KV blocks" in reqs[2].reject_reason
    assert reqs[1].status == Status.FINISHED
    assert run.recorder.num_steps > 0


def test_whole_prompt_policies_reject_what_their_budget_can_never_hold():
    reqs = make_requests([(0, 300, 10)])
    run_policy({"name": "orca", "token_budget": 256}, reqs)
    assert reqs[0].status == Status.REJECTED and "token budget" in reqs[0].reject_reason


def test_recompute_preemption_prefills_prompt_and_output_again():
    # two long decoders on a cache that cannot hold both to the end
    reqs = make_requests([(0, 16, 60), (0, 16, 60)])
    run = run_policy({"name": "orca", "kv_reservation": "paged"}, reqs, num_blocks=8, block_size=16, trace=True)
    victim = max(reqs, key=lambda r: r.num_preemptions)
    assert victim.num_preemptions >= 1 and all(r.status == Status.FINISHED for r in reqs)
    recomputes = [plan.scheduled[victim.id] for _, plan, _ in run.policies[0].plans
                  if plan.scheduled.get(victim.id, 0) > 16]
    assert recomputes, "the victim's prompt and generated tokens are prefilled again"


def test_swap_preemption_charges_swap_bytes_and_keeps_progress():
    reqs = make_requests([(0, 16, 60), (0, 16, 60)])
    run = run_policy({"name": "orca", "kv_reservation": "paged"}, reqs, num_blocks=8, block_size=16,
                     preemption="swap", trace=True)
    steps = run.recorder.step_table()
    assert steps["swap_bytes"].sum() > 0
    victim = max(reqs, key=lambda r: r.num_preemptions)
    # swapped back in, it continues decoding: no step ever schedules more than one token for it
    assert max(plan.scheduled.get(victim.id, 0) for _, plan, _ in run.policies[0].plans[1:]) == 1


def test_lowest_priority_victim():
    reqs = make_requests([(0, 16, 60, 0), (0, 16, 60, 5)])  # the first admitted has the lower priority
    run_policy({"name": "orca", "kv_reservation": "paged"}, reqs, num_blocks=8, block_size=16,
               victim="lowest_priority")
    assert reqs[0].num_preemptions >= 1 and reqs[1].num_preemptions == 0


def test_reserve_full_prompt_blocks_admission_until_the_whole_prompt_fits():
    reqs = make_requests([(0, 16, 40), (0, 200, 2)])
    # 13 blocks of 16: the long prompt needs all 13 for its whole input, so while the first request
    # holds a block it can start chunk by chunk, but not whole
    plain = run_policy({"name": "sarathi", "token_budget": 32}, make_requests([(0, 16, 40), (0, 200, 2)]),
                       num_blocks=13, block_size=16)
    reserved = run_policy({"name": "sarathi", "token_budget": 32}, reqs, num_blocks=13, block_size=16,
                          reserve_full_prompt=True)
    assert plain.requests[1].first_scheduled == 0.0
    assert reserved.requests[1].first_scheduled > plain.requests[1].first_scheduled


def test_watermark_keeps_blocks_free_at_admission():
    reqs = make_requests([(0, 64, 2), (0, 64, 2)])
    run = run_policy({"name": "orca", "kv_reservation": "paged"}, reqs, num_blocks=9, block_size=16,
                     watermark_blocks=2, trace=True)
    first_plan = run.policies[0].plans[0][1]
    assert len(first_plan.admitted) == 1  # 5 + 5 blocks would leave less than the watermark
