"""Model/GPU specs and the built-in analytic cost models (unit, linear, roofline)."""
import json
from pathlib import Path

import numpy as np
import pytest

from cbsim.core.errors import ConfigError
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.costmodels.catalog.lookup import gpu_spec, model_spec
from cbsim.sim.costmodels.catalog.specs import GiB
from cbsim.sim.kv.sizing import kv_cache_blocks
from cbsim.sim.cost import CostModel
from cbsim.sim.shape import StepShape
from paths import ROOT

LLAMA3_8B = model_spec("llama-3-8b")
LLAMA2_70B = model_spec("llama-2-70b")
TINY = model_spec("tiny")
PROFILES = ROOT / "sim" / "costmodels" / "profiles"


def decode(*contexts):
    return StepShape.from_batch(decode=contexts)


def prefill(*chunks):
    return StepShape.from_batch(prefill=chunks)


# ---------------------------------------------------------------- specs


def test_model_presets_and_aliases():
    assert model_spec("meta-llama/Meta-Llama-3-8B") is LLAMA3_8B
    assert model_spec("meta-llama/Llama-2-70b-hf") is LLAMA2_70B
    assert model_spec("Llama-3-8B-Instruct") is LLAMA3_8B
    assert LLAMA3_8B.head_dim == 128 and LLAMA3_8B.num_kv_heads == 8
    assert (TINY.hidden, TINY.num_layers, TINY.num_heads, TINY.num_kv_heads, TINY.head_dim) == (256, 2, 4, 2, 64)


def test_parameter_counts_match_published_totals():
    # Hugging Face model cards: Llama-2-7b 6,738,415,616; Llama-3-8B 8,030,261,248; Llama-2-70b 68,976,648,192
    assert model_spec("llama-2-7b").weight_bytes(1) == 2 * 6_738_415_616
    assert LLAMA3_8B.weight_bytes(1) == 2 * 8_030_261_248
    assert LLAMA2_70B.weight_bytes(1) == 2 * 68_976_648_192
    assert LLAMA3_8B.layer_params() == 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336


def test_kv_bytes_per_token_replicates_kv_heads_beyond_their_count():
    assert LLAMA3_8B.kv_bytes_per_token(1) == 2 * 32 * 8 * 128 * 2  # 128 KiB
    assert LLAMA2_70B.kv_bytes_per_token(8) == 2 * 80 * 1 * 128 * 2
    assert TINY.kv_bytes_per_token(4) == TINY.kv_bytes_per_token(2) == 2 * 2 * 1 * 64 * 2


def test_model_spec_from_mapping_and_errors():
    spec = model_spec({"name": "m", "hidden": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2,
                       "intermediate": 1024, "vocab": 100, "max_model_len": 2048})
    assert spec.head_dim == 64 and spec.dtype_bytes == 2
    with pytest.raises(ConfigError, match="llama-3-8b") as err:
        model_spec("gpt-5")
    assert err.value.path == "model"
    with pytest.raises(ConfigError) as err:
        model_spec({"name": "m", "hidden": 512, "num_layers": 4, "num_heads": 8, "num_kv_heads": 3,
                    "intermediate": 1024, "vocab": 100, "max_model_len": 2048})
    assert err.value.path == "model.num_kv_heads"
    with pytest.raises(ConfigError) as err:
        model_spec({"name": "m", "hidden": 512}, path="cluster.model")
    assert err.value.path.startswith("cluster.model.")


def test_gpu_presets():
    assert gpu_spec("A100-80GB") is gpu_spec("a100")
    assert gpu_spec("h100-sxm").bf16_flops == 989e12
    assert gpu_spec("h200").hbm_bandwidth == 4.8e12 and gpu_spec("h200").memory_bytes == 141 * GiB
    with pytest.raises(ConfigError) as err:
        gpu_spec("v100", path="cost_model.gpu")
    assert err.value.path == "cost_model.gpu"


