"""vLLM's precision and data-parallel flags (issue 30): --quantization, --kv-cache-dtype, --data-parallel-size,
--enable-expert-parallel, mapped onto the model's dtypes, replicas and the cost model's DP attention."""
import pytest

from cbsim.config import load_config
from cbsim.core.errors import ConfigError
from cbsim.sim.costmodels.catalog.lookup import model_spec

BASE = {"name": "x", "workload": {"num_requests": 10, "arrival": {"type": "poisson", "rate": 1},
                                  "prompt_len": {"type": "fixed", "value": 100},
                                  "output_len": {"type": "fixed", "value": 10}}}


def resolve(args: str, **extra):
    return load_config({**BASE, **extra, "server": {"engine": "vllm", "args": args}})


@pytest.mark.parametrize("args, weight, kv", [("--quantization fp8", "fp8", None), ("-q awq", "int4", None),
                                              ("--kv-cache-dtype fp8", None, "fp8"),
                                              ("--kv-cache-dtype fp8_e5m2 --quantization fp8", "fp8", "fp8"),
                                              ("--kv-cache-dtype auto", None, None)])
def test_precision_flags_set_the_models_dtypes(args, weight, kv):
    spec = model_spec(resolve(args).model, "model")
    assert (spec.weight_dtype, spec.kv_dtype) == (weight, kv)


def test_an_fp8_kv_cache_holds_twice_the_blocks():
    from cbsim.build import build_replica_parts

    def blocks(cfg):
        return build_replica_parts(cfg)[2]().num_blocks

    assert blocks(resolve("--kv-cache-dtype fp8")) > 1.9 * blocks(resolve(""))


def test_a_method_with_checkpoint_bits_asks_for_the_checkpoint():
    with pytest.raises(ConfigError, match="server.args --quantization: expected fp8 or awq"):
        resolve("--quantization gptq")


def test_a_flag_and_the_experiment_must_agree_on_a_dtype():
    with pytest.raises(ConfigError, match="model.kv_dtype: expected 'fp8'"):
        resolve("--kv-cache-dtype fp8", model={"config": "llama-3-8b", "kv_dtype": "bf16"})
    assert resolve("--kv-cache-dtype fp8", model={"config": "llama-3-8b", "kv_dtype": "fp8"}).model["kv_dtype"] == "fp8"


@pytest.mark.parametrize("args", ["--data-parallel-size 4", "-dp 4", "--data-parallel-size=4 --api-server-count 2"])
def test_data_parallel_ranks_are_replicas(args):
    assert resolve(args).cluster.replicas == 4


def test_expert_parallel_with_data_parallel_is_dp_attention_on_a_moe_model():
    cfg = resolve("--enable-expert-parallel --data-parallel-size 8", model="deepseek-v3",
                  cost_model={"type": "roofline", "gpu": "h200", "tp": 1})
    assert cfg.cluster.replicas == 8 and cfg.cost_model["expert_parallel"] is True
    assert cfg.cost_model["data_parallel"] == 8
    dense = resolve("--enable-expert-parallel -dp 2")  # no experts to split: plain replicas
    assert dense.cluster.replicas == 2 and "expert_parallel" not in dense.cost_model
