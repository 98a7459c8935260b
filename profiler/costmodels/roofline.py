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
tables; `topology:` defaults to the GPU's); then the serving engine around the kernels (engine.py; with `engine: none`, a constant
`step_overhead` of 300 µs for the engine's CPU work, as before that component existed). KV swap bytes are not charged:
the replica adds host-link time itself.

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

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from cbsim.schema import option, require
from cbsim.sim.cost import CostModel, decode_run_reads
from cbsim.sim.shape import StepShape

from ..specs import GPUSpec, ModelSpec, gpu_spec
from .collectives import Topology, allreduce_seconds, link_model
from .engine import NO_ENGINE, Engine, engine_option, load_engine
from .gemm_efficiency import gemm_curve
from .registry import register_cost_model

NO_ENGINE_STEP_OVERHEAD = 300e-6  # the CPU work per step this model charged before the engine component


def _max(a, b):
    """Elementwise maximum of floats or numpy arrays (identical results on both)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.maximum(a, b)
    return a if a >= b else b


@register_cost_model("roofline")
class RooflineCost(CostModel):
    """Roofline step time of a dense Llama-style model on one tensor-parallel group."""

    @dataclass
    class Config:
        gpu: str = option("h100", help="GPU preset: a100, h100, h200 (aliases a100-80gb, h100-sxm)")
        tp: int = option(1, help="tensor-parallel degree: 1, 2, 4 or 8")
        gemm_efficiency: Literal["auto"] | float = option(
            "auto", help="auto: shape-dependent GEMM curve fitted on Vidur's tables (gemm_efficiency.py); "
            "a number: one fraction of dense bf16 peak for every GEMM (0.72 before the curve)")
        topology: Topology | None = option(
            None, help="how the TP group connects, for the all-reduce: nvswitch, nvlink_pairwise, pcie "
            "(default: the GPU's; nvswitch for the SXM presets)")
        attention_efficiency: float = option(0.4, help="fraction of dense bf16 peak prefill attention reaches")
        memory_efficiency: float = option(0.8, help="fraction of peak HBM bandwidth streaming kernels reach")
        layer_overhead: float = option(15e-6, help="fixed seconds per layer for small kernels (norms, RoPE, adds)")
        step_overhead: float | None = option(
            None, help="fixed seconds per step for the engine's CPU work when engine is none (default 300e-6); "
            "with an engine its host terms cover this (default 0)")
        engine: Any = engine_option()

        def validate(self) -> None:
            gpu_spec(self.gpu, "gpu")
            require(self.tp in (1, 2, 4, 8), "tp", "one of 1, 2, 4, 8", self.tp)
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
                 topology: str | None = None):
        model.check_tp(tp, "cost_model.tp")
        self.model, self.gpu, self.tp = model, gpu, tp
        self.topology = topology or gpu.topology
        if step_overhead is None:
            step_overhead = NO_ENGINE_STEP_OVERHEAD if engine.is_none else 0.0
        self.engine = engine
        self._engine = engine.bind(model.num_layers, tp)
        self.factors = {"gemm_efficiency": gemm_efficiency, "attention_efficiency": attention_efficiency,
                        "memory_efficiency": memory_efficiency, "layer_overhead": layer_overhead,
                        "step_overhead": step_overhead, "topology": self.topology}
        self._precompute(gemm_efficiency, attention_efficiency, memory_efficiency, layer_overhead, step_overhead)

    @classmethod
    def from_config(cls, config: "RooflineCost.Config", model: ModelSpec) -> "RooflineCost":
        return cls(model, gpu_spec(config.gpu, "cost_model.gpu"), config.tp, config.gemm_efficiency,
                   config.attention_efficiency, config.memory_efficiency, config.layer_overhead,
                   config.step_overhead, load_engine(config.engine, "engine"), config.topology)

    def _precompute(self, gemm_eff, attn_eff, mem_eff, layer_overhead, step_overhead) -> None:
        """Fold the model, the GPU and the factors into per-feature constants (all Python floats)."""
        m, g, tp, b = self.model, self.gpu, self.tp, float(self.model.dtype_bytes)
        self._curve = gemm_curve(g) if gemm_eff == "auto" else None
        self._gemm_rate = g.bf16_flops * (0.72 if gemm_eff == "auto" else gemm_eff)
        self._attn_rate = g.bf16_flops * attn_eff
        self._bw = g.hbm_bandwidth * mem_eff
        self._shapes = tuple((float(k), float(n)) for k, n in m.gemm_shapes(tp))  # (in, out) per GPU
        # per GEMM: (FLOPs per token, weight bytes, activation bytes per token)
        self._gemms = tuple((2.0 * k * n, k * n * b, (k + n) * b) for k, n in m.gemm_shapes(tp))
        self._attn_flops_per_pair = 4.0 * m.heads_per_gpu(tp) * m.head_dim
        self._kv_bytes_per_token = 2.0 * m.kv_heads_per_gpu(tp) * m.head_dim * b  # one layer
        q, kv, mlp = m.heads_per_gpu(tp) * m.head_dim, m.kv_heads_per_gpu(tp) * m.head_dim, m.intermediate // tp
        # 2 RMSNorms (read + write), RoPE on q and k (read + write), SiLU*up (read 2, write 1), 2 residual adds
        self._elementwise_bytes = (4.0 * m.hidden + 2.0 * (q + kv) + 3.0 * mlp + 6.0 * m.hidden) * b
        self._layers = float(m.num_layers)
        self._layer_overhead = float(layer_overhead)
        vocab = m.vocab_per_gpu(tp)
        self._lm = (2.0 * m.hidden * vocab, m.hidden * vocab * b, (m.hidden + vocab) * b)
        self._lm_shape = (float(m.hidden), float(vocab))
        self._embed_bytes = 2.0 * m.hidden * b  # gather one row, write it
        self._num_allreduce = 2.0 * m.num_layers + 1.0 if tp > 1 else 0.0
        self._link = link_model(g.name, self.topology)
        self._allreduce_bytes_per_token = float(m.hidden) * b
        self._step_overhead = float(step_overhead)

    def _seconds(self, tokens: float, rows: float, pairs, kv_read):
        """Step time from aggregate features. tokens, rows: floats; pairs, kv_read: floats or arrays."""
        gemm = self._gemm_seconds(tokens)
        attention = _max(self._attn_flops_per_pair * pairs / self._attn_rate,
                         self._kv_bytes_per_token * kv_read / self._bw)
        layer = gemm + attention + self._elementwise_bytes * tokens / self._bw + self._layer_overhead
        lm_head = self._lm_seconds(rows) if rows > 0 else 0.0
        embed = self._embed_bytes * tokens / self._bw
        allreduce = self._num_allreduce * allreduce_seconds(
            self._allreduce_bytes_per_token * tokens, self.tp, self._link, self.topology)
        return layer * self._layers + lm_head + embed + allreduce + self._step_overhead

    def _gemm_seconds(self, tokens: float) -> float:
        """One layer's four GEMMs at `tokens` rows (a Python float, never an array)."""
        if self._curve is not None:
            curve, b = self._curve, float(self.model.dtype_bytes)
            gemm = 0.0
            for k, n in self._shapes:
                gemm = gemm + curve.seconds(tokens, n, k, b)
            return gemm
        gemm = 0.0
        for flops, weights, acts in self._gemms:
            gemm = gemm + _max(flops * tokens / self._gemm_rate, (weights + acts * tokens) / self._bw)
        return gemm

    def _lm_seconds(self, rows: float) -> float:
        """The LM head GEMM over the sampled rows."""
        if self._curve is not None:
            k, n = self._lm_shape
            return self._curve.seconds(rows, n, k, float(self.model.dtype_bytes))
        flops, weights, acts = self._lm
        return _max(flops * rows / self._gemm_rate, (weights + acts * rows) / self._bw)

    def step_time(self, shape: StepShape) -> float:
        if shape.is_empty:
            return 0.0
        tokens = len(shape.decode)
        pairs = 0.0
        kv_read = 0
        for c, h in shape.prefill:
            tokens += c
            pairs += c * (h + (c + 1) / 2)
            kv_read += c + h
        decode_read = sum(shape.decode)
        gpu = self._seconds(float(tokens), float(shape.tokens_sampled), pairs + float(decode_read),
                            float(kv_read + decode_read))
        return self._engine.step_of(gpu, shape)

    def decode_run_times(self, contexts: np.ndarray, steps: int) -> np.ndarray:
        n, read = decode_run_reads(contexts, steps)
        if n == 0:
            return np.zeros(steps, dtype=np.float64)
        gpu = np.asarray(self._seconds(float(n), float(n), 0.0 + read, read), dtype=np.float64)
        return self._engine.step_many(gpu, n)

    def describe(self) -> dict:
        return {"type": self.name, "model": self.model.name, "gpu": self.gpu.name, "tp": self.tp, **self.factors,
                "engine": self.engine.describe()}

