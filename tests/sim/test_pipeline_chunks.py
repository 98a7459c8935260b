"""Chunk pipelining under pipeline parallelism (sim/pipeline.py, issue 11): a prompt's next chunk goes
into the next micro-batch while the previous chunk is in flight, as vLLM V1 (num_computed_tokens
advanced at scheduling) and SGLang's PP loop do; off (`pp_chunk_pipelining: False`), every request
in flight waits for its output, as early vLLM V1 (scheduled_req_ids) did.

Checked: a long prompt of k chunks on P idle stages gets its first token after k + P - 1 stage
times with pipelining and k P without, for every policy (hypothesis, one request); a decode is never
scheduled before its previous token is out; with pipelining off every policy keeps the suite's
invariants (budgets and KV per micro-batch, exactly-once completion, token times, conservation) and
never schedules a request in flight; the setting is read from the replica's settings.
"""
from __future__ import annotations


import pytest
from hypothesis import given
from hypothesis import strategies as st

from cbsim.policies import make_policy
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Request, Status
from cbsim.sim.simulation import simulate

from test_invariants import ENGINE, MAX_MODEL_LEN, check_queue_rules, check_run, to_requests, tracing_queues, \
    WORKLOADS
from test_pipeline import EVERY_POLICY, Checked, Constant, Unpipelined, pipelined
from factories import run_policy

STAGE = 0.01  # seconds of one stage, every batch (Constant)


def one_request(policy: dict, prompt: int, output: int, stages: int, pipelining: bool):
    """One request alone on a replica of `stages` stages of STAGE seconds each; (request, steps, replica)."""
    req = Request(0, 0.0, prompt, output)
    recorder, pool = simulate([req], lambda: make_policy(policy), Constant(STAGE, stages),
                              lambda: KVCache(10_000, 16), ReplicaSettings(max_model_len=8192, pp_chunk_pipelining=pipelining))
    assert req.status == Status.FINISHED
    return req, recorder.step_table(), pool[0]


@pytest.mark.parametrize("p", [2, 4])
def test_a_long_prompt_pipelines_its_chunks_across_micro_batches(p):
    policy = {"name": "sarathi", "token_budget": 512, "max_num_seqs": 8}
    on, steps, replica = one_request(policy, 4096, 3, p, True)
    off, steps_off, _ = one_request(policy, 4096, 3, p, False)
    assert replica.chunk_pipelining and not replica.ahead and not replica.busy
    # 8 chunks of 512: one enters stage 1 every stage time; the last leaves after P more
    assert on.first_token_time == pytest.approx((8 + p - 1) * STAGE)
    assert off.first_token_time == pytest.approx(8 * p * STAGE)  # each chunk waits for the one before
    assert list(steps["prefill_tokens"][:8]) == [512] * 8 == list(steps_off["prefill_tokens"][:8])
    # a decode waits for its token in both: one token every P stage times after the first
    assert on.completion_time - on.first_token_time == pytest.approx(2 * p * STAGE)
    assert off.completion_time - off.first_token_time == pytest.approx(2 * p * STAGE)


def test_the_pipeline_bubble_closes_for_long_prompts():
    # 4 prompts of 2,048 tokens on 4 stages, budget 512: pipelined, stage 1 never idles during prefill
    policy = {"name": "sarathi", "token_budget": 512, "max_num_seqs": 8}
    reqs = [Request(i, 0.0, 2048, 1) for i in range(4)]
    recorder, _ = simulate(reqs, lambda: make_policy(policy), Constant(STAGE, 4), lambda: KVCache(10_000, 16),
                           ReplicaSettings(max_model_len=4096))
    steps = recorder.step_table()
    assert len(steps["start"]) == 16  # 8,192 prompt tokens in chunks of 512, each sampling where it ends
    assert max(r.completion_time for r in reqs) == pytest.approx((16 + 4 - 1) * STAGE)


