"""cbsim's MoE terms against published numbers, printed as predicted vs published with the source of each row.

1. The all-to-all (collectives.alltoall_seconds as the roofline charges it with data_parallel):
   DeepEP's low-latency kernels, deepseek-ai/DeepEP docs/legacy.md (commit 0297fc80, "Low-latency kernels
   with pure RDMA"): H800, one 400 Gb/s CX7 NIC per GPU (~50 GB/s), 128 tokens per rank, hidden 7168, top-8,
   FP8 dispatch, BF16 combine, latency per call. Kernel times: no engine around them.
2. Whole runs of data-parallel attention + EP: TensorRT-LLM trtllm-bench throughput (Total Output
   Throughput, tokens/s), NVIDIA/TensorRT-LLM
   - docs/source/performance/perf-overview.md (commit 00f37686): Qwen3-235B-A22B FP8, TP8 EP8 with
     enable_attention_dp, H200 and H100, kv_cache_free_gpu_mem_fraction 0.95, all requests queued;
   - docs/source/blogs/Best_perf_practice_on_DeepSeek-R1_in_TensorRT-LLM.md (commit 01c4ece9) "H200
     max-throughput": DeepSeek-R1 (DeepSeek-V3's architecture) FP8, TP8 EP8 attention DP, ISL 1024 /
     OSL 2048, 5,120 requests at concurrency 1,024, max_batch_size 128, max_num_tokens 1,151, KV
     fraction 0.8: 11,489 tokens/s.
   cbsim runs 8 replicas (one per attention rank) of roofline data_parallel 8, engine trtllm (whose host
   terms are 0: no public per-step host timings, so engine overhead is not separated from GPU time
   here; the published numbers include it), num_blocks auto (each rank holds 1/8 of the routed
   experts: kv_cache_blocks(data_parallel=8)).
   The same rows with TP attention (data_parallel 1, one TP8 replica) are printed for comparison.
3. Whole runs of MoE with the experts split tp ways (no EP): TensorRT-LLM v0.17's table,
   NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md (commit 258c7540, "All data ... version
   0.17", output tokens/s, TensorRT engines built with --quantization FP8, which sets an FP8 KV cache;
   A100 at FP16): Mixtral-8x7B at TP1-8 on H100/H200 and TP2-8 on A100, Mixtral-8x22B TP8, after dense
   rows of the same table (Llama-3.1-8B/70B, Mistral-7B) as the baseline to read them against. cbsim: one
   replica, roofline on the same GPU and TP, engine trtllm, sarathi 8,192 tokens / 2,048 sequences,
   KV fraction 0.95 (as validation/validate_trtllm_fp8.py).
Run: python validation/validate_moe.py [quick] [mean]   (cost_model.moe_routing: random by default, the
expected load of uniform random routing, sim/costmodels/routing.py; mean: every expert at the mean)
"""
from __future__ import annotations

import sys
import time

from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.costmodels.collectives import alltoall_seconds
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.costmodels.catalog.specs import GiB
from validate_trtllm_fp8 import offline_throughput  # the shared trtllm-bench setup (same folder)

# H800 SXM: H100 silicon with NVLink cut to 400 GB/s (200 GB/s one way; DeepEP: "~160 GB/s NVLink maximum
# bandwidth" measured) and, in DeepEP's cluster, one 400 Gb/s NIC per GPU.
H800 = {"name": "h800", "memory_bytes": 80 * GiB, "bf16_flops": 989e12, "fp8_flops": 1979e12, "hbm_bandwidth": 3.35e12,
        "link_bandwidth": 200e9, "topology": "nvswitch", "inter_node_bandwidth": 50e9, "pcie_bandwidth": 64e9}
DEEPEP_LL = {8: (77e-6, 114e-6), 16: (118e-6, 195e-6), 32: (155e-6, 273e-6), 64: (173e-6, 314e-6),
             128: (192e-6, 369e-6), 256: (194e-6, 360e-6)}  # EP: (dispatch, combine) latency
TRTLLM = "NVIDIA/TensorRT-LLM perf-overview.md @00f37686"
QWEN3 = {("h200", (128, 128)): 30429, ("h200", (128, 2048)): 42821, ("h200", (128, 4096)): 26852,
         ("h200", (500, 2000)): 28026, ("h200", (1000, 1000)): 23789, ("h200", (1000, 2000)): 22061,
         ("h200", (2048, 128)): 3331, ("h200", (2048, 2048)): 16672, ("h200", (5000, 500)): 3623,
         ("h100", (128, 2048)): 19658, ("h100", (128, 4096)): 12447, ("h100", (500, 2000)): 18351,
         ("h100", (1000, 1000)): 14898, ("h100", (1000, 2000)): 15136, ("h100", (2048, 2048)): 9924,
         ("h100", (5000, 500)): 3225}
