"""Admission signals (issue 15): SGLang's reserve for the running requests' future
decode KV (new_token_ratio) and the TPOT step-time cap; each off by default."""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cbsim.api import run_experiment
from cbsim.core.errors import ConfigError
from cbsim.policies.batch import BatchBuilder
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.admission import DecodeReserve
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.request import Request, Status
from cbsim.sim.state import SchedulerState

from factories import run_policy
from test_invariants import MAX_MODEL_LEN, POLICIES, WORKLOADS, to_requests

KV_PRESSURE = "experiments/regression/sarathi_kv_recompute.yaml"


# -- the ratio ------------------------------------------------------------------------------
def test_ratio_starts_decays_and_floors_as_sglang():
    reserve = DecodeReserve()
    assert reserve.ratio == reserve.init == 0.7 and reserve.min == pytest.approx(0.098)
    assert reserve.decay == pytest.approx((0.7 - 0.098) / 600)
    reserve.after_step(preempted=False, decoded=True, running=[])
    assert reserve.ratio == pytest.approx(0.7 - reserve.decay)
    reserve.after_step(preempted=False, decoded=False, running=[])  # a prefill-only step: no decay
    assert reserve.ratio == pytest.approx(0.7 - reserve.decay)
    reserve.decay_steps(10_000)
    assert reserve.ratio == reserve.min
    assert DecodeReserve(conservativeness=2.0).init == 1.0  # min(0.7 x 2, 1)


def test_ratio_jumps_after_a_preemption_to_the_running_requests_progress():
    # two kept requests: 30 and 10 outputs of 100 and 50: (40 + 20 x 2) / (150 + 1)
    kept = [Request(0, 0.0, 8, 100, num_output_tokens=30), Request(1, 0.0, 8, 50, num_output_tokens=10)]
    reserve = DecodeReserve()
    reserve.decay_steps(600)
    reserve.after_step(preempted=True, decoded=True, running=kept)
    assert reserve.ratio == pytest.approx(80 / 151)
    reserve.after_step(preempted=True, decoded=True, running=[Request(2, 0.0, 8, 10, num_output_tokens=9)])
    assert reserve.ratio == 1.0  # (9 + 20) / 11, capped


# -- the reserve stops an admission plain free blocks allow -----------------------------------
def reserve_state(output_len, reserve=True):
    """20 blocks of 16; a running decode R (64 computed tokens in 4 blocks, 1 of `output_len` outputs)
    and a waiting prompt W of 64 tokens (4 blocks) with 10 outputs."""
    kv = KVCache(20, 16, 0, False, 1000.0)
    running = Request(0, 0.0, 64, output_len, num_computed_tokens=64, num_output_tokens=1,
                      status=Status.RUNNING, admit_seq=0)
    kv.grow(running, 4)
    state = SchedulerState(kv=kv, max_model_len=4096, reserve=DecodeReserve() if reserve else None)
    state.running.append(running)
    waiting = Request(1, 0.0, 64, 10)
    state.waiting.append(waiting)
    return state, running, waiting


def test_the_reserve_refuses_what_free_blocks_allow():
    # free 16 blocks; W takes 4 and needs 1 more for its own 64 + 10 tokens; R reserves 0.7 x 299 =
    # 209.3 tokens: 14 blocks, 4 + 1 + 14 > 16
    state, _, waiting = reserve_state(300, reserve=False)
    assert BatchBuilder(state, 512, 8).admit(waiting, 64)
    state, _, waiting = reserve_state(300)
    assert not BatchBuilder(state, 512, 8).admit(waiting, 64)
    # R with 199 outputs left reserves 139.3 tokens: 9 blocks, 4 + 1 + 9 <= 16
    state, _, waiting = reserve_state(200)
    b = BatchBuilder(state, 512, 8)
    assert b.admit(waiting, 64) and b.reserved_tokens == pytest.approx(0.7 * 199 + 10)  # W reserves its 10 outputs


def test_a_victim_gives_back_its_reserve():
    state, running, waiting = reserve_state(300)
    b = BatchBuilder(state, 512, 8)
    b._preempt(running)
    assert b.reserved_tokens == 0 and b.admit(waiting, 64)


def test_a_request_whose_kv_is_here_already_needs_no_reserve():
    # P/D decode side: a landed request holds its prompt's blocks; R's reserve (14 blocks of the 11 free)
    # keeps a new prompt out but not it
    state, _, waiting = reserve_state(300)
    landed = Request(2, 0.0, 64, 10, num_computed_tokens=64, num_output_tokens=1, status=Status.WAITING)
    state.kv.grow(landed, 5)
    state.waiting.appendleft(landed)
    b = BatchBuilder(state, 512, 8)
    assert not b.admit(waiting, 64) and b.admit(landed, 1)


