"""Property-based invariants over random workloads, for every policy, both preemption modes.

Checked at every step (through a traced policy and the step table): token budget, max_num_seqs,
KV blocks; sarathi's per-request cap (long_prefill_token_threshold, chunk_size) and its
partial-prefill limits (unfinished rows, long rows: above the threshold, or 4 % of max_model_len);
FCFS admission (the admitted requests are the head of the waiting queue) for every policy except
sarathi without strict_fcfs, which may skip a prompt the limits hold back; over the run: every
request finishes exactly once with exactly output_len tokens or is rejected with a reason, token
times strictly increase and follow the arrival, time never runs backwards, tokens are conserved,
and fast-forward changes nothing.
"""
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cbsim.sim.request import Status

import factories
from factories import TracedPolicy, make_requests, run_policy

STATIC = st.builds(lambda k: {"name": "static", "max_num_seqs": k}, st.integers(1, 6))
ORCA = st.builds(lambda k, r: {"name": "orca", "max_num_seqs": k, "kv_reservation": r},
                 st.integers(1, 8), st.sampled_from(["max_len", "paged"]))
PREFILL_FIRST = st.builds(lambda c, k: {"name": "prefill_first", "chunk_size": c, "max_num_seqs": k},
                          st.one_of(st.none(), st.integers(1, 64)), st.integers(1, 8))
SPLITFUSE = st.builds(lambda b, k, m: {"name": "splitfuse", "token_budget": b, "max_num_seqs": k, "min_chunk": m},
                      st.integers(1, 96), st.integers(1, 8), st.integers(1, 16))
SARATHI = st.builds(lambda b, k, p, lp, t, c, strict: {"name": "sarathi", "token_budget": b, "max_num_seqs": k,
                                                      "max_num_partial_prefills": p, "max_long_partial_prefills": min(lp, p),
                                                      "long_prefill_token_threshold": t, "chunk_size": c,
                                                      "strict_fcfs": strict},
                    st.integers(1, 96), st.integers(1, 8), st.integers(1, 3), st.integers(1, 2),
                    st.one_of(st.none(), st.integers(1, 64)), st.one_of(st.none(), st.integers(1, 64)),
                    st.booleans())

CHUNKED_ONLY = st.builds(lambda c, b, k: {"name": "chunked_only", "chunk_size": c, "token_budget": b,
                                         "max_num_seqs": k},
                         st.integers(1, 64), st.one_of(st.none(), st.integers(1, 96)), st.integers(1, 8))

POLICIES = st.one_of(STATIC, ORCA, PREFILL_FIRST, SARATHI, SPLITFUSE, CHUNKED_ONLY)

MAX_MODEL_LEN = 256

WORKLOADS = st.lists(
    st.tuples(st.floats(0, 6, allow_nan=False), st.integers(1, 160), st.integers(1, 40), st.integers(0, 2)),
    min_size=1, max_size=18)

ENGINE_FIELDS = {  # the engine knobs drawn per example (the prefix suite adds its own)
    "num_blocks": st.integers(4, 120),
    "block_size": st.sampled_from([1, 4, 16]),
    "watermark_blocks": st.integers(0, 2),
    "preemption": st.sampled_from(["recompute", "swap"]),
    "victim": st.sampled_from(["last_admitted", "lowest_priority"]),
    "cost": st.sampled_from([{"type": "unit"}, {"type": "linear", "base": 0.01, "per_token": 0.001,
                                                  "per_seq": 0.0005, "per_kv_token": 1e-5}]),
    "reserve_full_prompt": st.booleans(),
}
ENGINE = st.fixed_dictionaries(ENGINE_FIELDS)


class QueueTracedPolicy(TracedPolicy):
    """Also keeps, per plan, what each request had left to compute and the waiting queue's order."""

    def __init__(self, inner):
        super().__init__(inner)
        self.needs, self.queues = [], []

    def schedule(self, state):
        self.needs.append({r.id: r.need for r in list(state.running) + list(state.waiting)})
        self.queues.append([r.id for r in state.waiting])
        return super().schedule(state)


@contextmanager
def tracing_queues():
    """run_policy(trace=True) wraps policies in QueueTracedPolicy inside this block."""
    factories.TracedPolicy, old = QueueTracedPolicy, factories.TracedPolicy
    try:
        yield
    finally:
        factories.TracedPolicy = old


def sarathi_limits(policy) -> tuple[int | None, int | None]:
    """(long threshold, per-request cap) of a sarathi config, as the policy applies them."""
    threshold = policy.get("long_prefill_token_threshold")
    caps = [c for c in (threshold, policy.get("chunk_size")) if c is not None]
    if threshold is None and policy.get("max_num_partial_prefills", 1) > 1:
        threshold = max(1, int(MAX_MODEL_LEN * 0.04))  # classifies only
    return threshold, min(caps) if caps else None


