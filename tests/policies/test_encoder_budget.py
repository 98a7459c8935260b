"""Encoder budget for multimodal requests (policies/encoder.py, vLLM V1 _try_schedule_encoder_inputs):
exact plans of small cases, arrival rejections, and a property test over every policy that the plan's
encoder tokens are exactly the inputs its chunks need, within the compute budget and the cache."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.core.errors import ConfigError
from cbsim.policies import make_policy
from cbsim.policies.encoder import vit_seconds_per_token
from cbsim.sim.request import Request, Status

from factories import run_policy

POLICIES = ["static", "orca", "prefill_first", "sarathi", "splitfuse", "chunked_only", "sglang"]


class Snapshots:
    """Wraps a policy: keeps (progress and status of every request in the state, plan) per step."""

    def __init__(self, inner):
        self.inner, self.name, self.config = inner, inner.name, inner.config
        self.steady_when_blocked = inner.steady_when_blocked
        self.steps = []

    def schedule(self, state):
        before = {r.id: (r.num_computed_tokens, r.status, r) for r in (*state.running, *state.waiting)}
        plan = self.inner.schedule(state)
        self.steps.append((before, plan))
        return plan

    def reject_reason(self, req, state):
        return self.inner.reject_reason(req, state)


def run_snapshots(policy: dict, reqs, **kw):
    from cbsim.sim.costmodels import load_cost_model
    from cbsim.sim.kv.cache import KVCache
    from cbsim.sim.replica import ReplicaSettings
    from cbsim.sim.simulation import simulate
    wrapped = []

    def new_policy():
        wrapped.append(Snapshots(make_policy(policy)))
        return wrapped[-1]

    settings = ReplicaSettings(max_model_len=kw.get("max_model_len", 100_000), fast_forward=kw.get("ff", True))
    simulate(reqs, new_policy, load_cost_model({"type": "unit"}),
             lambda: KVCache(kw.get("num_blocks", 10_000), kw.get("block_size", 16), 0, False, 1024.0),
             settings, replicas=1, router="round_robin", max_time=1e5)
    return wrapped[0]


def image_request(rid, prompt, images, output=2, arrival=0.0):
    return Request(rid, arrival, prompt, output, mm_inputs=tuple(images))


SARATHI = {"name": "sarathi", "token_budget": 64}


def test_a_chunk_stops_before_an_image_the_budget_cannot_encode():
    """Budget 30 encoder tokens: A's image (20 tokens) is encoded; B's would need 20 more, so B's chunk
    stops at its image (10 tokens); the next step encodes B's image."""
    a, b = image_request(0, 40, [(10, 20)]), image_request(1, 40, [(10, 20)])
    run = run_snapshots({**SARATHI, "encoder": {"seconds_per_token": 0.01, "max_num_encoder_input_tokens": 30}},
                        [a, b], ff=False)
    first, second = run.steps[0][1], run.steps[1][1]
    assert first.scheduled == {0: 40, 1: 10} and first.encoder_tokens == 20
    assert first.extra_seconds == pytest.approx(0.2)
    assert second.scheduled[1] == 30 and second.encoder_tokens == 20
    assert a.status == b.status == Status.FINISHED


def test_an_image_split_by_chunks_is_encoded_once_and_cached():
    """Token budget 24: the first chunk covers [0, 24) and needs the whole image (10..30): it is
    encoded then and cached; the next chunk consumes the rest of it without encoding again."""
    req = image_request(0, 40, [(10, 20)])
    run = run_snapshots({"name": "sarathi", "token_budget": 24, "encoder": {"seconds_per_token": 0.0}}, [req],
                        ff=False)
    plans = [p for _, p in run.steps]
    assert [p.scheduled.get(0) for p in plans[:2]] == [24, 16]
    assert [p.encoder_tokens for p in plans[:2]] == [20, 0]


def test_disable_chunked_mm_input_cuts_before_the_image():
    """vLLM --disable-chunked-mm-input: a chunk from before the image that would cover part of it stops
    at the image; the next chunk covers it whole."""
    req = image_request(0, 40, [(10, 20)])
    policy = {"name": "sarathi", "token_budget": 24,
              "encoder": {"seconds_per_token": 0.0, "disable_chunked_mm_input": True}}
    run = run_snapshots(policy, [req], ff=False)
    plans = [p for _, p in run.steps]
    assert [p.scheduled.get(0) for p in plans[:3]] == [10, 24, 6]
    assert [p.encoder_tokens for p in plans[:3]] == [0, 20, 0]


def test_the_encoder_cache_holds_partly_consumed_images_until_their_last_chunk():
    """Cache 24: A's 20-token image is split across chunks and stays cached; B's image (20) must wait
    until A's last chunk consumes it, and B's chunk stops before its image meanwhile."""
    a = image_request(0, 40, [(10, 20)])
    b = image_request(1, 30, [(4, 20)], arrival=0.5)
    policy = {"name": "sarathi", "token_budget": 24,
              "encoder": {"seconds_per_token": 0.0, "max_num_encoder_input_tokens": 24, "encoder_cache_size": 24}}
    run = run_snapshots(policy, [a, b], ff=False)
    plans = [p for _, p in run.steps]
    assert plans[0].scheduled == {0: 24} and plans[0].encoder_tokens == 20
    assert plans[1].scheduled == {0: 16, 1: 4} and plans[1].encoder_tokens == 0  # B stops before its image
    assert plans[2].scheduled[1] == 24 - 1 and plans[2].encoder_tokens == 20  # A decodes (1), B gets 23


