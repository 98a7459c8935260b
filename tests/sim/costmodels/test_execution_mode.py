"""Execution mode (issue 28): CUDA-graph capture sizes and padding, piecewise graphs, and vLLM's
custom all-reduce against NCCL, as the engine presets declare them."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from cbsim.api import load_cost_model
from cbsim.sim.costmodels import custom_allreduce as car
from cbsim.sim.costmodels.cuda_graphs import capture_size
from cbsim.sim.costmodels.engine import Engine, EngineTerms, load_engine
from cbsim.sim.shape import StepShape
from paths import ROOT

KB = 1024
NCCL = {"preset": "vllm-v1", "custom_all_reduce_max_bytes": 0, "cuda_graph_padding": False}
# sglang PR #2904, vLLM's kernel on H100: (TP, float32 elements) -> us
SGLANG_2904 = {2: [9.5, 8.8, 8.7, 12.9, 17.7, 26.6], 4: [9.1, 8.5, 9.2, 20.6, 26.9, 40.2],
               8: [10.1, 9.3, 11.8, 24.1, 30.4, 45.0]}
ELEMENTS = [512, 4096, 32768, 262144, 524288, 1048576]


def roofline(tp=4, engine="vllm-v1", gpu="h100", model="llama-2-70b", **kw):
    return load_cost_model({"type": "roofline", "gpu": gpu, "tp": tp, "engine": engine, **kw}, model)


def test_capture_sizes_are_vllms_list():
    """[1, 2, 4] + range(8, N + 1, 8): the next captured size, and no graph above N."""
    assert [capture_size(t, 512) for t in (1, 2, 3, 4, 5, 8, 9, 17, 511, 512)] == [1, 2, 4, 4, 8, 8, 16, 24, 512, 512]
    assert capture_size(513, 512) == 513 and capture_size(0, 512) == 0


def test_custom_allreduce_reproduces_the_published_timings():
    errors = [car.custom_allreduce_seconds(4 * e, n) / (us * 1e-6) - 1
              for n, row in SGLANG_2904.items() for e, us in zip(ELEMENTS, row)]
    assert max(map(abs, errors)) < 0.13 and float(np.median(np.abs(errors))) < 0.04


def test_custom_allreduce_applies_where_vllm_uses_it():
    assert car.applies(32 * KB, 4, "nvswitch", car.VLLM_MAX_BYTES, True)
    assert car.applies(32 * KB, 2, "pcie", car.VLLM_MAX_BYTES, True)  # two GPUs: any link
    assert not car.applies(32 * KB, 4, "pcie", car.VLLM_MAX_BYTES, True)  # more than two PCIe-only GPUs
    assert not car.applies(32 * KB, 3, "nvswitch", car.VLLM_MAX_BYTES, True)  # world sizes 2, 4, 6, 8
    assert not car.applies(car.VLLM_MAX_BYTES, 8, "nvswitch", car.VLLM_MAX_BYTES, True)  # strictly below max_size
    assert not car.applies(32 * KB, 8, "nvswitch", car.VLLM_MAX_BYTES, False)  # across nodes
    assert not car.applies(32 * KB, 8, "nvswitch", 0, True)  # the engine does not use it
    assert car.one_shot(511 * KB, 4) and not car.one_shot(512 * KB, 4)
    assert car.one_shot(255 * KB, 8) and not car.one_shot(256 * KB, 8) and car.one_shot(4096 * KB, 2)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_vllm_v1_decode_at_tp_is_priced_with_the_custom_allreduce(tp):
    """Small decode batches get cheaper by the all-reduce saving alone; TP1 has no all-reduce."""
    shape = StepShape.from_batch(decode=[1024] * 8)
    nccl, custom = roofline(tp, NCCL), roofline(tp, {"preset": "vllm-v1", "cuda_graph_padding": False})
    saved = nccl.collective_time(8) - custom.collective_time(8)
    assert saved > 0
    assert nccl.step_time(shape) - custom.step_time(shape) == pytest.approx(saved, rel=1e-9)
    assert roofline(1, NCCL).step_time(shape) == roofline(1, {**NCCL, "custom_all_reduce_max_bytes": 8 << 20}).step_time(
        shape)


def test_padding_prices_the_captured_batch():
    """9 sequences replay the graph of 16: GEMMs and all-reduces at 16 tokens, attention at the 9 real rows."""
    padded, plain = roofline(engine="vllm-v1"), roofline(engine={"preset": "vllm-v1", "cuda_graph_padding": False})
    nine = StepShape.from_batch(decode=[1024] * 9)
    assert padded.step_time(nine) > plain.step_time(nine)
    sixteen_rows = plain._seconds(16.0, 9.0, 9 * 1024.0, 9 * 1024.0)
    assert padded._seconds(*(16.0, 9.0, 9 * 1024.0, 9 * 1024.0)) == sixteen_rows
    big = StepShape.from_batch(decode=[1024] * 600)  # above the largest capture size: eager, unpadded
    assert padded.step_time(big) == plain.step_time(big)
    runs = padded.decode_run_times(np.array([1000] * 9), 5)
    assert list(runs) == [padded.step_time(StepShape.from_batch(decode=[1000 + j] * 9)) for j in range(5)]


def test_piecewise_graphs_lift_the_eager_floor_of_small_mixed_steps():
    terms = dict(launch_per_layer_s=1e-3, cuda_graph_max_batch=512)
    eager = Engine(EngineTerms(**terms), "t").bind(80, 1)
    piecewise = Engine(EngineTerms(cuda_graph_piecewise=True, **terms), "t").bind(80, 1)
    mixed = StepShape.from_batch(prefill=[(256, 0)], decode=[100] * 8)  # 264 tokens
    assert eager.step_of(1e-3, mixed) == pytest.approx(80e-3)
    assert piecewise.step_of(1e-3, mixed) == pytest.approx(1e-3)
    large = StepShape.from_batch(prefill=[(1024, 0)])
    assert piecewise.step_of(1e-3, large) == pytest.approx(80e-3)  # above the capture sizes: eager


def test_presets_state_their_execution_mode():
    v1, sgl, trt = (load_engine(n).terms for n in ("vllm-v1", "sglang", "trtllm"))
    assert (v1.cuda_graph_piecewise, v1.cuda_graph_padding, v1.custom_all_reduce_max_bytes) == (True, True, 8 << 20)
    assert (sgl.cuda_graph_piecewise, sgl.cuda_graph_padding, sgl.custom_all_reduce_max_bytes) == (False, True, 8 << 20)
    assert (trt.cuda_graph_padding, trt.custom_all_reduce_max_bytes) == (False, 0)
    for eager in ("vidur-a100-tp1", "vidur-a100-tp2", "vllm-2023-a100"):
        t = load_engine(eager).terms
        assert not t.cuda_graph_padding and t.custom_all_reduce_max_bytes == 0


def test_decode_pair_weight_is_the_per_query_head_kernels_rate():
    from cbsim.sim.costmodels.attention_structure import MMHA_FRACTION, decode_pair_weight
    from cbsim.sim.costmodels.catalog.lookup import model_spec
    mistral = model_spec("mistral-7b")
    assert decode_pair_weight(mistral, False, 0.4) == 1.0
    assert decode_pair_weight(mistral, True, 0.4) == pytest.approx(0.4 / MMHA_FRACTION)
    assert decode_pair_weight(model_spec("deepseek-v2-lite"), True, 0.4) == 1.0  # MLA's absorbed decode


def test_per_query_head_decode_prices_gqa_like_mha():
    """TensorRT-LLM v0.9's masked-MHA kernel: Mistral-7B (8 KV heads) decodes about as slowly as Llama-2-7B
    (32 KV heads) at the same batch, where a bytes-only price makes it far cheaper."""
    fp8 = {"weight_dtype": "fp8", "kv_dtype": "fp8"}
    per_head = {"preset": "trtllm", "decode_attention_per_query_head": True}
    shape = StepShape.from_batch(decode=[2048] * 120)

    def step(model, engine):
        return roofline(1, engine, model={"config": model, **fp8}).step_time(shape)
    assert step("mistral-7b", "trtllm") < 0.5 * step("llama-2-7b", "trtllm")
    assert 0.7 < step("mistral-7b", per_head) / step("llama-2-7b", per_head) < 1.0
    assert step("llama-2-7b", per_head) == step("llama-2-7b", "trtllm")  # MHA: bytes-bound either way


@pytest.mark.parametrize("contexts", [[1000] * 9, [3000, 4090, 5000, 20]])  # the second crosses Mistral's window
def test_per_query_head_decode_runs_equal_steps(contexts):
    cost = roofline(1, {"preset": "trtllm", "decode_attention_per_query_head": True}, model="mistral-7b")
    runs = cost.decode_run_times(np.array(contexts), 8)
    assert list(runs) == [cost.step_time(StepShape.from_batch(decode=[c + j for c in contexts])) for j in range(8)]


def test_trtllm_v09_static_table_mistral_decode_rows():
    """validation/validate_trtllm_static.py: the decode-bound Mistral-7B rows (all but 128/128) within 10 %
    with the per-query-head kernel, LLaMA-7B rows as before."""
    sys.path.insert(0, str(ROOT / "validation"))
    import validate_trtllm_static as v

    for (model, gpu, batch, isl, osl, published, bytes_only), (*_, per_head) in zip(v.rows(), v.rows(v.V09_ENGINE)):
        if model == "mistral-7b" and (isl, osl) != (128, 128):
            assert abs(per_head / published - 1) < 0.10, (gpu, isl, osl)
            assert bytes_only / published > 1.25
        if model == "llama-2-7b":
            assert per_head == bytes_only


def test_flash_attention_split_heuristic():
    """num_splits_heuristic's own example (flash_api.cpp): 48 blocks on 108 SMs take 2 splits (0.89)."""
    from cbsim.sim.costmodels.attention_structure import num_splits, prefill_efficiency, streaming_multiprocessors
    assert num_splits(48, 108, 100) == 2
    assert num_splits(200, 216, 100) == 1  # >= 80 % of the slots: one split
    assert num_splits(48, 108, 1) == 1  # one KV block cannot split
    assert streaming_multiprocessors("a100-40gb-sxm") == 108 and streaming_multiprocessors("h100-pcie") == 114
    assert streaming_multiprocessors("mi300x") == 0
    # CodeLlama-34B TP2 on A100: a 512-token chunk is 8 blocks x 32 heads = 256 >= 0.8 x 216, 1.19 waves
    assert prefill_efficiency([(512, 8000)], 32, 108, 128) == pytest.approx(256 / 432)
    assert prefill_efficiency([(16384, 0)], 32, 108, 128) > 0.95  # a whole prompt fills its waves
    assert prefill_efficiency([], 32, 108, 128) == prefill_efficiency([(512, 0)], 32, 0, 128) == 1.0


