"""Pipeline runs change nothing (sim/pipeline_run.py): random workloads on a replica of 2 to 4 pipeline stages,
stepped one micro-batch at a time (`fast_forward: false`) and advanced in runs, give identical step tables,
token runs and per-request times, bit for bit: with chunk pipelining on and off, cut by max_time, with client
timeouts, several replicas (round robin), and cost models with their own decode pricer (vidur, roofline) and
the base class's (a linear model split over the stages)."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cbsim.sim.pipeline_run as pipeline_run_module
from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Request
from cbsim.sim.simulation import simulate
from factories import assert_same_run
from test_fast_path import POLICIES, WORKLOADS
from test_pipeline import Staged

MAX_MODEL_LEN = 400
COSTS = {
    "linear": lambda p: Staged(load_cost_model({"type": "linear", "base": 0.01, "per_token": 0.001}), p),
    "vidur": lambda p: load_cost_model({"type": "vidur", "gpu": "a100", "model": "llama-2-7b", "tp": 1,
                                        "engine": "none", "pp": p}),
    "vidur-engine": lambda p: load_cost_model({"type": "vidur", "gpu": "a100", "model": "llama-2-7b", "tp": 1,
                                               "engine": "vllm-v1", "pp": p}),
    "roofline": lambda p: load_cost_model({"type": "roofline", "gpu": "h100", "tp": 1, "engine": "vllm-v1", "pp": p}),
}
_MODELS: dict = {}


def cost_model(name: str, p: int):
    if (name, p) not in _MODELS:
        _MODELS[name, p] = COSTS[name](p)
    return _MODELS[name, p]


def run(policy, cost, p, specs, num_blocks, fast_forward, chunk_pipelining=True, max_time=1e6, replicas=1,
        timeout=None, runs=None):
    requests, t = [], 0.0
    for i, (gap, prompt, output) in enumerate(specs):
        t += gap
        requests.append(Request(i, t, prompt, output))
    settings_ = ReplicaSettings(max_model_len=MAX_MODEL_LEN, fast_forward=fast_forward,
                                pp_chunk_pipelining=chunk_pipelining, client_timeout=timeout)
    with pytest.MonkeyPatch.context() as patch:
        if runs is not None:  # count the runs taken
            commit = pipeline_run_module.commit_pipeline_run
            patch.setattr(pipeline_run_module, "commit_pipeline_run",
                          lambda replica, run_: (runs.append(len(run_.drained)), commit(replica, run_)))
        recorder, _ = simulate(requests, lambda: make_policy(POLICIES[policy]), cost_model(cost, p),
                               lambda: KVCache(num_blocks, 16, 1, False, 1024.0), settings_, replicas=replicas,
                               max_time=max_time)
    return requests, recorder


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(POLICIES)), st.sampled_from(sorted(COSTS)), st.integers(2, 4), WORKLOADS,
       st.integers(26, 200), st.booleans(), st.sampled_from([1e6, 1e6, 0.5, 3.0]), st.sampled_from([1, 1, 2]),
       st.sampled_from([None, None, 2.0]), st.sampled_from([0, 8, 10**9]))
def test_pipeline_runs_match_stepping(policy, cost, p, specs, num_blocks, chunk_pipelining, max_time, replicas,
                                      timeout, scalar_run):
    """`scalar_run`: relaunches priced one by one up to this many a batch, else in one vectorised call."""
    stepped = run(policy, cost, p, specs, num_blocks, False, chunk_pipelining, max_time, replicas, timeout)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline_run_module, "SCALAR_RUN", scalar_run)
        fast = run(policy, cost, p, specs, num_blocks, True, chunk_pipelining, max_time, replicas, timeout)
    assert_same_run(stepped, fast)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_a_steady_decode_load_runs(p):
    """Long decodes with nothing arriving: most micro-batches are advanced in runs (the test above cannot
    pass vacuously), and the result is still stepping's."""
    specs = [(0.0, 20, 150)] * 8 + [(0.001, 30, 140)] * 8
    runs = []
    fast = run("sarathi", "vidur", p, specs, 200, True, runs=runs)
    stepped = run("sarathi", "vidur", p, specs, 200, False)
    assert_same_run(stepped, fast)
    assert sum(runs) > fast[1].num_steps / 2
