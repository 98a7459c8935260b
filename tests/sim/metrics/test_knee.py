"""Offered load against the simulated capacity (sim/metrics/knee.py): the estimate matches where a run
saturates, a light run is far from it, a batch has no offered rate, and `compare` flags a stage near
the knee."""
from __future__ import annotations

import numpy as np
import pytest

from cbsim.api import run_experiment
from cbsim.sim.metrics.knee import knee_note, offered_rate
from cbsim.tools.compare.compare import compare
from cbsim.tools.compare.measured import MeasuredRun

RUN = {"name": "knee", "seed": 0, "model": "llama-3-8b", "cost_model": {"type": "roofline", "gpu": "h100"},
       "cluster": {"kv_cache": {"num_blocks": "auto"}}, "policy": {"name": "sarathi", "token_budget": 512,
                                                                  "max_num_seqs": 64},
       "workload": {"num_requests": 600, "arrival": {"type": "poisson", "rate": 2.0},
                    "prompt_len": {"type": "lognormal", "median": 800, "sigma": 0.8, "max": 4096},
                    "output_len": {"type": "fixed", "value": 128}},
       "output": {"plots": False, "trace": False}}


def at_rate(rate: float):
    return run_experiment({**RUN, "workload": {**RUN["workload"], "arrival": {"type": "poisson", "rate": rate}}})


def test_capacity_is_where_the_run_saturates():
    light = at_rate(2.0).summary
    assert light["load_vs_capacity"] < 0.3 and knee_note(light) is None
    assert light["offered_requests_per_s"] == pytest.approx(2.0, rel=0.15)
    heavy = at_rate(4 * light["capacity_requests_per_s"]).summary  # far past the knee: completions at capacity
    completed = heavy["num_finished"] / heavy["makespan"]
    assert completed == pytest.approx(heavy["capacity_requests_per_s"], rel=0.15)
    assert heavy["load_vs_capacity"] > 3 and "past its capacity" in knee_note(heavy)
    assert heavy["ttft_p50"] > 20 * light["ttft_p50"]


def test_a_batch_has_no_offered_rate():
    assert offered_rate(np.zeros(5)) is None and offered_rate(np.array([1.0])) is None
    assert offered_rate(np.array([0.0, 1.0, 2.0])) == 1.0
    batch = run_experiment({**RUN, "workload": {**RUN["workload"], "num_requests": 20,
                                               "arrival": {"type": "all_at_once"}}}).summary
    assert batch["offered_requests_per_s"] is None and batch["load_vs_capacity"] is None
    assert batch["capacity_requests_per_s"] > 0


def test_compare_flags_a_stage_near_the_knee():
    light = at_rate(2.0).summary
    measured = MeasuredRun({"ttft_mean": 0.1, "e2e_mean": 2.0}, source="bench")
    near = {**RUN, "workload": {**RUN["workload"], "num_requests": 300,
                                "arrival": {"type": "poisson", "rate": 1.2 * light["capacity_requests_per_s"]}}}
    flagged = compare(near, measured)
    assert flagged.to_dict()["meta"]["near_knee"] and any("near the knee" in n for n in flagged.notes)
    calm = compare(RUN, measured)
    assert not calm.to_dict()["meta"]["near_knee"] and not any("near the knee" in n for n in calm.notes)
