"""The fast path changes nothing: random workloads through every policy, stepped one by one and
fast-forwarded (short runs in plain Python, long runs with numpy, or both), give identical step
tables and identical per-request times, bit for bit.

Cost models: `linear` (the base class's decode_step_time, via step_time), `vidur` with and
without a serving engine and `roofline` with one (their own O(1) decode_step_time and vectorised
decode_run_times)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cbsim.sim.fast_forward as fast_forward_module
from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Request
from cbsim.sim.simulation import simulate
from factories import assert_same_run

POLICIES = {
    "static": {"name": "static", "max_num_seqs": 6},
    "orca": {"name": "orca", "max_num_seqs": 8},
    "prefill_first": {"name": "prefill_first", "max_num_seqs": 8},
    "sarathi": {"name": "sarathi", "token_budget": 64, "max_num_seqs": 8},
    # prompt runs (fast_forward.prompt_run) under a per-request cap and under a budget most prompts fit in
    "sarathi-capped": {"name": "sarathi", "token_budget": 64, "max_num_seqs": 8, "long_prefill_token_threshold": 24},
    "sarathi-wide": {"name": "sarathi", "token_budget": 160, "max_num_seqs": 12},
    "splitfuse": {"name": "splitfuse", "token_budget": 64, "max_num_seqs": 8},
    "sglang": {"name": "sglang", "max_num_seqs": 8},
    "sglang-lpm": {"name": "sglang", "max_num_seqs": 8, "schedule_policy": "lpm"},
    "chunked_only": {"name": "chunked_only", "token_budget": 64, "max_num_seqs": 8},
}
COSTS = {
    "linear": {"type": "linear", "base": 0.01, "per_token": 0.001},
    "vidur": {"type": "vidur", "gpu": "a100", "model": "llama-2-7b", "tp": 1, "engine": "none"},
    "vidur-engine": {"type": "vidur", "gpu": "a100", "model": "llama-2-7b", "tp": 1, "engine": "vllm-v1"},
    "roofline": {"type": "roofline", "gpu": "h100", "tp": 1, "engine": "vllm-v1"},
}
MAX_MODEL_LEN = 400
# (arrival gap, prompt, output): bursts (gap 0) and pauses, long decodes so that runs are long and short
WORKLOADS = st.lists(st.tuples(st.sampled_from([0.0, 0.0, 0.01, 0.2, 1.0, 5.0]), st.integers(1, 200),
                               st.integers(1, 150)), min_size=1, max_size=14)
_COST_MODELS: dict = {}


def cost_model(name: str):
    if name not in _COST_MODELS:
        _COST_MODELS[name] = load_cost_model(COSTS[name])
    return _COST_MODELS[name]


def run(policy: str, cost: str, specs, num_blocks: int, fast_forward: bool, max_time: float = 1e6,
        kv: tuple[bool, bool] = (False, False)):
    """`kv`: (reserve_full_prompt, prefix_caching)."""
    requests, t = [], 0.0
    for i, (gap, prompt, output) in enumerate(specs):
        t += gap
        requests.append(Request(i, t, prompt, output))
    settings_ = ReplicaSettings(max_model_len=MAX_MODEL_LEN, fast_forward=fast_forward, swap_bandwidth=1e9)
    recorder, _ = simulate(requests, lambda: make_policy(POLICIES[policy]), cost_model(cost),
                           lambda: KVCache(num_blocks, 16, 1, kv[0], 1024.0, prefix_caching=kv[1]), settings_,
                           max_time=max_time)
    return requests, recorder


@settings(max_examples=150)
@given(st.sampled_from(sorted(POLICIES)), st.sampled_from(sorted(COSTS)), WORKLOADS, st.integers(26, 200),
       st.sampled_from([0, 8, 64, 10**9]), st.sampled_from([1e6, 1e6, 0.5, 3.0]),
       st.sampled_from([(False, False), (False, False), (True, False), (False, True)]))
# an idle replica woken by an arrival starts on SimPy's clock, which lands on the arrival from the feed's
# previous wake: a feed that slept through a prompt run landed an ulp late (6.200000000000001)
@example("sarathi", "linear", [(0.0, 1, 20), (0.2, 9, 90), (1.0, 1, 1), (5.0, 1, 1)], 26, 0, 1e6, (False, False))
def test_fast_path_matches_stepping(policy, cost, specs, num_blocks, scalar_run, max_time, kv):
    """Also where the simulation stops mid-run (sim.max_time): a run's steps that ended by then count;
    and with the KV cache's reserve_full_prompt or prefix caching (the matrix's rows)."""
    stepped = run(policy, cost, specs, num_blocks, fast_forward=False, max_time=max_time, kv=kv)
    with pytest.MonkeyPatch.context() as patch:  # 0: numpy runs only; 10**9: plain-Python runs only
        patch.setattr(fast_forward_module, "SCALAR_RUN", scalar_run)
        fast = run(policy, cost, specs, num_blocks, fast_forward=True, max_time=max_time, kv=kv)
    assert_same_run(stepped, fast)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["least_loaded", "kv_aware", "prefix_affinity", "round_robin"]),
       st.sampled_from(["sarathi", "orca", "prefill_first"]), WORKLOADS, st.integers(26, 120))
def test_fast_path_keeps_routing(router, policy, specs, num_blocks):
    """A router that reads the replicas' state at an arrival sees what stepping one by one shows it: a run
    reports its progress to least_loaded, and ends before the next arrival under kv_aware and
    prefix_affinity; round robin reads nothing. The step table's rows come in one order either way
    (sim/row_order.py: by replica, then each replica's own order)."""
    def routed(fast_forward: bool):
        requests, t = [], 0.0
        for i, (gap, prompt, output) in enumerate(specs):
            t += gap / 20
            requests.append(Request(i, t, prompt, output))
        settings_ = ReplicaSettings(max_model_len=MAX_MODEL_LEN, fast_forward=fast_forward)
        recorder, _ = simulate(requests, lambda: make_policy(POLICIES[policy]), cost_model("vidur"),
                               lambda: KVCache(num_blocks, 16, 1, False, 1024.0), settings_, replicas=3,
                               router=router, max_time=1e6)
        return requests, recorder

    stepped, fast = routed(False), routed(True)
    assert [r.replica for r in stepped[0]] == [r.replica for r in fast[0]]
    assert_same_run(stepped, fast)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["round_robin", "least_loaded"]), st.sampled_from(sorted(POLICIES)),
       st.sampled_from(["linear", "vidur", "roofline"]), WORKLOADS, st.integers(2, 4), st.integers(26, 160),
       st.sampled_from([1e6, 1e6, 2.0]), st.sampled_from([(False, False), (False, False), (True, False), (False, True)]),
       st.sampled_from([1, 4, 20]))