def test_kv_cache_blocks_llama3_8b_on_h100_by_hand():
    usable = 80 * 2**30 * 0.9  # 77,309,411,328 bytes
    weights = 2 * 8_030_261_248  # 16,060,522,496 bytes
    reserve = 2 * 2**30
    block = 16 * 131_072  # 16 tokens x 128 KiB
    assert (usable - weights - reserve) // block == 28_181
    assert kv_cache_blocks(LLAMA3_8B, gpu_spec("h100"), 1, 16, 0.9) == 28_181
    assert kv_cache_blocks(LLAMA3_8B, gpu_spec("h100"), 1, 16, 0.9, activation_reserve_bytes=0) == 29_205


def test_kv_cache_blocks_errors():
    with pytest.raises(ConfigError) as err:
        kv_cache_blocks(LLAMA2_70B, gpu_spec("a100"), 1, 16, 0.9)  # 138 GB of weights on one 80 GB card
    assert err.value.path == "cluster.kv_cache.num_blocks"
    assert kv_cache_blocks(LLAMA2_70B, gpu_spec("a100"), 2, 16, 0.9) > 0


# ---------------------------------------------------------------- loading


def test_load_each_model_from_a_mapping():
    assert load_cost_model({"type": "unit"}).step_time(decode(5)) == 1.0
    assert load_cost_model({"type": "unit", "seconds": 0.5}).step_time(prefill((100, 0))) == 0.5
    linear = load_cost_model({"type": "linear", "base": 0.01, "per_token": 1e-4, "per_seq": 1e-3,
                              "per_kv_token": 1e-6})
    # tokens 10 + 2 decode rows, 3 sequences, kv read h=50 + contexts 7 + 9
    shape = StepShape.from_batch(prefill=[(10, 50)], decode=[7, 9])
    assert linear.step_time(shape) == pytest.approx(0.01 + 12e-4 + 3e-3 + 66e-6, rel=1e-12)
    roofline = load_cost_model({"type": "roofline", "gpu": "a100-80gb", "tp": 2}, LLAMA2_70B)
    assert roofline.describe()["gpu"] == "a100" and roofline.describe()["tp"] == 2
    for model in (linear, roofline, load_cost_model({"type": "unit"})):
        json.dumps(model.describe())
        assert model.step_time(StepShape()) == 0.0


@pytest.mark.parametrize("mapping, path", [
    ({"type": "nope"}, "cost_model.type"),
    ({"seconds": 1}, "cost_model.type"),
    ({"type": "roofline", "gpu": "v100"}, "cost_model.gpu"),
    ({"type": "roofline", "tp": 3}, "cost_model.tp"),
    ({"type": "roofline", "memory_efficiency": 1.5}, "cost_model.memory_efficiency"),
    ({"type": "linear", "slope": 1.0}, "cost_model.slope"),
    ({"type": "linear", "per_token": -1.0}, "cost_model.per_token"),
    ({"type": "unit", "seconds": 0}, "cost_model.seconds"),
])
def test_config_errors_name_the_key(mapping, path):
    with pytest.raises(ConfigError) as err:
        load_cost_model(mapping)
    assert err.value.path == path


def test_tp_must_divide_the_model():
    with pytest.raises(ConfigError) as err:
        load_cost_model({"type": "roofline", "tp": 8}, TINY)  # 4 heads
    assert err.value.path == "cost_model.tp"


# ---------------------------------------------------------------- behaviour


def all_models():
    return [
        load_cost_model({"type": "unit"}),
        load_cost_model({"type": "linear", "per_seq": 2e-4, "per_kv_token": 3e-7}),
        load_cost_model({"type": "roofline"}, LLAMA3_8B),
        load_cost_model({"type": "roofline", "gpu": "a100", "tp": 4}, LLAMA2_70B),
        load_cost_model({"type": "roofline", "gpu": "h200", "tp": 2}, TINY),
    ]


