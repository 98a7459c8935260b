"""cbsim's roofline against TensorRT-LLM's published offline throughput (Total Output Throughput, tokens/s):
NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md (commit 00f37686aa854010d68bcbd0f4ab000221541ca6),
trtllm-bench throughput, ModelOpt FP8 checkpoints, all requests queued at once, fixed ISL/OSL.
Run: python validation/validate_trtllm_fp8.py [quick]   (the table in docs/validation/fp8.md)"""
import sys
import time

from cbsim.api import run_experiment

PUBLISHED = {  # (model, gpu, tp, ep) -> {(isl, osl): tokens/s}
    ("llama-3.1-8b", "h100", 1, False): {(128, 128): 28312, (128, 2048): 22714, (2048, 128): 3450, (1000, 1000): 15220,
                                         (5000, 500): 3459},
    ("llama-3.1-8b", "h200", 1, False): {(128, 128): 27911, (128, 2048): 26221, (2048, 128): 3538, (1000, 1000): 17744,
                                         (5000, 500): 3902},
    ("llama-3.1-70b", "h100", 2, False): {(128, 128): 6378, (128, 2048): 6651, (2048, 128): 762, (1000, 1000): 4205,
                                          (5000, 500): 898},
    ("llama-3.1-70b", "h200", 1, False): {(128, 128): 3803, (128, 2048): 4336, (2048, 128): 442, (1000, 1000): 2909,
                                          (5000, 500): 566},
    ("qwen3-235b-a22b", "h200", 8, True): {(128, 2048): 42821, (2048, 128): 3331, (1000, 1000): 23789, (5000, 500): 3623},
}
REQUESTS = {(128, 128): 3000, (128, 2048): 1000, (2048, 128): 1000, (1000, 1000): 1000, (5000, 500): 500}


def offline_throughput(model, cost: dict, isl: int, osl: int, n: int, *, replicas: int = 1,
                       kv_fraction: float = 0.95, max_num_tokens: int = 8192, max_batch_size: int = 2048,
                       **workload) -> float:
    """Total output tokens/s of a trtllm-bench-like run: `n` requests of fixed ISL/OSL all queued at
    once (or `workload` keys such as max_concurrency), sarathi with trtllm-bench's token budget and
    batch cap, KV blocks of 32 sized from `kv_fraction` of the memory, `replicas` behind round robin."""
    result = run_experiment({
        "name": "trtllm", "seed": 0, "model": model, "cost_model": cost,
        "cluster": {"replicas": replicas, "router": "round_robin",
                    "kv_cache": {"num_blocks": "auto", "gpu_memory_utilization": kv_fraction, "block_size": 32}},
        "policy": {"name": "sarathi", "token_budget": max_num_tokens, "max_num_seqs": max_batch_size},
        "workload": {"num_requests": n, "arrival": {"type": "all_at_once"},
                     "prompt_len": {"type": "fixed", "value": isl}, "output_len": {"type": "fixed", "value": osl},
                     **workload},
        "output": {"plots": False, "trace": False}})
    r = result.requests
    return float(r["output_tokens"].sum() / r["completion_time"].max())


def simulate(model, gpu, tp, ep, isl, osl, n):
    cost = {"type": "roofline", "gpu": gpu, "tp": tp, "engine": "trtllm"}
    if ep:
        cost["expert_parallel"] = True
    return offline_throughput({"config": model, "weight_dtype": "fp8", "kv_dtype": "fp8"}, cost, isl, osl, n)


if __name__ == "__main__":
    quick = sys.argv[1:] == ["quick"]
    print(f"{'model':<16} {'gpu':<5} {'tp':>2} {'ep':<5} {'isl/osl':>10} {'published':>10} {'cbsim':>10} {'ratio':>6}")
    for (model, gpu, tp, ep), rows in PUBLISHED.items():
        for (isl, osl), tput in rows.items():
            n = REQUESTS[(isl, osl)] // (5 if quick else 1)
            t0 = time.perf_counter()
            sim = simulate(model, gpu, tp, ep, isl, osl, n)
            print(f"{model:<16} {gpu:<5} {tp:>2} {str(ep):<5} {f'{isl}/{osl}':>10} {tput:>10,} {sim:>10,.0f} "
                  f"{sim / tput:>6.2f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
