"""int4 weight-only scale bytes in the roofline (issue 11): GPTQ/AWQ group quantisation reads a 16-bit
scale and a packed 4-bit zero point per group of `weight_group_size` weights (vLLM's AWQ and GPTQ
layouts, specs.py), 0.5 + 2.5 / g bytes a weight; fp8 and 16-bit weights are unchanged."""
from __future__ import annotations

import pytest

from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.shape import StepShape

INT4 = {"config": "llama-3.1-70b", "weight_dtype": "int4"}
DECODE = StepShape.from_batch(decode=[1000] * 8)  # weight-streaming: the bytes decide


def cost(model, **extra):
    """The roofline with one GEMM fraction (0.72), so that the weight bytes alone move a decode step (the
    fitted curve pads an int4 GEMM to Marlin's 16 rows: tests/sim/costmodels/test_int4_kernels.py)."""
    spec = {"type": "roofline", "gpu": "h100", "tp": 4, "gemm_efficiency": 0.72, **extra}
    return load_cost_model(spec, model_spec(model))


def test_int4_weights_read_their_group_scales_and_zero_points():
    assert cost(INT4)._wb == pytest.approx(0.5 + 2.5 / 128, rel=1e-15)  # 0.51953125: +3.9 %
    assert cost(INT4, weight_group_size=32)._wb == pytest.approx(0.5 + 2.5 / 32, rel=1e-15)
    assert cost(INT4).describe()["weight_group_size"] == 128
    fp8 = {"config": "llama-3.1-70b", "weight_dtype": "fp8"}
    assert cost(fp8)._wb == 1.0 and "weight_group_size" not in cost(fp8).describe()  # fp8 scales: < 0.1 %
    assert cost("llama-3.1-70b")._wb == 2.0 and cost("llama-3.1-70b", weight_group_size=32)._wb == 2.0


def test_smaller_groups_read_more_bytes_and_decode_slower():
    times = [cost(INT4, weight_group_size=g).step_time(DECODE) for g in (32, 64, 128, 4096)]
    assert times == sorted(times, reverse=True)
    # a weight-bound decode step grows by about the weights' share of 2.5 / 128 / 0.5 = 3.9 %
    scales = cost(INT4).step_time(DECODE) / cost(INT4, weight_group_size=1 << 30).step_time(DECODE) - 1
    assert 0.01 < scales < 0.039


def test_moe_experts_read_the_scales_too():
    model = {"config": "mixtral-8x7b", "weight_dtype": "int4"}
    batch = StepShape.from_batch(decode=[500] * 4)
    assert cost(model, weight_group_size=32).step_time(batch) > cost(model).step_time(batch)
    assert cost(model, moe_routing="random", weight_group_size=32).step_time(batch) > cost(
        model, moe_routing="random").step_time(batch)