def test_a_request_alone_is_admitted_whatever_its_reserve():
    # 4 blocks of 16 and a prompt of 1 token with 63 outputs: its whole life fits (4 blocks), so the
    # reserve of its own outputs never keeps it out (nor does static's max_len reservation count twice)
    kv = KVCache(4, 16, 0, False, 1000.0)
    state = SchedulerState(kv=kv, max_model_len=4096, reserve=DecodeReserve())
    lone = Request(0, 0.0, 1, 63)
    state.waiting.append(lone)
    assert BatchBuilder(state, 512, 8).admit(lone, 1)
    assert BatchBuilder(state, 512, 8).admit(lone, 1, reserve_tokens=64)


def test_the_reserve_cuts_preemptions_on_the_kv_pressure_scenario():
    # sarathi, 1000 blocks, 200 requests at 8/s: 345 recompute preemptions (271,361 tokens prefilled
    # again) and 1253.7 tokens/s without the reserve, none and 1441.3 tokens/s with it
    over = ["workload.num_requests=200"]
    plain = run_experiment(KV_PRESSURE, overrides=over).summary
    reserved = run_experiment(KV_PRESSURE, overrides=over + ["admission.decode_reserve=true"]).summary
    assert reserved["num_preemptions"] * 10 < plain["num_preemptions"]
    assert reserved["num_recomputed_tokens"] * 10 < plain["num_recomputed_tokens"]
    assert reserved["throughput_tokens_per_s"] > plain["throughput_tokens_per_s"]


def test_defaults_leave_every_signal_off():
    state = run_experiment(KV_PRESSURE, overrides=["workload.num_requests=20"]).config.admission
    assert not state.decode_reserve and state.tpot_slack is None


# -- TPOT slack -----------------------------------------------------------------------------
def cap_state(decoding=True, cap=0.05):
    """A running request (decoding, or mid-prompt) and a waiting prompt of 64 tokens; each step costs
    1 ms per token (linear cost model)."""
    kv = KVCache(100, 16, 0, False, 1000.0)
    outputs = 1 if decoding else 0
    running = Request(0, 0.0, 32, 10, num_computed_tokens=32 if decoding else 16, num_output_tokens=outputs,
                      status=Status.RUNNING, admit_seq=0)
    kv.grow(running, 3)
    state = SchedulerState(kv=kv, max_model_len=4096, step_cap=cap,
                           step_time=load_cost_model({"type": "linear", "base": 0.0, "per_token": 0.001}).step_time)
    state.running.append(running)
    waiting = Request(1, 0.0, 64, 10)
    state.waiting.append(waiting)
    return state, running, waiting


def test_tpot_slack_refuses_a_prefill_that_would_stretch_the_decodes_step():
    state, running, waiting = cap_state()
    b = BatchBuilder(state, 512, 8)
    b.schedule_decodes(state.running)
    assert not b.admit(waiting, 64)  # 1 + 64 tokens: 65 ms > 50 ms
    assert b.admit(waiting, 40)  # 41 ms


def test_tpot_slack_lets_anything_in_when_nobody_decodes():
    state, _, waiting = cap_state(decoding=False)
    assert BatchBuilder(state, 512, 8).admit(waiting, 64)


def test_tpot_slack_needs_a_tpot_objective():
    with pytest.raises(ConfigError, match="tpot_slack"):
        run_experiment(KV_PRESSURE, overrides=["admission.tpot_slack=0.5", "metrics.slo.tpot=null",
                                               "workload.num_requests=5"])


def test_tpot_slack_keeps_every_step_that_admits_beside_decodes_under_the_cap():
    # 1 ms per token, cap 40 ms: a step that admits a request while others decode stays within it;
    # chunks of prompts already running are the policy's (sarathi's budget of 96 here), not gated
    specs = [(0.0, 150, 30), (0.01, 20, 30), (0.02, 90, 5), (0.05, 60, 20), (0.3, 120, 10), (0.31, 10, 10)]
    run = run_policy({"name": "sarathi", "token_budget": 96, "max_num_seqs": 8},
                     [Request(i, t, p, o) for i, (t, p, o) in enumerate(specs)], trace=True, fast_forward=False,
                     cost={"type": "linear", "base": 0.0, "per_token": 0.001}, settings={"step_cap": 0.04})
    steps = run.recorder.step_table()
    durations = steps["end"] - steps["start"]
    gated = [i for i, (_, plan, decoding) in enumerate(run.policies[0].plans)
             if plan.admitted and set(plan.scheduled) & decoding]
    assert gated and all(durations[i] <= 0.04 + 1e-12 for i in gated)
    assert durations.max() > 0.04  # a running prompt's chunk may still take the whole budget
    assert all(r.status == Status.FINISHED for r in run.requests)


# -- fast-forward is still exact ----------------------------------------------------------------
@pytest.mark.slow
@given(POLICIES, WORKLOADS, st.integers(4, 120), st.sampled_from(["recompute", "swap"]), st.booleans(),
       st.sampled_from([None, 0.05]))
