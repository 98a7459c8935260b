"""`roofline`: analytic step time from the model's shapes and the GPU's peaks.

Per layer and per GPU, each GEMM (QKV, O, gate+up, down) takes the time of the shape-dependent
curve in gemm_efficiency.py (fitted on Vidur's per-operator tables: a fixed cost, the dense peak
on whole 128-token tiles, weight streaming at few tokens), or, with a number `gemm_efficiency`,
the longer of its FLOPs at `peak * gemm_efficiency` and its bytes (weights, plus activations in
and out) at `hbm * memory_efficiency`. Attention takes the longer of 4 * heads * head_dim FLOPs per query-key
pair (prefill chunks' causal pairs plus decode contexts) at `peak * attention_efficiency` and the
KV bytes it reads. Norms, RoPE, the activation and residual adds stream their bytes, and
`layer_overhead` covers their kernels' fixed cost. Times num_layers; plus the embedding, the LM
head (only sampled rows compute logits; same GEMM rule), 2 all-reduces per layer (+1 for the
embedding) when tp > 1, NCCL-like by topology (collectives.py, fitted on Vidur's all-reduce
tables; `topology:` defaults to the GPU's). A TP group larger than `gpus_per_node` (default: the
GPU catalog's, 8) spans tp / gpus_per_node nodes: its all-reduces run NCCL's ring or tree across
the nodes, the network step bounded by the node's NICs (GPUSpec.inter_node_bandwidth; collectives.py
names the sources); a group within one node is priced exactly as before. Then the serving engine around the kernels (engine.py; with `engine: none`, a constant
`step_overhead` of 300 µs for the engine's CPU work, as before that component existed). KV swap bytes are not charged:
the replica adds host-link time itself.

Models beyond dense Llama (ModelSpec fields, read from config.json by hf_config.py):
- Precision. Linear-layer weights stream at their own width (fp8: 1 byte, int4: 0.5); with fp8
  weights on a GPU with FP8 tensor cores (compute_dtype auto or fp8) their GEMMs run at the FP8 peak
  (same fitted fraction c: an assumption); int4 is weight-only (bf16 peak), its dense GEMMs pad rows
  to 16-row tiles as vLLM's Marlin kernels do (gemm_efficiency.WEIGHT_ONLY_TILE; bf16 and fp8 keep
  128), its MoE experts' grouped GEMMs to fused_marlin_moe's 8-64-row block for the step's rows
  (moe_gemms.marlin_block_m). int4 also reads, per group of g input weights,
  a 16-bit scale and a packed 4-bit zero point (vLLM's AWQ and GPTQ layouts, specs.py): 0.5 + 2.5 / g
  bytes a weight, 0.5195 at g = 128 (+3.9 %). g is `weight_group_size` when the cost model sets it
  (a what-if), else the model's (ModelSpec.weight_group_size, from config.json's
  quantization_config.group_size), else 128. fp8 scales are not counted: one float32 per output
  channel is 4 / K bytes a weight (0.1 % of fp8's 1 byte at K = 4,096), one per 128 x 128 block
  (DeepSeek-V3) 4 / 16,384 (0.02 %), one per tensor nothing. The LM head, router, attention and
  activations stay 16-bit; KV bytes follow kv_dtype.
- MoE. An MoE layer adds the router and the shared experts (one MLP) and replaces the dense MLP by
  two grouped GEMMs over the experts a step touches: D = E (1 - (1 - k/E)^T) of E experts in
  expectation for T tokens with top-k routing, each read once, the T k rows split over them (the
  busiest expert gets `moe_imbalance` times the mean). With `moe_routing: random` the rows follow
  uniform random routing instead (routing.py): the expected padded row tiles of the fused kernel,
  and with expert parallelism the expected busiest GPU (its rows, tiles and touched experts), the
  tiles times `moe_imbalance` (a real router's skew beyond chance). Dense first layers (first_k_dense) keep
  their MLP. Experts are split tp ways like the MLP, or with `expert_parallel` spread whole over
  the TP group's GPUs (across nodes the same all-reduce combines them, priced across the nodes).
- Data-parallel attention (`data_parallel: D` with `expert_parallel`; vLLM --data-parallel-size with
  --enable-expert-parallel, SGLang --enable-dp-attention, TensorRT-LLM enable_attention_dp): the
  replica is one of D ranks, each with its own scheduler, KV cache and attention on its tp GPUs; the
  experts spread whole over the tp D GPUs of the group. Every rank is assumed to run a step of the
  same shape (the engines step the ranks together; vLLM pads idle ranks with dummy batches), so the
  experts see D T tokens, and each MoE layer pays an all-to-all dispatch and combine
  (collectives.alltoall_seconds, by topology: NVLink within a node, the NIC across nodes) of, per GPU,
  T / tp tokens x k copies x hidden x bytes: k copies as DeepEP's low-latency kernels send them (one
  per routed expert: its published 128-token EP8 dispatch, 77 us at 98 GB/s, is 128 x 8 x 7,392
  bytes), dispatched in fp8 with a float32 scale per 128 elements (1.03 bytes) when the experts run
  fp8 GEMMs, else at the activation width, combined at the activation width. Dense layers and the
  attention keep their TP all-reduces within the rank.
- Pipeline parallelism (`pp`: P stages of tp GPUs, pipeline.py): `step_time` is the time of the
  slowest stage: its layers (dense and MoE apart), its all-reduces, the embedding on the first
  stage, the LM head on the last, and its activation hand-off (send to the next stage, all-gather of
  what it received); the replica keeps up to P batches in flight (`pipeline_stages`), so a batch
  takes P such steps end to end. pp = 1 is the one-stage formula, bit for bit.
- MLA (DeepSeek-V2/V3) as vLLM runs it: the GEMMs are q (or q_a, q_b), kv_a, kv_b (applied per
  query token) and O; attention reads kv_lora_rank + qk_rope_head_dim elements per cached token and
  layer, whole on every GPU. Decode uses the absorbed form, 2 * heads * (2 kv_lora_rank +
  qk_rope_head_dim) FLOPs per query-key pair; prefill chunks the naive form, 2 * heads *
  (qk_nope + qk_rope + v_head_dim) per pair plus kv_b decompressing every key the chunk reads
  (2 * kv_lora_rank * heads * (qk_nope + v_head_dim) FLOPs per key), both at the attention rate.
- Sliding window: on the windowed layers (sliding_layers of num_layers) each query sees at most
  `sliding_window` keys, capping the pairs and the KV read (Mistral-7B-v0.1, Gemma-2).

Invariant: `step_time` and `decode_run_times` call the same `_seconds` on the same aggregate
features, using only + - * / and `_max` on the array-valued ones (pairs, kv_read), so they return
bit-identical values. The GEMM and all-reduce terms depend only on the scalar token and row
counts and are computed from Python floats on both paths.

The other efficiencies come from Vidur's per-operator profiles (shared/data/vidur, Llama-2-7B and
70B on A100/H100): bf16 GEMMs of 2k-4k tokens reach 0.70-0.86 of the dense peak, decode-size GEMMs
stream weights at 0.7-0.85 of peak HBM bandwidth, and the norm/RoPE/activation/add kernels cost
about 20-30 µs per layer at decode sizes (timed one by one; CUDA graphs trim the gaps). Prefill
attention reaches ~0.2-0.3 of peak in Vidur's A100 profile and ~0.6 in FlashAttention-2's paper;
0.4 sits between.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from cbsim.core.errors import ConfigError
from cbsim.core.schema import option, require
from cbsim.sim.cost import CostModel, decode_run_reads
from cbsim.sim.shape import StepShape

from cbsim.sim.costmodels.catalog.gpus import gpus_per_node as catalog_gpus_per_node
from cbsim.sim.costmodels.catalog.lookup import gpu_spec
from cbsim.sim.costmodels.catalog.specs import INT4_GROUP_SCALE_BYTES, INT4_GROUP_ZERO_BYTES, TP_DEGREES, GPUSpec, ModelSpec
from cbsim.sim.costmodels.collectives import Topology, allreduce_seconds, alltoall_seconds, link_model, multinode_allreduce_seconds
from cbsim.sim.costmodels import custom_allreduce
from cbsim.sim.costmodels.attention_structure import decode_pair_weight, prefill_efficiency, streaming_multiprocessors
from cbsim.sim.costmodels.engine import NO_ENGINE, Engine, engine_option, load_engine
from cbsim.sim.costmodels.gemm_efficiency import TILE, WEIGHT_ONLY_TILE, gemm_curve
from cbsim.sim.costmodels.moe_gemms import MoEGemms
from cbsim.sim.costmodels.pipeline import Pipeline, check_pipeline, slowest
from cbsim.sim.costmodels.registry import register_cost_model

NO_ENGINE_STEP_OVERHEAD = 300e-6  # the CPU work per step this model charged before the engine component
SIZE_TERMS_CACHE = 1 << 16  # (tokens, rows) pairs whose size terms are remembered; cleared when full


def _max(a, b):
    """Elementwise maximum of floats or numpy arrays (identical results on both)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.maximum(a, b)
    return a if a >= b else b


