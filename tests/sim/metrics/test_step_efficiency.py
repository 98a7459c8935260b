"""Per-step efficiency (sim/metrics/step_efficiency.py): the recorder's attention aggregates step by step,
MFU and HBM utilisation of a hand-computed step, the all-reduce column, and the summary keys."""
import json

import numpy as np
import pandas as pd
import pytest

from cbsim.api import load_cost_model, run_experiment
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.costmodels.catalog.specs import MODEL_PRESETS
from cbsim.sim.shape import StepShape
from cbsim.sim.metrics.step_efficiency import COLUMNS, StepHardware, step_bytes, step_flops, weights_read, with_efficiency

from factories import make_requests, run_policy

AGGREGATES = ("decode_context_tokens", "prefill_history_tokens", "prefill_attention_pairs")
SMALL = ["workload.num_requests=60", "workload.arrival.rate=8", "output.dir=null", "output.trace=false"]


def aggregates(run) -> dict:
    table = run.recorder.step_table()
    return {name: table[name].tolist() for name in AGGREGATES}


@pytest.mark.parametrize("fast_forward", [True, False])
def test_orca_rows_whole_prompts_then_decode_contexts(fast_forward):
    # step 0 prefills (5, 0) and (3, 0): 15 + 6 pairs; then contexts 6 + 4, and R1 alone 7..10 (a
    # fast-forwarded run when allowed: its rows must equal stepping one by one)
    run = run_policy({"name": "orca", "max_num_seqs": 4}, make_requests([(0, 5, 6), (0, 3, 2)]),
                     fast_forward=fast_forward)
    assert aggregates(run) == {"decode_context_tokens": [0, 10, 7, 8, 9, 10],
                               "prefill_history_tokens": [0, 0, 0, 0, 0, 0],
                               "prefill_attention_pairs": [21, 0, 0, 0, 0, 0]}


def test_chunked_prefill_reads_its_history():
    # chunks (16, 0), (16, 16), (8, 32): pairs c h + c (c + 1) / 2 = 136, 392, 292
    run = run_policy({"name": "prefill_first", "chunk_size": 16}, make_requests([(0, 40, 3)]))
    assert aggregates(run) == {"decode_context_tokens": [0, 0, 0, 41, 42],
                               "prefill_history_tokens": [0, 16, 32, 0, 0],
                               "prefill_attention_pairs": [136, 392, 292, 0, 0]}


def test_padding_rows_count_as_decode_reads():
    # static batching keeps finished R1 (4 tokens in its cache) as a padding row beside R0's contexts 7, 8
    run = run_policy({"name": "static", "max_num_seqs": 2}, make_requests([(0, 5, 4), (0, 3, 2)]))
    table = run.recorder.step_table()
    assert table["padding_tokens"].tolist() == [0, 0, 1, 1]
    assert table["decode_context_tokens"].tolist() == [0, 10, 11, 12]


def test_aggregates_match_the_shape_the_cost_model_saw():
    run = run_policy({"name": "sarathi", "token_budget": 24}, make_requests([(0, 50, 4), (0.5, 30, 3), (1, 7, 5)]),
                     settings={"record_shapes": True}, fast_forward=False)
    table = run.recorder.step_table()
    shapes = run.replicas[0].shapes
    assert len(shapes) == len(table["start"])
    assert table["decode_context_tokens"].tolist() == [s.decode_kv_read for s in shapes]
    assert table["prefill_history_tokens"].tolist() == [s.prefill_kv_read - s.num_prefill_tokens for s in shapes]
    assert table["prefill_attention_pairs"].tolist() == [s.attention_pairs for s in shapes]


# ---------------------------------------------------------------- formulas on a hand-computed step


TINY = MODEL_PRESETS["tiny"]  # hidden 256, 2 layers, 4 heads, 2 KV heads, head_dim 64, MLP 512, vocab 1000