def test_fast_forward_changes_nothing_with_the_signals_on(policy, specs, num_blocks, mode, reserve, cap):
    extra = {"decode_reserve": reserve, "step_cap": cap, "swapped_queue": "vllm_v0"}
    cost = {"type": "linear", "base": 0.01, "per_token": 0.001}
    runs = [run_policy(policy, to_requests(specs), max_model_len=MAX_MODEL_LEN, fast_forward=ff, cost=cost,
                       num_blocks=num_blocks, preemption=mode, settings=extra) for ff in (True, False)]
    for a, b in zip(runs[0].requests, runs[1].requests):
        assert (a.status, a.first_token_time, a.completion_time, a.num_preemptions) == \
            (b.status, b.first_token_time, b.completion_time, b.num_preemptions)
    fs, ss = runs[0].recorder.step_table(), runs[1].recorder.step_table()
    for name in fs:
        assert np.array_equal(fs[name], ss[name]), name


# -- P/D backpressure -------------------------------------------------------------------------
class PendingAtPlan:
    """A prefill policy that notes, per plan, the hand-offs waiting for decode room and what it admitted."""

    def __init__(self, inner, box):
        self.inner, self.box, self.log = inner, box, []
        self.name, self.config, self.steady_when_blocked = inner.name, inner.config, inner.steady_when_blocked

    def schedule(self, state):
        plan = self.inner.schedule(state)
        self.log.append((len(self.box["cluster"].pending), plan.admitted))
        return plan

    def reject_reason(self, req, state):
        return self.inner.reject_reason(req, state)


def run_backpressured(limit):
    """One prefill replica (sarathi, 32 tokens a step, 1 s a step) feeding a decode replica whose 40
    blocks of 4 tokens hold about two of the requests (prompt 40, 20 outputs) at a time."""
    from cbsim.policies import make_policy
    from cbsim.sim.pd import PoolParts
    from cbsim.sim.replica import ReplicaSettings

    from factories import make_requests, run_pd_cluster

    reqs = make_requests([(0.1 * i, 40, 20) for i in range(12)])
    cost = load_cost_model({"type": "unit"})
    settings = ReplicaSettings(max_model_len=10_000, swap_bandwidth=1e9, pd_backpressure=limit)
    box, policies = {}, []

    def prefill_policy():
        policies.append(PendingAtPlan(make_policy({"name": "sarathi", "token_budget": 32}), box))
        return policies[-1]

    prefill = PoolParts(1, prefill_policy, cost, lambda: KVCache(1000, 4, 0, True, 1.0), settings)
    decode = PoolParts(1, lambda: make_policy({"name": "sarathi", "token_budget": 32}), cost,
                       lambda: KVCache(40, 4, 0, False, 1.0), settings)
    _, _, cluster = run_pd_cluster(reqs, prefill, decode, check=lambda replicas, c: box.setdefault("cluster", c))
    assert all(r.status == Status.FINISHED for r in reqs)
    return policies[0].log, cluster


def test_pd_backpressure_pauses_prefill_admissions_while_the_transfer_queue_is_full():
    free_log, free_cluster = run_backpressured(None)
    held_log, held_cluster = run_backpressured(2)
    assert max(pending for pending, _ in free_log) > 2  # unchecked, prefill runs ahead of decode room
    assert all(pending < 2 for pending, admitted in held_log if admitted)  # no admission at 2 waiting
    waits = [rec.reserved - rec.prefilled for rec in held_cluster.records.values()]
    free_waits = [rec.reserved - rec.prefilled for rec in free_cluster.records.values()]
    assert max(waits) < max(free_waits)  # prefilled KV waits less for decode room


# -- overload: SGLang's max_queued_requests -------------------------------------------------------
def test_a_full_queue_rejects_arrivals():
    from cbsim.sim.admission import REASON_PREFIX, queue_full_reason

    assert queue_full_reason(1, 2) == "" and queue_full_reason(2, 2).startswith(REASON_PREFIX)
    # five prompts at t=0 and one at t=5 (unit cost: 1 s a step; 100 tokens a step): two may wait,
    # the other three arriving with them are rejected; the late one finds the queue empty again
    reqs = [Request(i, 0.0, 100, 2) for i in range(5)] + [Request(5, 5.0, 100, 2)]
    run = run_policy({"name": "sarathi", "token_budget": 100, "max_num_seqs": 1}, reqs,
                     settings={"max_queued_requests": 2})
    assert [r.status for r in run.requests] == [Status.FINISHED] * 2 + [Status.REJECTED] * 3 + [Status.FINISHED]
    assert "request queue is full" in run.requests[2].reject_reason


def test_max_queued_requests_counts_as_admission_rejections():
    res = run_experiment(KV_PRESSURE, overrides=["admission.max_queued_requests=4", "workload.num_requests=200"])
    s = res.summary
    assert s["num_rejected_admission"] == s["num_rejected"] > 0