@register_cost_model("roofline")
class RooflineCost(CostModel):
    """Roofline step time of a decoder (dense, MoE, MLA, windowed) on one tensor-parallel group."""

    @dataclass
    class Config:
        gpu: str | dict = option("h100", help="GPU: a preset (a100, h100, h200), a catalog name (`cbsim gpus`: b200, "
                                 "l40s, mi300x, ...), or a mapping of GPUSpec fields")
        tp: int = option(1, help="tensor-parallel degree: 1, 2, 4, 8 (one node), or 16, 32, 64 across nodes "
                         "(see gpus_per_node)")
        gemm_efficiency: Literal["auto"] | float = option(
            "auto", help="auto: shape-dependent GEMM curve fitted on Vidur's tables (gemm_efficiency.py); "
            "a number: one fraction of dense bf16 peak for every GEMM (0.72 before the curve)")
        topology: Topology | None = option(
            None, help="how the TP group connects, for the all-reduce: nvswitch, nvlink_pairwise, pcie, xgmi_mesh "
            "(default: the GPU's; nvswitch for the SXM presets, xgmi_mesh for MI300X/MI325X)")
        attention_efficiency: float = option(0.4, help="fraction of dense bf16 peak prefill attention reaches")
        memory_efficiency: float = option(0.8, help="fraction of peak HBM bandwidth streaming kernels reach")
        layer_overhead: float = option(15e-6, help="fixed seconds per layer for small kernels (norms, RoPE, adds)")
        step_overhead: float | None = option(
            None, help="fixed seconds per step for the engine's CPU work when engine is none (default 300e-6); "
            "with an engine its host terms cover this (default 0)")
        moe_imbalance: float = option(
            1.0, help="MoE: tokens of the busiest expert over the mean (>= 1); the expert GEMMs are charged as if "
            "every expert a step touches received that many (moe_routing random: a factor on the busiest GPU's "
            "expert tiles, a real router's skew beyond chance)")
        moe_routing: Literal["mean", "random"] = option(
            "random", help="MoE: how a step's rows spread over the experts: random (tokens pick k distinct experts "
            "uniformly at random: the expected padded row tiles and, with expert parallelism, the expected busiest "
            "GPU; moe_imbalance then multiplies its tiles) or mean (every touched expert and EP GPU at the mean, "
            "cbsim before 2026-12)")
        weight_group_size: int | None = option(
            None, help="int4 weights: input weights per 16-bit scale and 4-bit zero point (GPTQ/AWQ group_size; "
            "0.5 + 2.5 / g bytes a weight); default: the model's (config.json quantization_config.group_size), "
            "else 128; a value here overrides the model's")
        expert_parallel: bool = option(
            False, help="MoE: the TP group's GPUs each hold num_experts / tp whole experts (vLLM "
            "--enable-expert-parallel without data parallelism) instead of a 1/tp slice of every expert")
        gpus_per_node: int | None = option(
            None, help="GPUs of one node on its NVLink/xGMI fabric (default: the GPU catalog's, 8 for DGX/HGX and "
            "MI300X platforms; 8 elsewhere); a larger tp spans tp / gpus_per_node nodes over the GPUs' NICs "
            "(gpu inter_node_bandwidth)")
        pp: int = option(
            1, help="pipeline stages (vLLM --pipeline-parallel-size): a replica of pp x tp GPUs; step_time is one "
            "stage's time (the slowest: its layers, embedding or LM head, the activation hand-off) and the replica "
            "keeps up to pp batches in flight")
        data_parallel: int = option(
            1, help="MoE with expert_parallel: data-parallel attention ranks sharing the experts (vLLM "
            "--data-parallel-size with --enable-expert-parallel, SGLang --enable-dp-attention, TensorRT-LLM "
            "enable_attention_dp); the replica is one rank (tp GPUs, its own scheduler and KV cache), the experts "
            "spread over tp x data_parallel GPUs, and each MoE layer pays an all-to-all dispatch and combine")
        prefill_occupancy: bool = option(
            True, help="charge prefill attention at FlashAttention-2's wave efficiency on the GPU's SMs (a 512-token "
            "chunk of a long prompt fills fewer CTA slots than the whole prompt; attention_structure.py); false: "
            "every prefill at the full attention rate (cbsim before issue 28)")
        engine: Any = engine_option()

        def validate(self) -> None:
            gpu_spec(self.gpu, "gpu")
            for key in ("pp", "data_parallel"):
                value = getattr(self, key)
                require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, key,
                        "an integer >= 1", value)
            require(self.moe_imbalance >= 1.0, "moe_imbalance", "a number >= 1", self.moe_imbalance)
            require(self.weight_group_size is None or (isinstance(self.weight_group_size, int) and not isinstance(
                    self.weight_group_size, bool) and self.weight_group_size >= 1), "weight_group_size",
                    "a positive integer (weights per int4 scale group, e.g. 128) or null (the model's)",
                    self.weight_group_size)
            require(self.tp in TP_DEGREES, "tp", "one of " + ", ".join(map(str, TP_DEGREES)), self.tp)
            require(self.gpus_per_node is None or (isinstance(self.gpus_per_node, int) and self.gpus_per_node >= 1),
                    "gpus_per_node", "an integer >= 1 or null", self.gpus_per_node)
            for key in ("gemm_efficiency", "attention_efficiency", "memory_efficiency"):
                value = getattr(self, key)
                if value == "auto":
                    continue
                require(0.0 < value <= 1.0, key, "a fraction in (0, 1]", value)
            require(self.layer_overhead >= 0, "layer_overhead", "a non-negative number of seconds", self.layer_overhead)
            require(self.step_overhead is None or self.step_overhead >= 0, "step_overhead",
                    "a non-negative number of seconds", self.step_overhead)

    def __init__(self, model: ModelSpec, gpu: GPUSpec, tp: int = 1, gemm_efficiency: float | str = "auto",
                 attention_efficiency: float = 0.4, memory_efficiency: float = 0.8,
                 layer_overhead: float = 15e-6, step_overhead: float | None = None, engine: Engine = NO_ENGINE,
                 topology: str | None = None, moe_imbalance: float = 1.0, expert_parallel: bool = False,
                 gpus_per_node: int | None = None, pp: int = 1, data_parallel: int = 1, moe_routing: str = "random",
                 weight_group_size: int | None = None, prefill_occupancy: bool = True):
        model.check_tp(tp, "cost_model.tp")
        check_pipeline(model.num_layers, pp)
        _check_data_parallel(model, tp, data_parallel, expert_parallel)
        if expert_parallel:
            require(model.is_moe and model.num_experts % tp == 0, "cost_model.expert_parallel",
                    f"false unless the model has experts and tp divides their count ({model.name}: "
                    f"{model.num_experts} experts, tp {tp})", expert_parallel)
        self.model, self.gpu, self.tp = model, gpu, tp
        self.pipeline_stages, self.data_parallel = pp, data_parallel
        self.topology = topology or gpu.topology
        self.gpus_per_node = _placement(gpu, tp, self.topology, gpus_per_node)
        if tp * data_parallel > self.gpus_per_node:
            require(gpu.inter_node_bandwidth > 0, "cost_model.data_parallel", f"at most {self.gpus_per_node // tp} "
                    f"(one node) unless the GPU has an inter_node_bandwidth ({gpu.name} has none)", data_parallel)
        if step_overhead is None:
            step_overhead = NO_ENGINE_STEP_OVERHEAD if engine.is_none else 0.0
        self.engine = engine
        self._pipeline = None
        if pp > 1:
            self._pipeline = Pipeline.build(model.num_layers, pp, tp, model.hidden, float(model.dtype_bytes), gpu,
                                            self.topology, link_model(gpu, self.topology), self.gpus_per_node)
        self._engine = engine.bind(max(self._pipeline.layers) if pp > 1 else model.num_layers, tp, classes=True)
        # calibrated per-class kernel factors (engine.py; 1.0 each unless calibrated: x * 1.0 is x, bit for bit)
        self._gemm_f, self._attn_f, self._comm_f, self._moe_f = engine.terms.class_scales
        self.factors = {"gemm_efficiency": gemm_efficiency, "attention_efficiency": attention_efficiency,
                        "memory_efficiency": memory_efficiency, "layer_overhead": layer_overhead,
                        "step_overhead": step_overhead, "topology": self.topology}
        if max(tp * pp, tp * data_parallel) > self.gpus_per_node:  # multi-node only (describe() unchanged)
            self.factors["gpus_per_node"] = self.gpus_per_node
        if pp > 1:
            self.factors["pp"] = pp
        if data_parallel > 1:
            self.factors["data_parallel"] = data_parallel
        if model.is_moe:
            self.factors["moe_imbalance"] = moe_imbalance
            self.factors["expert_parallel"] = expert_parallel
            self.factors["moe_routing"] = moe_routing
        if weight_group_size is None:
            weight_group_size = model.int4_group
        if model.weight_dtype == "int4":
            self.factors["weight_group_size"] = weight_group_size
        self._expert_parallel = expert_parallel
        self._moe_routing, self._group_size = moe_routing, weight_group_size
        self._fp8 = _fp8_compute(model, gpu)
        self._moe_imbalance = float(moe_imbalance)
        self._prefill_occupancy = prefill_occupancy
        if not prefill_occupancy:
            self.factors["prefill_occupancy"] = False
        self._precompute(gemm_efficiency, attention_efficiency, memory_efficiency, layer_overhead, step_overhead)

    @classmethod
    def from_config(cls, config: "RooflineCost.Config", model: ModelSpec) -> "RooflineCost":
        return cls(model, gpu_spec(config.gpu, "cost_model.gpu"), config.tp, config.gemm_efficiency,
                   config.attention_efficiency, config.memory_efficiency, config.layer_overhead,
                   config.step_overhead, load_engine(config.engine, "engine"), config.topology, config.moe_imbalance,
                   config.expert_parallel, config.gpus_per_node, config.pp, config.data_parallel, config.moe_routing,
                   config.weight_group_size, config.prefill_occupancy)

    def _precompute(self, gemm_eff, attn_eff, mem_eff, layer_overhead, step_overhead) -> None:
        """Fold the model, the GPU and the factors into per-feature constants (all Python floats).

        b: activation bytes (the dtype_bytes of old); wb: bytes per linear-layer weight (fp8: 1,
        int4: 0.5 plus its group scales and zero points); kvb: bytes per cached element. For a 16-bit
        model all three are 2.0 and every expression below is the one the dense presets always used."""
        m, g, tp, b = self.model, self.gpu, self.tp, float(self.model.dtype_bytes)
        self._wb = wb = _weight_bytes(m, self._group_size)
        self._curve = gemm_curve(g, self._fp8) if gemm_eff == "auto" else None
        self._tile = WEIGHT_ONLY_TILE if m.weight_dtype == "int4" else TILE  # Marlin's 16-row m-blocks
        self._lm_curve = gemm_curve(g) if gemm_eff == "auto" else None  # the LM head stays bf16
        self._gemm_rate = g.peak_flops(self._fp8) * (0.72 if gemm_eff == "auto" else gemm_eff)
        self._lm_rate = g.bf16_flops * (0.72 if gemm_eff == "auto" else gemm_eff)
        self._attn_rate = g.bf16_flops * attn_eff
        self._bw = g.hbm_bandwidth * mem_eff
        self._shapes = tuple((float(k), float(n)) for k, n in m.gemm_shapes(tp))  # (in, out) per GPU
        # per GEMM: (FLOPs per token, weight bytes, activation bytes per token)
        self._gemms = tuple((2.0 * k * n, k * n * wb, (k + n) * b) for k, n in m.gemm_shapes(tp))
        kvb = float(m.kv_elem_bytes)
        if m.is_mla:  # absorbed MLA: each head scores the latent + rope key, and sums latent values
            latent = m.kv_lora_rank + m.qk_rope_head_dim
            self._attn_flops_per_pair = 2.0 * m.heads_per_gpu(tp) * (latent + m.kv_lora_rank)
            # prefill runs the naive form: per head a (nope + rope) query-key product and a v-wide sum,
            # after kv_b decompresses every token the chunk reads (a GEMM over those tokens)
            self._mla_prefill = (2.0 * m.heads_per_gpu(tp) * (m.head_dim + m.v_head_dim),
                                 2.0 * m.kv_lora_rank * m.heads_per_gpu(tp) * (m.qk_nope_head_dim + m.v_head_dim))
            self._kv_bytes_per_token = latent * kvb  # one layer
            q, kv = m.heads_per_gpu(tp) * m.head_dim, float(latent)
        else:
            self._attn_flops_per_pair = 4.0 * m.heads_per_gpu(tp) * m.head_dim
            self._kv_bytes_per_token = 2.0 * m.kv_heads_per_gpu(tp) * m.head_dim * kvb  # one layer
            q, kv = m.heads_per_gpu(tp) * m.head_dim, m.kv_heads_per_gpu(tp) * m.head_dim
        mlp = m.intermediate // tp if not m.is_moe else _moe_mlp_width(m, tp)
        # 2 RMSNorms (read + write), RoPE on q and k (read + write), SiLU*up (read 2, write 1), 2 residual adds
        self._elementwise_bytes = (4.0 * m.hidden + 2.0 * (q + kv) + 3.0 * mlp + 6.0 * m.hidden) * b
        self._layers = float(m.num_layers)
        self._window = float(m.sliding_window)
        self._window_share = m.sliding_layers / m.num_layers  # fraction of layers whose attention is windowed
        self._layer_overhead = float(layer_overhead)
        vocab = m.vocab_per_gpu(tp)
        self._lm = (2.0 * m.hidden * vocab, m.hidden * vocab * b, (m.hidden + vocab) * b)
        self._lm_shape = (float(m.hidden), float(vocab))
        self._embed_bytes = 2.0 * m.hidden * b  # gather one row, write it
        self._num_allreduce = 2.0 * m.num_layers + 1.0 if tp > 1 else 0.0
        self._link = link_model(g, self.topology)
        self._custom_ar_max = float(self.engine.terms.custom_all_reduce_max_bytes)
        # the Triton fused-MoE kernel's exposed weight streaming (moe_gemms.py); int4 runs fused_marlin_moe: none
        self._moe_exposed = 0.0 if m.weight_dtype == "int4" else float(self.engine.terms.fused_moe_exposed)
        # a decode query-key pair in units of prefill pairs (1.0, or the per-query-head kernel's slower rate)
        self._decode_pairs = decode_pair_weight(m, self.engine.terms.decode_attention_per_query_head, attn_eff)
        self._heads = m.heads_per_gpu(tp)  # query heads per GPU: prefill attention's CTAs per query block
        self._sms = streaming_multiprocessors(g.name) if self._prefill_occupancy and not m.is_mla else 0
        self._allreduce_bytes_per_token = float(m.hidden) * b
        self._step_overhead = float(step_overhead)
        if m.is_moe:
            self._moe = MoEGemms(m, tp, self._moe_imbalance, wb, b, self._expert_parallel, self.data_parallel,
                                 self._moe_routing, weight_only=m.weight_dtype == "int4")
        self._stages = _stage_layers(m, self._pipeline.layers if self._pipeline else (m.num_layers,))
        self._staged = self._pipeline is not None or self.data_parallel > 1
        self._terms: dict[tuple[float, float], tuple] = {}  # _size_terms, remembered
        if self.data_parallel > 1:  # per token and GPU: k copies dispatched, k combined (DeepEP low-latency)
            k = float(m.experts_per_token)
            self._a2a_bytes = (k * m.hidden * _dispatch_bytes(m, self._fp8) / tp, k * m.hidden * b / tp)

    def _seconds(self, tokens: float, rows: float, pairs, kv_read, window=None, prefill=None):
        """Step time from aggregate features. tokens, rows: floats; pairs, kv_read: floats or arrays;
        window: (pairs, kv_read) capped at the sliding window, for a model that has one; prefill:
        (pairs, kv_read) of the prefill chunks alone, for an MLA model (their naive form)."""
        flops = self._attn_flops_per_pair * pairs
        if prefill is not None:  # MLA: the prefill pairs at the naive rate, plus decompressing their keys
            per_pair, per_key = self._mla_prefill
            flops = self._attn_flops_per_pair * (pairs - prefill[0]) + per_pair * prefill[0] + per_key * prefill[1]
        attention = _max(flops / self._attn_rate, self._kv_bytes_per_token * kv_read / self._bw)
        if window is not None:
            windowed = _max(self._attn_flops_per_pair * window[0] / self._attn_rate,
                            self._kv_bytes_per_token * window[1] / self._bw)
            attention = attention * (1.0 - self._window_share) + windowed * self._window_share
        attention = attention * self._attn_f
        gemm, streaming, lm_head, embed, collective = self._size_terms(tokens, rows)
        if self._staged:  # pipeline stages or data-parallel attention: per stage, GEMMs by layer kind
            rest = attention + streaming + self._layer_overhead
            return self._slowest_stage(tokens, rest, lm_head, embed) + self._step_overhead
        layer = gemm + attention + streaming + self._layer_overhead
        return layer * self._layers + lm_head + embed + collective + self._step_overhead

    def _size_terms(self, tokens: float, rows: float) -> tuple:
        """(one layer's GEMMs, one layer's streaming kernels, LM head, embedding, all-reduces) of a step of
        `tokens` tokens sampling `rows` rows: pure in (tokens, rows), so remembered (a decode run repeats
        one batch size step after step); GEMMs and all-reduces are None where stages price them."""
        key = (tokens, rows)
        terms = self._terms.get(key)
        if terms is None:
            if len(self._terms) >= SIZE_TERMS_CACHE:
                self._terms.clear()
            staged = self._staged
            terms = self._terms[key] = (
                None if staged else self._gemm_seconds(tokens), self._elementwise_bytes * tokens / self._bw,
                self._lm_seconds(rows) if rows > 0 else 0.0, self._embed_bytes * tokens / self._bw,
                None if staged else self.collective_time(tokens))
        return terms

    def _slowest_stage(self, tokens: float, rest, lm_head: float, embed: float):
        """The longest stage (elementwise over arrays): its GEMMs (dense and MoE layers apart), `rest`
        (attention, streaming kernels, fixed cost) per layer, its collectives and hand-off, the
        embedding on the first stage and the LM head on the last."""
        dense, moe = self._moe.layer_pair(self, tokens) if self.model.is_moe else (self._gemm_seconds(tokens),) * 2
        last = len(self._stages) - 1
        return slowest((layers - moe_layers) * dense + moe_layers * moe + layers * rest + self._stage_comm(tokens, s)
                       + (embed if s == 0 else 0.0) + (lm_head if s == last else 0.0)
                       for s, (layers, moe_layers) in enumerate(self._stages))

    def _stage_comm(self, tokens: float, stage: int) -> float:
        """Seconds stage `stage` spends communicating for a step of `tokens` tokens: its all-reduces (2 per
        layer, +1 for the embedding on the first stage, when tp > 1), its MoE layers' all-to-all dispatch and
        combine (data-parallel attention), and passing the activations on (pipeline)."""
        layers, moe_layers = self._stages[stage]
        comm = 0.0
        if self.tp > 1:
            count = 2.0 * layers + (1.0 if stage == 0 else 0.0)
            comm = count * self._allreduce(self._allreduce_bytes_per_token * tokens)
        if self.data_parallel > 1 and moe_layers:
            comm = comm + moe_layers * self.alltoall_time(tokens)
        comm = comm * self._comm_f
        if self._pipeline is not None:
            comm = comm + self._pipeline.handoff_seconds(tokens, stage)
        return comm

    def _allreduce(self, size: float) -> float:
        """One TP all-reduce of `size` bytes: NCCL by topology (across nodes when the group spans them), or
        vLLM's custom kernel where the engine uses it for this size (custom_allreduce.py)."""
        if self.tp > self.gpus_per_node:
            return multinode_allreduce_seconds(size, self.tp, self.gpus_per_node, self._link, self.topology,
                                               self.gpu.inter_node_bandwidth)
        if custom_allreduce.applies(size, self.tp, self.topology, self._custom_ar_max, True):
            return custom_allreduce.custom_allreduce_seconds(size, self.tp)
        return allreduce_seconds(size, self.tp, self._link, self.topology)

    def alltoall_time(self, tokens: float) -> float:
        """One MoE layer's dispatch + combine for a step of `tokens` tokens on this rank, every rank of
        the EP group sending as many (0 without data-parallel attention)."""
        if self.data_parallel <= 1 or tokens <= 0:
            return 0.0
        n, gpu = self.tp * self.data_parallel, self.gpu
        dispatch, combine = self._a2a_bytes
        return (alltoall_seconds(dispatch * tokens, n, self.gpus_per_node, self._link, self.topology,
                                 gpu.inter_node_bandwidth)
                + alltoall_seconds(combine * tokens, n, self.gpus_per_node, self._link, self.topology,
                                   gpu.inter_node_bandwidth))

    def step_time_among(self, shape: StepShape, share: float) -> float:
        """step_time with the routed experts receiving `share` x this step's tokens instead of
        data_parallel x (the ranks of data-parallel attention in lockstep, sim/dp_lockstep.py: every
        rank's tokens over this rank's). Staged pricing caches no GEMM term, so the swap is exact."""
        if not self.model.is_moe or self.data_parallel <= 1:
            return self.step_time(shape)
        moe, ranks = self._moe, self._moe.ranks
        moe.ranks = float(share)
        try:
            return self.step_time(shape)
        finally:
            moe.ranks = ranks

    def collective_time(self, tokens: float) -> float:
        """Seconds a step of `tokens` tokens spends in all-reduces (2 per layer, +1 for the embedding,
        when tp > 1; 0 on one GPU): the term `_seconds` adds. Asked after the run for the steps table
        (sim/metrics/step_efficiency.py)."""
        if self._staged:  # the stage that communicates longest
            return max(self._stage_comm(tokens, s) for s in range(len(self._stages)))
        return self._num_allreduce * self._allreduce(self._allreduce_bytes_per_token * tokens) * self._comm_f

    def _gemm_seconds(self, tokens: float) -> float:
        """One layer's GEMMs at `tokens` rows (a Python float, never an array); for an MoE model the
        mean over its dense and MoE layers."""
        if self.model.is_moe:
            return self._moe.layer_mean(self, tokens)
        return self._dense_gemm_seconds(tokens, self._shapes, self._gemms)

    def _dense_gemm_seconds(self, tokens: float, shapes, gemms) -> float:
        if self._curve is not None:
            curve, b, tile = self._curve, float(self.model.dtype_bytes), self._tile
            wb = None if self._wb == b else self._wb
            gemm = 0.0
            for k, n in shapes:
                gemm = gemm + curve.seconds(tokens, n, k, b, wb, tile)
            return gemm * self._gemm_f
        gemm = 0.0
        for flops, weights, acts in gemms:
            gemm = gemm + _max(flops * tokens / self._gemm_rate, (weights + acts * tokens) / self._bw)
        return gemm * self._gemm_f

    def _grouped_seconds(self, groups: float, rows: float, busiest: float, k: float, n: float,
                         tile: int = TILE) -> float:
        """A fused-MoE grouped GEMM: `groups` experts, `rows` token-expert rows, `busiest` per expert,
        padded to `tile`-row tiles on the curve (int4: fused_marlin_moe's block, moe_gemms.py)."""
        b = float(self.model.dtype_bytes)
        if self._curve is not None and tile != TILE:
            if rows <= 0 or groups <= 0:
                return 0.0
            return self._padded_grouped(groups * tile * math.ceil(busiest / tile), groups, rows, k, n)
        if self._curve is not None:
            return self._curve.grouped_seconds(groups, rows, n, k, b, self._wb, busiest, self._moe_exposed)
        if rows <= 0:
            return 0.0
        return _max(2.0 * groups * busiest * n * k / self._gemm_rate,
                    (groups * k * n * self._wb + rows * (k + n) * b) / self._bw)

    def _routed_seconds(self, tiles: float, groups: float, rows: float, k: float, n: float,
                        tile: int = TILE) -> float:
        """A fused-MoE grouped GEMM priced by its row tiles: compute on `tiles` whole `tile`-row tiles
        (TILE; int4: fused_marlin_moe's block, moe_gemms.py), memory the weights of `groups` experts and
        `rows` rows in and out (moe_routing random). The curve charges groups x whole tiles each, so it
        is given `tiles` groups of one tile whose weight bytes add up to the `groups` experts'."""
        if rows <= 0:
            return 0.0
        b = float(self.model.dtype_bytes)
        if self._curve is not None and tile != TILE:
            return self._padded_grouped(tiles * tile, groups, rows, k, n)
        if self._curve is not None:
            return self._curve.grouped_seconds(tiles, rows, n, k, b, self._wb * groups / tiles, float(TILE),
                                               self._moe_exposed)
        return _max(2.0 * tiles * tile * n * k / self._gemm_rate,
                    (groups * k * n * self._wb + rows * (k + n) * b) / self._bw)

    def _padded_grouped(self, padded: float, groups: float, rows: float, k: float, n: float) -> float:
        """A grouped GEMM on the curve computing `padded` rows in all (whole tiles of any height), reading
        `groups` experts' weights and `rows` rows in and out. The curve pads to TILE-row tiles only, so it
        is given padded / TILE groups of one TILE each, their weight bytes adding up to the `groups`
        experts' (the same compute, memory and one fixed cost)."""
        units = padded / TILE
        return self._curve.grouped_seconds(units, rows, n, k, float(self.model.dtype_bytes),
                                           self._wb * groups / units, float(TILE))

    def _bf16_gemm_seconds(self, rows: float, k: float, n: float) -> float:
        """A small 16-bit GEMM outside the quantised layers (the MoE router)."""
        b = float(self.model.dtype_bytes)
        if self._lm_curve is not None:
            return self._lm_curve.seconds(rows, n, k, b)
        return _max(2.0 * k * n * rows / self._lm_rate, (k * n + (k + n) * rows) * b / self._bw)

    def _lm_seconds(self, rows: float) -> float:
        """The LM head GEMM over the sampled rows (16-bit weights and compute at every precision)."""
        if self._lm_curve is not None:
            k, n = self._lm_shape
            return self._lm_curve.seconds(rows, n, k, float(self.model.dtype_bytes)) * self._gemm_f
        flops, weights, acts = self._lm
        return _max(flops * rows / self._lm_rate, (weights + acts * rows) / self._bw) * self._gemm_f

    def step_time(self, shape: StepShape) -> float:
        if shape.is_empty:
            return 0.0
        window = self._window_features(shape) if self._window else None
        return self._rows_time(shape.prefill, len(shape.decode), sum(shape.decode), shape.tokens_sampled, window)

    def mixed_step_time(self, prefill, contexts, offset: int, context_sum: int, sampled: int) -> float:
        """step_time from the decode rows' count and context sum, O(1) in them; a sliding window reads
        each row's context, so a windowed model prices the rows themselves."""
        if self._window or not (prefill or contexts):
            return CostModel.mixed_step_time(self, prefill, contexts, offset, context_sum, sampled)
        return self._rows_time(prefill, len(contexts), context_sum, sampled, None)

    def _rows_time(self, prefill, rows: int, decode_read: int, sampled: int, window) -> float:
        """A step's seconds from its prefill rows (c, h), its decode rows' count and context sum, the tokens
        it samples and, for a windowed model, its capped reads (_window_features)."""
        tokens = rows
        pairs = 0.0
        kv_read = 0
        for c, h in prefill:
            tokens += c
            pairs += c * (h + (c + 1) / 2)
            kv_read += c + h
        if prefill and self._sms:  # the attention kernel's wave efficiency on these chunks (attention_structure.py)
            pairs = pairs / prefill_efficiency(prefill, self._heads, self._sms, self.model.head_dim)
        mla = (pairs, float(kv_read)) if self.model.is_mla and prefill else None
        padded = self._engine.graph_tokens(tokens, len(prefill))  # a graph step runs at its captured size
        gpu = self._seconds(float(padded), float(sampled), pairs + self._decode_pairs * decode_read,
                            float(kv_read + decode_read), window, mla)
        return self._engine.step_for(gpu, len(prefill) + rows, len(prefill), tokens)

    def _window_features(self, shape: StepShape) -> tuple[float, float]:
        """(pairs, kv_read) of a step when every query sees at most `window` keys (itself included)."""
        w = int(self._window)
        pairs, kv_read = 0, 0
        for c, h in shape.prefill:
            first, last = h + 1, h + c  # keys the chunk's first and last query see, uncapped
            if last <= w:
                pairs += (first + last) * c // 2
            elif first > w:
                pairs += c * w
            else:
                pairs += (first + w) * (w - first + 1) // 2 + (last - w) * w
            kv_read += min(c + h, w + c - 1)
        decode = sum(min(d, w) for d in shape.decode)
        efficiency = prefill_efficiency(shape.prefill, self._heads, self._sms, self.model.head_dim)
        return float(pairs) / efficiency + self._decode_pairs * decode, float(kv_read + decode)

    def decode_step_time(self, contexts, offset: int, context_sum: int) -> float:
        return self.mixed_step_time((), contexts, offset, context_sum, len(contexts))

    def decode_run_times(self, contexts: np.ndarray, steps: int) -> np.ndarray:
        n, read = decode_run_reads(contexts, steps)
        if n == 0:
            return np.zeros(steps, dtype=np.float64)
        window = None
        if self._window:
            capped = _capped_decode_reads(contexts, steps, int(self._window))
            window = (self._decode_pairs * capped, capped)
        padded = self._engine.graph_tokens(n, 0)
        gpu = np.asarray(self._seconds(float(padded), float(n), self._decode_pairs * read, read, window), dtype=np.float64)
        return self._engine.step_many(gpu, n)

    def describe(self) -> dict:
        return {"type": self.name, "model": self.model.name, "gpu": self.gpu.name, "tp": self.tp, **self.factors,
                "engine": self.engine.describe()}


