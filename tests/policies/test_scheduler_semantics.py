"""Scheduling semantics the seeds define, as exact traces under the unit cost model.

- A chunked toy: a per-request chunk of 256 tokens under a 512-token budget.
- vLLM V0's max_long_partial_prefills: a short prompt overtakes a long one that the
  partial-prefill limits hold back (vLLM V0 `_schedule_prefills`: leftover_waiting_sequences);
  strict_fcfs keeps it waiting.
- vLLM V1's per-request cap (long_prefill_token_threshold) on running and waiting prefills, and
  vLLM's 4 % long line; a request that KV stops ends the scan even when limits would be skipped.
"""
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.policies import make_policy
from cbsim.policies.batch import BatchBuilder
from cbsim.policies.helpers import PrefillLimit, admit_prefills
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.request import Request, Status
from cbsim.sim.state import SchedulerState

from factories import make_requests, run_policy
from test_golden import expected, membership_lines
from test_invariants import tracing_queues

TOY = [(0, 1024, 6), (0, 128, 9)]  # (arrival, prompt_len, output_len): see golden/chunked_toy_sarathi.txt


@pytest.mark.parametrize("options", [
    {"token_budget": 512, "chunk_size": 256},  # Sarathi-Serve's chunk size
    {"token_budget": 512, "long_prefill_token_threshold": 256},  # vLLM V1's name for the same cap
])
def test_seed_003_chunked_toy_step_by_step(options):
    run = run_policy({"name": "sarathi", **options}, make_requests(TOY), trace=True, fast_forward=False)
    assert membership_lines(run) == expected("chunked_toy_sarathi.txt")
    used = [sum(plan.scheduled.values()) for _, plan, _ in run.policies[0].plans]
    assert used == [384, 257, 257, 257, 2, 2, 2, 2, 2]  # the toy's budget_used per step


LONG_LONG_SHORT = [(0, 4000, 2), (0, 4000, 2), (0, 100, 2)]
OVERTAKE = {"name": "sarathi", "token_budget": 512, "long_prefill_token_threshold": 256,
            "max_long_partial_prefills": 1}


@pytest.mark.parametrize("partial", [1, 2])
def test_a_short_prompt_overtakes_a_long_one_the_limits_hold_back(partial):
    """max_long_partial_prefills: L1 prefills 256 tokens a step; L2 is long and the one long slot is taken, so
    it is skipped and the 100-token prompt starts in the first step. Before this change (no cap,
    no skipping) it waited 15 steps behind L2."""
    reqs = make_requests(LONG_LONG_SHORT)
    run = run_policy({**OVERTAKE, "max_num_partial_prefills": partial}, reqs, trace=True, fast_forward=False)
    long1, long2, short = reqs
    assert short.first_scheduled_step == 0 and short.first_token_step == 0
    assert long2.first_scheduled_step == 15  # when L1 has 160 tokens left (no longer long)
    first = run.policies[0].plans[0][1]
    assert first.scheduled == {long1.id: 256, short.id: 100}


@pytest.mark.parametrize("partial, waits", [(1, 16), (2, 15)])
def test_strict_fcfs_keeps_the_short_prompt_behind_the_long_one(partial, waits):
    reqs = make_requests(LONG_LONG_SHORT)
    run_policy({**OVERTAKE, "max_num_partial_prefills": partial, "strict_fcfs": True}, reqs)
    long1, long2, short = reqs
    assert long2.first_scheduled_step == 15
    # partial 1: in step 16 L2's chunk is the one unfinished prefill, so the short prompt (96 tokens
    # of budget left) would be a second one and waits a step more
    assert short.first_scheduled_step == waits


def test_the_cap_holds_for_running_and_waiting_prefills():
    reqs = make_requests([(0, 1000, 3), (0, 8, 40)])
    run = run_policy({"name": "sarathi", "token_budget": 512, "long_prefill_token_threshold": 100}, reqs,
                     trace=True, fast_forward=False)
    chunks = [plan.scheduled[0] for _, plan, _ in run.policies[0].plans if 0 in plan.scheduled]
    assert chunks[:10] == [100] * 10  # the first chunk (waiting) and the next nine (running)
    assert chunks[10:] == [1, 1]  # then its decodes
    assert reqs[0].first_token_step == 9  # ten 100-token steps, with budget left in each


def test_with_partial_prefills_long_means_4_percent_of_max_model_len_and_nothing_is_capped():
    """vLLM's SchedulerConfig: threshold 0 and max_num_partial_prefills > 1 -> 4 % of max_model_len
    (here 40), used to classify (V0), not to cap."""
    reqs = make_requests([(0, 300, 1), (0, 300, 1), (0, 30, 1)])
    run = run_policy({"name": "sarathi", "token_budget": 200, "max_num_partial_prefills": 2}, reqs,
                     trace=True, fast_forward=False, max_model_len=1000)
    first = run.policies[0].plans[0][1]
    assert first.scheduled == {0: 200}  # no cap: the first prompt takes the whole budget
    second = run.policies[0].plans[1][1]
    assert second.scheduled == {0: 100, 2: 30}  # the second (long, 300 > 40) is skipped for the 30-token one


