"""int4 MoE experts in the roofline (issue 11): vLLM runs an int4 model's routed experts with
fused_marlin_moe, which pads each expert's rows to a row block it picks per call, the first of 8, 16,
32, 48, 64 with M x topk / E / block < 0.9, else 64 (vllm-project/vllm
vllm/model_executor/layers/fused_moe/fused_marlin_moe.py @129ab7c60cbb): M the hidden-state rows on
this GPU, E the experts it holds. bf16 and fp8 experts keep 128-row tiles, bit for bit (the golden
rows of tests/sim/costmodels/test_multinode.py and tests/sim/costmodels/test_moe_routing.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.sim.costmodels import load_cost_model, moe_gemms
from cbsim.sim.costmodels.gemm_efficiency import TILE
from cbsim.sim.costmodels.moe_gemms import MARLIN_BLOCKS_M, marlin_block_m
from cbsim.sim.costmodels.routing import UniformRouting
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.shape import StepShape

INT4_MIXTRAL = {"config": "mixtral-8x7b", "weight_dtype": "int4"}


def roofline(model=INT4_MIXTRAL, tp=2, **extra):
    return load_cost_model({"type": "roofline", "gpu": "h100", "tp": tp, **extra}, model_spec(model))


def decode(batch, context=1000):
    return StepShape.from_batch(decode=[context] * batch)


def tile_128(monkeypatch):
    """Price the int4 experts with 128-row tiles (the rule before fused_marlin_moe's blocks)."""
    monkeypatch.setattr(moe_gemms, "marlin_block_m", lambda rows, top_k, experts: TILE)


# ---------------------------------------------------------------- the block choice


@pytest.mark.parametrize(("rows", "top_k", "experts", "block"), [
    (1, 2, 8, 8),      # Mixtral: 0.25 rows an expert
    (28, 2, 8, 8),     # 7 rows an expert: 7 / 8 = 0.875 < 0.9
    (29, 2, 8, 16),    # 7.25 / 8 = 0.906; 7.25 / 16 = 0.45
    (100, 2, 8, 32),   # 25 / 16 = 1.56; 25 / 32 = 0.78
    (172, 2, 8, 48),   # 43 / 32 = 1.34; 43 / 48 = 0.896
    (180, 2, 8, 64),   # 45 / 48 = 0.94; 45 / 64 = 0.70
    (300, 2, 8, 64),   # 75 / 64 = 1.17: no block breaks, 64
    (32, 8, 256, 8),   # DeepSeek-V3 on one GPU's worth of experts: 1 row an expert
    (32, 8, 32, 16),   # EP over 8 GPUs (32 experts each): 8 / 8 = 1.0; 8 / 16 = 0.5
    (0, 8, 256, 8),
])
def test_block_at_hand_computed_points(rows, top_k, experts, block):
    assert marlin_block_m(rows, top_k, experts) == block


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 20000), st.integers(1, 8), st.sampled_from([1, 2, 4, 8, 16, 32, 60, 64, 128, 256]))
def test_block_is_the_first_under_0_9_and_grows_with_rows(rows, top_k, experts):
    block = marlin_block_m(rows, top_k, experts)
    assert block in MARLIN_BLOCKS_M
    smaller = MARLIN_BLOCKS_M[:MARLIN_BLOCKS_M.index(block)]
    assert all(rows * top_k / experts / b >= 0.9 for b in smaller)
    assert block == 64 or rows * top_k / experts / block < 0.9
    assert marlin_block_m(rows + 1, top_k, experts) >= block


def test_the_block_sees_this_gpus_rows_and_experts(monkeypatch):
    """M: the step's tokens (every rank's with data-parallel attention); E: all experts under TP, the
    experts per GPU under expert parallelism."""
    seen = []
    monkeypatch.setattr(moe_gemms, "marlin_block_m", lambda rows, k, e: seen.append((rows, k, e)) or 16)
    for extra, expected in [({}, (8.0, 2, 8)),  # 6 sequences replay the graph of 8 (vLLM's padding)
                            ({"expert_parallel": True}, (8.0, 2, 4)),
                            ({"expert_parallel": True, "data_parallel": 2}, (16.0, 2, 2))]:
        for routing in ("random", "mean"):
            seen.clear()
            roofline(moe_routing=routing, **extra).step_time(decode(6))
            assert seen and set(seen) == {expected}, (extra, routing)


def test_bf16_and_fp8_experts_never_ask_for_a_block(monkeypatch):
    def refuse(*args):
        raise AssertionError("a 16-bit or fp8 model's experts keep 128-row tiles")

    monkeypatch.setattr(moe_gemms, "marlin_block_m", refuse)
    for model in ("mixtral-8x7b", {"config": "mixtral-8x7b", "weight_dtype": "fp8"}):
        for routing in ("random", "mean"):
            cost = roofline(model, moe_routing=routing)
            assert cost.step_time(decode(8)) > 0 and cost._moe.tile(100.0) == TILE