@pytest.mark.parametrize("model", all_models(), ids=lambda m: m.describe()["type"])
def test_monotone_in_tokens_and_context(model):
    strict = model.name != "unit"
    times = [model.step_time(prefill((c, 0))) for c in (1, 16, 256, 4096, 16384)]
    assert all(t > 0 for t in times) and times == sorted(times)
    assert not strict or times[-1] > times[0]
    times = [model.step_time(decode(*[ctx] * 32)) for ctx in (1, 100, 1000, 10_000, 100_000)]
    assert times == sorted(times) and (not strict or times[-1] > times[0])
    times = [model.step_time(prefill((512, h))) for h in (0, 1000, 10_000, 100_000)]
    assert times == sorted(times) and (not strict or times[-1] > times[0])


@pytest.mark.parametrize("model", all_models(), ids=lambda m: m.describe()["type"])
def test_swap_bytes_are_not_charged(model):
    base = StepShape.from_batch(prefill=[(64, 10)], decode=[100, 200])
    swapped = StepShape.from_batch(prefill=[(64, 10)], decode=[100, 200], kv_swap_bytes=5e9)
    assert model.step_time(swapped) == model.step_time(base)


@pytest.mark.parametrize("model", all_models(), ids=lambda m: m.describe()["type"])
def test_decode_run_times_bit_identical_to_step_by_step(model):
    rng = np.random.default_rng(7)
    cases = [(rng.integers(1, 4096, size=int(rng.integers(1, 300))), int(rng.integers(1, 60))) for _ in range(6)]
    cases.append((rng.integers(1_000_000, 2_000_000_000, size=64), 40))  # very large contexts
    cases.append((np.array([1]), 1))
    for contexts, steps in cases:
        fast = model.decode_run_times(contexts, steps)
        slow = CostModel.decode_run_times(model, contexts, steps)
        assert fast.dtype == np.float64 and fast.shape == (steps,)
        assert np.array_equal(fast, slow)
    assert np.array_equal(model.decode_run_times(np.array([], dtype=np.int64), 3), np.zeros(3))


def decode_pricing_models():
    """Every kind of step the roofline prices: dense, MoE, MLA, windowed, pipelined, data-parallel, an engine."""
    roofline = lambda model, **keys: load_cost_model({"type": "roofline", **keys}, model_spec(model))
    return [*all_models(), roofline("llama-3-8b", engine="vllm-v1"), roofline("mixtral-8x7b", tp=2),
            roofline("deepseek-v3", gpu="h200", tp=8), roofline("gemma-2-27b"), roofline("llama-3-8b", pp=2),
            roofline("qwen3-30b-a3b", tp=2, data_parallel=2, expert_parallel=True),
            load_cost_model({"type": "vidur", "gpu": "a100", "model": "llama-2-7b", "tp": 1, "engine": "vllm-v1"}),
            load_cost_model({"type": "vidur", "gpu": "a100", "model": "llama-2-7b", "tp": 1, "pp": 2}),
            load_cost_model({"type": "vidur", "gpu": "a100", "model": "llama-2-70b", "tp": 2, "engine": "none"}),
            load_cost_model({"type": "fitted", "engine": "vllm-v1", "profile": str(
                PROFILES / "fitted" / "a100-llama-2-70b-tp2-published.json")}, LLAMA2_70B)]


@pytest.mark.parametrize("model", decode_pricing_models(), ids=lambda m: m.describe()["type"])
def test_mixed_step_time_bit_identical_to_step_time(model):
    """A prompt run's price of a step of chunks beside decode rows (CostModel.mixed_step_time, from the
    rows' count and context sum) is step_time's, bit for bit."""
    rng = np.random.default_rng(12)
    for _ in range(40):
        contexts = rng.integers(1, 9000, size=int(rng.integers(0, 150))).tolist()
        prefill = tuple((int(c), int(h)) for c, h in rng.integers(1, 3000, size=(int(rng.integers(1, 3)), 2)))
        for offset, sampled in ((0, len(contexts)), (3, len(contexts) + 1), (40, len(contexts) + len(prefill))):
            shape = StepShape(prefill, tuple(c + offset for c in contexts), 0, sampled)
            assert model.mixed_step_time(prefill, contexts, offset, sum(contexts) + len(contexts) * offset,
                                         sampled) == model.step_time(shape)