def _placement(gpu: GPUSpec, tp: int, topology: str, gpus_per_node: int | None) -> int:
    """GPUs per node of a TP group (the catalog's unless given), checked: a group that spans nodes
    fills whole nodes and needs the GPU's network bandwidth; the 8-GPU node models cap a node at 8
    GPUs except on NVSwitch."""
    per_node = catalog_gpus_per_node(gpu) if gpus_per_node is None else gpus_per_node
    key = "cost_model.gpus_per_node"
    require(isinstance(per_node, int) and not isinstance(per_node, bool) and per_node >= 1, key,
            "an integer >= 1", per_node)
    require(topology == "nvswitch" or per_node <= 8, key,
            f"at most 8 on a {topology} node (its all-reduce model covers 8 GPUs)", per_node)
    if tp > per_node:
        require(tp % per_node == 0, key, f"a divisor of tp ({tp}) when the group spans nodes", per_node)
        require(gpu.inter_node_bandwidth > 0, key, f"at least tp ({tp}) unless the GPU has an inter_node_bandwidth "
                f"({gpu.name} has none: give gpu as a mapping with one)", per_node)
    return per_node


def _check_data_parallel(model: ModelSpec, tp: int, dp: int, expert_parallel: bool) -> None:
    """ConfigError at cost_model.data_parallel unless data-parallel attention has experts to share."""
    if dp == 1:
        return
    key = "cost_model.data_parallel"
    require(model.is_moe, key, f"1 for a dense model ({model.name} has no experts: data-parallel copies of a dense "
            "model are cluster.replicas)", dp)
    require(expert_parallel, key, "1 unless expert_parallel is true (the ranks share the experts by expert "
            "parallelism)", dp)
    require(model.num_experts % (tp * dp) == 0, key, f"a degree with tp x data_parallel dividing the "
            f"{model.num_experts} experts of {model.name} (tp {tp})", dp)


