"""server: an engine's flags resolve to the settings and defaults that engine uses (vLLM V1, SGLang)."""
from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from cbsim.cli.app import app
from cbsim.config import load_config
from cbsim.core.errors import ConfigError
from cbsim.sim.costmodels.catalog.lookup import gpu_spec
from cbsim.server import apply_server, sglang

WORKLOAD = {"num_requests": 5, "arrival": {"type": "poisson", "rate": 1.0},
            "prompt_len": {"type": "fixed", "value": 100}, "output_len": {"type": "fixed", "value": 10}}


def resolved(args, engine="vllm", gpu="h100", **extra):
    data = {"name": "s", "model": "llama-3-8b", "cost_model": {"type": "roofline", "gpu": gpu, "tp": 1},
            "server": {"engine": engine, "args": args}, "workload": WORKLOAD, **extra}
    return load_config(data)


@pytest.mark.parametrize("gpu,budget,seqs", [("h100", 8192, 1024), ("h200", 8192, 1024), ("a100", 2048, 256)])
def test_vllm_serve_batch_defaults_follow_the_gpu(gpu, budget, seqs):
    # arg_utils.get_batch_defaults: >= 70 GiB and not an A100 -> 8192 / 1024, else 2048 / 256
    policy = resolved("", gpu=gpu).policy
    assert (policy["name"], policy["token_budget"], policy["max_num_seqs"]) == ("sarathi", budget, seqs)
    assert policy["long_prefill_token_threshold"] is None and policy["max_num_partial_prefills"] == seqs


def test_vllm_defaults_of_the_cache_engine_and_preemption():
    cfg = resolved("")
    kv = cfg.cluster.kv_cache
    assert (kv.block_size, kv.gpu_memory_utilization, kv.prefix_caching) == (16, 0.9, True)
    assert cfg.cost_model["engine"] == "vllm-v1" and cfg.preemption.mode == "recompute"


def test_vllm_flags_in_every_spelling():
    cfg = resolved("--max-num-batched-tokens=4096 --max_num_seqs 64 --no-enable-prefix-caching -tp 2 "
                   "--long-prefill-token-threshold 512 --async-scheduling --enforce-eager --block-size 32")
    assert cfg.policy["token_budget"] == 4096 and cfg.policy["max_num_seqs"] == 64
    assert cfg.policy["long_prefill_token_threshold"] == 512
    assert cfg.cluster.kv_cache.prefix_caching is False and cfg.cluster.kv_cache.block_size == 32
    assert cfg.cluster.tp == 2
    assert cfg.cost_model["engine"] == {"preset": "vllm-v1", "overlap": True, "output_lag_steps": 1,
                                        "cuda_graph_max_batch": 0}
    mapping = resolved({"max-num-batched-tokens": 4096, "--max_num_seqs": 64, "enable-prefix-caching": False})
    assert mapping.policy["token_budget"] == 4096 and mapping.cluster.kv_cache.prefix_caching is False


def test_vllm_without_chunked_prefill_runs_whole_prompts():
    # no chunking: max_num_batched_tokens = max(max_model_len, default), decodes + whole prompts (orca, paged KV)
    policy = resolved("--no-enable-chunked-prefill", gpu="a100").policy
    assert policy == {"name": "orca", "token_budget": 8192, "max_num_seqs": 256, "kv_reservation": "paged"}


def test_num_gpu_blocks_override_leaves_out_vllms_null_block():
    # vllm/v1/core/block_pool.py BlockPool.__init__: `self.null_block = self.free_block_queue.popleft()`
    assert resolved("--num-gpu-blocks-override 40").cluster.kv_cache.num_blocks == 39
    assert resolved("--num-gpu-blocks-override 2").cluster.kv_cache.num_blocks == 1
    with pytest.raises(ConfigError, match="server.args --num-gpu-blocks-override"):
        resolved("--num-gpu-blocks-override 1")


@pytest.mark.parametrize("args,key", [
    ("--max-num-partial-prefills 2", "--max-num-partial-prefills"),  # V1 rejects concurrent partial prefills
    ("--frobnicate 3", "--frobnicate"),
    ("--max-num-seqs many", "--max-num-seqs"),
    ("--scheduling-policy lottery", "--scheduling-policy"),
    ("--max-num-seqs 8 --max-num-seqs 16", "--max-num-seqs"),
])
def test_bad_flags_are_named(args, key):
    with pytest.raises(ConfigError, match=f"server.args {key}"):
        resolved(args)


def test_a_flag_and_an_experiment_key_must_agree():
    with pytest.raises(ConfigError, match="policy.max_num_seqs"):
        resolved("--max-num-seqs 128", policy={"name": "sarathi", "max_num_seqs": 64})
    with pytest.raises(ConfigError, match="policy.name"):
        resolved("", policy={"name": "orca"})
    agreed = resolved("--max-num-seqs 128", policy={"name": "sarathi", "max_num_seqs": 128, "token_budget": 512})
    assert agreed.policy["token_budget"] == 512  # an experiment key refines an engine default
    same_model = resolved("meta-llama/Meta-Llama-3-8B-Instruct --port 8000")
    assert same_model.model == "llama-3-8b"