def test_runs_go_on_past_other_replicas_arrivals(router, policy, cost, specs, replicas, num_blocks, max_time, kv,
                                                 pace):
    """Several replicas: under round_robin each replica's runs look ahead at the requests it will receive
    (sim/simulation.py RoutedArrivals) and admit them as a lone replica's do; under least_loaded the router
    reads, at each arrival, what the runs in flight have done by then (sim/run_progress.py), and a request
    routed to a replica cuts its run. Either way other replicas' arrivals do not end a run, and the tables
    equal stepping one by one's, rows in the step table's order, every step index renumbered with them
    (also where the simulation stops mid-run, under reserve_full_prompt and with prefix caching)."""
    def routed(fast_forward: bool):
        requests, t = [], 0.0
        for i, (gap, prompt, output) in enumerate(specs):
            t += gap / pace
            requests.append(Request(i, t, prompt, output))
        settings_ = ReplicaSettings(max_model_len=MAX_MODEL_LEN, fast_forward=fast_forward, swap_bandwidth=1e9)
        recorder, _ = simulate(requests, lambda: make_policy(POLICIES[policy]), cost_model(cost),
                               lambda: KVCache(num_blocks, 16, 1, kv[0], 1024.0, prefix_caching=kv[1]), settings_,
                               replicas=replicas, router=router, max_time=max_time)
        return requests, recorder

    stepped, fast = routed(False), routed(True)
    assert [r.replica for r in stepped[0]] == [r.replica for r in fast[0]]
    assert_same_run(stepped, fast)


