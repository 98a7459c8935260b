"""Preemption breadth (issue 15): swap space with a capacity (recompute when it is full), vLLM V0's
swapped queue, and the victim rules shortest_remaining and lowest_cache_value; a property test that
every budget, the host swap space included, holds at every step for every policy and option."""
import pytest
import simpy
from hypothesis import given
from hypothesis import strategies as st

from cbsim.policies import make_policy
from cbsim.policies.batch import BatchBuilder
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.metrics.recorder import Recorder
from cbsim.sim.replica import Replica, ReplicaSettings
from cbsim.sim.request import Request, Status
from cbsim.sim.state import SchedulerState

import factories
from factories import TracedPolicy, run_policy
from test_invariants import MAX_MODEL_LEN, POLICIES, WORKLOADS, check_run, to_requests

LINEAR = {"type": "linear", "base": 0.0, "per_token": 0.001}
BLOCK_BYTES = 16 * 1000  # block_size 16 x 1,000 bytes per token


def replica_with_running(specs, **settings):
    """A replica whose running requests hold (computed tokens, blocks) each, for direct _preempt calls."""
    env = simpy.Environment()
    replica = Replica(env, 0, make_policy({"name": "sarathi"}), load_cost_model(LINEAR),
                      KVCache(20, 16, 0, False, 1000.0), Recorder(),
                      ReplicaSettings(swap_bandwidth=1e12, max_model_len=1000, **settings), lambda: float("inf"))
    reqs = []
    for i, (computed, blocks) in enumerate(specs):
        req = Request(i, 0.0, computed, 10)
        replica.kv.grow(req, blocks)
        req.num_computed_tokens, req.status, req.admit_seq = computed, Status.RUNNING, i
        replica.state.running.append(req)
        replica.by_id[req.id] = req
        reqs.append(req)
    return replica, reqs


# -- swap space ----------------------------------------------------------------------------
def test_a_victim_that_does_not_fit_in_the_swap_space_is_recomputed():
    # 3 blocks of swap space (48,000 bytes); victims hold 2 blocks each: the first swaps (2 of 3),
    # the second would need 4 and recomputes, the third swaps once the first has swapped back in
    replica, (a, b, c) = replica_with_running([(32, 2), (32, 2), (32, 2)], preemption_mode="swap",
                                              swap_space=3 * BLOCK_BYTES)
    assert replica.swap_capacity_blocks == 3
    assert replica._preempt(a) == 2 * BLOCK_BYTES and a.status == Status.SWAPPED
    assert replica._preempt(b) == 0.0 and b.status == Status.PREEMPTED and b.num_computed_tokens == 0
    assert replica.kv.host_blocks == 2 and replica.swap_full_recomputes == 1
    replica.kv.drop_host_copy(a)  # a swaps back in (Replica._admit)
    assert replica._preempt(c) == 2 * BLOCK_BYTES and c.status == Status.SWAPPED
    assert [row[3] for row in replica.preemption_log] == ["swap", "recompute", "swap"]


def test_swap_space_is_sized_in_blocks_like_vllm_v0():
    replica, _ = replica_with_running([], preemption_mode="swap", swap_space=4 * 2**30)
    assert replica.swap_capacity_blocks == 4 * 2**30 // BLOCK_BYTES  # num_cpu_blocks = swap bytes // block bytes
    unbounded, _ = replica_with_running([], preemption_mode="swap")
    assert unbounded.swap_capacity_blocks is None


def test_swap_space_full_on_the_kv_pressure_scenario():
    from cbsim.api import run_experiment

    path = "experiments/regression/sarathi_kv_swap.yaml"
    small = run_experiment(path, overrides=["preemption.swap_space_gib=0.1", "workload.num_requests=200"]).summary
    big = run_experiment(path, overrides=["preemption.swap_space_gib=4", "workload.num_requests=200"]).summary
    assert big["num_recompute_preemptions"] == 0 and big["num_swap_preemptions"] > 0
    assert small["num_recompute_preemptions"] > 0 and small["num_swap_preemptions"] > 0


# -- swapped queue -------------------------------------------------------------------------
def test_swapped_victims_rejoin_the_head_latest_first_by_default():
    replica, (a, b, c) = replica_with_running([(32, 2), (32, 2), (32, 2)], preemption_mode="swap")
    for req in (a, b, c):
        replica._preempt(req)
    assert [r.id for r in replica.waiting] == [2, 1, 0]


