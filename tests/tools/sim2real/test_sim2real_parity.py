"""Scheduler parity: vLLM 0.32's own V1 Scheduler against cbsim's, step by step (cbsim/tools/sim2real).

Needs vLLM (skipped without it, a failure in CI). Without prefix caching every stream is identical; with
it, a stream either is identical or first differs by one of the named differences (parity.KNOWN).
A request resumed after preemption hits its own output blocks in both (no longer a difference).
"""
import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sim2real_engine import require_engine

require_engine()

from cbsim.tools.sim2real.cbsim_scheduler import run_cbsim  # noqa: E402
from cbsim.tools.sim2real.parity import KNOWN, compare, first_difference, run_parity  # noqa: E402
from cbsim.tools.sim2real.streams import Limits, Stream, StreamRequest, random_stream  # noqa: E402
from cbsim.tools.sim2real.vllm_scheduler import VLLM_VERSION, VllmScheduler  # noqa: E402

from sim2real_cases import CASES, EXPECTED, first_steps  # noqa: E402

ENGINE = VllmScheduler()
SEEDS = st.integers(min_value=0, max_value=2**31 - 1)


def test_the_engine_is_the_pinned_version():
    assert ENGINE.version() == VLLM_VERSION


@given(SEEDS)
def test_without_prefix_caching_every_step_is_identical(seed):
    stream = random_stream(seed, prefix_caching=False)
    divergence, steps = compare(stream, ENGINE)
    assert divergence is None, (divergence.step, divergence.vllm, divergence.cbsim)
    assert steps  # vLLM ran it


@given(SEEDS)
def test_with_prefix_caching_a_stream_is_identical_or_differs_by_a_named_difference(seed):
    divergence, _ = compare(random_stream(seed, prefix_caching=True), ENGINE)
    assert divergence is None or divergence.kind in KNOWN, (divergence.step, divergence.vllm, divergence.cbsim)


def test_kv_pressure_preempts_and_still_agrees():
    """Recompute preemption under a tight cache, prefix caching off: some streams preempt, all agree."""
    report = run_parity(40, first_seed=10_000, prefix_caching=False, kv_pressure=True)
    assert report.identical == report.streams == 40
    assert report.coverage["preemption"] >= 5 and report.coverage["chunked_prefill"] >= 30


def _shared_prefix_stream(caching: bool) -> Stream:
    """The issue's example: prompts of 300, 350 and 400 tokens sharing their first 300, budget 512."""
    base = tuple(range(3, 303))
    prompts = [base, base + (1000,) * 50, base + (1001,) * 100]
    return Stream(0, Limits(512, 16, enable_prefix_caching=caching), tuple(StreamRequest(0, p, 3) for p in prompts))


def test_same_step_prefix_hit_is_the_named_difference():
    """vLLM's first step lets requests 1 and 2 hit the 18 full blocks (288 tokens) request 0 computes in
    that very step: 350 - 288 = 62 and 400 - 288 = 112 tokens. cbsim's cache publishes a step's blocks
    after the plan, so request 1 computes from its start (the 212 tokens the budget leaves) and request 2
    waits. Without prefix caching the two agree."""
    stream = _shared_prefix_stream(True)
    vllm = ENGINE.run(stream)
    cbsim, _ = run_cbsim(stream)
    assert vllm[0].scheduled == {0: 300, 1: 62, 2: 112} and vllm[0].same_step_hits == (1, 2)
    assert cbsim[0].scheduled == {0: 300, 1: 212}
    divergence, _ = compare(stream, ENGINE)
    assert divergence.kind == "same_step_prefix_hit" and divergence.step == 0
    off = _shared_prefix_stream(False)
    assert first_difference(ENGINE.run(off), run_cbsim(off)[0]) is None


def test_a_resumed_request_hits_its_own_output_blocks_in_both():
    """9 blocks (8 usable) for two 32-token prompts generating 40 tokens each: request 1 is preempted mid-decode
    and, resumed, vLLM hits its prompt and output blocks (cached with hashes over all its tokens). cbsim
    caches the output blocks too (Request.output_hashes over the fake sampled tokens), so the schedules agree."""
    stream = Stream(0, Limits(512, 4, num_gpu_blocks=9),
                    (StreamRequest(0, tuple(range(3, 35)), 40), StreamRequest(0, tuple(range(100, 132)), 40)))
    vllm = ENGINE.run(stream)
    resumed = [step for step in vllm if step.output_hits]
    assert resumed and resumed[0].output_hits == (1,) and resumed[0].hits[1] > 32
    assert first_difference(vllm, run_cbsim(stream)[0]) is None


@pytest.mark.parametrize("seed,step", [(38, 19), (355, 59)])
def test_lru_eviction_is_the_named_difference(seed, step):
    """Streams of the recorded 1000 (docs/howto/sim2real-cpu/parity.json) whose first difference is vLLM's
    eviction order: its one LRU queue of free and cached blocks gives up a cached block cbsim keeps (355: a
    prompt block of a preempted request, which cbsim hits on resuming, one block more than vLLM)."""
    divergence, _ = compare(random_stream(seed), ENGINE)
    assert (divergence.kind, divergence.step) == ("lru_eviction", step)


def test_a_lone_long_prompt_is_not_capped_in_either():
    stream = Stream(0, Limits(512, 4, long_prefill_token_threshold=48), (StreamRequest(0, tuple(range(3, 403)), 2),))
    vllm = ENGINE.run(stream)
    assert vllm[0].scheduled == {0: 400}
    assert first_difference(vllm, run_cbsim(stream)[0]) is None
    two = dataclasses.replace(stream, requests=stream.requests * 2)
    assert ENGINE.run(two)[0].scheduled == {0: 48, 1: 48}


@pytest.mark.parametrize("name", sorted(CASES))
def test_vllm_schedules_the_pinned_cases_as_recorded(name):
    """The schedules tests/test_sim2real_v032.py holds cbsim to are vLLM's own."""
    scheduled, preempted = EXPECTED[name]
    assert first_steps(ENGINE.run(CASES[name]), len(scheduled)) == (scheduled, preempted)