def check_queue_rules(traced, policy):
    """Sarathi's cap and partial-prefill limits per plan; FCFS admission where the policy keeps it."""
    sarathi = policy["name"] == "sarathi"
    threshold, cap = sarathi_limits(policy) if sarathi else (None, None)
    for (_, plan, _), needs, queue in zip(traced.plans, traced.needs, traced.queues):
        if sarathi:
            rows = [(n, needs[rid]) for rid, n in plan.scheduled.items()]
            if cap is not None:
                assert all(n <= cap for n, _ in rows)
            assert sum(n < need for n, need in rows) <= policy["max_num_partial_prefills"]
            if threshold is not None:
                assert sum(need > threshold for _, need in rows) <= policy["max_long_partial_prefills"]
        if not sarathi or policy["strict_fcfs"]:
            assert list(plan.admitted) == queue[:len(plan.admitted)]


def to_requests(specs):
    t, rows = 0.0, []
    for gap, prompt, output, prio in specs:
        t += gap
        rows.append((round(t, 3), prompt, output, prio))
    return make_requests(rows)


def token_times(run, req):
    """Expand a request's runs (independently of cbsim.sim.metrics)."""
    steps = run.recorder.step_table()
    runs = run.recorder.run_table()
    times = []
    for rid, first, last, tokens in zip(runs["request_id"], runs["first_step"], runs["last_step"], runs["tokens"]):
        if rid != req.id:
            continue
        replica = steps["replica"][first]
        idx = np.flatnonzero(steps["replica"] == replica)
        idx = idx[(idx >= first) & (idx <= last)]
        assert len(idx) == tokens
        times.extend(steps["end"][idx])
    return np.sort(np.array(times))


def check_run(run, policy, engine):
    budget = policy.get("token_budget") or MAX_MODEL_LEN
    chunk = policy.get("chunk_size") if policy["name"] != "sarathi" else None  # sarathi's is per request
    for _, plan, decoding in run.policies[0].plans:
        assert sum(plan.scheduled.values()) <= budget
        if chunk and not set(plan.scheduled) & decoding:  # a prefill step of prefill_first
            assert sum(plan.scheduled.values()) <= chunk
        assert len(plan.scheduled) + len(plan.padding) <= policy["max_num_seqs"]
        assert all(n >= 1 for n in plan.scheduled.values())
        assert not set(plan.preempted) & set(plan.scheduled)
    steps = run.recorder.step_table()
    assert (steps["kv_blocks_used"] <= engine["num_blocks"]).all()
    assert (steps["end"] > steps["start"]).all()
    ends = steps["end"][steps["replica"] == 0]
    starts = steps["start"][steps["replica"] == 0]
    assert (starts[1:] >= ends[:-1]).all()
    assert run.replicas[0].kv.free_blocks == engine["num_blocks"]  # everything released at the end
    for req in run.requests:
        assert req.status in (Status.FINISHED, Status.REJECTED)
        if req.status == Status.REJECTED:
            assert req.reject_reason
            continue
        times = token_times(run, req)
        assert len(times) == req.output_len == req.num_output_tokens
        assert (np.diff(times) > 0).all()
        assert times[0] > req.arrival and times[0] == req.first_token_time
        assert req.completion_time >= times[-1]
    computed = steps["prefill_tokens"].sum() + steps["decode_tokens"].sum()
    needed = sum(r.prompt_len + r.output_len - 1 for r in run.requests if r.status == Status.FINISHED)
    if engine["preemption"] == "swap" or not steps["preemptions"].any():
        assert computed == needed
    else:
        assert computed > needed



@pytest.mark.slow
@given(POLICIES, WORKLOADS, ENGINE)
def test_invariants_hold_for_every_policy(policy, specs, engine):
    with tracing_queues():
        run = run_policy(policy, to_requests(specs), trace=True, max_model_len=MAX_MODEL_LEN, **engine)
    check_run(run, policy, engine)
    check_queue_rules(run.policies[0], policy)



@pytest.mark.slow
@given(POLICIES, WORKLOADS, ENGINE)
def test_fast_forward_changes_nothing(policy, specs, engine):
    fast = run_policy(policy, to_requests(specs), max_model_len=MAX_MODEL_LEN, fast_forward=True, **engine)
    slow = run_policy(policy, to_requests(specs), max_model_len=MAX_MODEL_LEN, fast_forward=False, **engine)
    for a, b in zip(fast.requests, slow.requests):
        assert (a.status, a.first_token_time, a.completion_time, a.num_preemptions, a.first_scheduled_step,
                a.first_token_step) == (b.status, b.first_token_time, b.completion_time, b.num_preemptions,
                                        b.first_scheduled_step, b.first_token_step)
    fs, ss = fast.recorder.step_table(), slow.recorder.step_table()
    for name in fs:
        assert np.array_equal(fs[name], ss[name]), name
    fr, sr = fast.recorder.run_table(), slow.recorder.run_table()
    for name in fr:
        assert np.array_equal(fr[name], sr[name]), name
