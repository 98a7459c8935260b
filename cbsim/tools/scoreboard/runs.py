"""How cbsim reproduces each published measurement (published.py): the experiment or kernel call
that stands for the engine's benchmark. One copy, used by the scoreboard and by validation/validate_*.py.
"""
from __future__ import annotations

from cbsim.tools.scoreboard.published import CUSTOM_AR_MS, DEEPEP_LL, FUSED_MOE_US, H800, INT4_MODEL, INT4_PROMPT_TOKENS


def offline_throughput(model, cost: dict, isl: int, osl: int, n: int, *, replicas: int = 1,
                       kv_fraction: float = 0.95, max_num_tokens: int = 8192, max_batch_size: int = 2048,
                       **workload) -> float:
    """Total output tokens/s of a trtllm-bench-like run: `n` requests of fixed ISL/OSL all queued at
    once (or `workload` keys such as max_concurrency), sarathi with trtllm-bench's token budget and
    batch cap, KV blocks of 32 sized from `kv_fraction` of the memory, `replicas` behind round robin."""
    from cbsim.api import run_experiment  # numpy, pandas: loaded when a run is asked for

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


def trtllm_fp8_throughput(model: str, gpu: str, tp: int, ep: bool, isl: int, osl: int, n: int) -> float:
    """TensorRT-LLM's FP8 table (published.TRTLLM_FP8): roofline on the GPU and TP, engine trtllm."""
    cost = {"type": "roofline", "gpu": gpu, "tp": tp, "engine": "trtllm"}
    if ep:
        cost["expert_parallel"] = True
    return offline_throughput({"config": model, "weight_dtype": "fp8", "kv_dtype": "fp8"}, cost, isl, osl, n)


def trtllm_017_throughput(model: str, gpu: str, tp: int, isl: int, osl: int, n: int, routing: str = "random") -> float:
    """TensorRT-LLM v0.17's table (published.MIXTRAL_017, DENSE_017): one TP replica (experts split tp
    ways), FP8 weights and KV on H100/H200, 16 bits on A100."""
    spec = model if gpu == "a100" else {"config": model, "weight_dtype": "fp8", "kv_dtype": "fp8"}
    cost = {"type": "roofline", "gpu": gpu, "tp": tp, "engine": "trtllm", "moe_routing": routing}
    return offline_throughput(spec, cost, isl, osl, n)


def int4_run_ms(batch: int, output_tokens: int, model=INT4_MODEL, gpu: str = "l4") -> float:
    """cbsim's time for one offline run of published.INT4_L4_MS: `batch` requests at once, fixed prompt
    and output lengths, roofline on an L4 with the default engine."""
    from cbsim.api import run_experiment

    result = run_experiment({
        "name": "validate_int4", "seed": 0, "model": model,
        "cost_model": {"type": "roofline", "gpu": gpu, "tp": 1},
        "cluster": {"replicas": 1, "kv_cache": {"num_blocks": "auto", "gpu_memory_utilization": 0.9}},
        "policy": {"name": "sarathi", "token_budget": 2048, "max_num_seqs": 256},
        "workload": {"num_requests": batch, "arrival": {"type": "all_at_once"},
                     "prompt_len": {"type": "fixed", "value": INT4_PROMPT_TOKENS},
                     "output_len": {"type": "fixed", "value": output_tokens}},
        "output": {"plots": False, "trace": False}})
    return float(result.requests["completion_time"].max()) * 1e3


def custom_allreduce_rows() -> list[tuple]:
    """(TP, bytes, published s, predicted s) for vLLM's custom all-reduce table (published.CUSTOM_AR_MS):
    one all-reduce as the roofline charges it on an H100 node under the vllm-v1 engine (its collective
    time over its all-reduces, for a Llama-3-8B step of as many tokens as the message holds)."""
    from cbsim.sim.costmodels import load_cost_model
    from cbsim.sim.costmodels.catalog.lookup import model_spec

    model = model_spec("llama-3-8b")
    per_token = float(model.hidden * model.dtype_bytes)
    rows = []
    for i, tp in enumerate((2, 4, 8)):
        cost = load_cost_model({"type": "roofline", "gpu": "h100", "tp": tp, "engine": "vllm-v1"}, model)
        for elements, published in CUSTOM_AR_MS.items():
            size = 4.0 * elements  # float32
            predicted = cost.collective_time(size / per_token) / (2.0 * model.num_layers + 1.0)
            rows.append((tp, int(size), published[i] * 1e-3, predicted))
    return rows


def fused_moe_rows(engine: str = "vllm-v1") -> list[tuple]:
    """(tokens, published s, predicted s) for vLLM's fused_moe table (published.FUSED_MOE_US): one MoE
    layer's routed experts of Mixtral-8x7B as the roofline charges them on H100 at TP2 under `engine`."""
    from cbsim.sim.costmodels import load_cost_model
    from cbsim.sim.costmodels.catalog.lookup import model_spec

    cost = load_cost_model({"type": "roofline", "gpu": "h100", "tp": 2, "engine": engine}, model_spec("mixtral-8x7b"))
    return [(tokens, us * 1e-6, cost._moe.routed(cost, float(tokens))) for tokens, us in FUSED_MOE_US.items()]


def alltoall_rows() -> list[tuple]:
    """(EP, kind, published s, predicted s) for DeepEP's low-latency table (128 tokens per rank), the
    all-to-all as the roofline charges it with data_parallel (kernel time, no engine)."""
    from cbsim.sim.costmodels import load_cost_model
    from cbsim.sim.costmodels.catalog.lookup import model_spec
    from cbsim.sim.costmodels.collectives import alltoall_seconds

    model = model_spec("deepseek-v3")  # hidden 7168, top-8, fp8 experts: FP8 dispatch (7,392 bytes a token)
    rows = []
    for ep, (dispatch, combine) in DEEPEP_LL.items():
        cost = load_cost_model({"type": "roofline", "gpu": H800, "tp": 1, "expert_parallel": True,
                                "data_parallel": ep, "engine": "none"}, model)
        sizes = cost._a2a_bytes  # per token and GPU: (dispatch, combine)
        for kind, size, published in (("dispatch", sizes[0], dispatch), ("combine", sizes[1], combine)):
            predicted = alltoall_seconds(size * 128, ep, cost.gpus_per_node, cost._link, cost.topology, 50e9)
            rows.append((ep, kind, published, predicted))
    return rows