@pytest.mark.parametrize("model", decode_pricing_models(), ids=lambda m: m.describe()["type"])
def test_decode_step_time_bit_identical_to_step_time(model):
    """A decode run's O(1) price of a step (CostModel.decode_step_time, and the function decode_pricer gives
    for a set of rows) is step_time's, bit for bit, also after mixed steps of the same token count have
    filled a model's remembered terms."""
    rng = np.random.default_rng(11)
    for _ in range(40):
        contexts = rng.integers(1, 9000, size=int(rng.integers(1, 200))).tolist()
        n = len(contexts)
        model.step_time(StepShape(prefill=((n, 100),), decode=(5,) * 3, tokens_sampled=1))  # tokens n + 3, rows 1
        for offset in (0, 1, 17):
            shape = StepShape(decode=tuple(c + offset for c in contexts), tokens_sampled=n)
            assert model.decode_step_time(contexts, offset, sum(contexts) + n * offset) == model.step_time(shape)
            assert model.decode_pricer(contexts)(sum(contexts) + n * offset) == model.step_time(shape)


# ---------------------------------------------------------------- roofline magnitudes


def test_llama3_8b_h100_decode_is_about_weights_over_bandwidth():
    model = load_cost_model({"type": "roofline", "gpu": "h100"}, LLAMA3_8B)
    floor = LLAMA3_8B.weight_bytes(1) / gpu_spec("h100").hbm_bandwidth  # 4.79 ms at peak bandwidth
    t = model.step_time(decode(1000))  # 6.5 ms with the default GEMM curve (6.4 with gemm_efficiency 0.72)
    assert floor < t < 1.5 * floor


def test_llama3_8b_h100_prefill_2048_is_compute_bound():
    model = load_cost_model({"type": "roofline", "gpu": "h100"}, LLAMA3_8B)
    t = model.step_time(prefill((2048, 0)))  # 51.4 ms with the default GEMM curve (48.7 with 0.72)
    flops_floor = 2 * 2048 * LLAMA3_8B.num_layers * LLAMA3_8B.layer_params() / 989e12  # 28.9 ms at 100% peak
    assert flops_floor < t < 80e-3
    assert t > 5 * LLAMA3_8B.weight_bytes(1) / 3.35e12  # far above the memory floor
    assert 1.8 < model.step_time(prefill((4096, 0))) / t < 2.3  # scales with tokens


def test_llama2_70b_tp2_a100_decode_of_8():
    model = load_cost_model({"type": "roofline", "gpu": "a100", "tp": 2}, LLAMA2_70B)
    t = model.step_time(decode(*[1000] * 8))  # 56.8 ms: GEMMs 47.8, all-reduces 6.4 (161 x 40 us)
    # floor: 69 GB of weights per GPU at 2.039 TB/s is 33.8 ms; Vidur's A100 TP2 profile of this model
    # (shared/data/vidur, mlp.csv, 8 tokens) measures 0.57 ms per layer = 45.9 ms before attention
    # (its 4 GEMMs 0.54 ms), and its a100_dgx table ~40-55 us per 2-GPU all-reduce of 128 KiB
    assert LLAMA2_70B.weight_bytes(2) / 2.039e12 < t < 60e-3
    # one factor for every GEMM and the old flat all-reduce (10 us + datasheet NVLink) gave 46.3 ms
    tp4 = load_cost_model({"type": "roofline", "gpu": "a100", "tp": 4}, LLAMA2_70B)
    assert tp4.step_time(decode(*[1000] * 8)) < t