def test_vllm_v0_swapped_queue_is_fifo_ahead_of_recompute_victims():
    # a and b swap (FIFO: a first), c does not fit in the swap space and is recomputed: it waits
    # behind the swapped requests, as vLLM V0's waiting queue waits behind self.swapped
    replica, (a, b, c) = replica_with_running([(32, 2), (32, 2), (32, 2)], preemption_mode="swap",
                                              swapped_queue="vllm_v0", swap_space=4 * BLOCK_BYTES)
    replica.waiting.append(Request(9, 0.0, 8, 4))
    for req in (a, b, c):
        replica._preempt(req)
    assert [r.status for r in (a, b, c)] == [Status.SWAPPED, Status.SWAPPED, Status.PREEMPTED]
    assert [r.id for r in replica.waiting] == [0, 1, 2, 9]


def swapped_state():
    """A waiting queue [swapped S (2 blocks on the host), new N] and one running decode R."""
    kv = KVCache(20, 16, 0, False, 1000.0)
    running = Request(0, 0.0, 16, 10, num_computed_tokens=16, num_output_tokens=1, status=Status.RUNNING, admit_seq=0)
    kv.grow(running, 2)
    swapped = Request(1, 0.0, 20, 10, num_computed_tokens=24, num_output_tokens=5, status=Status.SWAPPED)
    swapped.num_swapped_blocks, kv.host_blocks = 2, 2
    new = Request(2, 0.0, 16, 4)
    state = SchedulerState(kv=kv, max_model_len=1000, swapped_first=True)
    state.running.append(running)
    state.waiting.extend([swapped, new])
    return state, running, swapped, new


def test_vllm_v0_admits_no_prompt_while_a_request_is_swapped_out():
    state, _, swapped, new = swapped_state()
    b = BatchBuilder(state, 100, 10)
    assert not b.admit(new, 16)
    assert b.admit(swapped, 1)  # swaps in: its need is one decode token
    state.swapped_first = False
    assert BatchBuilder(state, 100, 10).admit(new, 16)


def test_vllm_v0_swaps_nothing_in_during_a_step_that_preempts():
    state, running, swapped, _ = swapped_state()
    b = BatchBuilder(state, 100, 10)
    b._preempt(running)
    assert not b.admit(swapped, 1)


# -- victims -------------------------------------------------------------------------------
def victim_state(rule, prefix=False):
    """Running: 0 (admitted first, priority 2, 90 of 100 outputs, 149 computed), 1 (priority 0, 5 of 20
    outputs, 59 computed), 2 (priority 1, 10 of 200 outputs, 39 computed), 3 (the requester, admitted
    last, priority 1, 1 of 50 outputs, 69 computed)."""
    kv = KVCache(64, 16, 0, False, 1000.0, prefix_caching=prefix)
    rows = [(60, 100, 90, 2), (55, 20, 5, 0), (30, 200, 10, 1), (69, 50, 1, 1)]
    state = SchedulerState(kv=kv, max_model_len=1000, victim=rule)
    for i, (prompt, output, outputs, priority) in enumerate(rows):
        req = Request(i, 0.0, prompt, output, priority=priority, num_computed_tokens=prompt + outputs - 1,
                      num_output_tokens=outputs, status=Status.RUNNING, admit_seq=i)
        kv.grow(req, kv.blocks_for(req.num_computed_tokens))
        state.running.append(req)
    return state


@pytest.mark.parametrize("rule, victim", [
    ("last_admitted", 2),  # the last admitted among the others (never the requester)
    ("lowest_priority", 1),  # priority 0
    ("shortest_remaining", 0),  # 10 outputs left
    ("lowest_cache_value", 2),  # 39 computed tokens (request 1: 59)
])
def test_each_victim_rule_picks_its_request(rule, victim):
    state = victim_state(rule)
    b = BatchBuilder(state, 100, 10)
    assert b._pick_victim(state.running[3]).id == victim


def test_a_requester_that_scores_lowest_preempts_itself():
    state = victim_state("shortest_remaining")
    state.running[3].output_len = 2  # one output left: itself
    assert BatchBuilder(state, 100, 10)._pick_victim(state.running[3]) is None


def test_lowest_cache_value_discounts_a_shared_cached_prefix():
    # request 2 holds 39 computed tokens and request 1 holds 59; with 48 of request 1's tokens in cached
    # prefix units it holds (they stay cached after a preemption), request 1 costs 11 tokens to rebuild
    state = victim_state("lowest_cache_value", prefix=True)
    one = state.running[1]
    one.prefix_hashes = (11, 12, 13)
    state.kv.prefix.publish(one, one.num_computed_tokens)
    assert BatchBuilder(state, 100, 10).recompute_tokens(one) == 59 - 48
    assert BatchBuilder(state, 100, 10)._pick_victim(state.running[3]).id == 1


