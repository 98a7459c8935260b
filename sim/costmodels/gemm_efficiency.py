"""Shape-dependent time and efficiency of one bf16 GEMM on one GPU (M tokens, K in, N out features).

    t(M, N, K) = t0 + max(2 * Mp * N * K / (peak * c),  (K*N + M*(K + N)) * 2 / (hbm * e_mem))
    Mp = TILE * ceil(M / TILE)                      (M padded to whole 128-row output tiles)
    efficiency(M, N, K) = roofline bound / t,  bound = max(2*M*N*K / peak, bytes / hbm)

Three physical effects and four constants per GPU: a fixed cost t0 (launch, prologue, tail wave)
that dominates narrow TP shards at few tokens; a compute rate c of the dense peak reached on whole
tiles; the tile staircase (a GEMM of 129 tokens costs what one of 256 does: Vidur's tables are flat
across each 128-token window and jump just past it); and a weight-streaming rate e_mem of HBM
bandwidth at few tokens. So efficiency rises with M within the compute regime (t0 and padding
amortised), dips near the ridge point, and falls for narrow shards (small N*K per GPU), whose
time is mostly t0. Smoother forms were tried (M/(M+m0) compute ramp, K/(K+k0) depth factor, wave
quantisation over the SMs, a p-norm blend of the two regimes): none improved p90 by more than one
point, and the blend needed e_mem > 1.

Invariant: `gemm_seconds` is a pure function of Python scalars (no numpy), so a caller that
evaluates it on the same token count always gets the same float.

Fit: `python validation/fit_gemm_collectives.py` (log-ratio least squares) on every row of Vidur's
published token-operator tables, shared/data/vidur/data/profiling/compute/<gpu>/*/*/mlp.csv
(microsoft/vidur 7d47513, MIT): columns time_stats.{attn_pre_proj, attn_post_proj, mlp_up_proj,
mlp_down_proj}.median by num_tokens (1..4096, Llama-3: ..32768) and num_tensor_parallel_workers
(1, 2, 4, 8), with the per-GPU shapes of each model's QKV, O, gate+up and down projections. A100:
8 models (Llama-2-7B/70B, Llama-3-8B/70B, CodeLlama-34B, Qwen-72B, InternLM-20B, phi-2), 36,516
GEMMs; H100: 6 models (no Llama-3), 21,924 GEMMs. Relative error of predicted GEMM time:

    GPU    this curve: median / p90     one factor (0.72 of peak, 0.8 of HBM): median / p90
    A100   5.0 % / 13.9 %               7.1 % / 28.8 %
    H100   7.6 % / 20.3 %               14.0 % / 43.8 %

H100's kernel choice is noisier (its tables jump at 64-token steps too). H200 has no published
table: it takes H100's compute form (same SXM5 die) with its own HBM bandwidth. GPUs of no fitted
family (B200, L40S, L4, A10, MI300X, MI325X: GPUSpec.family '') take H100's constants on their own
peaks, an extrapolation whose error is unknown.

Weight-only int4 GEMMs pad rows as their kernels do, to WEIGHT_ONLY_TILE = 16 (`tile`): vLLM runs AWQ and
GPTQ checkpoints with the Marlin kernel (awq_marlin, gptq_marlin), whose thread block covers
thread_m_blocks x 16 rows, 1 to 4 blocks (64 rows), more rows in parallel 64-row slices
(vllm-project/vllm csrc/quantization/gptq_marlin/gptq_marlin.cu @6ee29e8847d9: marlin_mm pads
`tot_m_blocks = div_ceil(prob_m, 16)`, `pad = 16 * tot_m_blocks - tot_m`; determine_reduce_max_m
steps 16, 32, 48, 64, then 64 x par; the m16n8k16 mma.sync tile). So a decode of 8 sequences
computes 16 rows, not 128, and stays weight-streaming up to the ridge (~55 rows on H100 at 0.52
bytes a weight), as the MARLIN paper reports (Frantar et al., PPoPP 2025: near 4x over fp16 up to
batch 16-32, less up to 64-128). Machete (vLLM's Hopper kernel for compressed-tensors W4A16;
csrc/quantization/machete/generate.py @a0bba9bf09d7 default_heuristic) picks 16-, 32- or 64-row
token tiles up to 64 rows and 32-256 beyond: the same 16 below 17 rows, at most one tile's
padding apart above (not modelled). An int4 GEMM's compute fraction c and t0 are the bf16 fit's (no int4 table
was fitted: an assumption; Marlin's mma.sync cannot reach Hopper's wgmma peak at large M, so int4
prefill on H100/H200 is likely optimistic). bf16 and fp8 keep TILE, bit for bit.

Precision: an fp8 GEMM (fp8 weights and compute) runs on the fp8 peak with the same fraction c, and
streams its weights at their own width (`weight_bytes`: 1 for fp8, 0.5 for int4 weight-only, whose
GEMM computes at the bf16 peak); activations stay 16-bit. No fp8 or int4 table was fitted: the same
c and e_mem on fp8 are an assumption (FP8 GEMMs in published H100 benchmarks reach a similar or
lower fraction of their doubled peak).
"""
from __future__ import annotations