# sarathi under budgets, seats and caches that an admission inside a prompt run can hit (a budget the
# decodes can fill, few seats, a cap, and a watermark the first chunk must leave), splitfuse's min_chunk
# and orca's whole prompts
ADMITTING = {
    "sarathi": {"name": "sarathi", "token_budget": 64, "max_num_seqs": 8},
    "sarathi-tight": {"name": "sarathi", "token_budget": 6, "max_num_seqs": 12},
    "sarathi-seats": {"name": "sarathi", "token_budget": 96, "max_num_seqs": 3},
    "sarathi-capped": {"name": "sarathi", "token_budget": 64, "max_num_seqs": 8, "long_prefill_token_threshold": 24},
    "sarathi-partials": {"name": "sarathi", "token_budget": 64, "max_num_seqs": 8, "max_num_partial_prefills": 2},
    "splitfuse": {"name": "splitfuse", "token_budget": 64, "max_num_seqs": 8, "min_chunk": 24},
    # whole prompts only, KV reserved for prompt + output (or page by page), a budget a prompt may not fit
    "orca": {"name": "orca", "max_num_seqs": 8},
    "orca-paged": {"name": "orca", "max_num_seqs": 4, "kv_reservation": "paged"},
    "orca-budget": {"name": "orca", "max_num_seqs": 8, "token_budget": 96},
    # vLLM V0's prefill-first: an admitted prompt runs alone, the decodes wait (SteadyAdmission.prefill_only)
    "prefill_first": {"name": "prefill_first", "max_num_seqs": 8},
    "prefill_first-seats": {"name": "prefill_first", "max_num_seqs": 1},
    "prefill_first-budget": {"name": "prefill_first", "max_num_seqs": 8, "token_budget": 96},
    # SGLang's prefill batches alone, whole prompts (a prompt over the chunk budget: stepped), its running-request cap
    "sglang": {"name": "sglang", "max_num_seqs": 8},
    "sglang-lpm": {"name": "sglang", "max_num_seqs": 8, "schedule_policy": "lpm"},
    "sglang-chunked": {"name": "sglang", "max_num_seqs": 8, "chunked_prefill_size": 64},
    "sglang-seats": {"name": "sglang", "max_num_seqs": 2},
}
# arrivals spread over the decode steps of the requests before them (a step takes ~0.02-0.2 s)
SPREAD = st.lists(st.tuples(st.sampled_from([0.0, 0.01, 0.03, 0.06, 0.1, 0.25, 0.6, 2.0]), st.integers(1, 160),
                            st.integers(1, 120)), min_size=2, max_size=18)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(ADMITTING)), st.sampled_from(["linear", "vidur", "roofline"]), SPREAD,
       st.integers(12, 160), st.sampled_from([1, 4, 12]), st.sampled_from([1e6, 1e6, 2.0]), st.booleans())
def test_runs_admit_arrivals_as_stepping_does(policy, cost, specs, num_blocks, watermark, max_time, reserve):
    """A prompt run that routes and admits arrivals itself (one replica, open loop: sim/prompt_run.py)
    gives what stepping one by one gives, where the admission fits and where it does not (KV beside the
    watermark, seats, a budget the decodes fill, two requests waiting, a cut), whether an admission
    reserves the first chunk's blocks or the whole prompt's (reserve_full_prompt)."""
    def one(fast_forward: bool):
        requests, t = [], 0.0
        for i, (gap, prompt, output) in enumerate(specs):
            t += gap
            requests.append(Request(i, t, prompt, output))
        settings_ = ReplicaSettings(max_model_len=MAX_MODEL_LEN, fast_forward=fast_forward)
        recorder, _ = simulate(requests, lambda: make_policy(ADMITTING[policy]), cost_model(cost),
                               lambda: KVCache(num_blocks, 16, watermark, reserve, 1024.0), settings_,
                               max_time=max_time)
        return requests, recorder

    assert_same_run(one(False), one(True))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["round_robin", "least_loaded"]), st.sampled_from(sorted(ADMITTING)), SPREAD,
       st.integers(2, 3), st.integers(12, 160), st.sampled_from([1, 4, 12]), st.booleans())
def test_runs_on_several_replicas_admit_arrivals(router, policy, specs, replicas, num_blocks, watermark, reserve):
    """The admissions around prompt runs (test_runs_admit_arrivals_as_stepping_does) on each of several
    replicas: round-robin ones each take only their own arrivals inside their runs; least-loaded ones plan
    each admission after the arrival cuts the run."""
    def routed(fast_forward: bool):
        requests, t = [], 0.0
        for i, (gap, prompt, output) in enumerate(specs):
            t += gap / replicas
            requests.append(Request(i, t, prompt, output))
        settings_ = ReplicaSettings(max_model_len=MAX_MODEL_LEN, fast_forward=fast_forward)
        recorder, _ = simulate(requests, lambda: make_policy(ADMITTING[policy]), cost_model("linear"),
                               lambda: KVCache(num_blocks, 16, watermark, reserve, 1024.0), settings_,
                               replicas=replicas, router=router)
        return requests, recorder

    assert_same_run(routed(False), routed(True))


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["sglang-lpm", "sglang", "prefill_first", "sarathi", "orca"]), SPREAD,
       st.lists(st.sampled_from([None, 0, 1]), min_size=18, max_size=18), st.integers(12, 160))
