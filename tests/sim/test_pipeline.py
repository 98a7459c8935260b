"""Pipeline parallelism (sim/pipeline.py): a replica of P stages keeps up to P micro-batches in flight.

The cost models here are fakes that expose `pipeline_stages` (Staged: an inner model's step time
split evenly over P stages), so nothing depends on a real model's pricing of PP.

Checked: one stage through the pipelined loop is the plain loop, bit for bit; with P in {2, 4} and
every policy (hypothesis): the budgets of every micro-batch, KV within the cache, every request
finishing once with exactly its tokens, strictly increasing token times, tokens conserved, a
replica's rows never overlapping, at most P batches in flight, a request in two of them only as a
pipelined prompt chunk (chunk pipelining, the default; tests/sim/test_pipeline_chunks.py has it off), the
look-ahead bookkeeping exact, and an in-flight request's KV blocks held until its output returns; the
same under P/D pools, prefix caching, client timeouts and closed-loop clients; determinism.
Physics: a saturated decode load on P stages of 1/P the time each gives P x the throughput; a load
of one micro-batch gains nothing (the pipeline bubble); at a fixed concurrency, two micro-batches
of half the requests give T(N) / T(N / 2) x, which a memory-bound step makes ~1; an isolated
request's first token takes P stage times.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import cbsim.sim.pipeline as pipeline
import test_closed_loop
import test_invariants_prefix
import test_pd
import test_prefix
from cbsim.core.errors import ConfigError
from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.cost import CostModel
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.pipeline import PipelinedReplica
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Request, Status
from cbsim.sim.simulation import simulate

import factories
from factories import make_requests, run_policy
from test_invariants import ENGINE, MAX_MODEL_LEN, POLICIES, WORKLOADS, check_queue_rules, check_run, \
    to_requests, tracing_queues

SGLANG = st.builds(lambda k, b: {"name": "sglang", "max_num_seqs": k, "token_budget": b},
                   st.integers(1, 8), st.integers(16, 96))
EVERY_POLICY = st.one_of(POLICIES, SGLANG)


class Staged(CostModel):
    """`inner`'s step time split evenly over `stages` pipeline stages (one stage's time)."""

    name = "staged"

    def __init__(self, inner: CostModel, stages: int):
        self.inner, self.pipeline_stages = inner, stages

    def step_time(self, shape) -> float:
        return self.inner.step_time(shape) / self.pipeline_stages


class Constant(CostModel):
    """Every non-empty stage takes `seconds`, on `stages` stages."""

    name = "constant"

    def __init__(self, seconds: float, stages: int):
        self.seconds, self.pipeline_stages = seconds, stages

    def step_time(self, shape) -> float:
        return 0.0 if shape.is_empty else self.seconds


class Checked(PipelinedReplica):
    """Asserts the pipeline's own invariants at every launch (inside the plan's instant: a request
    chunk pipelining shows has its counter raised by its tokens in flight) and every drain."""

    launches = 0  # over all instances: a test sees that its runs went through this loop
    pipelined_launches = 0  # launches that scheduled a request already in flight (chunk pipelining)

    def _launch(self, plan, now):
        Checked.launches += 1
        assert len(self.in_flight) < self.stages
        again = set(plan.scheduled) & set(self.busy)
        assert again <= self.shown | set(plan.admitted), "a request in flight was scheduled again"
        assert self.chunk_pipelining or not again
        Checked.pipelined_launches += bool(again & self.pipelined)
        for rid in again - self.pipelined:  # preempted in flight, readmitted: only stale batches fly
            assert self.ahead[rid][0] != self.by_id[rid].epoch
        for rid in again & self.pipelined:  # only a prompt chunk goes after chunks in flight, never a decode
            req = self.by_id[rid]
            assert self.ahead[rid][0] == req.epoch == plan.epochs[rid]
            assert req.num_computed_tokens < req.prompt_len + req.num_output_tokens
            assert req.num_computed_tokens + plan.scheduled[rid] <= req.prompt_len + req.num_output_tokens
        block_size = self.kv.block_size
        for rid, n in plan.scheduled.items():  # the blocks cover every token the batch writes
            req = self.by_id[rid]
            if rid not in plan.preempted:
                assert plan.blocks[rid] * block_size >= req.num_computed_tokens + n
        for batch in self.in_flight:  # in-flight requests keep at least the blocks their batch holds
            for rid in batch.plan.scheduled:
                req = self.by_id.get(rid)
                if req is not None and req.status == Status.RUNNING and req.epoch == batch.plan.epochs[rid]:
                    assert req.num_blocks >= batch.plan.blocks[rid]
        super()._launch(plan, now)
        ends = [b.end for b in self.in_flight]
        assert ends == sorted(ends) and self.in_flight[-1].end > now
        self._check_ahead()

    discarded = 0  # tokens of batch entries whose request was preempted while they flew (over all instances)

    def _drain(self, now):
        for batch in self.in_flight:  # the batches this drain applies: entries of an older epoch are dropped
            if batch.end > now:
                break
            for rid, n in batch.plan.scheduled.items():
                req = self.by_id.get(rid)
                if req is None or req.epoch != batch.plan.epochs[rid]:
                    Checked.discarded += n
        super()._drain(now)
        self._check_ahead()
        for req in self.state.running:
            assert req.num_computed_tokens <= req.prompt_len + req.num_output_tokens

    def _check_ahead(self):
        """`ahead` is exactly the tokens of the batches in flight, per request and epoch."""
        expected = {}
        for batch in self.in_flight:
            for rid, n in batch.plan.scheduled.items():
                epoch = batch.plan.epochs[rid]
                entry = expected.get(rid)
                expected[rid] = (epoch, n + entry[1]) if entry and entry[0] == epoch else (epoch, n)
        for rid, (epoch, tokens) in self.ahead.items():
            assert expected[rid][0] != epoch or expected[rid][1] == tokens
        for rid, (epoch, tokens) in expected.items():
            req = self.by_id.get(rid)
            if req is not None and req.epoch == epoch and req.status == Status.RUNNING:
                assert self.ahead[rid] == (epoch, tokens)


class Unpipelined(Checked):
    """Checked with chunk pipelining off: every request in flight waits for its output."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, chunk_pipelining=False, **kwargs)