def one_step(**over) -> pd.DataFrame:
    # a prefill chunk (8, 4) and decode rows of contexts 10 and 20, in 1 ms
    row = dict(replica=0, start=0.0, end=1e-3, prefill_tokens=8, decode_tokens=2, padding_tokens=0, num_seqs=3,
               kv_blocks_used=3, preemptions=0, swap_bytes=0.0, decode_context_tokens=30, prefill_history_tokens=4,
               prefill_attention_pairs=8 * 4 + 8 * 9 // 2, duration=1e-3)
    return pd.DataFrame([{**row, **over}])


def test_mfu_and_hbm_of_a_tiny_step_by_hand():
    layer = 256 * (256 + 2 * 128) + 256 * 256 + 256 * 2 * 512 + 512 * 256  # QKV, O, gate+up, down
    linear = 2 * layer + (2 * 2 + 1) * 256  # + the RMSNorms
    flops = (2 * linear * 10  # 10 tokens through the layers
             + 2 * 256 * 1000 * 3  # LM head on the 3 rows
             + 2 * 4 * 4 * 64 * (68 + 30))  # 2 layers x 4 heads x head_dim per pair: prefill 68, decode 30
    weights = (linear + 1000 * 256) * 2  # bf16; the embedding table is gathered, not streamed
    kv = 2 * 2 * 2 * 64 * 2 * (30 + 8 + 4)  # K and V x 2 layers x 2 KV heads x 64 x 2 bytes, 42 tokens read
    steps = with_efficiency(one_step(), {0: StepHardware(TINY, 1e12, 1e11, 1)})
    row = steps.iloc[0]
    assert row["flops"] == flops
    assert row["hbm_bytes"] == weights + kv
    assert row["mfu"] == pytest.approx(flops / (1e-3 * 1e12), rel=1e-12)
    assert row["hbm_util"] == pytest.approx((weights + kv) / (1e-3 * 1e11), rel=1e-12)
    assert row["collective_s"] == 0.0  # one GPU, nothing to reduce


def test_two_gpus_divide_the_peaks_and_unknown_all_reduce_is_nan():
    one = with_efficiency(one_step(), {0: StepHardware(TINY, 1e12, 1e11, 1)}).iloc[0]
    two = with_efficiency(one_step(), {0: StepHardware(TINY, 1e12, 1e11, 2)}).iloc[0]
    assert two["flops"] == one["flops"] and two["mfu"] == pytest.approx(one["mfu"] / 2)
    assert np.isnan(two["collective_s"])


def test_columns_are_nan_without_hardware_or_duration():
    steps = with_efficiency(one_step(duration=0.0), {0: StepHardware(TINY, 1e12, 1e11, 1)})
    assert np.isnan(steps.loc[0, "mfu"]) and np.isnan(steps.loc[0, "hbm_util"]) and steps.loc[0, "flops"] > 0
    steps = with_efficiency(one_step(), {0: None})
    assert all(np.isnan(steps.loc[0, name]) for name in COLUMNS)


def test_sliding_window_caps_and_moe_reads_touched_experts():
    windowed = model_spec({"config": "tiny", "sliding_window": 4})
    step = one_step()
    assert step_flops(step, windowed)[0] < step_flops(step, TINY)[0]
    assert step_bytes(step, windowed, 1)[0] < step_bytes(step, TINY, 1)[0]
    moe = model_spec({"config": "tiny", "num_experts": 8, "experts_per_token": 2, "moe_intermediate": 128})
    one, many = weights_read(moe, 1, np.array([1.0, 1e4]))
    expert = 256 * 2 * 128 + 128 * 256
    assert many == pytest.approx(one + 2 * (8 - 2) * expert * 2)  # 2 MoE layers: 6 more experts in bf16


def test_roofline_collective_time_is_its_all_reduce_term():
    cost = load_cost_model({"type": "roofline", "gpu": "h100", "tp": 2, "engine": "none"}, "llama-3-8b")
    alone = load_cost_model({"type": "roofline", "gpu": "h100", "tp": 2, "engine": "none",
                             "topology": "nvswitch"}, "llama-3-8b")
    assert cost.collective_time(512.0) > 0 and cost.collective_time(512.0) == alone.collective_time(512.0)
    single = load_cost_model({"type": "roofline", "gpu": "h100", "tp": 1, "engine": "none"}, "llama-3-8b")
    assert single.collective_time(512.0) == 0.0
    shape = StepShape.from_batch(prefill=[(512, 0)])
    assert cost.step_time(shape) > cost.collective_time(512.0)


# ---------------------------------------------------------------- through a run


def test_run_steps_carry_the_columns_and_summary_is_json():
    res = run_experiment("experiments/quickstart.yaml", overrides=SMALL + ["cost_model.tp=2"])
    steps = res.steps
    assert set(COLUMNS) <= set(steps.columns) and set(AGGREGATES) <= set(steps.columns)
    assert steps["mfu"].between(0, 1).all() and steps["hbm_util"].between(0, 1).all()
    cost = load_cost_model(res.config.cost_model, res.config.model)
    tokens = steps["prefill_tokens"] + steps["decode_tokens"] + steps["padding_tokens"]
    assert steps["collective_s"].tolist() == [cost.collective_time(float(t)) for t in tokens]
    keys = ("kv_usage_mean", "kv_usage_p99", "mfu_mean", "hbm_util_mean", "collective_share")
    summary = res.summary
    json.dumps(summary, allow_nan=False)
    assert all(type(summary[k]) is float and 0 < summary[k] < 1 for k in keys)
    assert summary["kv_usage_mean"] <= summary["kv_usage_p99"]
    weights = steps["duration"]
    assert summary["mfu_mean"] == pytest.approx(np.average(steps["mfu"], weights=weights))
    used = steps["kv_blocks_used"] / res.kv_blocks[0]
    assert summary["kv_usage_mean"] == pytest.approx(np.average(used, weights=weights))


def test_unit_cost_model_without_a_gpu_has_no_efficiency():
    res = run_experiment({"name": "u", "cost_model": {"type": "unit"}, "cluster": {"kv_cache": {"num_blocks": 100}},
                          "workload": {"num_requests": 5, "arrival": {"type": "poisson", "rate": 1.0},
                                       "prompt_len": {"type": "fixed", "value": 20},
                                       "output_len": {"type": "fixed", "value": 3}},
                          "output": {"plots": False, "trace": False}})
    assert res.steps["mfu"].isna().all()
    s = res.summary
    assert s["mfu_mean"] is None and s["hbm_util_mean"] is None and s["collective_share"] is None
    assert 0 < s["kv_usage_mean"] <= s["kv_usage_p99"] <= 1
    json.dumps(s, allow_nan=False)


def test_columns_computed_block_by_block_equal_the_whole_run_at_once(monkeypatch):
    """Every formula is per step, so ROWS (the block) changes no value: three replicas on two kinds of
    hardware and one unknown, steps interleaved, blocks that split them anywhere."""
    from cbsim.sim.metrics import step_efficiency

    res = run_experiment("experiments/quickstart.yaml", overrides=SMALL + ["cluster.replicas=4", "cost_model.tp=2"])
    # the table comes grouped by replica (sim/row_order.py): interleaved in time order here
    steps = res.steps.drop(columns=list(COLUMNS)).sort_values(["start", "replica"], kind="stable")
    steps = steps.reset_index(drop=True)
    cost = load_cost_model(res.config.cost_model, res.config.model)
    windowed = model_spec({"config": "tiny", "sliding_window": 4})
    hardware = {0: StepHardware(model_spec("llama-3-8b"), 1e15, 3e12, 2, cost.collective_time, 2),
                1: StepHardware(windowed, 2e14, 1e12, 1), 2: None,
                3: StepHardware(model_spec("llama-3-8b"), 1e15, 3e12, 2, cost.collective_time, 2)}
    assert len(set(steps["replica"])) == 4 and not steps["replica"].is_monotonic_increasing
    whole = step_efficiency.efficiency_columns(steps, hardware)
    monkeypatch.setattr(step_efficiency, "ROWS", 7)
    blocks = step_efficiency.efficiency_columns(steps, hardware)
    for name in COLUMNS:
        np.testing.assert_array_equal(whole[name], blocks[name], err_msg=name)
    assert np.isnan(whole["mfu"][steps["replica"].to_numpy() == 2]).all()
    assert np.isfinite(whole["flops"][steps["replica"].to_numpy() == 1]).all()