def test_ignored_flags_are_reported():
    data = {"server": {"engine": "vllm", "args": "--port 8000 --host 0.0.0.0 --disable-log-requests"}}
    _, resolution = apply_server(data)
    assert resolution.ignored == ("port", "host", "disable-log-requests")


@pytest.mark.parametrize("gpu,chunk", [("a100", 8192), ("h200", 8192)])
def test_sglang_defaults(gpu, chunk):
    cfg = resolved("", engine="sglang", gpu=gpu)
    assert cfg.policy == {"name": "sglang", "token_budget": 16384, "chunked_prefill_size": chunk,
                          "schedule_policy": "fcfs", "enable_mixed_chunk": False}
    assert cfg.cluster.kv_cache.block_size == 1 and cfg.cluster.kv_cache.prefix_caching is True
    assert cfg.cost_model["engine"] == "sglang"


def test_sglang_chunk_default_by_gpu_memory():
    h100 = gpu_spec("h100")
    small = type(h100)("l4-like", 24 << 30, 1e14, 3e11, 0.0, 1e-5, "pcie")
    big = type(h100)("b200-like", 180 << 30, 2e15, 8e12, 9e11, 1e-5)
    assert [sglang._chunk_default(g) for g in (None, small, h100, big)] == [4096, 2048, 8192, 16384]


def test_sglang_flags():
    cfg = resolved("--chunked-prefill-size -1 --schedule-policy dfs-weight --disable-radix-cache --dp-size 2 "
                   "--page-size 16 --max-total-tokens 1000 --mem-fraction-static 0.8", engine="sglang")
    assert cfg.policy["chunked_prefill_size"] is None and cfg.policy["schedule_policy"] == "dfs_weight"
    kv = cfg.cluster.kv_cache
    assert (kv.prefix_caching, kv.block_size, kv.num_blocks, kv.gpu_memory_utilization) == (False, 16, 63, 0.8)
    assert cfg.cluster.replicas == 2
    with pytest.raises(ConfigError, match="--schedule-conservativeness"):
        resolved("--schedule-conservativeness 0.5", engine="sglang")


def test_server_block_errors():
    for server, key in (({"engine": "trt"}, "server.engine"), ({"engine": {}}, "server.engine"),
                        ({"engine": ["vllm"]}, "server.engine"), ({"engine": "vllm", "flags": ""}, "server.flags"),
                        ({"engine": "vllm", "version": "0.6.3"}, "server.version"), ("vllm", "server")):
        with pytest.raises(ConfigError, match=key):
            load_config({"server": server, "workload": WORKLOAD})


def test_validate_prints_the_resolution_and_bad_flags_exit_2(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({"name": "s", "server": {"engine": "vllm", "args": "--max-num-seqs 32 --port 1"},
                                    "workload": WORKLOAD}))
    out = CliRunner().invoke(app, ["validate", str(path)])
    assert out.exit_code == 0, out.output
    assert "* policy.max_num_seqs = 32" in out.output and "policy.token_budget = 8192" in out.output
    assert "ignored (no effect on a simulation): --port" in out.output
    path.write_text(yaml.safe_dump({"name": "s", "server": {"engine": "vllm", "args": "--bogus 1"},
                                    "workload": WORKLOAD}))
    out = CliRunner().invoke(app, ["validate", str(path)])
    assert out.exit_code == 2 and "server.args --bogus" in out.output and "Traceback" not in out.output


def test_shipped_server_experiments_resolve():
    for name in ("vllm_llama3_8b", "sglang_llama3_8b"):
        cfg = load_config(f"experiments/servers/{name}.yaml")
        assert cfg.policy["max_num_seqs"] == 128


def test_vllm_lora_flags_limit_adapters_per_step():
    assert resolved("--enable-lora").policy["max_loras"] == 1  # vLLM's LoRAConfig default
    assert resolved("--enable-lora --max-loras 4").policy["max_loras"] == 4
    assert "max_loras" not in resolved("--max-loras 4").policy  # without --enable-lora vLLM serves no adapters
    with pytest.raises(ConfigError, match="--enable-lora"):
        resolved("--enable-lora --no-enable-chunked-prefill")


@pytest.mark.parametrize("args, needle", [
    ("--max-num-batched-tokens 16 --max-num-seqs 256", "at least --max-num-seqs (256)"),
    ("--max-num-batched-tokens 2000 --max-num-seqs 8 --no-enable-chunked-prefill --max-model-len 4096",
     "at least max_model_len (4096)"),
    ("--block-size 7", "one of 1, 8, 16, 32, 64, 128, 256"),
])
def test_flags_vllm_refuses_at_startup_are_refused(args, needle):
    """vllm/config/scheduler.py @01230b40 verify_max_model_len and cache.py's BlockSize choices (issue 26)."""
    with pytest.raises(ConfigError, match="server.args --") as err:
        load_config({"server": {"engine": "vllm", "args": args}, "workload": WORKLOAD})
    assert needle in str(err.value)