@pytest.mark.slow
@given(EVERY_POLICY, st.integers(1, 600), st.integers(1, 4), st.sampled_from([2, 3, 4]))
def test_a_lone_prompt_of_k_batches_takes_k_plus_p_minus_1_stage_times(policy, prompt, output, p):
    on, steps_on, _ = one_request(policy, prompt, output, p, True)
    off, steps_off, _ = one_request(policy, prompt, output, p, False)
    k = off.first_token_step + 1  # the batches up to the first token: the prompt's chunks, whatever they are
    assert on.first_token_step + 1 == k
    assert list(steps_on["prefill_tokens"][:k]) == list(steps_off["prefill_tokens"][:k])
    assert off.first_token_time == pytest.approx(k * p * STAGE)
    assert on.first_token_time == pytest.approx((k + p - 1) * STAGE)
    assert on.completion_time - on.first_token_time == pytest.approx((output - 1) * p * STAGE)


@pytest.mark.slow
@given(EVERY_POLICY, WORKLOADS, ENGINE, st.sampled_from([2, 4]))
def test_invariants_hold_without_chunk_pipelining(policy, specs, engine, p):
    before = Checked.pipelined_launches
    with tracing_queues(), pipelined(p, Unpipelined):
        run = run_policy(policy, to_requests(specs), trace=True, max_model_len=MAX_MODEL_LEN, **engine)
    assert all(isinstance(r, Unpipelined) and not r.chunk_pipelining for r in run.replicas)
    check_run(run, policy, engine)  # budgets, KV, exactly-once, token times, rows, conservation (exact)
    check_queue_rules(run.policies[0], policy)
    assert Checked.pipelined_launches == before  # no request was ever scheduled while in flight
    replica = run.replicas[0]
    assert not replica.in_flight and not replica.busy and not replica.ahead


def test_chunk_pipelining_happens_in_the_randomized_suite():
    """The invariant tests' workloads exercise the mechanism: a long prompt and a tight budget."""
    before = Checked.pipelined_launches
    with pipelined(2):
        run = run_policy({"name": "sarathi", "token_budget": 16, "max_num_seqs": 4},
                         to_requests([(0.0, 120, 5, 0), (0.0, 40, 3, 0)]), max_model_len=MAX_MODEL_LEN)
    assert Checked.pipelined_launches > before
    assert all(r.status == Status.FINISHED and r.num_output_tokens == r.output_len for r in run.requests)


THRASH = {  # found by the thorough hypothesis profile (test_invariants_hold_without_chunk_pipelining)
    "policy": {"name": "splitfuse", "token_budget": 37, "max_num_seqs": 2, "min_chunk": 14},
    "specs": [(5.172449689840924, 23, 17, 0), (1.4834684947236395e-65, 1, 1, 0), (1.4834684947236395e-65, 53, 37, 0),
              (0.001, 102, 24, 0), (0.7022513250420752, 88, 16, 2), (0.7022513250420752, 88, 16, 2),
              (5.172449689840924, 23, 17, 0)],
    "engine": {"preemption": "recompute", "reserve_full_prompt": False, "block_size": 4, "watermark_blocks": 0,
               "num_blocks": 34, "cost": {"type": "unit"}, "victim": "last_admitted"},
}


def thrash_run(loop):
    with pipelined(2, loop):
        return run_policy(THRASH["policy"], to_requests(THRASH["specs"]), max_model_len=MAX_MODEL_LEN,
                          max_time=2000, **THRASH["engine"])


def test_the_splitfuse_thrash_ends_with_chunk_pipelining():
    run = thrash_run(Checked)
    assert all(r.status == Status.FINISHED for r in run.requests)


def test_the_splitfuse_thrash_ends_without_chunk_pipelining():
    """It used to livelock: splitfuse preempted the one visible request and admitted a waiting one in the same
    plan while the other micro-batch flew, and three long prompts took turns evicting each other forever.
    splitfuse now admits nobody in a step that preempts, as vLLM V1 does (`if not preempted_reqs:`)."""
    run = thrash_run(Unpipelined)
    assert all(r.status == Status.FINISHED for r in run.requests)