def test_a_request_kv_stops_ends_the_scan_even_when_limits_are_skipped():
    """vLLM: allocate_slots() is None -> break (V1), AllocStatus.LATER -> break (V0)."""
    # R0 holds 8 of 10 blocks; H's 64-token prompt needs 4 more, so H cannot start, and S, whose
    # 8 tokens would fit in one block, waits behind it until R0 finishes
    reqs = make_requests([(0, 128, 20), (1, 64, 2), (1, 8, 2)])
    run_policy({"name": "sarathi", "token_budget": 512}, reqs, num_blocks=10, block_size=16)
    r0, head, short = reqs
    assert r0.completion_time == 20.0  # its 20th token ends step 20 (0-based 19)
    assert head.first_scheduled_step == short.first_scheduled_step == 20  # both start after it


def _builder(waiting, num_blocks=100, budget=512) -> BatchBuilder:
    state = SchedulerState(kv=KVCache(num_blocks, 16), max_model_len=10_000)
    state.waiting.extend(waiting)
    return BatchBuilder(state, budget, 8)


@pytest.mark.parametrize("skip, admitted", [(True, [0, 2]), (False, [0])])
def test_admit_prefills_skips_what_only_the_limits_block(skip, admitted):
    # max_long 1: R1 is long like R0 and is held back; R2 is short
    reqs = [Request(0, 0.0, 400, 1), Request(1, 0.0, 400, 1), Request(2, 0.0, 50, 1)]
    b = _builder(reqs)
    admit_prefills(b, reqs, limit=PrefillLimit(2, 1, 100), cap=100, skip_blocked=skip)
    assert b.admitted == admitted and all(n <= 100 for n in b.scheduled.values())


def test_admit_prefills_never_skips_a_request_kv_stops():
    reqs = [Request(0, 0.0, 400, 1), Request(1, 0.0, 16, 1)]
    b = _builder(reqs, num_blocks=3)
    admit_prefills(b, reqs, limit=PrefillLimit(2, 1, 100), skip_blocked=True)
    assert b.admitted == []


def test_sarathi_options_are_validated():
    from cbsim.core.errors import ConfigError
    for bad in ({"chunk_size": 0}, {"long_prefill_token_threshold": 0}):
        with pytest.raises(ConfigError):
            make_policy({"name": "sarathi", **bad})
    assert make_policy({"name": "sarathi"}).config.token_budget == 8192


QUEUE_POLICY = st.builds(lambda b, p, lp, t, c: {"name": "sarathi", "token_budget": b, "max_num_partial_prefills": p,
                                                "max_long_partial_prefills": min(lp, p), "long_prefill_token_threshold": t,
                                                "chunk_size": c},
                         st.integers(32, 512), st.integers(1, 3), st.integers(1, 2),
                         st.one_of(st.none(), st.integers(16, 256)), st.one_of(st.none(), st.integers(16, 256)))
QUEUE = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 400), st.integers(1, 8)), min_size=2, max_size=10)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(QUEUE_POLICY, QUEUE)
def test_strict_fcfs_admits_the_queue_head_and_skipping_keeps_equal_prompts_in_order(policy, specs):
    """Strict: every plan admits a prefix of the waiting queue. Skipping (ample KV, so only the
    limits hold prompts back): a prompt is passed over only for what it is, so prompts of the same
    length never overtake each other."""
    strict_reqs, skip_reqs = make_requests(specs), make_requests(specs)
    with tracing_queues():
        strict = run_policy({**policy, "strict_fcfs": True}, strict_reqs, trace=True, fast_forward=False)
    traced = strict.policies[0]
    for (_, plan, _), queue in zip(traced.plans, traced.queues):
        assert list(plan.admitted) == queue[:len(plan.admitted)]
    run_policy({**policy, "strict_fcfs": False}, skip_reqs)
    assert all(r.status == Status.FINISHED for r in strict_reqs + skip_reqs)
    for a, b in itertools.combinations(skip_reqs, 2):
        if a.prompt_len == b.prompt_len and a.arrival <= b.arrival:
            assert a.first_scheduled_step <= b.first_scheduled_step


def test_long_partial_limit_cannot_exceed_the_partial_limit():
    # vLLM SchedulerConfig.verify_max_model_len: max_long_partial_prefills <= max_num_partial_prefills
    from cbsim.core.errors import ConfigError

    with pytest.raises(ConfigError, match="max_long_partial_prefills"):
        make_policy({"name": "sarathi", "max_num_partial_prefills": 1, "max_long_partial_prefills": 2})
