"""Load stages are one run: the backlog and the prefix cache one stage leaves are what the next stage
starts from (issue 13: "stages carry state"), unlike separate runs per stage."""
from __future__ import annotations

import pytest

from cbsim.api import run_experiment

LIGHT = {"rate": 1.0, "duration": 6.0}


def experiment(first_stage: dict, shared_prefix: dict | None = None) -> dict:
    workload = {"arrival": {"type": "stages", "process": "constant", "stages": [first_stage, LIGHT]},
                "prompt_len": {"type": "fixed", "value": 200}, "output_len": {"type": "fixed", "value": 20}}
    if shared_prefix:
        workload["shared_prefix"] = shared_prefix
    return {"name": "stages", "seed": 1, "model": "llama-3-8b",
            "cost_model": {"type": "linear", "base": 0.01, "per_token": 2e-4},
            "cluster": {"kv_cache": {"num_blocks": 4000, "block_size": 16,
                                     "prefix_caching": shared_prefix is not None}},
            "policy": {"name": "sarathi", "token_budget": 256}, "workload": workload,
            "output": {"plots": False, "trace": False, "formats": ["csv"]}}


def second_stage(results, start: float):
    df = results.requests
    return df[df["arrival"] >= start - 1e-9].sort_values("arrival")


def test_the_backlog_of_an_overloaded_stage_delays_the_next_stage():
    burst = run_experiment(experiment({"rate": 40.0, "duration": 2.0}))  # 80 requests, ~2x what 2 s can serve
    idle = run_experiment(experiment({"rate": 0.0, "duration": 2.0}))  # the same second stage after nothing
    after_burst, after_idle = second_stage(burst, 2.0), second_stage(idle, 2.0)
    assert after_burst["arrival"].tolist() == after_idle["arrival"].tolist() == [2.0 + k for k in range(6)]
    assert len(burst.requests) == 86 and len(idle.requests) == 6
    first_burst, first_idle = after_burst["ttft"].iloc[0], after_idle["ttft"].iloc[0]
    assert first_burst > 5 * first_idle  # it queues behind the first stage's leftover requests
    # once the backlog has drained, the stages agree again: the last light request is served alike
    assert after_burst["ttft"].iloc[-1] == pytest.approx(after_idle["ttft"].iloc[-1], rel=1e-9)


def test_the_prefix_cache_filled_in_one_stage_serves_the_next():
    prefix = {"mode": "system_prompts", "num_prefixes": 1, "prefix_len": 512, "hash_block_size": 16}
    warm = run_experiment(experiment({"rate": 2.0, "duration": 2.0}, prefix))  # 4 requests fill the cache
    cold = run_experiment(experiment({"rate": 0.0, "duration": 2.0}, prefix))
    warm_first, cold_first = second_stage(warm, 2.0).iloc[0], second_stage(cold, 2.0).iloc[0]
    assert cold_first["cached_tokens"] == 0  # nothing before it: the run's first request computes the prefix
    assert warm_first["cached_tokens"] == 512  # the 32 blocks the first stage left in the cache
    assert warm_first["ttft"] < cold_first["ttft"]