REQUESTS = {(128, 128): 30000, (128, 2048): 3000, (128, 4096): 1500, (1000, 2000): 1500, (2048, 128): 3000,
            (2048, 2048): 1500, (5000, 500): 1500, (1000, 1000): 3000, (500, 2000): 3000}  # the doc's $num_requests


TRTLLM_017 = "NVIDIA/TensorRT-LLM perf-overview.md @258c7540 (v0.17)"
MIXTRAL = {  # (model, gpu, tp) -> {(isl, osl): output tokens/s}
    ("mixtral-8x7b", "h200", 1): {(128, 2048): 15095.21, (1000, 1000): 10371.36, (2048, 128): 2009.67, (5000, 500): 2309.1},
    ("mixtral-8x7b", "h100", 1): {(128, 2048): 8290.13, (1000, 1000): 6868.52, (2048, 128): 1892.81, (5000, 500): 1764.7},
    ("mixtral-8x7b", "h200", 2): {(128, 2048): 29584.05, (1000, 1000): 19151.19, (2048, 128): 3383.16, (5000, 500): 4223.68},
    ("mixtral-8x7b", "h100", 2): {(128, 2048): 22830.08, (1000, 1000): 15770.89, (2048, 128): 3333.68, (5000, 500): 3646.09},
    ("mixtral-8x7b", "a100", 2): {(128, 2048): 4169.78, (1000, 1000): 3154.52, (2048, 128): 649, (5000, 500): 724.44},
    ("mixtral-8x7b", "h200", 4): {(128, 2048): 52291.78, (1000, 1000): 33580.9, (2048, 128): 5467.62, (5000, 500): 7084.94},
    ("mixtral-8x7b", "h100", 4): {(128, 2048): 41164.73, (1000, 1000): 27784.74, (2048, 128): 5234.98, (5000, 500): 6401.56},
    ("mixtral-8x7b", "a100", 4): {(128, 2048): 10911.86, (1000, 1000): 7122.84, (2048, 128): 1237.62, (5000, 500): 1500.55},
    ("mixtral-8x7b", "h200", 8): {(128, 2048): 68608.45, (1000, 1000): 44705.48, (2048, 128): 7554.38, (5000, 500): 10271.8},
    ("mixtral-8x7b", "h100", 8): {(128, 2048): 61607.7, (1000, 1000): 40631.71, (2048, 128): 6988.18, (5000, 500): 9210.11},
    ("mixtral-8x7b", "a100", 8): {(128, 2048): 20277.88, (1000, 1000): 12851.44, (2048, 128): 2165.52, (5000, 500): 2761.28},
    ("mixtral-8x22b", "h200", 8): {(128, 2048): 32415.81, (1000, 1000): 19712.35, (2048, 128): 2899.84, (5000, 500): 4031.79},
    ("mixtral-8x22b", "h100", 8): {(128, 2048): 25150.03, (1000, 1000): 16573.24, (2048, 128): 2794.97, (5000, 500): 3645.27},
}

DENSE_017 = {  # the same table's dense rows, the baseline the MoE rows are read against
    ("llama-3.1-70b", "h100", 4): {(128, 2048): 11511.93, (1000, 1000): 7430.99, (2048, 128): 1302.6, (5000, 500): 1602.78},
    ("llama-3.1-70b", "h100", 8): {(128, 2048): 17061.82, (1000, 1000): 11451.16, (2048, 128): 1923.41,
                                   (5000, 500): 2457.42},
    ("llama-3.1-70b", "a100", 4): {(128, 2048): 2811.27, (1000, 1000): 1921.77, (2048, 128): 325.15, (5000, 500): 392.62},
    ("llama-3.1-8b", "h100", 1): {(128, 2048): 21109.38, (1000, 1000): 15244.78, (2048, 128): 3556.73, (5000, 500): 3559.36},
    ("mistral-7b", "h100", 1): {(128, 2048): 23496.42, (1000, 1000): 16035.66, (2048, 128): 3642.48, (5000, 500): 3591.33},
}


def simulate_tp(model: str, gpu: str, tp: int, isl: int, osl: int, n: int, routing: str = "mean") -> float:
    """Output tokens/s of one TP replica (experts split tp ways) in the v0.17 setup; A100 at 16 bits."""
    spec = model if gpu == "a100" else {"config": model, "weight_dtype": "fp8", "kv_dtype": "fp8"}
    cost = {"type": "roofline", "gpu": gpu, "tp": tp, "engine": "trtllm", "moe_routing": routing}
    return offline_throughput(spec, cost, isl, osl, n)


