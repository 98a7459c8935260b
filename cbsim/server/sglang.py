"""`python -m sglang.launch_server` flags as cbsim settings.

Sources (sgl-project/sglang, python/sglang/srt/server_args.py, read through the code index; the
static defaults checked again at @469c63e5: max_prefill_tokens 16384, schedule_conservativeness 1.0,
page_size None = 1 with the default attention backends, tp_size 1, pp_size 1):
- chunked_prefill_size when not given, by GPU memory (`_handle_gpu_memory_settings`): under 35 GiB
  2048, under 160 GiB 8192 (A100, H100, H200), else 16384 (B200, MI300); 4096 when the memory is
  unknown. -1 turns chunking off.
- max_prefill_tokens 16384; schedule_policy fcfs; schedule_conservativeness 1.0; page_size 1;
  radix cache on (disable_radix_cache False); enable_mixed_chunk False.
- mem_fraction_static, when not given, is derived from GPU memory, TP and features in a way that
  changes between versions; cbsim then keeps its kv_cache.gpu_memory_utilization (0.9): pass
  `--mem-fraction-static` to match a server. max_running_requests, when not given, is derived from
  the KV pool; cbsim keeps the sglang policy's max_num_seqs: pass `--max-running-requests`.
`--pp-size` sets `cost_model.pp` as vLLM's --pipeline-parallel-size does (flags.pipeline_setting).
What cbsim runs: the sglang policy (prefill batches first, one chunked request at a time), engine
preset sglang, recompute on KV shortage (SGLang retracts decodes and recomputes them).
"""
from __future__ import annotations

from cbsim.core.errors import ConfigError

from cbsim.server import kv_tiers, speculative
from cbsim.server.flags import Flag, explicit_keys, pipeline_setting

GiB = 1 << 30
ARGS = "python/sglang/srt/server_args.py @469c63e5"
ORDERS = ("fcfs", "lpm", "dfs-weight", "lof", "random")


def _chunk_flag(chunk, wanted: dict) -> int:
    return -1 if chunk is None else chunk


def _order_flag(order: str, wanted: dict) -> str:
    return order.replace("_", "-")


def _radix_flag(prefix_caching: bool, wanted: dict) -> bool:
    return not prefix_caching


def _total_tokens_flag(num_blocks: int, wanted: dict) -> int:
    return num_blocks * wanted.get("cluster.kv_cache.block_size", 1)


def _graph_flag(engine, wanted: dict) -> bool:
    return isinstance(engine, dict) and engine.get("cuda_graph_max_batch") == 0


FLAGS = {  # in the order rendered flags are written (render.py): --page-size before --max-total-tokens
    "model-path": Flag(str, ARGS, key="model"),
    "max-prefill-tokens": Flag(int, ARGS, default=16384, key="policy.token_budget", pin=True),
    "chunked-prefill-size": Flag(int, ARGS, key="policy.chunked_prefill_size", to_flag=_chunk_flag, pin=True),
    "max-running-requests": Flag(int, ARGS, key="policy.max_num_seqs", pin=True),
    "page-size": Flag(int, ARGS, default=1, key="cluster.kv_cache.block_size", pin=True),
    "mem-fraction-static": Flag(float, ARGS, key="cluster.kv_cache.gpu_memory_utilization", pin=True),
    "schedule-policy": Flag(str, ARGS, choices=ORDERS, default="fcfs", key="policy.schedule_policy",
                            to_flag=_order_flag),
    "schedule-conservativeness": Flag(float, ARGS, default=1.0),
    "enable-mixed-chunk": Flag(bool, ARGS, boolean=True, default=False, key="policy.enable_mixed_chunk"),
    "disable-radix-cache": Flag(bool, ARGS, boolean=True, default=False, key="cluster.kv_cache.prefix_caching",
                                to_flag=_radix_flag),
    "tp-size": Flag(int, ARGS, default=1, key="cluster.tp"),
    "pp-size": Flag(int, ARGS, default=1, key="cost_model.pp"),
    "dp-size": Flag(int, ARGS, default=1, key="cluster.replicas"),
    "context-length": Flag(int, ARGS, default=None, key="cluster.max_model_len"),
    "max-total-tokens": Flag(int, ARGS, default=None, key="cluster.kv_cache.num_blocks", to_flag=_total_tokens_flag),
    "kv-cache-dtype": Flag(str, ARGS, choices=("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2"), default="auto"),
    "disable-cuda-graph": Flag(bool, ARGS, boolean=True, default=False, key="cost_model.engine", to_flag=_graph_flag),
    "speculative-algorithm": Flag(str, ARGS, choices=tuple(speculative.SGLANG_ALGORITHMS), default=None),
    "speculative-num-steps": Flag(int, ARGS, default=None),
    "speculative-eagle-topk": Flag(int, ARGS, default=None),
    "speculative-num-draft-tokens": Flag(int, ARGS, default=None),
    "speculative-draft-model-path": Flag(str, ARGS, default=None),
    # HiCache (cbsim/server/kv_tiers.py -> cluster.kv_cache.tiers)
    "enable-hierarchical-cache": Flag(bool, ARGS, boolean=True, default=False),
    "hicache-ratio": Flag(float, ARGS, default=2.0),
    "hicache-size": Flag(int, ARGS, default=0),
    "hicache-write-policy": Flag(str, ARGS, choices=("write_back", "write_through", "write_through_selective"),
                                 default="write_through"),
    "hicache-storage-backend": Flag(str, ARGS, default=None),
}
ALIASES = {"model": "model-path", "tensor-parallel-size": "tp-size", "tp": "tp-size",
           "pipeline-parallel-size": "pp-size", "pp": "pp-size",
           "data-parallel-size": "dp-size", "dp": "dp-size"}
