"""The GEMMs of an MoE model's layers for the roofline (roofline.py charges them per step).

Invariant: every method is a function of Python floats (token counts) and the cost model's GEMM
rules (`_dense_gemm_seconds`, `_grouped_seconds`, `_routed_seconds`, `_bf16_gemm_seconds`) and the
routing statistics (routing.py, deterministic and cached per token count), so the roofline's
`step_time` and `decode_run_times` see the same values; with one rank and no pipeline the mean over
layers (`layer_mean`) is the arithmetic the roofline always used.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from cbsim.sim.costmodels.catalog.specs import ModelSpec
from cbsim.sim.costmodels.gemm_efficiency import TILE
from cbsim.sim.costmodels.routing import UniformRouting

MARLIN_BLOCKS_M = (8, 16, 32, 48, 64)  # fused_marlin_moe's row blocks, tried in this order (marlin_block_m)


if TYPE_CHECKING:
    from cbsim.sim.costmodels.roofline import RooflineCost


class MoEGemms:
    """Per-step GEMM time of an MoE model's layers, as the mean over its dense and MoE layers.

    An MoE layer runs the attention GEMMs, the router (hidden -> experts, 16-bit), the shared
    experts as one MLP, and two grouped GEMMs (gate+up, down) over the routed experts. With T tokens
    and top-k routing over E experts, a step touches D = E (1 - (1 - k/E)^T) distinct experts in
    expectation (uniform routing): their weights are read once each, and the T k token-expert rows
    are split over them, the busiest receiving `moe_imbalance` times the mean (at most T).

    With expert parallelism inside the TP group each GPU holds E/tp whole experts and runs them on
    all T tokens (the hidden states are replicated after attention's all-reduce, and the same
    all-reduce combines the experts' outputs, as vLLM does without data parallelism). The step waits
    for the busiest GPU: each of its E/tp experts is touched with probability q = 1 - (1 - k/E)^T,
    and it is charged the expected maximum over the tp GPUs of Binomial(E/tp, q) touched experts,
    whole. At one token of DeepSeek-V3 on 8 GPUs that is ~2.5 experts where TP reads 1/8 of 8.

    With data-parallel attention over `data_parallel` ranks the experts spread over tp x
    data_parallel GPUs and receive every rank's tokens (`ranks` x T, all ranks stepping the same
    shape); attention, the dense MLP, the shared experts and the router run on this rank's T.

    `routing` "random" (routing.py): tokens pick k distinct experts uniformly at random, and the routed
    experts' grouped GEMMs are charged what that gives in expectation on the busiest GPU: its padded
    row tiles (a fused-MoE kernel computes whole tiles per expert, spread over the SMs, so on one GPU
    the busiest expert gates nothing but its own padding), its rows and its touched experts' weights;
    `imbalance` then multiplies those tiles (the skew of a real router on top of chance). "mean" is
    the rule above: every touched expert and GPU at the mean, the busiest expert at `imbalance` x mean.

    Row tiles: a 16-bit or fp8 model's experts pad each expert's rows to TILE (128) rows. An int4
    (weight-only) model's run in vLLM's fused_marlin_moe, which picks its row block per call from the
    rows it is given (`marlin_block_m`): the tile of both routing modes is that block, chosen from the
    step's routed rows on this GPU (every rank's tokens with data-parallel attention) and the experts
    this GPU holds (E / GPUs under expert parallelism).

    Overlap: vLLM's Triton fused_moe kernel (16-bit and fp8 experts; SGLang runs a copy) does not hide its
    weight streaming under its MMA as a dense cuBLAS GEMM does. With the engine term `fused_moe_exposed`
    (x) each routed grouped GEMM costs max(compute, memory) + x min(the rows' useful compute, memory)
    (GemmCurve.grouped_seconds). vllm-v1 and sglang set x = 0.4, fitted (one parameter, 0.1 steps) on
    the only published per-batch kernel times of a tuned fused_moe we found, vllm-project/vllm PR #24700
    (2025-09-11, `benchmarks/kernels/benchmark_moe.py --model=mistralai/Mixtral-8x7B-Instruct-v0.1 -tp=2`,
    H100, tuned config E=8,N=7168: 144.03 us at 1 token, 483.14 at 64, 536.77 at 256, 662.33 at 512,
    833.72 at 1024, 1122.93 at 1536; fused_moe without the router GEMM). Against those 15 rows the
    routed experts (moe_routing random) were -12 / -26 / -15 / -12 % at 256 / 512 / 1024 / 1536 tokens
    (prefill: compute and weight streaming of similar length) and -13..-3 % at 1-128 (decode: weight
    streaming, unchanged); with 0.4, -3 / -12 / +4 / +1 % and -13..-1 %, median |error| 6.4 -> 3.5 %
    (tests/sim/costmodels/test_fused_moe.py). One GPU, one model, one TP: other shapes extrapolate.
    TensorRT-LLM's CUTLASS MoE kernels and the int4 fused_marlin_moe path are other kernels: 0 there."""

    def __init__(self, m: ModelSpec, tp: int, imbalance: float, wb: float, b: float, expert_parallel: bool = False,
                 data_parallel: int = 1, routing: str = "mean", weight_only: bool = False):
        def gemms(shapes):  # ((in, out) shapes, (FLOPs per token, weight bytes, activation bytes per token))
            shapes = tuple((float(k), float(n)) for k, n in shapes)
            return shapes, tuple((2.0 * k * n, k * n * wb, (k + n) * b) for k, n in shapes)

        self.attention = gemms(m.attention_shapes(tp))
        self.dense = gemms(m.mlp_shapes(m.intermediate, tp))
        shared = m.num_shared_experts * (m.shared_intermediate or m.moe_intermediate)
        self.shared = gemms(m.mlp_shapes(shared, tp) if shared else ())
        self.ep = tp * data_parallel if expert_parallel else 1
        self.ranks = float(data_parallel)  # ranks whose tokens meet at the experts (data-parallel attention)
        self.routing = UniformRouting(m.num_experts, m.experts_per_token, self.ep)  # caches per token count
        self._by_tile = {TILE: self.routing}  # one UniformRouting per row tile (its caches are per token count)
        self.weight_only = weight_only
        self.random = routing == "random"
        self.experts = tuple((float(k), float(n)) for k, n in m.mlp_shapes(m.moe_intermediate, 1 if expert_parallel else tp))
        self.router = (float(m.hidden), float(m.num_experts))
        self.moe_layers = float(m.num_moe_layers)
        self.dense_layers = float(m.num_layers - m.num_moe_layers)
        self.imbalance = imbalance

    def touched(self, tokens: float) -> float:
        """Expected distinct experts a step of `tokens` tokens routes to."""
        return self.routing.touched(tokens)

    def busiest_gpu_experts(self, tokens: float) -> float:
        """E[max over the EP GPUs of the experts a step touches on one GPU] (expert parallelism)."""
        if self.random:
            return self.routing.busiest_rank_experts(tokens)
        return self.routing.independent_busiest_experts(tokens)

    def tile(self, routed_tokens: float) -> int:
        """Rows of one expert's row tile at `routed_tokens` rows reaching this GPU's experts: TILE,
        or for an int4 model fused_marlin_moe's block for those rows and this GPU's experts."""
        if not self.weight_only:
            return TILE
        return marlin_block_m(routed_tokens, self.routing.top_k, self.routing.per_rank)

    def routing_for(self, tile: int) -> UniformRouting:
        """The routing statistics with `tile`-row tiles (one instance per tile, created on first use)."""
        if tile not in self._by_tile:
            r = self.routing
            self._by_tile[tile] = UniformRouting(r.experts, r.top_k, r.ranks, tile)
        return self._by_tile[tile]

    def layer_mean(self, cost: "RooflineCost", tokens: float) -> float:
        if tokens <= 0:
            return 0.0
        attention, dense, moe = self._parts(cost, tokens)
        total = self.dense_layers * (attention + dense) + self.moe_layers * (attention + moe)
        return total / (self.dense_layers + self.moe_layers)

    def layer_pair(self, cost: "RooflineCost", tokens: float) -> tuple[float, float]:
        """(GEMM seconds of one dense layer, of one MoE layer) at `tokens` rows (pipeline stages)."""
        if tokens <= 0:
            return 0.0, 0.0
        attention, dense, moe = self._parts(cost, tokens)
        return attention + dense, attention + moe

    def _parts(self, cost: "RooflineCost", tokens: float) -> tuple[float, float, float]:
        """(attention GEMMs, dense MLP, MoE block) seconds of one layer at `tokens` rows of this rank.
        With data-parallel attention the experts receive every rank's tokens (`ranks` x tokens)."""
        def gemms(pair):
            return cost._dense_gemm_seconds(tokens, *pair)

        attention = gemms(self.attention)
        dense = gemms(self.dense)
        router = cost._bf16_gemm_seconds(tokens, *self.router)
        moe = gemms(self.shared) + self.routed(cost, tokens) + router * cost._moe_f  # a calibrated factor (engine.py)
        return attention, dense, moe

    def routed(self, cost: "RooflineCost", tokens: float) -> float:
        """Seconds of one MoE layer's routed experts at `tokens` rows of this rank (the fused-MoE kernel's
        two grouped GEMMs: what vLLM's benchmark_moe.py times; no router, no shared experts)."""
        routed_tokens = tokens * self.ranks if self.ranks > 1 else tokens
        routed = (self._random_routed(cost, routed_tokens) if self.random
                  else self._mean_routed(cost, routed_tokens))
        return routed * cost._moe_f

    def _mean_routed(self, cost: "RooflineCost", routed_tokens: float) -> float:
        """The routed experts at the mean (routing "mean"): touched experts at mean rows, the busiest
        expert at `imbalance` x mean; with EP the busiest GPU's touched experts on their share of rows."""
        groups = self.touched(routed_tokens)
        rows = routed_tokens * self.routing.top_k
        busiest = min(routed_tokens, self.imbalance * rows / groups)
        if self.ep > 1:  # the busiest GPU: its touched experts, whole, on their rows
            touched = groups
            groups = self.busiest_gpu_experts(routed_tokens)
            rows = groups * rows / touched
        tile = self.tile(routed_tokens)
        return sum(cost._grouped_seconds(groups, rows, busiest, k, n, tile) for k, n in self.experts)

    def _random_routed(self, cost: "RooflineCost", routed_tokens: float) -> float:
        """The routed experts under uniform random routing (routing "random"): the busiest GPU's expected
        rows, touched experts and padded tiles (x `imbalance`, at most every touched expert on every token)."""
        tile = self.tile(routed_tokens)
        r = self.routing_for(tile)
        rows = r.busiest_rank_rows(routed_tokens)
        groups = r.busiest_rank_experts(routed_tokens)
        cap = groups * math.ceil(routed_tokens / tile)
        tiles = min(r.busiest_rank_tiles(routed_tokens) * self.imbalance, cap)
        return sum(cost._routed_seconds(tiles, groups, rows, k, n, tile) for k, n in self.experts)


def marlin_block_m(rows: float, top_k: int, experts: int) -> int:
    """The row block vLLM's fused_marlin_moe runs a call with: the first of 8, 16, 32, 48, 64 rows
    with rows x top_k / experts / block < 0.9, else 64 (rows: hidden_states' rows on this GPU;
    experts: the experts this GPU holds, w1.shape[0]). vllm-project/vllm
    vllm/model_executor/layers/fused_moe/fused_marlin_moe.py @129ab7c60cbb, `fused_marlin_moe`."""
    for block in MARLIN_BLOCKS_M:
        if rows * top_k / experts / block < 0.9:
            return block
    return MARLIN_BLOCKS_M[-1]