def test_encoder_inputs_that_never_fit_are_rejected_at_arrival():
    too_big = image_request(0, 100, [(0, 50)])
    split = image_request(1, 100, [(0, 30)])
    total = image_request(2, 100, [(0, 20), (40, 20)])
    run_policy({**SARATHI, "encoder": {"seconds_per_token": 0.0, "max_num_encoder_input_tokens": 40}}, [too_big])
    assert too_big.status == Status.REJECTED and "exceeds the encoder budget" in too_big.reject_reason
    run_policy({"name": "sarathi", "token_budget": 24,
                "encoder": {"seconds_per_token": 0.0, "max_num_encoder_input_tokens": 64,
                            "disable_chunked_mm_input": True}}, [split])
    assert split.status == Status.REJECTED and "disable_chunked_mm_input" in split.reject_reason
    run_policy({"name": "orca", "encoder": {"seconds_per_token": 0.0, "max_num_encoder_input_tokens": 30}}, [total])
    assert total.status == Status.REJECTED and "runs a prompt whole" in total.reject_reason


def test_a_whole_prompt_policy_encodes_every_image_in_its_prompt_step():
    req = image_request(0, 100, [(0, 20), (40, 20)])
    run = run_snapshots({"name": "orca", "encoder": {"seconds_per_token": 0.5}}, [req], ff=False)
    assert run.steps[0][1].encoder_tokens == 40 and run.steps[0][1].extra_seconds == 20.0


def test_vit_roofline_per_token():
    assert vit_seconds_per_token(675e6, 989e12, 0.4) == pytest.approx(3.41e-6, rel=1e-3)


@pytest.mark.parametrize("bad, key", [
    ({"encoder": {}}, "seconds_per_token"),
    ({"encoder": {"seconds_per_token": -1}}, "seconds_per_token"),
    ({"encoder": {"seconds_per_token": 0, "encoder_cache_size": 0}}, "encoder_cache_size"),
])
def test_bad_encoder_options_name_the_key(bad, key):
    with pytest.raises(ConfigError, match=key):
        make_policy({"name": "sarathi", **bad})


def needed(images, computed, n, running):
    """Encoder tokens a chunk [computed, computed + n) needs (the rule, restated)."""
    total = 0
    for start, length in images:
        if start >= computed + n:
            break
        if start + length <= computed or (running and start < computed):
            continue
        total += length
    return total


def cached(images, computed):
    return sum(length for start, length in images if start < computed < start + length)


@st.composite
def mm_request(draw, rid):
    prompt = draw(st.integers(1, 90))
    images, pos = [], draw(st.integers(0, 20))
    while pos < prompt and draw(st.booleans()):
        length = draw(st.integers(1, min(24, prompt - pos)))
        images.append((pos, length))
        pos += length + draw(st.integers(0, 10))
    return Request(rid, draw(st.floats(0, 5, allow_nan=False)), prompt, draw(st.integers(1, 6)),
                   mm_inputs=tuple(images) or None)


@st.composite
def mm_workload(draw):
    return [draw(mm_request(i)) for i in range(draw(st.integers(1, 10)))]


@settings(max_examples=80, deadline=None)
@given(mm_workload(), st.sampled_from(POLICIES), st.integers(24, 64), st.integers(24, 48), st.booleans(),
       st.integers(0, 16))
def test_every_plan_encodes_exactly_what_its_chunks_need_within_both_budgets(reqs, name, compute, cache, whole,
                                                                            extra_blocks):
    reqs = sorted(reqs, key=lambda r: r.arrival)
    for i, r in enumerate(reqs):
        r.id = i
    cache = max(cache, compute) if name in ("static", "orca") else cache
    encoder = {"seconds_per_token": 0.001, "max_num_encoder_input_tokens": compute, "encoder_cache_size": cache,
               "disable_chunked_mm_input": whole}
    policy = {"name": name, "token_budget": 96, "encoder": encoder}
    run = run_snapshots(policy, reqs, num_blocks=24 + extra_blocks, block_size=8, max_model_len=128)
    for before, plan in run.steps:
        encoded = 0
        for rid, n in plan.scheduled.items():
            computed, status, req = before[rid]
            encoded += needed(req.mm_inputs or (), computed, n, status == Status.RUNNING)
            if whole:
                for start, length in req.mm_inputs or ():
                    assert not (computed < start < computed + n < start + length), "a chunk split an image"
        assert plan.encoder_tokens == encoded <= compute
        preempted = set(plan.preempted)
        held = sum(cached(req.mm_inputs or (), c) for rid, (c, s, req) in before.items()
                   if s == Status.RUNNING and rid not in preempted)
        assert held + encoded <= cache
        assert plan.extra_seconds == pytest.approx(0.001 * encoded)
    assert all(r.status in (Status.FINISHED, Status.REJECTED) for r in reqs)
    assert all(r.status == Status.FINISHED or "encoder" in r.reject_reason or "budget" in r.reject_reason
               or "KV" in r.reject_reason or "max_model_len" in r.reject_reason for r in reqs)