@contextmanager
def pipelined(p: int, loop: type = Checked):
    """Inside: run_policy, test_pd.run_pd, test_closed_loop.run and test_prefix.run_prefix split their
    cost model over `p` stages, run by `loop`."""
    def staged(mapping, *args, **kwargs):
        return Staged(load_cost_model(mapping, *args, **kwargs), p)

    def ledger(replicas, cluster):  # the policy's view hides the requests in flight: count them too
        places = plain_ledger(replicas, cluster)
        for r in replicas:
            for rid in getattr(r, "busy", ()):
                req = r.by_id.get(rid)
                if req is not None and req.num_blocks:
                    places[r.index][rid] = req.num_blocks
        return places

    plain_ledger = test_pd.kv_ledger
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_pd, "kv_ledger", ledger)
        patch.setattr(factories, "load_cost_model", staged)
        patch.setattr(test_pd, "load_cost_model", staged)
        patch.setattr(test_closed_loop, "load_cost_model", staged)
        patch.setattr(test_prefix, "load_cost_model", staged)
        patch.setattr(pipeline, "replica_class", lambda stages: loop)
        yield


def outcome(run) -> tuple:
    requests = [(r.status, r.first_token_time, r.completion_time, r.num_preemptions, r.first_scheduled,
                 r.first_scheduled_step, r.first_token_step, r.num_output_tokens) for r in run.requests]
    steps = {name: column.tolist() for name, column in run.recorder.step_table().items()}
    runs = {name: column.tolist() for name, column in run.recorder.run_table().items()}
    return requests, steps, runs


# -- the loop ---------------------------------------------------------------------------------
@pytest.mark.slow
@given(EVERY_POLICY, WORKLOADS, ENGINE)
def test_one_stage_through_the_pipelined_loop_is_the_plain_loop(policy, specs, engine):
    plain = run_policy(policy, to_requests(specs), max_model_len=MAX_MODEL_LEN, fast_forward=False, **engine)
    with pipelined(1, PipelinedReplica):
        piped = run_policy(policy, to_requests(specs), max_model_len=MAX_MODEL_LEN, **engine)
    assert all(isinstance(r, PipelinedReplica) for r in piped.replicas)
    assert outcome(piped) == outcome(plain)


@pytest.mark.slow
@given(EVERY_POLICY, WORKLOADS, ENGINE, st.sampled_from([2, 4]))
def test_invariants_hold_with_micro_batches_in_flight(policy, specs, engine, p):
    before = Checked.discarded
    with tracing_queues(), pipelined(p):
        run = run_policy(policy, to_requests(specs), trace=True, max_model_len=MAX_MODEL_LEN, **engine)
    assert all(isinstance(r, Checked) and r.stages == p for r in run.replicas)
    discarded = Checked.discarded - before  # chunks in flight of a preempted request: computed, then dropped
    check_run(run, policy, engine if not discarded else {**engine, "preemption": "recompute"})
    if engine["preemption"] == "swap":  # budgets, KV, exactly-once, token times, rows, conservation
        steps = run.recorder.step_table()
        computed = steps["prefill_tokens"].sum() + steps["decode_tokens"].sum()
        assert computed == sum(r.prompt_len + r.output_len - 1 for r in run.requests
                               if r.status == Status.FINISHED) + discarded
    check_queue_rules(run.policies[0], policy)
    replica = run.replicas[0]
    assert not replica.in_flight and not replica.busy
    steps = run.recorder.step_table()
    assert (np.diff(steps["end"]) > 0).all()  # outputs return in order, one batch at a time


