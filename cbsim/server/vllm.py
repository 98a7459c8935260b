"""`vllm serve` flags (vLLM V1 engine, 0.8 and later) as cbsim settings.

Sources (vllm-project/vllm, read through the code index; file @ commit):
- vllm/engine/arg_utils.py @99d7eb5d: `get_batch_defaults` and
  `_set_default_max_num_seqs_and_batched_tokens_args`. For `vllm serve` (OPENAI_API_SERVER) on a GPU
  with >= 70 GiB that is not an A100: max_num_batched_tokens 8192, max_num_seqs 1024; otherwise
  (A100, smaller GPUs, or a device it cannot query) 2048 and 256. Then max_num_batched_tokens =
  min(max_num_seqs x max_model_len, it) and max_num_seqs = min(max_num_seqs, max_num_batched_tokens);
  without chunked prefill, max_num_batched_tokens = max(max_model_len, default).
  `_is_v1_supported_oracle`: `--max-num-partial-prefills` / `--max-long-partial-prefills` other than 1
  raise "Concurrent Partial Prefill is not supported" on V1.
- vllm/config/scheduler.py @01230b40: long_prefill_token_threshold 0 (no cap), policy fcfs,
  enable_chunked_prefill True, async_scheduling False.
- vllm/config/cache.py: block_size 16, gpu_memory_utilization 0.9, num_gpu_blocks_override None;
  prefix caching on for generative models (arg_utils `_set_default_chunked_prefill_and_prefix_caching_args`:
  `model_config.is_prefix_caching_supported`).
- vllm/v1/core/sched/scheduler.py: preemption frees the victim's blocks and requeues it (recompute;
  V1 has no swap space), the victim being the last running request under fcfs.

What cbsim runs: the sarathi policy (decodes first, prompts chunked into what the budget leaves,
each capped at long_prefill_token_threshold); V1 has no partial-prefill limits, so cbsim's are lifted
(max_num_seqs); without chunked prefill, orca with paged KV (decodes plus whole prompts). The
engine preset is vllm-v1; `--async-scheduling` overlaps host and GPU (engine overlap, one step of
output lag) and `--enforce-eager` turns CUDA graphs off. `--enable-lora` limits the adapters a step
serves to `--max-loras` (vllm/config/lora.py: default 1), as V1's scheduler does (policies/lora.py).
"""
from __future__ import annotations

from cbsim.errors import ConfigError

from .flags import Flag

GiB = 1 << 30
ARG_UTILS = "vllm/engine/arg_utils.py @99d7eb5d"
SCHED = "vllm/config/scheduler.py @01230b40"
CACHE = "vllm/config/cache.py"


def _fraction(text: str) -> float:
    return float(text)


FLAGS = {
    "model": Flag(str, ARG_UTILS),
    "max-num-batched-tokens": Flag(int, SCHED),
    "max-num-seqs": Flag(int, SCHED),
    "max-model-len": Flag(int, "vllm/config/model.py"),
    "enable-chunked-prefill": Flag(bool, SCHED, boolean=True),
    "long-prefill-token-threshold": Flag(int, SCHED),
    "max-num-partial-prefills": Flag(int, SCHED),
    "max-long-partial-prefills": Flag(int, SCHED),
    "scheduling-policy": Flag(str, SCHED, choices=("fcfs", "priority")),
    "async-scheduling": Flag(bool, SCHED, boolean=True),
    "enable-prefix-caching": Flag(bool, CACHE, boolean=True),
    "block-size": Flag(int, CACHE),
    "gpu-memory-utilization": Flag(_fraction, CACHE),
    "num-gpu-blocks-override": Flag(int, CACHE),
    "kv-cache-dtype": Flag(str, CACHE, choices=("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")),
    "tensor-parallel-size": Flag(int, "vllm/config/parallel.py"),
    "pipeline-parallel-size": Flag(int, "vllm/config/parallel.py"),
    "enforce-eager": Flag(bool, "vllm/config/model.py", boolean=True),
    "dtype": Flag(str, "vllm/config/model.py", choices=("auto", "bfloat16", "float16", "half")),
    "enable-lora": Flag(bool, "vllm/engine/arg_utils.py", boolean=True),
    "max-loras": Flag(int, "vllm/config/lora.py"),
}
ALIASES = {"tp": "tensor-parallel-size", "pp": "pipeline-parallel-size"}
IGNORED = frozenset({
    "host", "port", "uvicorn-log-level", "disable-uvicorn-access-log", "api-key", "served-model-name",
    "trust-remote-code", "download-dir", "load-format", "seed", "tokenizer", "tokenizer-mode", "chat-template",
    "enable-log-requests", "disable-log-requests", "disable-log-stats", "allowed-origins", "root-path",
    "ssl-keyfile", "ssl-certfile", "revision", "hf-token", "config", "generation-config", "disable-fastapi-docs",
    "enable-auto-tool-choice", "tool-call-parser", "reasoning-parser", "middleware", "max-log-len",
    "swap-space",  # V1 never swaps: preemption recomputes (vllm/v1/core/sched/scheduler.py)
})