def _stage_layers(model: ModelSpec, layers: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(layers, MoE layers) of each pipeline stage, in order."""
    out, start = [], 0
    for n in layers:
        out.append((n, sum(model.moe_layer(i) for i in range(start, start + n))))
        start += n
    return tuple(out)


def _dispatch_bytes(model: ModelSpec, fp8: bool) -> float:
    """Bytes per element of a dispatched token: fp8 with one float32 scale per 128 elements when the
    experts run fp8 GEMMs (DeepEP's FP8 dispatch, as SGLang and vLLM use it for DeepSeek-V3's block-fp8
    weights), else the activation width; the combine returns 16-bit outputs either way."""
    return 1.0 + 4.0 / 128.0 if fp8 else float(model.dtype_bytes)


def _weight_bytes(model: ModelSpec, group_size: int) -> float:
    """Bytes a GEMM reads per linear-layer weight: its width, and for int4 the 16-bit scale and packed
    4-bit zero point of its group of `group_size` (module docstring: fp8 scales are below 0.1 %)."""
    wb = model.weight_bits / 8.0
    if model.weight_dtype == "int4":
        wb += (INT4_GROUP_SCALE_BYTES + INT4_GROUP_ZERO_BYTES) / group_size
    return wb


def _fp8_compute(model: ModelSpec, gpu: GPUSpec) -> bool:
    """Whether the linear layers' GEMMs run at the FP8 peak: fp8 weights on a GPU with FP8 tensor
    cores (compute_dtype auto or fp8); an explicit fp8 on a GPU without them is an error."""
    if model.compute_dtype == "fp8" and gpu.fp8_flops <= 0:
        raise ConfigError("gpu", f"a GPU with FP8 tensor cores for the model's compute_dtype fp8 ({gpu.name} has none; "
                          "use compute_dtype auto or bf16)", gpu.name)
    return model.compute_dtype != "bf16" and model.weight_dtype == "fp8" and gpu.fp8_flops > 0


def _moe_mlp_width(m: ModelSpec, tp: int) -> float:
    """Intermediate activations per token of one layer, averaged over dense and MoE layers."""
    moe = m.num_moe_layers
    routed = m.experts_per_token * m.moe_intermediate + m.num_shared_experts * (m.shared_intermediate or m.moe_intermediate)
    return ((m.num_layers - moe) * m.intermediate + moe * routed) / m.num_layers / tp


def _capped_decode_reads(contexts: np.ndarray, steps: int, window: int) -> np.ndarray:
    """sum(min(context_i + j, window)) for each decode step j (float64, exact integers)."""
    c = np.sort(np.asarray(contexts, dtype=np.int64))
    prefix = np.concatenate(([0], np.cumsum(c)))
    j = np.arange(steps, dtype=np.int64)
    below = np.searchsorted(c, window - j, side="left")  # sequences still inside the window at step j
    return (prefix[below] + j * below + window * (len(c) - below)).astype(np.float64)