@pytest.mark.slow
@given(EVERY_POLICY, WORKLOADS, ENGINE, st.sampled_from([2, 4]))
def test_pipelined_runs_are_deterministic(policy, specs, engine, p):
    with pipelined(p):
        first = run_policy(policy, to_requests(specs), max_model_len=MAX_MODEL_LEN, **engine)
        again = run_policy(policy, to_requests(specs), max_model_len=MAX_MODEL_LEN, **engine)
    assert outcome(first) == outcome(again)


@pytest.mark.slow
@given(test_pd.WORKLOADS, test_pd.PREFILL_POLICIES, test_pd.DECODE_POLICIES, test_pd.CLUSTERS, test_pd.LINKS,
       st.sampled_from([2, 4]))
def test_pd_pools_of_pipelined_replicas_keep_the_pd_invariants(rows, prefill_policy, decode_policy, cluster, link, p):
    before = Checked.launches
    with pipelined(p):
        test_pd.test_pd_invariants.hypothesis.inner_test(rows, prefill_policy, decode_policy, cluster, link)
    assert Checked.launches > before


# -- what the pipeline does to time -------------------------------------------------------------
def saturated(p: int, seconds: float, requests: int, max_num_seqs: int, output: int = 400):
    reqs = [Request(i, 0.0, 16, output) for i in range(requests)]
    policy = {"name": "sarathi", "token_budget": 512, "max_num_seqs": max_num_seqs}
    recorder, pool = simulate(reqs, lambda: make_policy(policy), Constant(seconds, p),
                              lambda: KVCache(100_000, 16), ReplicaSettings(max_model_len=1000))
    assert all(r.status == Status.FINISHED for r in reqs)
    return reqs, recorder, pool


def throughput(reqs) -> float:
    return sum(r.num_output_tokens for r in reqs) / max(r.completion_time for r in reqs)


@pytest.mark.parametrize("p", [2, 4])
def test_a_saturated_decode_load_on_p_stages_of_a_pth_of_the_time_gets_p_times_the_throughput(p):
    # each micro-batch as large as the single-stage batch (P GPUs hold P x the KV): 4 P x 16 requests
    one, _, _ = saturated(1, 0.02, 64 * p, 16)
    piped, recorder, pool = saturated(p, 0.02 / p, 64 * p, 16)
    ratio = throughput(piped) / (throughput(one) * p)  # per request load the same, P x the requests
    assert ratio == pytest.approx(1.0, abs=0.01)
    steps = recorder.step_table()
    busy = (steps["end"] - steps["start"]).sum() / steps["end"].max()
    assert busy == pytest.approx(1.0, abs=0.01)  # the last stage never idles
    assert isinstance(pool[0], PipelinedReplica) and pool[0].stages == p


def test_one_micro_batch_of_work_gains_nothing_from_the_pipeline():
    # 16 requests fit one micro-batch: each is in flight until its output returns, so the second
    # stage's slot stays empty (the bubble): the same throughput as one stage of twice the time
    one, _, _ = saturated(1, 0.02, 16, 16)
    two, _, _ = saturated(2, 0.01, 16, 16)
    assert throughput(two) == pytest.approx(throughput(one), rel=1e-9)
    assert [r.completion_time for r in two] == pytest.approx([r.completion_time for r in one], rel=1e-9)


@pytest.mark.parametrize("weights, per_seq", [(0.03, 0.0001), (0.001, 0.001)])
def test_at_fixed_concurrency_two_micro_batches_gain_t_n_over_t_half_n(weights, per_seq):
    # the same 32 requests: one batch of 32 on one stage, or two micro-batches of 16 on two stages
    # of half the layers. A step costs weights + per_seq x batch (a memory-bound decode: the weights
    # dominate); two stages each take half. Steady throughput: 32 / T(32) against 16 / (T(16) / 2)
    def run(p, max_num_seqs):
        reqs = [Request(i, 0.0, 1, 600) for i in range(32)]
        cost = Staged(load_cost_model({"type": "linear", "base": weights, "per_token": 0.0, "per_seq": per_seq}), p)
        simulate(reqs, lambda: make_policy({"name": "sarathi", "token_budget": 512, "max_num_seqs": max_num_seqs}),
                 cost, lambda: KVCache(100_000, 16), ReplicaSettings(max_model_len=1000))
        return throughput(reqs)

    expected = (weights + 32 * per_seq) / (weights + 16 * per_seq)
    assert run(2, 16) / run(1, 32) == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("p", [2, 4])
