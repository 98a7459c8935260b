"""`python -m sglang.launch_server` flags as cbsim settings.

Sources (sgl-project/sglang, python/sglang/srt/server_args.py, read through the code index):
- chunked_prefill_size when not given, by GPU memory (`_handle_gpu_memory_settings`): under 35 GiB
  2048, under 160 GiB 8192 (A100, H100, H200), else 16384 (B200, MI300); 4096 when the memory is
  unknown. -1 turns chunking off.
- max_prefill_tokens 16384; schedule_policy fcfs; schedule_conservativeness 1.0; page_size 1;
  radix cache on (disable_radix_cache False); enable_mixed_chunk False.
- mem_fraction_static, when not given, is derived from GPU memory, TP and features in a way that
  changes between versions; cbsim then keeps its kv_cache.gpu_memory_utilization (0.9): pass
  `--mem-fraction-static` to match a server. max_running_requests, when not given, is derived from
  the KV pool; cbsim keeps the sglang policy's max_num_seqs: pass `--max-running-requests`.
What cbsim runs: the sglang policy (prefill batches first, one chunked request at a time), engine
preset sglang, recompute on KV shortage (SGLang retracts decodes and recomputes them).
"""
from __future__ import annotations

from cbsim.errors import ConfigError

from .flags import Flag

GiB = 1 << 30
ARGS = "python/sglang/srt/server_args.py"
ORDERS = ("fcfs", "lpm", "dfs-weight", "lof", "random")

FLAGS = {
    "model-path": Flag(str, ARGS),
    "chunked-prefill-size": Flag(int, ARGS),
    "max-prefill-tokens": Flag(int, ARGS),
    "max-running-requests": Flag(int, ARGS),
    "schedule-policy": Flag(str, ARGS, choices=ORDERS),
    "schedule-conservativeness": Flag(float, ARGS),
    "enable-mixed-chunk": Flag(bool, ARGS, boolean=True),
    "mem-fraction-static": Flag(float, ARGS),
    "disable-radix-cache": Flag(bool, ARGS, boolean=True),
    "page-size": Flag(int, ARGS),
    "tp-size": Flag(int, ARGS),
    "dp-size": Flag(int, ARGS),
    "context-length": Flag(int, ARGS),
    "max-total-tokens": Flag(int, ARGS),
    "kv-cache-dtype": Flag(str, ARGS, choices=("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")),
    "disable-cuda-graph": Flag(bool, ARGS, boolean=True),
}
ALIASES = {"model": "model-path", "tensor-parallel-size": "tp-size", "tp": "tp-size",
           "data-parallel-size": "dp-size", "dp": "dp-size"}
IGNORED = frozenset({
    "host", "port", "log-level", "log-requests", "api-key", "served-model-name", "trust-remote-code",
    "download-dir", "load-format", "random-seed", "tokenizer-path", "chat-template", "show-time-cost",
    "enable-metrics", "skip-server-warmup", "revision", "attention-backend", "sampling-backend",
})


def resolve(flags: dict, context, path: str) -> tuple[dict, set[str]]:
    """(dotted cbsim key -> value, the keys a flag set explicitly) for SGLang with these flags."""
    if flags.get("schedule-conservativeness", 1.0) != 1.0:
        raise ConfigError(f"{path} --schedule-conservativeness", "1.0 (cbsim's sglang policy does not model the "
                          "new-token-ratio reserve it scales yet)", flags["schedule-conservativeness"])
    if flags.get("kv-cache-dtype", "auto") not in ("auto", "bf16", "bfloat16"):
        raise ConfigError(f"{path} --kv-cache-dtype", "auto or bf16 (cbsim's KV cache is 16-bit here)",
                          flags["kv-cache-dtype"])
    chunk = flags.get("chunked-prefill-size", _chunk_default(context.gpu))
    page = flags.get("page-size", 1)
    settings = {
        "policy.name": "sglang",
        "policy.token_budget": flags.get("max-prefill-tokens", 16384),
        "policy.chunked_prefill_size": None if chunk == -1 else chunk,
        "policy.schedule_policy": flags.get("schedule-policy", "fcfs").replace("-", "_"),
        "policy.enable_mixed_chunk": flags.get("enable-mixed-chunk", False),
        "cluster.kv_cache.block_size": page,
        "cluster.kv_cache.prefix_caching": not flags.get("disable-radix-cache", False),
        "cost_model.engine": {"preset": "sglang", "cuda_graph_max_batch": 0} if flags.get("disable-cuda-graph")
        else "sglang",
        "preemption.mode": "recompute",
    }
    optional = {"max-running-requests": "policy.max_num_seqs", "mem-fraction-static":
                "cluster.kv_cache.gpu_memory_utilization", "tp-size": "cluster.tp", "dp-size": "cluster.replicas",
                "context-length": "cluster.max_model_len", "model-path": "model"}
    settings.update({key: flags[name] for name, key in optional.items() if name in flags})
    if "max-total-tokens" in flags:
        settings["cluster.kv_cache.num_blocks"] = -(-flags["max-total-tokens"] // page)
    by_flag = {**{key: name for name, key in optional.items()}, "policy.token_budget": "max-prefill-tokens",
               "policy.chunked_prefill_size": "chunked-prefill-size", "policy.schedule_policy": "schedule-policy",
               "policy.enable_mixed_chunk": "enable-mixed-chunk", "cluster.kv_cache.block_size": "page-size",
               "cluster.kv_cache.prefix_caching": "disable-radix-cache",
               "cluster.kv_cache.num_blocks": "max-total-tokens"}
    return settings, {key for key in settings if by_flag.get(key) in flags}


def _chunk_default(gpu) -> int:
    if gpu is None:
        return 4096
    memory = gpu.memory_bytes
    return 2048 if memory < 35 * GiB else 8192 if memory < 160 * GiB else 16384
