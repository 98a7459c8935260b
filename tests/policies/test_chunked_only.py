"""chunked_only (Sarathi-Serve's chunked-prefills-only baseline): exact step sequences on tiny workloads.

Unit cost model: every step takes one time unit, so a request arriving at t = 0.5 is first seen at
t = 1. Each plan below is written as its {request id: tokens}; fast-forward is off where every step
is listed (it would merge repeated decode steps into one plan), and compared with it on separately.
"""
import pytest
from hypothesis import given, settings

from cbsim.core.errors import ConfigError
from cbsim.policies import make_policy
from cbsim.sim.request import Status

from factories import make_requests, run_policy
from test_invariants import ENGINE, MAX_MODEL_LEN, WORKLOADS, to_requests


def plans(policy, specs, **engine):
    reqs = make_requests(specs)
    run = run_policy({"name": "chunked_only", **policy}, reqs, trace=True, fast_forward=False, **engine)
    assert all(r.status == Status.FINISHED for r in reqs)
    return reqs, [(dict(plan.scheduled), plan.admitted, plan.preempted) for _, plan, _ in run.policies[0].plans]


def scheduled(steps):
    return [s for s, _, _ in steps]


def test_prefill_chunks_and_decodes_take_turns_and_never_mix():
    # request 0 decodes while request 1's 20-token prompt runs in chunks of 8: one chunk, one decode
    reqs, steps = plans({"chunk_size": 8}, [(0, 4, 6), (1.5, 20, 2)])
    assert scheduled(steps) == [{0: 4}, {0: 1}, {1: 8}, {0: 1}, {1: 8}, {0: 1}, {1: 4}, {0: 1, 1: 1}, {0: 1}]
    assert steps[2][1] == (1,)
    assert reqs[1].first_token_time == 7.0  # 3 chunks and 2 decode steps between them
    # between request 0's tokens at most one prefill step: every gap is 1 or 2 steps
    assert [reqs[0].first_token_time, reqs[0].completion_time] == [1.0, 9.0]


def test_with_no_decode_to_run_prefill_steps_run_back_to_back():
    _, steps = plans({"chunk_size": 8}, [(0, 20, 3)])
    assert scheduled(steps) == [{0: 8}, {0: 8}, {0: 4}, {0: 1}, {0: 1}]


def test_a_prompt_in_progress_goes_first_and_its_step_admits_nobody():
    # step 0 admits three prompts under the 16-token chunk (the last one chunked); step 2 finishes
    # that prompt with 12 tokens to spare, yet request 3 (waiting since 0.5) is admitted only at step 4
    _, steps = plans({"chunk_size": 16}, [(0, 5, 2), (0, 5, 2), (0, 10, 3), (0.5, 3, 1)])
    assert scheduled(steps) == [{0: 5, 1: 5, 2: 6}, {0: 1, 1: 1}, {2: 4}, {2: 1}, {3: 3}, {2: 1}]
    assert [admitted for _, admitted, _ in steps] == [(0, 1, 2), (), (), (), (3,), ()]


def test_prefill_steps_stay_within_the_chunk_and_the_token_budget():
    _, steps = plans({"chunk_size": 8, "token_budget": 5}, [(0, 12, 2), (0, 3, 2)])
    assert scheduled(steps) == [{0: 5}, {0: 5}, {0: 2}, {0: 1}, {1: 3}, {1: 1}]


def test_max_num_seqs_caps_the_running_requests_at_admission():
    # two running requests fill max_num_seqs = 2: the third waits until one finishes, although
    # every prefill turn has room in its chunk
    reqs, steps = plans({"chunk_size": 64, "max_num_seqs": 2}, [(0, 4, 3), (0, 4, 5), (0, 4, 1)])
    assert scheduled(steps) == [{0: 4, 1: 4}, {0: 1, 1: 1}, {0: 1, 1: 1}, {2: 4}, {1: 1}, {1: 1}]
    assert reqs[2].first_scheduled == 3.0


def test_under_tight_kv_a_decode_evicts_the_prompt_in_progress_and_the_prompt_never_evicts_a_decode():
    # 6 blocks of 4 tokens: request 0 (decoding to 15 tokens) and request 1 (a 16-token prompt) do not fit together
    reqs, steps = plans({"chunk_size": 4}, [(0, 4, 12), (0.5, 16, 2)], num_blocks=6, block_size=4)
    assert [(s, p) for s, _, p in steps] == [
        ({0: 4}, ()), ({0: 1}, ()), ({1: 4}, ()), ({0: 1}, ()), ({1: 4}, ()), ({0: 1}, ()), ({1: 4}, ()),
        ({0: 1}, ()), ({1: 4}, ()),
        ({0: 1}, (1,)),  # decode turn: request 0 needs a block, request 1 (its first token out) is evicted
        ({1: 4}, ()), ({0: 1}, ()), ({1: 4}, ()), ({0: 1}, ()), ({1: 4}, ()), ({0: 1}, ()),
        ({0: 1}, (1,)),  # prefill turn: the prompt lacks KV and spares the decode; the decode step evicts it
        ({1: 4}, ()), ({0: 1}, ()), ({1: 4}, ()), ({0: 1}, ()),
        ({1: 4}, ()), ({1: 4}, ()), ({1: 1}, ()),  # request 0 done: back-to-back prefill
    ]
    assert reqs[0].num_preemptions == 0 and reqs[1].num_preemptions == 2