# -- every budget at every step, the swap space included --------------------------------------
SWAP_SPACES = st.sampled_from([None, 0, 1, 3, 8])  # in blocks of block_size x 1,024 bytes
OPTIONS = st.fixed_dictionaries({
    "num_blocks": st.integers(4, 120),
    "block_size": st.sampled_from([1, 4, 16]),
    "watermark_blocks": st.integers(0, 2),
    "preemption": st.sampled_from(["recompute", "swap", "auto"]),
    "victim": st.sampled_from(["last_admitted", "lowest_priority", "shortest_remaining", "lowest_cache_value"]),
    "cost": st.sampled_from([{"type": "unit"}, {"type": "linear", "base": 0.01, "per_token": 0.001,
                                                  "per_seq": 0.0005, "per_kv_token": 1e-5}]),
    "reserve_full_prompt": st.booleans(),
})
SIGNALS = st.fixed_dictionaries({
    "swap_blocks": SWAP_SPACES,
    "swapped_queue": st.sampled_from(["head", "vllm_v0"]),
    "decode_reserve": st.booleans(),
    "step_cap": st.sampled_from([None, 0.02, 0.2]),
})


class HostTracedPolicy(TracedPolicy):
    """Also keeps the host blocks in use before every plan."""

    def __init__(self, inner):
        super().__init__(inner)
        self.host = []

    def schedule(self, state):
        self.host.append(state.kv.host_blocks)
        return super().schedule(state)


@pytest.mark.slow
@given(POLICIES, WORKLOADS, OPTIONS, SIGNALS)
def test_budgets_and_swap_space_hold_with_every_option(policy, specs, engine, signals):
    swap_blocks = signals["swap_blocks"]
    extra = {"swapped_queue": signals["swapped_queue"], "decode_reserve": signals["decode_reserve"],
             "step_cap": signals["step_cap"],
             "swap_space": None if swap_blocks is None else swap_blocks * engine["block_size"] * 1024.0}
    factories.TracedPolicy, old = HostTracedPolicy, factories.TracedPolicy
    try:
        run = run_policy(policy, to_requests(specs), trace=True, max_model_len=MAX_MODEL_LEN, settings=extra,
                         **engine)
    finally:
        factories.TracedPolicy = old
    modes = {row[3] for row in run.replicas[0].preemption_log}  # swap, with recomputes where the space was full
    check_run(run, policy, {**engine, "preemption": "recompute" if "recompute" in modes else "swap"})
    traced = run.policies[0]
    if swap_blocks is not None:
        assert max(traced.host, default=0) <= swap_blocks
    assert run.replicas[0].kv.host_blocks == 0


SGLANG = st.builds(lambda b, c, order, mixed, k: {"name": "sglang", "token_budget": b, "chunked_prefill_size": c,
                                                  "schedule_policy": order, "enable_mixed_chunk": mixed,
                                                  "max_num_seqs": k},
                   st.integers(8, 96), st.one_of(st.none(), st.integers(8, 64)),
                   st.sampled_from(["fcfs", "lof", "random", "priority", "sjf"]), st.booleans(), st.integers(1, 8))


@pytest.mark.slow
@given(SGLANG, WORKLOADS, OPTIONS, SIGNALS)
def test_sglang_keeps_kv_and_swap_space_with_every_option(policy, specs, engine, signals):
    # SGLang has no swapped queue (the config refuses vllm_v0 with it); everything else applies
    swap_blocks = signals["swap_blocks"]
    extra = {"decode_reserve": signals["decode_reserve"], "step_cap": signals["step_cap"],
             "swap_space": None if swap_blocks is None else swap_blocks * engine["block_size"] * 1024.0}
    factories.TracedPolicy, old = HostTracedPolicy, factories.TracedPolicy
    try:
        run = run_policy(policy, to_requests(specs), trace=True, max_model_len=MAX_MODEL_LEN, settings=extra,
                         **engine)
    finally:
        factories.TracedPolicy = old
    steps = run.recorder.step_table()
    assert (steps["kv_blocks_used"] <= engine["num_blocks"]).all()
    assert max(run.policies[0].host, default=0) <= (swap_blocks if swap_blocks is not None else 1 << 60)
    assert run.replicas[0].kv.free_blocks == engine["num_blocks"] and run.replicas[0].kv.host_blocks == 0
    for req in run.requests:
        assert req.status in (Status.FINISHED, Status.REJECTED)
        if req.status == Status.FINISHED:
            assert req.num_output_tokens == req.output_len
