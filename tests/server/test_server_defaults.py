"""The flag tables against the engines' documented defaults.

Each row below was read in the engine's source (through the code index) and is written here by hand,
apart from the tables in cbsim/server, so a wrong table entry fails here:

vLLM (vllm-project/vllm)
- vllm/config/scheduler.py @01230b40: max_num_partial_prefills 1, max_long_partial_prefills 1,
  long_prefill_token_threshold 0, enable_chunked_prefill True, policy "fcfs", async_scheduling False.
- vllm/config/cache.py @01230b40: gpu_memory_utilization 0.9 (0.92 @002f10e0, as the v0.25.0 API docs
  show), block_size None (16 on CUDA), cache_dtype "auto", num_gpu_blocks_override None,
  enable_prefix_caching None (on for V1).
- vllm/config/parallel.py: tensor_parallel_size 1, pipeline_parallel_size 1, data_parallel_size 1,
  enable_expert_parallel False.
- vllm/config/lora.py: max_loras 1; vllm/config/model.py: enforce_eager False, dtype "auto", quantization None.
- vllm/engine/arg_utils.py: speculative_config None (speculation off).
- vllm/config/cache.py: kv_offloading_size None, kv_offloading_backend None (offloading off; newer
  versions default the backend to "native", still off without a size); kv_transfer_config None.
- vllm/engine/arg_utils.py @99d7eb5d get_batch_defaults: no static default for max_num_batched_tokens
  and max_num_seqs (8192/1024 on a >= 70 GiB GPU that is not an A100, else 2048/256).
SGLang (sgl-project/sglang, python/sglang/srt/server_args.py @469c63e5)
- max_prefill_tokens 16384, schedule_policy "fcfs", schedule_conservativeness 1.0, page_size None (1),
  enable_mixed_chunk False, disable_radix_cache False, tp_size 1, pp_size 1, dp_size 1,
  kv_cache_dtype "auto", disable_cuda_graph False; chunked_prefill_size, mem_fraction_static and
  max_running_requests are derived at startup (GPU memory, KV pool): no static default;
  speculative_algorithm, speculative_num_steps, speculative_eagle_topk, speculative_num_draft_tokens and
  speculative_draft_model_path None (speculation off); enable_hierarchical_cache False, hicache_ratio 2.0,
  hicache_size 0 (use the ratio), hicache_write_policy "write_through", hicache_storage_backend None
  (docs/advanced_features/hicache_best_practices.md).
"""
from __future__ import annotations

import pytest

from cbsim.sim.costmodels.catalog.lookup import gpu_spec
from cbsim.server import ENGINES, Context, apply_server
from cbsim.server.flags import NO_STATIC_DEFAULT

VLLM_DOCUMENTED = {
    "enable-chunked-prefill": True, "long-prefill-token-threshold": 0, "max-num-partial-prefills": 1,
    "max-long-partial-prefills": 1, "scheduling-policy": "fcfs", "async-scheduling": False,
    "gpu-memory-utilization": 0.9, "block-size": 16, "kv-cache-dtype": "auto", "num-gpu-blocks-override": None,
    "enable-prefix-caching": True, "tensor-parallel-size": 1, "pipeline-parallel-size": 1, "max-loras": 1,
    "disable-hybrid-kv-cache-manager": False, "data-parallel-size": 1, "enable-expert-parallel": False,
    "quantization": None, "prefill-schedule-interval": 1,  # SchedulerConfig (vLLM PR #44558): Field(default=1, ge=1)
    "enforce-eager": False, "dtype": "auto", "enable-lora": False, "max-model-len": None, "speculative-config": None,
    "kv-offloading-size": None, "kv-offloading-backend": None, "kv-transfer-config": None,
    "max-num-batched-tokens": NO_STATIC_DEFAULT, "max-num-seqs": NO_STATIC_DEFAULT, "model": NO_STATIC_DEFAULT,
}
SGLANG_DOCUMENTED = {
    "max-prefill-tokens": 16384, "schedule-policy": "fcfs", "schedule-conservativeness": 1.0, "page-size": 1,
    "enable-mixed-chunk": False, "disable-radix-cache": False, "tp-size": 1, "pp-size": 1, "dp-size": 1,
    "kv-cache-dtype": "auto", "disable-cuda-graph": False, "context-length": None, "max-total-tokens": None,
    "chunked-prefill-size": NO_STATIC_DEFAULT, "mem-fraction-static": NO_STATIC_DEFAULT,
    "max-running-requests": NO_STATIC_DEFAULT, "model-path": NO_STATIC_DEFAULT,
    "speculative-algorithm": None, "speculative-num-steps": None, "speculative-eagle-topk": None,
    "speculative-num-draft-tokens": None, "speculative-draft-model-path": None,
    "enable-hierarchical-cache": False, "hicache-ratio": 2.0, "hicache-size": 0,
    "hicache-write-policy": "write_through", "hicache-storage-backend": None,
}
CONTEXT = Context(gpu_spec("h100"), 8192, None, "roofline", frozenset({"tp", "pp"}))