def test_chunked_prefill_costs_what_the_sms_allow():
    """512-token chunks of an 8K prompt over one step: within 5 points of the published +11..+20 % on
    34B/70B A100 (validation/validate_chunked_prefill.py); decode steps are not touched."""
    sys.path.insert(0, str(ROOT / "validation"))
    from validate_chunked_prefill import chunked_overhead

    for model, tp in (("codellama-34b", 2), ("llama-2-70b", 4)):
        on, off = (roofline(tp, gpu="a100", model=model, prefill_occupancy=flag) for flag in (True, False))
        assert 0.06 <= chunked_overhead(on, 8192) <= 0.25, model
        assert chunked_overhead(on, 8192) >= chunked_overhead(off, 8192)
        decode = StepShape.from_batch(decode=[3000] * 16)
        assert on.step_time(decode) == off.step_time(decode)
    assert roofline(2, gpu="a100", model="codellama-34b", prefill_occupancy=False).describe()["prefill_occupancy"] is False


def test_windowed_prefill_takes_the_same_occupancy():
    """Mistral-7B's sliding window path prices its capped pairs at the same wave efficiency."""
    on = roofline(1, gpu="a100", model="mistral-7b")
    off = roofline(1, gpu="a100", model="mistral-7b", prefill_occupancy=False)
    chunk = StepShape.from_batch(prefill=[(512, 1000)])
    pairs_on, _ = on._window_features(chunk)
    pairs_off, _ = off._window_features(chunk)
    assert pairs_on > pairs_off and on.step_time(chunk) > off.step_time(chunk)


@pytest.mark.parametrize("bad,words", [({"custom_all_reduce_max_bytes": True}, "expected a number"),
                                       ({"custom_all_reduce_max_bytes": -1}, ">= 0"),
                                       ({"cuda_graph_padding": 3}, "true or false"),
                                       ({"decode_attention_per_query_head": "yes"}, "true or false")])
def test_bad_execution_mode_terms_name_the_field(bad, words):
    from cbsim.core.errors import ConfigError
    with pytest.raises(ConfigError, match=f"{next(iter(bad))}.*{words}"):
        load_engine({"preset": "vllm-v1", **bad})
