"""bench.json round trips through `cbsim compare` (the engine issue's measured-run comparison): a run's
own bench.json, read back as a `vllm bench serve --save-result` file, compares with zero error against
the same experiment, and, without a workload, replays its exact lengths and send times to the same
metrics. A scaled copy gives exactly its scale as the error."""
from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from cbsim.api import run_experiment
from cbsim.cli.app import app
from cbsim.tools.compare.compare import compare
from cbsim.tools.compare.measured import METRICS, load_measured, simulated_metrics

EXPERIMENT = {
    "name": "bench_rt", "seed": 5, "model": "llama-3-8b",
    "cost_model": {"type": "linear", "base": 0.004, "per_token": 2e-5},
    "cluster": {"kv_cache": {"num_blocks": 2000}},
    "policy": {"name": "sarathi", "token_budget": 256},
    "workload": {"num_requests": 60, "arrival": {"type": "poisson", "rate": 40.0},
                 "prompt_len": {"type": "uniform", "min": 20, "max": 500},
                 "output_len": {"type": "uniform", "min": 2, "max": 60}},
    "metrics": {"percentiles": [50, 90, 99]},
    "output": {"plots": False, "trace": False, "formats": ["csv"], "bench_details": True},
}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The experiment's run and the bench.json it wrote (run once for the module)."""
    folder = tmp_path_factory.mktemp("bench")
    results = run_experiment(EXPERIMENT, out_dir=folder / "run")
    return results, folder / "run" / "bench.json", folder


def test_bench_json_reads_back_as_the_runs_own_metrics(written):
    results, bench, _ = written
    measured = load_measured(bench)
    assert measured.format == "vllm" and measured.has_lengths and measured.start_times is not None
    assert list(measured.input_lens) == results.requests["prompt_len"].tolist()
    assert set(measured.metrics) == set(METRICS)  # mean, p50, p90, p99 of each latency, both rates
    simulated = simulated_metrics(results)
    for name, value in measured.metrics.items():
        assert value == pytest.approx(simulated[name], rel=1e-9), name


def test_cbsim_compare_of_a_run_against_its_own_bench_json_has_zero_error(written):
    _, bench, folder = written
    exp = folder / "exp.yaml"
    exp.write_text(yaml.safe_dump(EXPERIMENT))
    out = folder / "cmp"
    result = CliRunner().invoke(app, ["compare", str(exp), str(bench), "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "compare.json").read_text())
    assert saved["meta"]["measured_format"] == "vllm" and saved["meta"]["measured_requests"] == 60
    for name in METRICS:
        assert abs(saved[name]["error"]) < 1e-9, (name, saved[name])


def test_without_a_workload_compare_replays_the_bench_json_lengths_and_send_times(written):
    results, bench, folder = written
    no_workload = {k: v for k, v in EXPERIMENT.items() if k != "workload"}
    outcome = compare(no_workload, bench)
    assert any("measured send times" in note for note in outcome.notes)
    replayed = outcome.results.requests
    assert replayed["prompt_len"].tolist() == results.requests["prompt_len"].tolist()
    assert replayed["arrival"].tolist() == pytest.approx(results.requests["arrival"].tolist(), abs=1e-9)
    for name, row in outcome.rows.items():
        assert abs(row.error) < 1e-6, (name, row)


def test_a_scaled_bench_json_gives_its_scale_as_the_error(written):
    _, bench, folder = written
    data = json.loads(bench.read_text())
    for key in list(data):
        if key.endswith("_ms"):
            data[key] *= 2.0
    data["ttfts"] = [t * 2.0 for t in data["ttfts"]]
    data["itls"] = [[g * 2.0 for g in gaps] for gaps in data["itls"]]
    data["latencies"] = [t * 2.0 for t in data["latencies"]]
    slower = folder / "slower.json"
    slower.write_text(json.dumps(data))
    outcome = compare(EXPERIMENT, slower)
    for name in METRICS:
        if name.startswith(("ttft", "tpot", "itl", "e2e")):
            assert outcome.rows[name].error == pytest.approx(-0.5, abs=1e-9), name  # (x - 2x) / 2x