def test_an_isolated_request_waits_p_stage_times_for_each_token(p):
    reqs, recorder, _ = saturated(p, 0.01, 1, 16, output=5)
    req = reqs[0]
    assert req.first_token_time == pytest.approx(p * 0.01)
    assert req.completion_time == pytest.approx(5 * p * 0.01)
    steps = recorder.step_table()
    assert (steps["end"] - steps["start"]) == pytest.approx(0.01)  # a row: the pass through the last stage


def test_stages_must_be_a_positive_integer():
    reqs = make_requests([(0, 10, 2)])
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="cost_model.pp"):
            simulate(reqs, lambda: make_policy({"name": "sarathi"}), Constant(0.01, bad),
                     lambda: KVCache(100, 16), ReplicaSettings(max_model_len=1000))


def test_the_policy_sees_requests_in_flight_apart_from_the_running_ones():
    seen = []

    class Spy:
        def __init__(self, inner):
            self.inner, self.name, self.config = inner, inner.name, inner.config
            self.steady_when_blocked = inner.steady_when_blocked

        def schedule(self, state):
            seen.append(({r.id for r in state.running}, {r.id for r in state.in_flight}))
            return self.inner.schedule(state)

        def reject_reason(self, req, state):
            return self.inner.reject_reason(req, state)

    reqs = [Request(i, 0.0, 16, 50) for i in range(12)]
    simulate(reqs, lambda: Spy(make_policy({"name": "sarathi", "max_num_seqs": 4})), Constant(0.01, 2),
             lambda: KVCache(1000, 16), ReplicaSettings(max_model_len=1000))
    assert all(not running & flying for running, flying in seen)
    assert max(len(flying) for _, flying in seen) == 4  # a full micro-batch in flight while the next is planned
    assert all(len(running | flying) <= 8 for running, flying in seen)  # two micro-batches of at most 4


@pytest.mark.slow
@given(n=st.integers(1, 30), concurrency=st.one_of(st.none(), st.integers(1, 6)), think=st.sampled_from([0.0, 3.0]),
       timeout=st.one_of(st.none(), st.floats(5.0, 200.0)), blocks=st.integers(12, 80),
       preemption=st.sampled_from(["recompute", "swap"]), seed=st.integers(0, 50), p=st.sampled_from([2, 4]))
def test_clients_and_timeouts_keep_their_invariants_with_micro_batches_in_flight(n, concurrency, think, timeout, blocks,
                                                                                 preemption, seed, p):
    mapping = {"num_requests": n, "max_concurrency": concurrency, "think_time": think if concurrency else 0.0,
               "timeout": timeout, "prompt_len": {"type": "uniform", "min": 1, "max": 120},
               "output_len": {"type": "uniform", "min": 1, "max": 60}}
    if concurrency is None:
        mapping["arrival"] = {"type": "poisson", "rate": 0.5}
    wl = test_closed_loop.workload(mapping, seed)
    if wl.clients is None:
        wl.clients = test_closed_loop.ClientPlan()
    with pipelined(p):
        pool, kvs = test_closed_loop.run(wl.requests, wl.clients, num_blocks=blocks, policy={"name": "prefill_first"},
                                         preemption=preemption, max_model_len=16 * blocks, cost=test_closed_loop.LINEAR)
    assert isinstance(pool[0], Checked)
    test_closed_loop.assert_done_once_and_freed(wl.requests, kvs)
    if concurrency is not None:
        feed = pool[0].on_leave.__self__
        assert feed.max_in_flight <= concurrency and feed.in_flight == 0 and feed.index == n
    if timeout is not None:
        assert all(r.completion_time <= r.arrival + timeout for r in wl.requests if r.status == Status.FINISHED)


def test_one_stage_cost_models_get_the_plain_replica():
    for cost in (load_cost_model({"type": "unit"}), Constant(0.01, 1)):
        _, pool = simulate(make_requests([(0, 10, 2)]), lambda: make_policy({"name": "sarathi"}), cost,
                           lambda: KVCache(100, 16), ReplicaSettings(max_model_len=1000))
        assert type(pool[0]) is pipeline.Replica


@pytest.mark.slow
@given(test_invariants_prefix.POLICIES, test_invariants_prefix.SPECS, test_invariants_prefix.ENGINE,
       st.sampled_from([2, 4]))
def test_prefix_caching_keeps_its_invariants_with_micro_batches_in_flight(policy, specs, engine, p):
    plain_check = test_invariants_prefix.check_cache

    def check(state):  # requests in flight hold their prompt's nodes and blocks too
        plain_check(replace(state, running=[*state.running, *state.in_flight]))

    with pipelined(p), pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_invariants_prefix, "check_cache", check)
        run = test_invariants_prefix.simulate(policy, specs, engine, wrap=test_invariants_prefix.Checked)
    assert isinstance(run.replicas[0], Checked)
    test_invariants_prefix.check_run(run, policy, engine)
