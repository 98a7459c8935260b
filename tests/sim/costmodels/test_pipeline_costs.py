"""Pipeline parallelism in the roofline (issue 11): vLLM's layer split, one stage's time as
step_time (its layers, the embedding or the LM head, the activation hand-off by placement), pp 1
bit for bit as before, the KV cache sized per stage, GPUs per replica tp x pp, and one-line errors."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.config import load_config
from cbsim.core.errors import ConfigError
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.costmodels.collectives import NET_EFFICIENCY, NET_RING_HOP, link_model
from cbsim.sim.costmodels.pipeline import P2P_FIT, stage_layers
from cbsim.sim.costmodels.catalog.lookup import gpu_spec, model_spec
from cbsim.sim.costmodels.catalog.specs import GiB
from cbsim.sim.kv.sizing import kv_cache_blocks
from cbsim.replica_gpus import gpus_per_replica, pipeline_stages, replica_kv_blocks, tensor_parallel
from cbsim.sim.shape import StepShape

SHAPES = [StepShape.from_batch(prefill=[(512, 0)], decode=[1000] * 8), StepShape.from_batch(decode=[37, 4000, 129]),
          StepShape.from_batch(prefill=[(2048, 100), (17, 3)])]


def roofline(model: str, **keys):
    return load_cost_model({"type": "roofline", "engine": "none", **keys}, model_spec(model))


# vLLM tests/distributed/test_pipeline_partition.py (test_uneven_auto_partition): (layers, pp) -> per stage
@pytest.mark.parametrize("layers,pp,expected", [(2, 2, (1, 1)), (3, 2, (2, 1)), (3, 3, (1, 1, 1)), (4, 3, (1, 2, 1)),
                                                 (5, 3, (2, 2, 1)), (80, 3, (27, 27, 26)), (61, 4, (15, 15, 16, 15))])
def test_layers_split_as_vllm_does(layers, pp, expected):
    split = stage_layers(layers, pp)
    assert split == expected and sum(split) == layers and max(split) == math.ceil(layers / pp)


@pytest.mark.parametrize("model,keys", [("llama-3.1-70b", {"gpu": "h100", "tp": 8}),
                                        ("deepseek-v3", {"gpu": "h200", "tp": 8, "expert_parallel": True}),
                                        ("mistral-7b", {"gpu": "a100", "tp": 1}), ("llama-3-8b", {"gpu": "h100"})])
def test_one_stage_is_bit_identical(model, keys):
    before = load_cost_model({"type": "roofline", **keys}, model_spec(model))
    after = load_cost_model({"type": "roofline", **keys, "pp": 1}, model_spec(model))
    assert [after.step_time(s).hex() for s in SHAPES] == [before.step_time(s).hex() for s in SHAPES]
    assert after.collective_time(300.0) == before.collective_time(300.0)
    assert after.pipeline_stages == 1 and after.describe() == before.describe() and "pp" not in after.describe()


def test_two_stages_by_hand():
    """Llama-3.1-8B on 2 H100s, one GPU per stage: stage 1 (16 layers + LM head) is the slower one."""
    one, two = roofline("llama-3.1-8b", gpu="h100"), roofline("llama-3.1-8b", gpu="h100", pp=2)
    assert two.pipeline_stages == 2 and two.describe()["pp"] == 2
    for shape in SHAPES:
        tokens, rows = float(shape.num_tokens), float(shape.tokens_sampled)
        lm, embed = one._lm_seconds(rows), one._embed_bytes * tokens / one._bw
        layers = one.step_time(shape) - one._step_overhead - lm - embed  # 32 layers (tp 1: no all-reduce)
        send = P2P_FIT["h100"][0] + tokens * 2 * 4096 * 2 / P2P_FIT["h100"][1]  # hidden + residual, bf16
        first, last = layers / 2 + embed + send, layers / 2 + lm
        assert two.step_time(shape) == pytest.approx(max(first, last) + two._step_overhead, rel=1e-12)
        assert two.collective_time(tokens) == pytest.approx(send, rel=1e-12)


def test_a_boundary_between_nodes_goes_over_the_nic_and_the_next_stage_gathers():
    cost = roofline("llama-3.1-70b", gpu="h100", tp=8, pp=2)
    pipe, link = cost._pipeline, link_model(gpu_spec("h100"), "nvswitch")
    assert pipe.crosses == (True,) and cost.describe()["gpus_per_node"] == 8
    size = 100 * 2 * 8192 * 2.0
    assert pipe.send_seconds(100.0, 0) == pytest.approx(
        P2P_FIT["h100"][0] + NET_RING_HOP + size / 8 / (50e9 * NET_EFFICIENCY), rel=1e-12)
    assert pipe.gather_seconds(100.0, 1) == pytest.approx(link.base + 7 * link.hop + 7 / 8 * size / link.bandwidth,
                                                          rel=1e-12)
    assert pipe.send_seconds(100.0, 1) == 0.0 and pipe.gather_seconds(100.0, 0) == 0.0
    inside = roofline("llama-3.1-70b", gpu="h100", tp=4, pp=2)  # 8 GPUs: one node
    assert inside._pipeline.crosses == (False,) and "gpus_per_node" not in inside.describe()
    nvlink = inside._pipeline.send_seconds(100.0, 0)
    assert nvlink == pytest.approx(P2P_FIT["h100"][0] + size / 4 / P2P_FIT["h100"][1], rel=1e-12)
    assert nvlink < P2P_FIT["h100"][0] + NET_RING_HOP + size / 4 / (50e9 * NET_EFFICIENCY)  # the same slice over the NIC
    four = roofline("llama-3.1-70b", gpu="h100", tp=4, pp=4)  # 16 GPUs: only the middle boundary leaves the node
    assert four._pipeline.crosses == (False, True, False)


@pytest.mark.parametrize("model,keys", [("llama-3.1-70b", {"gpu": "h100", "tp": 4, "pp": 2}),
                                        ("llama-3.1-70b", {"gpu": "a100", "tp": 2, "pp": 3}),
                                        ("deepseek-v3", {"gpu": "h200", "tp": 8, "pp": 2, "expert_parallel": True}),
                                        ("gemma-2-27b", {"gpu": "h100", "tp": 2, "pp": 2}),
                                        ("deepseek-v2-lite", {"gpu": "h100", "pp": 3})])
def test_decode_runs_match_step_time_and_engines_bind_the_stage(model, keys):
    cost = load_cost_model({"type": "roofline", **keys}, model_spec(model))
    contexts = np.array([10, 500, 3000])
    run = cost.decode_run_times(contexts, 4)
    for j in range(4):
        assert run[j] == cost.step_time(StepShape.from_batch(decode=contexts + j))
    stage = max(stage_layers(model_spec(model).num_layers, keys["pp"]))
    assert cost._engine.eager_floor == cost.engine.bind(stage, keys.get("tp", 1)).eager_floor


@settings(max_examples=60, deadline=None)
@given(pp=st.sampled_from([2, 3, 4, 8]), chunks=st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 8000)),
                                                        max_size=3),
       decodes=st.lists(st.integers(1, 20000), max_size=64))
def test_stages_together_cost_at_least_the_whole_model(pp, chunks, decodes):
    """pp x (one stage) >= the unsplit step (the stages' work plus hand-offs), and one stage is faster."""
    shape = StepShape.from_batch(prefill=chunks, decode=decodes)
    if shape.is_empty:
        return
    one, split = roofline("llama-3.1-70b", gpu="h200"), roofline("llama-3.1-70b", gpu="h200", pp=pp)
    whole, stage = one.step_time(shape) - one._step_overhead, split.step_time(shape) - split._step_overhead
    assert pp * stage >= whole * (1 - 1e-12)
    assert stage < whole


@pytest.mark.parametrize("value,fragment", [(0, "an integer >= 1"), (-2, "an integer >= 1"), (True, "an integer"),
                                            ("2", "an integer"), (3, "at most the model's 2 layers")])
def test_bad_pp_is_one_line_naming_the_key(value, fragment):
    with pytest.raises(ConfigError) as err:
        load_cost_model({"type": "roofline", "gpu": "h100", "pp": value}, model_spec("tiny"))
    assert err.value.path == "cost_model.pp" and fragment in str(err.value) and "\n" not in str(err.value)


def test_stages_across_nodes_need_a_network():
    with pytest.raises(ConfigError) as err:
        roofline("llama-3.1-70b", gpu="l40s", tp=8, pp=2)
    assert err.value.path == "cost_model.pp" and "inter_node_bandwidth" in str(err.value)


def test_kv_cache_per_stage_by_hand():
    """Llama-3.1-8B on 2 H100s as 2 stages: each GPU holds 16 layers' weights and KV, the first the
    embedding, the last the final norm and the LM head; the replica keeps the smaller count."""
    m, gpu = model_spec("llama-3.1-8b"), gpu_spec("h100")
    layer = m.layer_params(1) + m.norms_per_layer * m.hidden
    table = m.vocab * m.hidden
    first, last = 2 * (16 * layer + table), 2 * (16 * layer + table + m.hidden)
    kv = 16 * 2 * 8 * 128 * 2  # 16 layers of K and V, 8 KV heads of 128, bf16
    budget = gpu.memory_bytes * 0.9 - 2 * GiB
    expected = min(int((budget - first) // (16 * kv)), int((budget - last) // (16 * kv)))
    assert kv_cache_blocks(m, gpu, 1, 16, 0.9, pp=2) == expected
    assert first + last == m.weight_bytes(1)  # untied: the embedding and the head, one per end
    # a two-stage replica holds about what a TP2 one does (same GPUs), and far more than one GPU
    assert abs(expected / kv_cache_blocks(m, gpu, 2, 16, 0.9) - 1) < 0.01
    assert expected > 2 * kv_cache_blocks(m, gpu, 1, 16, 0.9)


def test_a_tied_head_is_a_second_copy_on_the_last_stage():
    m = model_spec("qwen2.5-7b")  # tie_word_embeddings false; gemma-2 ties its head
    g = model_spec("gemma-2-27b")
    assert g.tie_word_embeddings and not m.tie_word_embeddings
    table = g.vocab_per_gpu(1) * g.hidden * 2
    n = g.num_layers
    halves = g.stage_weight_bytes(1, 0, n // 2, True, False) + g.stage_weight_bytes(1, n // 2, n - n // 2, False, True)
    assert halves == g.weight_bytes(1) + table


def test_gpus_per_replica_is_tp_times_pp():
    base = {"model": "llama-3.1-70b", "cluster": {"replicas": 3},
            "workload": {"num_requests": 4, "arrival": {"type": "constant", "rate": 4.0},
                         "prompt_len": {"type": "fixed", "value": 32}, "output_len": {"type": "fixed", "value": 10}}}
    cfg = load_config({**base, "cost_model": {"type": "roofline", "gpu": "h100", "tp": 4, "pp": 2}})
    cost = load_cost_model(cfg.cost_model, model_spec(cfg.model))
    assert (tensor_parallel(cfg), pipeline_stages(cfg), gpus_per_replica(cfg), gpus_per_replica(cfg, cost)) == (4, 2, 8, 8)
    assert replica_kv_blocks(load_config({**base, "cost_model": cfg.cost_model}), model_spec(cfg.model), cost) == \
        kv_cache_blocks(model_spec(cfg.model), gpu_spec("h100"), 4, 16, 0.9, pp=2)
    plain = load_config({**base, "cost_model": {"type": "roofline", "gpu": "h100", "tp": 4}})
    assert gpus_per_replica(plain) == 4 and pipeline_stages(plain) == 1


def vidur(**keys):
    return load_cost_model({"type": "vidur", "gpu": "a100", "tp": 2, "engine": "none", **keys},
                           model_spec("llama-2-70b"))


def test_vidur_one_stage_is_bit_identical_and_two_stages_by_hand():
    """Vidur's A100 Llama-2-70B TP2 profile (token ops, attention and all-reduce measured) as two stages
    of 40 layers: the slower stage is its 40 layers plus the LM head (the first pays the embedding and
    the hand-off over NVSwitch, both smaller)."""
    before, one, two = vidur(), vidur(pp=1), vidur(pp=2)
    assert two.pipeline_stages == 2 and two.describe()["pp"] == 2 and "pp" not in one.describe()
    for shape in SHAPES:
        assert one.step_time(shape).hex() == before.step_time(shape).hex()
        tokens, rows = shape.num_tokens, shape.tokens_sampled
        per_layer, fixed = before._token_terms_of(tokens, rows)
        attn = before._prefill_attention(shape.prefill) + before.attention.decode(len(shape.decode), sum(shape.decode))
        emb, lm = before._emb.at(tokens), before._lm_head.at(rows) * before._lm_ratio
        send = P2P_FIT["a100"][0] + tokens * 2 * 8192 * 2 / 2 / P2P_FIT["a100"][1]
        link = link_model(gpu_spec("a100"), "nvswitch")
        gather = link.base + link.hop + 0.5 * tokens * 2 * 8192 * 2 / link.bandwidth
        stages = (40 * (per_layer + attn) + emb + send, 40 * (per_layer + attn) + lm + gather)
        assert two.step_time(shape) == pytest.approx(max(stages), rel=1e-12)
        assert fixed == pytest.approx(emb + lm, rel=1e-12)
    contexts = np.array([10, 500, 3000])
    run = two.decode_run_times(contexts, 3)
    assert all(run[j] == two.step_time(StepShape.from_batch(decode=contexts + j)) for j in range(3))
    assert two.collective_time(64.0) == pytest.approx(
        max(40 * before.allreduce.seconds(64.0) + two._pipeline.handoff_seconds(64.0, s) for s in (0, 1)), rel=1e-12)


def test_vidur_bad_pp_and_fitted_refuses_it():
    with pytest.raises(ConfigError) as err:
        vidur(pp=0)
    assert err.value.path == "cost_model.pp"
    with pytest.raises(ConfigError) as err:
        vidur(pp=81)
    assert err.value.path == "cost_model.pp" and "80 layers" in str(err.value)


def fitted(**keys):
    return load_cost_model({"type": "fitted", "profile": "fitted/a100-llama-2-70b-tp2-published.json", "engine": "none",
                            **keys}, model_spec("llama-2-70b"))


def test_fitted_stages_by_hand():
    """The shipped fitted profile (A100 Llama-2-70B TP2, fitted on Vidur's published tables) as 2 stages:
    the slower is 40 fitted layers + the LM head + the all-gather of what it received."""
    before, one, two = fitted(), fitted(pp=1), fitted(pp=2)
    assert two.pipeline_stages == 2 and two.describe()["pp"] == 2 and "pp" not in one.describe()
    link = link_model(gpu_spec("a100"), "nvswitch")
    for shape in SHAPES:
        assert one.step_time(shape).hex() == before.step_time(shape).hex()
        tokens, rows = shape.num_tokens, shape.tokens_sampled
        lm = before._lm0 + before._lm1 * rows
        layer = (before.gpu_time(shape) - before.step_overhead - lm) / 80
        send = P2P_FIT["a100"][0] + tokens * 2 * 8192 * 2 / 2 / P2P_FIT["a100"][1]
        gather = link.base + link.hop + 0.5 * tokens * 2 * 8192 * 2 / link.bandwidth
        expected = max(40 * layer + send, 40 * layer + lm + gather) + before.step_overhead
        assert two.step_time(shape) == pytest.approx(expected, rel=1e-9)
    contexts = np.array([10, 500, 3000])
    run = two.decode_run_times(contexts, 3)
    assert all(run[j] == two.step_time(StepShape.from_batch(decode=contexts + j)) for j in range(3))



@pytest.mark.parametrize("name", ["llama-3.1-8b", "gemma-2-27b", "deepseek-v3", "mixtral-8x7b", "qwen3-30b-a3b",
                                  "deepseek-v2-lite", "qwen2.5-7b"])
@pytest.mark.parametrize("pp", [1, 2, 3, 5])
def test_the_stages_hold_every_weight_once(name, pp):
    """Over the stages of any split, the weights add up to the whole model's (one more head when a tied
    head lands on another stage than the embedding)."""
    m = model_spec(name)
    total, start = 0, 0
    for s, n in enumerate(stage_layers(m.num_layers, pp)):
        total += m.stage_weight_bytes(1, start, n, s == 0, s == pp - 1)
        start += n
    extra = m.vocab_per_gpu(1) * m.hidden * 16 // 8 if (m.tie_word_embeddings and pp > 1) else 0
    assert abs(total - (m.weight_bytes(1) + extra)) <= pp  # integer division per stage at most
    assert start == m.num_layers


def test_a_model_that_fits_no_stage_is_a_one_line_error():
    with pytest.raises(ConfigError) as err:
        kv_cache_blocks(model_spec("llama-3.1-405b"), gpu_spec("h100"), 1, 16, 0.9, pp=2)
    assert err.value.path == "cluster.kv_cache.num_blocks" and "TP1 PP2" in str(err.value)
    assert "\n" not in str(err.value)
