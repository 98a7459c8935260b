"""A run sizes each replica's KV cache from its layout (tp, pp stages, data-parallel ranks), as
cbsim/replica_gpus.py resolves it, and a swap moves one GPU's share of a request's KV."""
from __future__ import annotations

from cbsim.api import run_experiment
from cbsim.build import build_replica_parts
from cbsim.config import load_config
from cbsim.sim.costmodels.catalog.lookup import gpu_spec, model_spec
from cbsim.sim.kv.sizing import kv_cache_blocks

BASE = {"model": "llama-3.1-70b", "cluster": {"kv_cache": {"num_blocks": "auto"}},
        "policy": {"name": "sarathi"},
        "workload": {"num_requests": 12, "arrival": {"type": "poisson", "rate": 4.0},
                     "prompt_len": {"type": "fixed", "value": 600}, "output_len": {"type": "fixed", "value": 8}}}


def parts(cost_model: dict, model: str = "llama-3.1-70b"):
    return build_replica_parts(load_config({**BASE, "model": model, "cost_model": cost_model}))


def test_six_gpus_in_three_stages_of_two_size_per_stage():
    model, _, make_kv, _ = parts({"type": "roofline", "gpu": "h100", "tp": 2, "pp": 3})
    expected = kv_cache_blocks(model, gpu_spec("h100"), 2, 16, 0.9, pp=3)
    assert make_kv().num_blocks == expected
    assert expected > kv_cache_blocks(model, gpu_spec("h100"), 2, 16, 0.9)  # a stage holds a third of the weights


def test_one_stage_sizes_as_before_and_swaps_the_tp_share():
    model, _, make_kv, _ = parts({"type": "roofline", "gpu": "h100", "tp": 4})
    kv = make_kv()
    assert kv.num_blocks == kv_cache_blocks(model, gpu_spec("h100"), 4, 16, 0.9)
    assert kv.bytes_per_token == model.kv_bytes_per_token(4)


def test_a_stage_swaps_its_layers_share():
    model, _, make_kv, _ = parts({"type": "roofline", "gpu": "h100", "tp": 2, "pp": 2})
    assert make_kv().bytes_per_token == model.kv_bytes_per_token(2) / 2


def test_data_parallel_ranks_hold_a_share_of_the_experts():
    cost = {"type": "roofline", "gpu": "h200", "tp": 1, "expert_parallel": True, "data_parallel": 8}
    model, _, make_kv, _ = parts(cost, model="deepseek-v3")
    assert make_kv().num_blocks == kv_cache_blocks(model_spec("deepseek-v3"), gpu_spec("h200"), 1, 16, 0.9,
                                                   data_parallel=8)


def test_a_pipelined_run_with_auto_blocks_finishes_every_request():
    results = run_experiment({**BASE, "cost_model": {"type": "roofline", "gpu": "h100", "tp": 2, "pp": 3}})
    assert results.summary["num_finished"] == 12