@pytest.mark.parametrize("engine, documented", [("vllm", VLLM_DOCUMENTED), ("sglang", SGLANG_DOCUMENTED)])
def test_every_flag_has_the_documented_default(engine, documented):
    table = ENGINES[engine].FLAGS
    assert set(table) == set(documented)
    assert {name: flag.default for name, flag in table.items()} == documented


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_giving_a_flag_its_default_changes_no_setting(engine):
    """The defaults are the ones resolve uses: `--flag <default>` resolves exactly as leaving it out."""
    module = ENGINES[engine]
    without, _ = module.resolve({}, CONTEXT, "x")
    for name, flag in module.FLAGS.items():
        if flag.default is NO_STATIC_DEFAULT or flag.default is None:
            continue
        given, _ = module.resolve({name: flag.default}, CONTEXT, "x")
        leftover = {k: v for k, v in given.items() if k not in without}  # keys only a given flag sets
        assert {k: given[k] for k in without} == without, name
        assert all(v == flag.default for v in leftover.values()), (name, leftover)


@pytest.mark.parametrize("version, expected", [(None, 0.9), ("0.11", 0.9), ("0.24.1", 0.9), ("0.25", 0.92),
                                               ("0.27.1", 0.92)])
def test_vllm_gpu_memory_utilization_follows_the_version(version, expected):
    server = {"engine": "vllm", "args": ""} | ({"version": version} if version else {})
    merged, resolution = apply_server({"server": server})
    assert resolution.settings["cluster.kv_cache.gpu_memory_utilization"] == expected
    assert merged["cluster"]["kv_cache"]["gpu_memory_utilization"] == expected


@pytest.mark.parametrize("args, expected", [("", True), ("--disable-hybrid-kv-cache-manager", False),
                                            ("--no-disable-hybrid-kv-cache-manager", True)])
def test_vllm_hybrid_kv_cache_manager_flag(args, expected):
    """vLLM's hybrid manager (on by default) frees a sliding window's pages; the flag turns it off."""
    merged, resolution = apply_server({"server": {"engine": "vllm", "args": args}})
    assert resolution.settings["cluster.kv_cache.hybrid_kv_cache_manager"] is expected
    assert merged["cluster"]["kv_cache"]["hybrid_kv_cache_manager"] is expected


@pytest.mark.parametrize("args, expected", [("", None), ("--prefill-schedule-interval 2", 2),
                                            ("--prefill_schedule_interval=4", 4)])
def test_vllm_prefill_schedule_interval_flag(args, expected):
    """vLLM's --prefill-schedule-interval (DP ranks: prompts on every Nth step) sets
    cluster.prefill_schedule_interval only when given (sim/dp_lockstep.py applies it)."""
    merged, resolution = apply_server({"server": {"engine": "vllm", "args": args}})
    assert resolution.settings.get("cluster.prefill_schedule_interval") == expected
    assert merged.get("cluster", {}).get("prefill_schedule_interval") == expected
