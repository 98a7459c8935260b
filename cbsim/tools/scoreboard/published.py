"""Published measurements that cbsim is scored against: one copy, read by the scoreboard
(cbsim/tools/scoreboard/) and by the validation scripts in validation/ (validate_trtllm_fp8.py,
validate_moe.py, validate_int4.py), each table with the source it was copied from.

The measured tables shipped as data files (Splitwise's whole-step times in shared/data/measured,
Vidur's per-operator tables in shared/data/vidur) are read where they lie, not copied here.
"""
from __future__ import annotations

from cbsim.sim.costmodels.catalog.specs import GiB

# --- TensorRT-LLM trtllm-bench offline throughput (Total Output Throughput, tokens/s) ------------------
TRTLLM = "NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md @00f37686aa854010d68bcbd0f4ab000221541ca6"
# trtllm-bench throughput, ModelOpt FP8 checkpoints (FP8 KV), all requests queued at once, fixed ISL/OSL
TRTLLM_FP8 = {  # (model, gpu, tp, expert parallel) -> {(isl, osl): tokens/s}
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
# Qwen3-235B-A22B FP8, TP8 EP8 with enable_attention_dp, kv_cache_free_gpu_mem_fraction 0.95 (same document)
QWEN3_DP = {("h200", (128, 128)): 30429, ("h200", (128, 2048)): 42821, ("h200", (128, 4096)): 26852,
            ("h200", (500, 2000)): 28026, ("h200", (1000, 1000)): 23789, ("h200", (1000, 2000)): 22061,
            ("h200", (2048, 128)): 3331, ("h200", (2048, 2048)): 16672, ("h200", (5000, 500)): 3623,
            ("h100", (128, 2048)): 19658, ("h100", (128, 4096)): 12447, ("h100", (500, 2000)): 18351,
            ("h100", (1000, 1000)): 14898, ("h100", (1000, 2000)): 15136, ("h100", (2048, 2048)): 9924,
            ("h100", (5000, 500)): 3225}
# the document's $num_requests per (isl, osl)
TRTLLM_FP8_REQUESTS = {(128, 128): 3000, (128, 2048): 1000, (2048, 128): 1000, (1000, 1000): 1000, (5000, 500): 500}
TRTLLM_REQUESTS = {(128, 128): 30000, (128, 2048): 3000, (128, 4096): 1500, (1000, 2000): 1500, (2048, 128): 3000,
                   (2048, 2048): 1500, (5000, 500): 1500, (1000, 1000): 3000, (500, 2000): 3000}

TRTLLM_017 = "NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md @258c7540 (v0.17)"
# TensorRT engines built with --quantization FP8 (FP8 KV cache; A100 at FP16), output tokens/s
MIXTRAL_017 = {  # (model, gpu, tp) -> {(isl, osl): output tokens/s}
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

# --- DeepEP low-latency all-to-all ---------------------------------------------------------------------
DEEPEP = "deepseek-ai/DeepEP docs/legacy.md @0297fc80 (Low-latency kernels with pure RDMA)"
# H800 SXM: H100 silicon with NVLink cut to 400 GB/s (200 GB/s one way; DeepEP: "~160 GB/s NVLink maximum
# bandwidth" measured) and, in DeepEP's cluster, one 400 Gb/s NIC per GPU.
H800 = {"name": "h800", "memory_bytes": 80 * GiB, "bf16_flops": 989e12, "fp8_flops": 1979e12, "hbm_bandwidth": 3.35e12,
        "link_bandwidth": 200e9, "topology": "nvswitch", "inter_node_bandwidth": 50e9, "pcie_bandwidth": 64e9}
DEEPEP_LL = {8: (77e-6, 114e-6), 16: (118e-6, 195e-6), 32: (155e-6, 273e-6), 64: (173e-6, 314e-6),
             128: (192e-6, 369e-6), 256: (194e-6, 360e-6)}  # EP: (dispatch, combine) seconds, 128 tokens per rank

# --- vLLM's custom all-reduce on H100, outside CUDA graphs -------------------------------------------
CUSTOM_AR = ("sgl-project/sglang PR #2904 (2025-01-15), 'unit test performance in H100 (without cuda graph)', "
             "the vllm table; sizes are float32 element counts (its test's perf worker: torch.randint(..., (sz,), "
             "dtype=torch.float32)), wall time of 50-100 back-to-back calls")
CUSTOM_AR_MS = {  # float32 elements -> latency ms at TP 2, 4, 8, as published
    512: (0.0095, 0.0091, 0.0101), 4096: (0.0088, 0.0085, 0.0093), 32768: (0.0087, 0.0092, 0.0118),
    262144: (0.0129, 0.0206, 0.0241), 524288: (0.0177, 0.0269, 0.0304), 1048576: (0.0266, 0.0402, 0.0450),
}

# --- vLLM's Triton fused_moe, Mixtral-8x7B TP2 on H100 (tuned config) -----------------------------------
FUSED_MOE = ("vllm-project/vllm PR #24700 (2025-09-11), 'Benchmarks on H100', Mixtral BF16, `python "
             "benchmarks/kernels/benchmark_moe.py --model=mistralai/Mixtral-8x7B-Instruct-v0.1 -tp=2`, the tuned "
             "config E=8,N=7168,device_name=NVIDIA_H100_80GB_HBM3.json: kernel time of fused_moe per batch size")
FUSED_MOE_US = {  # tokens -> kernel time in microseconds, as published
    1: 144.03, 2: 229.28, 4: 351.10, 8: 434.98, 16: 471.49, 24: 478.27, 32: 487.35, 48: 487.85, 64: 483.14,
    96: 494.42, 128: 491.39, 256: 536.77, 512: 662.33, 1024: 833.72, 1536: 1122.93,
}

# --- int4 AWQ (Marlin) decode on an L4, vLLM 0.16.0 ----------------------------------------------------
INT4_L4 = "bereketlemma/llm-inference-bench@e3c51199 results/Data/awq_marlin_results.csv"
INT4_PROMPT_TOKENS = 26  # estimate: one English sentence of 18 words and punctuation, plus BOS
INT4_MODEL = {"config": "mistral-7b", "weight_dtype": "int4", "weight_group_size": 128, "max_model_len": 2048}
# (batch, output tokens) -> mean_latency_ms of one run, as published (10 runs each)
INT4_L4_MS = {
    (1, 128): 2084.076759099844, (1, 256): 4200.395622800352, (1, 512): 8459.656260000338,
    (4, 128): 2179.9132934003865, (4, 256): 4393.515665900122, (4, 512): 8990.099085800466,
    (8, 128): 2264.0909331006696, (8, 256): 4589.831577201039, (8, 512): 9545.16661609996,
}

# --- data files read in place (CBSIM_DATA) ---------------------------------------------------------------
SPLITWISE = ("Splitwise (ISCA'24) profiling database, Mutinifni/splitwise-sim data/perf_model.csv @3780880 (MIT); "
             "shared/data/measured/splitwise_a100_llama2_70b/SOURCE.md")
SPLITWISE_CSV = ("measured", "splitwise_a100_llama2_70b", "perf_model_a100_tp2_tp8.csv")
VIDUR = "microsoft/vidur data/profiling @7d47513 (MIT); shared/data/vidur/SOURCE.md"