# ---------------------------------------------------------------- step times


@pytest.mark.parametrize("routing", ["random", "mean"])
@pytest.mark.parametrize("extra", [{}, {"expert_parallel": True}])
def test_int4_mixtral_decode_is_faster_than_with_128_row_tiles(monkeypatch, routing, extra):
    blocks = [roofline(moe_routing=routing, **extra).step_time(decode(b)) for b in (1, 8, 32, 100)]
    tile_128(monkeypatch)
    tiles = [roofline(moe_routing=routing, **extra).step_time(decode(b)) for b in (1, 8, 32, 100)]
    assert all(x < y for x, y in zip(blocks, tiles))
    if not extra:  # 8 sequences on TP 2: 16 rows over 8 experts, 128-row tiles make them compute-bound
        assert blocks[1] < 0.8 * tiles[1]


def _mean_expected(cost, tokens, tile):
    """The curve's grouped GEMM by hand (mean routing, one rank): t0 plus the longer of the touched
    experts' padded rows at the compute rate and their weights and rows at the memory rate."""
    moe, curve, b = cost._moe, cost._curve, float(cost.model.dtype_bytes)
    groups = moe.touched(tokens)
    rows = tokens * moe.routing.top_k
    busiest = min(tokens, rows / groups)
    total = 0.0
    for k, n in moe.experts:
        compute = 2.0 * groups * tile * math.ceil(busiest / tile) * n * k / curve.compute_rate
        memory = (groups * k * n * cost._wb + rows * (k + n) * b) / curve.memory_rate
        total += curve.t0 + max(compute, memory)
    return total


@pytest.mark.parametrize("block", [8, 16, 32, 48, 64, TILE])
@pytest.mark.parametrize("tokens", [8.0, 100.0, 600.0, 3000.0])
def test_mean_routed_part_moves_as_the_tile_does(monkeypatch, block, tokens):
    monkeypatch.setattr(moe_gemms, "marlin_block_m", lambda rows, k, e: block)
    cost = roofline(moe_routing="mean", tp=1)
    assert cost._moe._mean_routed(cost, tokens) == pytest.approx(_mean_expected(cost, tokens, block), rel=1e-12)


@pytest.mark.parametrize("tokens", [1.0, 8.0, 29.0, 100.0, 600.0])
@pytest.mark.parametrize("extra", [{}, {"expert_parallel": True}])
def test_random_routed_part_pads_to_the_chosen_block(tokens, extra):
    """The padded-tile expectation and the curve both take fused_marlin_moe's block."""
    cost = roofline(moe_routing="random", **extra)
    moe, curve, b = cost._moe, cost._curve, float(cost.model.dtype_bytes)
    block = marlin_block_m(tokens, moe.routing.top_k, moe.routing.per_rank)
    assert moe.tile(tokens) == block
    r = UniformRouting(moe.routing.experts, moe.routing.top_k, moe.routing.ranks, block)
    groups, rows = r.busiest_rank_experts(tokens), r.busiest_rank_rows(tokens)
    tiles = min(r.busiest_rank_tiles(tokens), groups * math.ceil(tokens / block))
    expected = sum(curve.t0 + max(2.0 * tiles * block * n * k / curve.compute_rate,
                                  (groups * k * n * cost._wb + rows * (k + n) * b) / curve.memory_rate)
                   for k, n in moe.experts)
    assert moe._random_routed(cost, tokens) == pytest.approx(expected, rel=1e-12)
    assert moe.routing_for(block) is moe.routing_for(block)  # one instance per tile


def test_routed_part_grows_with_the_tile(monkeypatch):
    """At a compute-bound step the routed experts cost more the taller the tile (more padding)."""
    times = []
    for block in (8, 16, 32, 64, TILE):
        monkeypatch.setattr(moe_gemms, "marlin_block_m", lambda rows, k, e, block=block: block)
        cost = roofline(moe_routing="random", tp=1)
        times.append(cost._moe._random_routed(cost, 1000.0))
    assert times == sorted(times) and times[0] < times[-1]


# ---------------------------------------------------------------- decode runs


@pytest.mark.parametrize("extra", [{"moe_routing": "random"}, {"moe_routing": "mean"},
                                   {"moe_routing": "random", "expert_parallel": True},
                                   {"moe_routing": "random", "expert_parallel": True, "data_parallel": 2},
                                   {"moe_routing": "mean", "pp": 2}])
@pytest.mark.parametrize("batch", [1, 28, 29, 100, 180])
def test_decode_runs_equal_step_by_step(extra, batch):
    cost = roofline(**extra)
    rng = np.random.default_rng(batch)
    contexts = rng.integers(10, 3000, size=batch)
    steps = 6
    run = cost.decode_run_times(contexts, steps)
    for j in range(steps):
        assert run[j] == cost.step_time(StepShape.from_batch(decode=[int(c) + j for c in contexts]))