def resolve(flags: dict, context, path: str) -> tuple[dict, set[str]]:
    """(dotted cbsim key -> value, the keys a flag set explicitly) for vLLM V1 with these flags."""
    for name in ("max-num-partial-prefills", "max-long-partial-prefills"):
        if flags.get(name, 1) != 1:
            raise ConfigError(f"{path} --{name}", "1: vLLM V1 rejects concurrent partial prefills at startup "
                              f"({ARG_UTILS} _is_v1_supported_oracle: 'Concurrent Partial Prefill is not "
                              "supported')", flags[name])
    if flags.get("pipeline-parallel-size", 1) != 1:
        raise ConfigError(f"{path} --pipeline-parallel-size", "1 (cbsim does not model pipeline parallelism yet)",
                          flags["pipeline-parallel-size"])
    if flags.get("scheduling-policy", "fcfs") != "fcfs":
        raise ConfigError(f"{path} --scheduling-policy", "fcfs (cbsim's sarathi has no priority-ordered waiting "
                          "queue yet)", flags["scheduling-policy"])
    if flags.get("kv-cache-dtype", "auto") not in ("auto", "bfloat16"):
        raise ConfigError(f"{path} --kv-cache-dtype", "auto or bfloat16 (cbsim's KV cache is 16-bit here)",
                          flags["kv-cache-dtype"])
    chunked = flags.get("enable-chunked-prefill", True)
    max_len = flags.get("max-model-len", context.max_model_len)
    budget, seqs = _batch_defaults(context, max_len, chunked)
    settings = {
        "policy.name": "sarathi" if chunked else "orca",
        "policy.token_budget": flags.get("max-num-batched-tokens", budget),
        "policy.max_num_seqs": flags.get("max-num-seqs", seqs),
        "cluster.kv_cache.block_size": flags.get("block-size", 16),
        "cluster.kv_cache.gpu_memory_utilization": flags.get("gpu-memory-utilization", 0.9),
        "cluster.kv_cache.prefix_caching": flags.get("enable-prefix-caching", True),
        "cost_model.engine": _engine(flags),
        "preemption.mode": "recompute",
    }
    if flags.get("enable-lora"):  # LoRAConfig.max_loras defaults to 1; without --enable-lora it does nothing
        if not chunked:
            raise ConfigError(f"{path} --enable-lora", "chunked prefill on (cbsim limits adapters per step in "
                              "its sarathi policy only)", True)
        settings["policy.max_loras"] = flags.get("max-loras", 1)
    if chunked:
        threshold = flags.get("long-prefill-token-threshold", 0)
        settings["policy.long_prefill_token_threshold"] = threshold or None
        settings["policy.max_num_partial_prefills"] = settings["policy.max_num_seqs"]  # V1: no such limit
        settings["policy.max_long_partial_prefills"] = settings["policy.max_num_seqs"]
    else:
        settings["policy.kv_reservation"] = "paged"
    optional = {"num-gpu-blocks-override": "cluster.kv_cache.num_blocks", "tensor-parallel-size": "cluster.tp",
                "max-model-len": "cluster.max_model_len", "model": "model"}
    settings.update({key: flags[name] for name, key in optional.items() if name in flags})
    explicit = {key for key in settings if _flag_of(key, flags)}
    return settings, explicit


def _batch_defaults(context, max_len: int, chunked: bool) -> tuple[int, int]:
    """vLLM's `vllm serve` defaults for max_num_batched_tokens and max_num_seqs on this GPU."""
    gpu = context.gpu
    large = gpu is not None and gpu.memory_bytes >= 70 * GiB and "a100" not in gpu.name.lower()
    budget, seqs = (8192, 1024) if large else (2048, 256)
    if not chunked:
        budget = max(max_len, budget)
    budget = min(seqs * max_len, budget)
    return budget, min(seqs, budget)


def _engine(flags: dict) -> dict | str:
    overrides = {}
    if flags.get("async-scheduling"):
        overrides.update(overlap=True, output_lag_steps=1)
    if flags.get("enforce-eager"):
        overrides["cuda_graph_max_batch"] = 0
    return {"preset": "vllm-v1", **overrides} if overrides else "vllm-v1"


_FLAG_OF_KEY = {
    "policy.token_budget": "max-num-batched-tokens", "policy.max_num_seqs": "max-num-seqs",
    "policy.long_prefill_token_threshold": "long-prefill-token-threshold",
    "cluster.kv_cache.block_size": "block-size", "cluster.kv_cache.gpu_memory_utilization": "gpu-memory-utilization",
    "cluster.kv_cache.prefix_caching": "enable-prefix-caching", "cluster.kv_cache.num_blocks": "num-gpu-blocks-override",
    "cluster.tp": "tensor-parallel-size", "cluster.max_model_len": "max-model-len", "model": "model",
    "policy.name": "enable-chunked-prefill", "policy.max_loras": "max-loras",
}


def _flag_of(key: str, flags: dict) -> bool:
    return _FLAG_OF_KEY.get(key) in flags
