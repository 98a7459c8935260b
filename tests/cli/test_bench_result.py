"""bench.json: a run's results in the schema of `vllm bench serve --save-result`, checked against the
request table and the expanded token gaps, and read back by cbsim's own reader of vLLM files."""
from __future__ import annotations

import json

import numpy as np
import pytest

from cbsim.api import run_experiment
from cbsim.tools.compare.measured import load_measured, simulated_metrics
from cbsim.bench_result import bench_result, percentile_word

EXPERIMENT = {
    "name": "bench", "seed": 3, "model": "tiny", "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1},
    "cluster": {"kv_cache": {"block_size": 16, "num_blocks": 400}},
    "policy": {"name": "sarathi", "token_budget": 256},
    "workload": {"num_requests": 40, "arrival": {"type": "gamma", "rate": 50.0, "cv": 2.0},
                 "prompt_len": {"type": "uniform", "min": 10, "max": 300},
                 "output_len": {"type": "uniform", "min": 1, "max": 20}},
    "metrics": {"slo": {"ttft": 0.05, "tpot": 0.01}},
    "output": {"plots": False, "trace": False},
}


@pytest.fixture(scope="module")
def results():
    return run_experiment(EXPERIMENT)


def test_keys_and_values_follow_vllm(results):
    bench = bench_result(results, percentiles=(50, 90, 99, 99.9))
    df = results.requests
    done = df[df["status"] == "finished"]
    assert bench["completed"] == len(done) and bench["failed"] == len(df) - len(done)
    assert bench["duration"] == results.summary["makespan"]
    assert bench["request_throughput"] == pytest.approx(len(done) / bench["duration"])
    assert bench["total_token_throughput"] == pytest.approx(
        (done["prompt_len"].sum() + done["output_tokens"].sum()) / bench["duration"])
    assert bench["request_goodput"] == pytest.approx(done["meets_slo"].sum() / bench["duration"])
    assert bench["burstiness"] == 0.25 and bench["request_rate"] == 50.0  # gamma shape 1 / cv^2
    assert bench["max_concurrency"] is None  # open loop
    ttft = done["ttft"].to_numpy()
    assert bench["mean_ttft_ms"] == pytest.approx(ttft.mean() * 1e3)
    assert bench["median_ttft_ms"] == pytest.approx(np.median(ttft) * 1e3)
    assert bench["std_ttft_ms"] == pytest.approx(np.std(ttft) * 1e3)
    assert bench["p99.9_ttft_ms"] == pytest.approx(np.percentile(ttft, 99.9) * 1e3)
    tpot = done.loc[done["output_len"] > 1, "tpot"].to_numpy()
    assert bench["p90_tpot_ms"] == pytest.approx(np.percentile(tpot, 90) * 1e3)
    gaps = np.concatenate([np.diff(results.token_times(int(r))) for r in df["request_id"]])
    assert bench["p99_itl_ms"] == pytest.approx(np.percentile(gaps, 99) * 1e3)
    assert bench["std_itl_ms"] == pytest.approx(np.std(gaps) * 1e3)
    assert {f"{s}_{k}_ms" for s in ("mean", "median", "std", "p50", "p90", "p99", "p99.9")
            for k in ("ttft", "tpot", "itl", "e2el")} <= set(bench)
    json.dumps(bench, allow_nan=False)


def test_details_list_every_request_in_id_order(results):
    bench = bench_result(results, details=True)
    df = results.requests.sort_values("request_id")
    assert bench["input_lens"] == df["prompt_len"].tolist()
    finished = (df["status"] == "finished").to_numpy()
    assert [len(g) for g in bench["itls"]] == [n - 1 if ok else 0 for n, ok in zip(df["output_tokens"], finished)]
    assert bench["start_times"][0] == 0.0 and all(e == "" for e, ok in zip(bench["errors"], finished) if ok)


def test_no_slo_means_no_goodput_and_empty_metrics_are_zero():
    cfg = dict(EXPERIMENT, metrics={}, workload=dict(EXPERIMENT["workload"], num_requests=1,
                                                     output_len={"type": "fixed", "value": 1}))
    bench = bench_result(run_experiment(cfg))
    assert bench["request_goodput"] is None
    assert bench["mean_itl_ms"] == 0.0 and bench["p99_tpot_ms"] == 0.0  # one token: no gap, no TPOT


def test_cbsim_reads_its_bench_json_as_a_vllm_file(results, tmp_path):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench_result(results, percentiles=(50, 90, 99), details=True)))
    measured = load_measured(path)
    assert measured.format == "vllm" and measured.has_lengths
    simulated = simulated_metrics(results)
    for name, value in measured.metrics.items():
        assert value == pytest.approx(simulated[name], rel=1e-9), name


@pytest.mark.parametrize("q,word", [(99, "99"), (99.9, "99.9"), (50.0, "50")])
def test_percentile_words(q, word):
    assert percentile_word(q) == word


def test_a_run_writes_bench_json_with_the_configured_percentiles(tmp_path):
    cfg = dict(EXPERIMENT, metrics={"percentiles": [50, 99.9]},
               workload=dict(EXPERIMENT["workload"], max_concurrency=4), output={"plots": False, "bench_details": True})
    results = run_experiment(cfg, out_dir=tmp_path)
    bench = json.loads((tmp_path / "bench.json").read_text())
    assert "p99.9_itl_ms" in bench and "p90_itl_ms" not in bench and bench["max_concurrency"] == 4
    assert len(bench["input_lens"]) == len(results.requests) and "bench.json" in results.files