def test_a_swapped_out_decode_rejoins_in_a_decode_step():
    reqs = make_requests([(0, 16, 60), (0, 16, 60), (30, 40, 2)])
    run = run_policy({"name": "chunked_only", "chunk_size": 32}, reqs, trace=True, num_blocks=8, block_size=16,
                     preemption="swap")
    assert all(r.status == Status.FINISHED for r in reqs) and max(r.num_preemptions for r in reqs[:2]) >= 1
    resumed = 0
    for _, plan, decoding in run.policies[0].plans:
        rows = set(plan.scheduled)
        assert rows <= decoding or not rows & decoding, "a chunk beside a decode"
        resumed += bool(set(plan.admitted) & decoding)
    assert resumed >= 1
    assert run.recorder.step_table()["swap_bytes"].sum() > 0


class Counting:
    """Counts schedule calls; passes steady_when_blocked through live (it changes step by step)."""

    def __init__(self, inner):
        self.inner, self.name, self.config, self.calls = inner, inner.name, inner.config, 0

    @property
    def steady_when_blocked(self):
        return self.inner.steady_when_blocked

    def schedule(self, state):
        self.calls += 1
        return self.inner.schedule(state)

    def reject_reason(self, req, state):
        return self.inner.reject_reason(req, state)


def run_counted(specs, fast_forward, **policy):
    from cbsim.sim.costmodels import load_cost_model
    from cbsim.sim.kv.cache import KVCache
    from cbsim.sim.replica import ReplicaSettings
    from cbsim.sim.simulation import simulate

    reqs = make_requests(specs)
    made = []

    def new_policy():
        made.append(Counting(make_policy({"name": "chunked_only", **policy})))
        return made[-1]

    recorder, _ = simulate(reqs, new_policy, load_cost_model({"type": "unit"}), lambda: KVCache(1000, 16),
                           ReplicaSettings(fast_forward=fast_forward, max_model_len=1000))
    return reqs, recorder, made[0].calls


@pytest.mark.parametrize("specs, policy, admitted_at", [
    # steps: {0: 4}, {0: 1}, {1: 4}, then {0: 1, 1: 1} on the decodes' turn with request 2 waiting;
    # the prefill turn after it admits request 2, so that decode step must not be repeated ahead
    ([(0, 4, 10), (0, 4, 10), (0.5, 8, 2)], {"chunk_size": 4}, 4.0),
    # a prefill turn that admits nobody (max_num_seqs full): the decodes repeat until request 0 is done
    ([(0, 4, 12), (0, 4, 30), (0.5, 8, 2)], {"chunk_size": 64, "max_num_seqs": 2}, 12.0),
])
def test_fast_forward_skips_only_decode_steps_that_would_repeat(specs, policy, admitted_at):
    fast, fast_steps, fast_calls = run_counted(specs, True, **policy)
    slow, slow_steps, slow_calls = run_counted(specs, False, **policy)
    for a, b in zip(fast, slow):
        assert (a.first_scheduled, a.first_token_time, a.completion_time) == \
               (b.first_scheduled, b.first_token_time, b.completion_time)
    ft, st = fast_steps.step_table(), slow_steps.step_table()
    assert all((ft[k] == st[k]).all() for k in ft)
    assert fast[2].first_scheduled == admitted_at
    assert slow_calls == slow_steps.num_steps and fast_calls < slow_calls  # it did skip, where it may


def test_chunk_size_must_be_positive():
    with pytest.raises(ConfigError, match="chunk_size"):
        make_policy({"name": "chunked_only", "chunk_size": 0})
    assert make_policy({"name": "chunked_only", "max_num_batched_tokens": 64}).config.token_budget == 64


class Turns:
    """Records each plan with the ids of running decodes and of waiting requests that would resume as one."""

    def __init__(self, inner):
        self.inner, self.name, self.config, self.steps = inner, inner.name, inner.config, []
        self.steady_when_blocked = False

    def schedule(self, state):
        decodes = {r.id for r in state.running if r.num_output_tokens and r.need == 1}
        resuming = {r.id for r in state.waiting if r.num_output_tokens and r.need == 1}
        plan = self.inner.schedule(state)
        self.steps.append((plan, decodes, resuming))
        return plan

    def reject_reason(self, req, state):
        return self.inner.reject_reason(req, state)


@settings(max_examples=120)
@given(WORKLOADS, ENGINE)
def test_steps_never_mix_and_prefill_steps_follow_each_other_only_without_decodes(specs, engine):
    from cbsim.sim.costmodels import load_cost_model
    from cbsim.sim.kv.cache import KVCache
    from cbsim.sim.replica import ReplicaSettings
    from cbsim.sim.simulation import simulate

    made = []

    def new_policy():
        made.append(Turns(make_policy({"name": "chunked_only", "chunk_size": 24, "max_num_seqs": 4})))
        return made[-1]

    settings_ = ReplicaSettings(preemption_mode=engine["preemption"], victim=engine["victim"],
                                max_model_len=MAX_MODEL_LEN, swap_bandwidth=1e9)
    kv = lambda: KVCache(engine["num_blocks"], engine["block_size"], engine["watermark_blocks"],  # noqa: E731
                         engine["reserve_full_prompt"], 1024.0)
    reqs = to_requests(specs)
    simulate(reqs, new_policy, load_cost_model(engine["cost"]), kv, settings_, max_time=1e5)
    assert all(r.status in (Status.FINISHED, Status.REJECTED) for r in reqs)
    previous_prefill = False
    for plan, decodes, resuming in made[0].steps:
        rows = set(plan.scheduled)
        if not rows:
            continue
        is_decode_step = rows <= decodes | resuming
        assert is_decode_step or not rows & (decodes | resuming), "a chunk beside a decode"
        if not is_decode_step:
            assert sum(plan.scheduled.values()) <= 24
            assert not (previous_prefill and decodes), "a decode could run, yet a second prefill step ran"
        previous_prefill = not is_decode_step