import math
from types import MappingProxyType

TILE = 128  # output-tile rows in M; 64 and 256 fit worse on A100 (p90 15.0 %, 23.1 %), tie on H100
WEIGHT_ONLY_TILE = 16  # rows of one Marlin m-block (int4 weight-only GEMMs; module docstring)

# gpu family -> (t0 seconds, compute fraction c of dense peak, HBM fraction e_mem), fitted as above
CONSTANTS = MappingProxyType({
    "a100": (7.15e-6, 0.727, 0.739),
    "h100": (7.73e-6, 0.690, 0.955),
})
FIT_ERROR = MappingProxyType({  # median / p90 absolute relative error of GEMM time on the tables
    "a100": (0.050, 0.139),
    "h100": (0.076, 0.203),
})


def family(gpu_name: str) -> str:
    """The fitted GPU whose constants a GPU uses (H200 and unfitted GPUs: H100's)."""
    return "a100" if gpu_name.startswith("a100") else "h100"


class GemmCurve:
    """GEMM seconds and efficiency on one GPU (peak FLOP/s and HBM bytes/s from its spec)."""

    __slots__ = ("peak", "hbm", "t0", "compute_rate", "memory_rate")

    def __init__(self, peak_flops: float, hbm_bandwidth: float, gpu_name: str):
        t0, c, e_mem = CONSTANTS[family(gpu_name)]
        self.peak, self.hbm, self.t0 = float(peak_flops), float(hbm_bandwidth), t0
        self.compute_rate, self.memory_rate = self.peak * c, self.hbm * e_mem

    def seconds(self, m: float, n: float, k: float, dtype_bytes: float = 2.0, weight_bytes: float | None = None,
                tile: int = TILE) -> float:
        """Time of one (M x K) @ (K x N) GEMM; 0 when there are no rows. `weight_bytes` per weight
        when it differs from the activations' `dtype_bytes` (fp8, int4); M padded to whole `tile`-row
        tiles (WEIGHT_ONLY_TILE for int4 weight-only kernels)."""
        if m <= 0:
            return 0.0
        padded = tile * math.ceil(m / tile)
        compute = 2.0 * padded * n * k / self.compute_rate
        if weight_bytes is None or weight_bytes == dtype_bytes:
            memory = (k * n + m * (k + n)) * dtype_bytes / self.memory_rate
        else:
            memory = (k * n * weight_bytes + m * (k + n) * dtype_bytes) / self.memory_rate
        return self.t0 + (compute if compute >= memory else memory)

    def grouped_seconds(self, groups: float, rows: float, n: float, k: float, dtype_bytes: float = 2.0,
                        weight_bytes: float | None = None, busiest: float | None = None,
                        exposed: float = 0.0) -> float:
        """One grouped GEMM (a fused MoE kernel): `groups` weight matrices of (K x N), `rows` rows in
        all; compute is charged as if every group had `busiest` rows (default the mean) padded to
        whole tiles; one fixed cost. 0 when there are no rows. `exposed`: the fraction of the shorter
        of the rows' useful compute and the memory time that the kernel does not hide under the longer
        (moe_gemms.FUSED_MOE_EXPOSED for vLLM's Triton fused_moe; 0: perfect overlap, the dense rule)."""
        if rows <= 0 or groups <= 0:
            return 0.0
        wb = dtype_bytes if weight_bytes is None else weight_bytes
        per_group = rows / groups if busiest is None else busiest
        padded = groups * TILE * math.ceil(per_group / TILE)
        compute = 2.0 * padded * n * k / self.compute_rate
        memory = (groups * k * n * wb + rows * (k + n) * dtype_bytes) / self.memory_rate
        seconds = self.t0 + (compute if compute >= memory else memory)
        if exposed:
            useful = 2.0 * rows * n * k / self.compute_rate
            seconds = seconds + exposed * (useful if useful <= memory else memory)
        return seconds

    def efficiency(self, m: float, n: float, k: float, dtype_bytes: float = 2.0) -> float:
        """Fraction of the roofline bound max(FLOPs / peak, bytes / HBM) this GEMM reaches."""
        bound = max(2.0 * m * n * k / self.peak, (k * n + m * (k + n)) * dtype_bytes / self.hbm)
        return bound / self.seconds(m, n, k, dtype_bytes)


def gemm_curve(gpu, fp8: bool = False) -> GemmCurve:
    """The curve of a GPUSpec, at its fp8 peak when `fp8` (and it has one)."""
    name = getattr(gpu, "family", "") or gpu.name
    peak = gpu.peak_flops(fp8) if hasattr(gpu, "peak_flops") else gpu.bf16_flops
    return GemmCurve(peak, gpu.hbm_bandwidth, name)
