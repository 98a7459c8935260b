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

from cbsim.tools.scoreboard.published import (DEEPEP_LL, DENSE_017, H800, MIXTRAL_017, QWEN3_DP, TRTLLM,  # noqa: F401
                                              TRTLLM_017, TRTLLM_REQUESTS)
from cbsim.tools.scoreboard.runs import alltoall_rows, offline_throughput
from cbsim.tools.scoreboard.runs import trtllm_017_throughput as simulate_tp

QWEN3, REQUESTS = QWEN3_DP, TRTLLM_REQUESTS
MIXTRAL = MIXTRAL_017


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