IGNORED = frozenset({
    "host", "port", "log-level", "log-requests", "api-key", "served-model-name", "trust-remote-code",
    "download-dir", "load-format", "random-seed", "tokenizer-path", "chat-template", "show-time-cost",
    "enable-metrics", "skip-server-warmup", "revision", "attention-backend", "sampling-backend",
    "hicache-io-backend", "hicache-mem-layout",  # how HiCache copies and lays out pages, not how much it holds
})


def default(name: str, context):
    """The engine's default for flag `name` here (chunked_prefill_size depends on the GPU's memory)."""
    if name == "chunked-prefill-size":
        return _chunk_default(context.gpu)
    return FLAGS[name].default


def _get(flags: dict, name: str, context):
    return flags[name] if name in flags else default(name, context)


def resolve(flags: dict, context, path: str) -> tuple[dict, set[str]]:
    """(dotted cbsim key -> value, the keys a flag set explicitly) for SGLang with these flags."""
    if flags.get("schedule-conservativeness", 1.0) != 1.0:
        raise ConfigError(f"{path} --schedule-conservativeness", "1.0 (cbsim's sglang policy does not model the "
                          "new-token-ratio reserve it scales yet)", flags["schedule-conservativeness"])
    if flags.get("kv-cache-dtype", "auto") not in ("auto", "bf16", "bfloat16"):
        raise ConfigError(f"{path} --kv-cache-dtype", "auto or bf16 (cbsim's KV cache is 16-bit here)",
                          flags["kv-cache-dtype"])
    chunk = _get(flags, "chunked-prefill-size", context)
    page = _get(flags, "page-size", context)
    settings = {
        "policy.name": "sglang",
        "policy.token_budget": _get(flags, "max-prefill-tokens", context),
        "policy.chunked_prefill_size": None if chunk == -1 else chunk,
        "policy.schedule_policy": _get(flags, "schedule-policy", context).replace("-", "_"),
        "policy.enable_mixed_chunk": _get(flags, "enable-mixed-chunk", context),
        "cluster.kv_cache.block_size": page,
        "cluster.kv_cache.prefix_caching": not _get(flags, "disable-radix-cache", context),
        "cost_model.engine": {"preset": "sglang", "cuda_graph_max_batch": 0} if flags.get("disable-cuda-graph")
        else "sglang",
        "preemption.mode": "recompute",
    }
    optional = ("max-running-requests", "mem-fraction-static", "tp-size", "dp-size", "context-length", "model-path")
    settings.update({FLAGS[name].key: flags[name] for name in optional if name in flags})
    if "max-total-tokens" in flags:
        settings["cluster.kv_cache.num_blocks"] = -(-flags["max-total-tokens"] // page)
    settings.update(pipeline_setting(flags.get("pp-size"), context, f"{path} --pp-size"))
    spec = speculative.from_sglang(flags, path)
    settings.update(spec)
    tiers = kv_tiers.from_sglang(flags, path)
    settings.update(tiers)
    return settings, explicit_keys(FLAGS, flags, settings) | set(spec) | set(tiers)


def _chunk_default(gpu) -> int:
    if gpu is None:
        return 4096
    memory = gpu.memory_bytes
    return 2048 if memory < 35 * GiB else 8192 if memory < 160 * GiB else 16384