def test_runs_under_prefix_caching_admit_as_stepping_does(policy, specs, documents, num_blocks):
    """With a prefix cache, a run takes only requests it cannot share (no prefix hashes), and stops before
    one it could: requests that share a document's leading blocks (or carry none) give what stepping one
    by one gives, their hits, evictions and SGLang's lpm order included."""
    def one(fast_forward: bool):
        requests, t = [], 0.0
        for i, (gap, prompt, output) in enumerate(specs):
            t += gap
            doc = documents[i]
            hashes = None if doc is None else tuple(1000 * doc + j for j in range(prompt // 16))
            requests.append(Request(i, t, prompt, output, prefix_hashes=hashes))
        settings_ = ReplicaSettings(max_model_len=MAX_MODEL_LEN, fast_forward=fast_forward)
        recorder, _ = simulate(requests, lambda: make_policy(ADMITTING[policy]), cost_model("linear"),
                               lambda: KVCache(num_blocks, 16, 1, False, 1024.0, prefix_caching=True), settings_)
        return requests, recorder

    assert_same_run(one(False), one(True))


@pytest.mark.parametrize("policy, specs", [
    ("sarathi-tight", [(0.0, 5, 100)] * 7 + [(0.5, 10, 20)]),  # the decodes fill the budget: no admission
    ("sarathi", [(0.0, 30, 100), (0.5, 10, 20), (0.5, 10, 20)]),  # two arrive together: the policy plans
    ("sarathi", [(0.0, 30, 100), (0.5, 500, 20), (0.7, 10, 20)]),  # one too long for the model: rejected
    ("sarathi", [(0.0, 300, 100), (0.001, 200, 20), (0.9, 10, 5)]),  # one waits while a chunk fills the budget
    ("sarathi-seats", [(0.0, 20, 100)] * 3 + [(0.4, 10, 20)]),  # every seat taken
    ("sarathi", [(0.0, 30, 100), (0.5, 200, 20), (0.5, 10, 20), (0.5, 10, 20)]),  # the head fills the budget
    ("sarathi-capped", [(0.0, 30, 100), (0.5, 100, 20), (0.5, 10, 20)]),  # a capped head: the next one joins it
    ("sarathi-seats", [(0.0, 20, 100), (0.4, 10, 20), (0.4, 10, 20), (0.4, 10, 20)]),  # seats end the scan
    ("splitfuse", [(0.0, 50, 100), (0.3, 200, 20), (0.5, 30, 20)]),  # a first piece under min_chunk waits
    ("prefill_first", [(0.0, 30, 100), (0.5, 10, 20), (0.8, 10, 20)]),  # each runs alone, the decodes wait
    ("prefill_first", [(0.0, 30, 100), (0.5, 10, 20), (0.5, 10, 20)]),  # two arrive together: the policy plans
    ("prefill_first", [(0.0, 30, 3), (0.01, 10, 1), (0.02, 10, 40)]),  # leaves around the steps alone
    ("prefill_first-budget", [(0.0, 30, 100), (0.5, 90, 20), (0.5, 10, 20)]),  # the head fills the budget
])
def test_runs_with_arrivals_in_examples(policy, specs):
    def one(fast_forward: bool):
        requests = [Request(i, t, prompt, output) for i, (t, prompt, output) in enumerate(specs)]
        recorder, _ = simulate(requests, lambda: make_policy(ADMITTING[policy]), cost_model("linear"),
                               lambda: KVCache(200, 16, 1, False, 1024.0),
                               ReplicaSettings(max_model_len=MAX_MODEL_LEN, fast_forward=fast_forward))
        return requests, recorder

    assert_same_run(one(False), one(True))


@pytest.mark.parametrize("policy", ["sarathi", "orca", "prefill_first", "sglang-lpm"])
@pytest.mark.parametrize("reserve", [False, True])
def test_a_run_admits_the_arrivals_it_reaches(policy, reserve):
    """The reference shape (a request at a time, each arriving while the others decode) takes its
    arrivals inside prompt runs: fewer planned steps than arrivals, and the same tables; also where an
    admission reserves the whole prompt's KV (reserve_full_prompt, Vidur's rule) and under Orca (whole
    prompts, KV for prompt + output)."""
    specs = [(0.5, 100, 80)] * 30
    requests = [Request(i, 0.5 * i, 100, 80) for i in range(30)]
    planned = []

    def one(fast_forward: bool):
        reqs = [Request(r.id, r.arrival, r.prompt_len, r.output_len) for r in requests]
        planner = make_policy(ADMITTING[policy])
        schedule = planner.schedule
        planner.schedule = lambda state: planned.append(1) or schedule(state)
        recorder, _ = simulate(reqs, lambda: planner, cost_model("linear"),
                               lambda: KVCache(400, 16, 1, reserve, 1024.0),
                               ReplicaSettings(max_model_len=MAX_MODEL_LEN, fast_forward=fast_forward))
        return reqs, recorder

    stepped = one(False)
    planned.clear()
    fast = one(True)
    assert_same_run(stepped, fast)
    assert len(planned) < len(specs) / 2, len(planned)
