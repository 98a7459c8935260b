"""Expert parallelism with data-parallel attention in the roofline (issue 11): each MoE layer pays an
all-to-all dispatch and combine by topology (collectives.alltoall_seconds), charged in step_time and
reported by collective_time; the experts see every rank's tokens; the KV cache holds 1/data_parallel
of the routed experts; bad configs are one-line errors naming cost_model.data_parallel."""
from __future__ import annotations

import pytest

from cbsim.core.errors import ConfigError
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.costmodels.collectives import alltoall_seconds, link_model
from cbsim.sim.costmodels.catalog.lookup import gpu_spec, model_spec
from cbsim.sim.kv.sizing import kv_cache_blocks
from cbsim.sim.shape import StepShape

V3 = model_spec("deepseek-v3")  # fp8 weights (its config.json): fp8 GEMMs on H200, FP8 dispatch
H200 = gpu_spec("h200")
LINK = link_model(H200, "nvswitch")


def dp(model=V3, gpu="h200", **keys):
    return load_cost_model({"type": "roofline", "gpu": gpu, "engine": "none", "expert_parallel": True, **keys}, model)


def test_alltoall_by_hand_and_charged_per_moe_layer(monkeypatch):
    cost = dp(tp=1, data_parallel=8)
    tokens = 64.0
    dispatch = tokens * 8 * 7168 * (1 + 4 / 128)  # top-8 copies, fp8 with a float32 scale per 128 elements
    combine = tokens * 8 * 7168 * 2  # bf16 outputs back
    one = sum(alltoall_seconds(size, 8, 8, LINK, "nvswitch", 50e9) for size in (dispatch, combine))
    assert cost.alltoall_time(tokens) == pytest.approx(one, rel=1e-12)
    assert one == pytest.approx(2 * (LINK.base + LINK.hop) + (dispatch + combine) * 7 / 8 / LINK.bandwidth, rel=1e-12)
    assert cost.collective_time(tokens) == pytest.approx(V3.num_moe_layers * one, rel=1e-12)  # tp 1: no all-reduce
    shape = StepShape.from_batch(decode=[2000] * 64)
    charged = cost.step_time(shape)
    monkeypatch.setattr(cost, "alltoall_time", lambda t: 0.0)
    assert charged - cost.step_time(shape) == pytest.approx(58 * one, rel=1e-9)


def test_doubling_tokens_doubles_the_bytes_and_leaving_the_node_costs_more():
    one_node, two_nodes = dp(tp=1, data_parallel=8), dp(tp=1, data_parallel=16)
    fixed = 2 * (LINK.base + LINK.hop)
    for t in (16.0, 128.0, 1024.0):
        assert one_node.alltoall_time(2 * t) - fixed == pytest.approx(2 * (one_node.alltoall_time(t) - fixed), rel=1e-12)
        assert two_nodes.alltoall_time(t) > one_node.alltoall_time(t)
    assert two_nodes.describe()["gpus_per_node"] == 8 and two_nodes.describe()["data_parallel"] == 16
    # with TP inside a rank each GPU dispatches tokens / tp
    tp2 = dp(tp=2, data_parallel=4)
    assert tp2.alltoall_time(64.0) == pytest.approx(one_node.alltoall_time(32.0), rel=1e-12)


def test_the_term_is_zero_without_data_parallel_attention():
    for cost in (dp(tp=8), load_cost_model({"type": "roofline", "gpu": "h100", "tp": 8}, model_spec("llama-3.1-70b"))):
        assert cost.alltoall_time(100.0) == 0.0 and cost.data_parallel == 1
        assert "data_parallel" not in cost.describe()


def test_the_experts_see_every_ranks_tokens():
    """A rank of DP8 at T tokens runs the grouped GEMMs of 8 T routed tokens: more than TP8-EP at T,
    less than 8x: the experts' weights are read once for all ranks."""
    rank, group = dp(tp=1, data_parallel=8), dp(tp=8)
    assert rank._moe.ranks == 8 and rank._moe.ep == 8
    t = 16.0
    _, _, moe_rank = rank._moe._parts(rank, t)
    _, _, moe_tp = group._moe._parts(group, t)
    assert moe_rank > moe_tp


@pytest.mark.parametrize("model,keys,fragment", [
    ("llama-3.1-70b", {"tp": 1, "data_parallel": 2}, "dense model"),
    ("mixtral-8x7b", {"tp": 1, "data_parallel": 16}, "dividing the 8 experts"),
    ("deepseek-v3", {"tp": 1, "data_parallel": 0}, "an integer >= 1"),
])
def test_bad_data_parallel_is_one_line_naming_the_key(model, keys, fragment):
    with pytest.raises(ConfigError) as err:
        load_cost_model({"type": "roofline", "gpu": "h100", "expert_parallel": True, **keys}, model_spec(model))
    assert err.value.path == "cost_model.data_parallel" and fragment in str(err.value) and "\n" not in str(err.value)


def test_data_parallel_needs_expert_parallel_and_a_network_across_nodes():
    with pytest.raises(ConfigError, match="expert_parallel is true"):
        load_cost_model({"type": "roofline", "gpu": "h100", "data_parallel": 2}, model_spec("mixtral-8x7b"))
    with pytest.raises(ConfigError, match="inter_node_bandwidth"):
        load_cost_model({"type": "roofline", "gpu": "l40s", "expert_parallel": True, "data_parallel": 16},
                        model_spec("qwen3-30b-a3b"))


def test_cost_models_refuse_what_they_cannot_price():
    with pytest.raises(ConfigError) as err:
        load_cost_model({"type": "vidur", "data_parallel": 2}, model_spec("llama-2-7b"))
    assert err.value.path == "cost_model.data_parallel" and "only roofline" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_cost_model({"type": "unit", "pp": 2}, model_spec("llama-2-7b"))
    assert err.value.path == "cost_model.pp" and "roofline, vidur and fitted price them" in str(err.value)
    assert load_cost_model({"type": "vidur", "data_parallel": 1}, model_spec("llama-2-7b")).describe()["type"] == "vidur"


def test_each_rank_holds_a_share_of_the_experts():
    m = model_spec("qwen3-30b-a3b")  # bf16, 128 experts, every layer MoE
    share = m.stage_weight_bytes(1, 0, m.num_layers, True, True, expert_share=8)
    moved = m.num_moe_layers * (m.num_experts - m.num_experts // 8) * m.expert_params(1) * 2
    assert share == m.weight_bytes(1) - moved
    gpu = gpu_spec("h100")
    assert kv_cache_blocks(m, gpu, 1, 16, 0.9, data_parallel=8) > kv_cache_blocks(m, gpu, 1, 16, 0.9)
    assert kv_cache_blocks(m, gpu, 1, 16, 0.9, data_parallel=1) == kv_cache_blocks(m, gpu, 1, 16, 0.9)