def alltoall_rows() -> list[tuple]:
    """(EP, kind, published s, predicted s) for DeepEP's low-latency table (128 tokens per rank)."""
    model = model_spec("deepseek-v3")  # hidden 7168, top-8, fp8 experts: FP8 dispatch (7,392 bytes a token)
    rows = []
    for ep, (dispatch, combine) in DEEPEP_LL.items():
        cost = load_cost_model({"type": "roofline", "gpu": H800, "tp": 1, "expert_parallel": True,
                                "data_parallel": ep, "engine": "none"}, model)
        n, per_node = ep, cost.gpus_per_node
        sizes = cost._a2a_bytes  # per token and GPU: (dispatch, combine)
        for kind, size, published in (("dispatch", sizes[0], dispatch), ("combine", sizes[1], combine)):
            predicted = alltoall_seconds(size * 128, n, per_node, cost._link, cost.topology, 50e9)
            rows.append((ep, kind, published, predicted))
    return rows


def simulate(model: dict, gpu: str, isl: int, osl: int, n: int, data_parallel: bool, routing: str = "mean",
             **extra) -> float:
    """Total output tokens/s of a trtllm-bench-like run on 8 GPUs: 8 data-parallel attention ranks
    (EP over all 8), or one TP8 replica with EP (all requests queued, or closed-loop clients)."""
    cost = {"type": "roofline", "gpu": gpu, "tp": 8, "expert_parallel": True, "engine": "trtllm", "moe_routing": routing}
    replicas = 1
    if data_parallel:
        cost, replicas = {**cost, "tp": 1, "data_parallel": 8}, 8
    return offline_throughput(model, cost, isl, osl, n, replicas=replicas, **extra)


def main(quick: bool, routing: str = "mean") -> None:
    print(f"cost_model.moe_routing: {routing}")
    print("All-to-all: DeepEP low-latency kernels (deepseek-ai/DeepEP docs/legacy.md @0297fc80), H800, 128 tokens")
    print(f"{'EP':>4} {'kind':<9} {'published':>10} {'cbsim':>10} {'error':>7}")
    for ep, kind, published, predicted in alltoall_rows():
        print(f"{ep:>4} {kind:<9} {published * 1e6:>8.0f}us {predicted * 1e6:>8.1f}us {predicted / published - 1:>+7.1%}")
    print()
    print(f"Whole runs ({TRTLLM}; DeepSeek-R1: Best_perf_practice_on_DeepSeek-R1_in_TensorRT-LLM.md @01c4ece9)")
    print(f"{'model':<16} {'gpu':<5} {'isl/osl':>10} {'published':>10} {'DP attn':>9} {'error':>7} {'TP attn':>9} {'error':>7}")
    fp8 = {"config": "qwen3-235b-a22b", "weight_dtype": "fp8", "kv_dtype": "fp8"}  # ModelOpt FP8: FP8 KV as well
    for (gpu, (isl, osl)), published in QWEN3.items():
        n = REQUESTS[(isl, osl)] // (20 if quick else 1)
        t0 = time.perf_counter()
        dp = simulate(fp8, gpu, isl, osl, n, True, routing)
        tp = simulate(fp8, gpu, isl, osl, n, False, routing)
        print(f"{'qwen3-235b-a22b':<16} {gpu:<5} {f'{isl}/{osl}':>10} {published:>10,} {dp:>9,.0f} "
              f"{dp / published - 1:>+7.1%} {tp:>9,.0f} {tp / published - 1:>+7.1%}  ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    print()
    print(f"Experts split tp ways ({TRTLLM_017})")
    print(f"{'model':<14} {'gpu':<5} {'tp':>2} {'isl/osl':>10} {'published':>10} {'cbsim':>9} {'error':>7}")
    for (model, gpu, tp), rows in {**DENSE_017, **MIXTRAL}.items():
        for (isl, osl), published in rows.items():
            n = REQUESTS[(isl, osl)] // (20 if quick else 1)
            sim = simulate_tp(model, gpu, tp, isl, osl, n, routing)
            print(f"{model:<14} {gpu:<5} {tp:>2} {f'{isl}/{osl}':>10} {published:>10,.0f} {sim:>9,.0f} "
                  f"{sim / published - 1:>+7.1%}", flush=True)
    print()
    n = 5120 // (10 if quick else 1)
    r1 = {"config": "deepseek-v3"}  # DeepSeek-R1 = DeepSeek-V3's geometry; its config gives fp8 weights, bf16 KV
    knobs = dict(kv_fraction=0.8, max_num_tokens=1151, max_batch_size=128)
    dp = simulate(r1, "h200", 1024, 2048, n, True, routing, max_concurrency=1024, **knobs)
    tp = simulate(r1, "h200", 1024, 2048, n, False, routing, max_concurrency=1024, **dict(knobs, max_batch_size=1024))
    print(f"{'deepseek-r1':<16} {'h200':<5} {'1024/2048':>10} {11489:>10,} {dp:>9,.0f} {dp / 11489 - 1:>+7.1%} "
          f"{tp:>9,.0f} {tp / 11489 - 1:>+7.1%}")


if __name__ == "__main__":
    main("quick" in sys.argv[1:], "mean" if "mean" in sys.argv[1:] else "random")
