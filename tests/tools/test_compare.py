"""`cbsim compare`: the measured-results readers (cbsim flat, vLLM, SGLang), their errors, and
measured-vs-simulated round trips on a tiny experiment."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from cbsim.api import run_experiment
from cbsim.cli.app import app
from cbsim.tools.compare.compare import compare, measured_workload
from cbsim.core.errors import ConfigError
from cbsim.tools.compare.measured import METRICS, MeasuredRun, load_measured, simulated_metrics
from paths import TESTS

DATA = TESTS / "data" / "measured"
runner = CliRunner()

TINY = {
    "name": "tiny", "seed": 3, "cost_model": {"type": "linear", "base": 0.01, "per_token": 1e-4},
    "cluster": {"kv_cache": {"num_blocks": 400}},
    "policy": {"name": "sarathi", "token_budget": 128},
    "workload": {"num_requests": 50, "arrival": {"type": "all_at_once"},
                 "prompt_len": {"type": "uniform", "min": 10, "max": 300},
                 "output_len": {"type": "uniform", "min": 1, "max": 40}},
    "output": {"plots": False, "trace": False, "formats": ["csv"]},
}
NO_WORKLOAD = {k: v for k, v in TINY.items() if k != "workload"}


@pytest.fixture(scope="module")
def tiny():
    """The tiny experiment's run and its metrics (simulated once for the module)."""
    results = run_experiment(TINY)
    return results, simulated_metrics(results)


def write_json(tmp_path, data, name="measured.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def write_yaml(tmp_path, data, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def vllm_record(results, metrics, scale=1.0, request_rate="inf"):
    """What `vllm bench serve --save-result --save-detailed` would write had it measured `results`."""
    df = results.requests
    record = {"backend": "vllm", "request_rate": request_rate, "burstiness": 1.0, "max_concurrency": None,
              "completed": len(df), "input_lens": df["prompt_len"].tolist(), "output_lens": df["output_len"].tolist(),
              "ttfts": (df["ttft"] * scale).tolist(), "errors": [""] * len(df),
              "itls": [(np.diff(results.token_times(i)) * scale).tolist() for i in df["request_id"]]}
    for name, key in (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2e", "e2el")):
        record[f"mean_{key}_ms"] = metrics[f"{name}_mean"] * scale * 1000
        record[f"median_{key}_ms"] = metrics[f"{name}_p50"] * scale * 1000
        record[f"p99_{key}_ms"] = metrics[f"{name}_p99"] * scale * 1000
    return record


# readers

def test_flat_format_is_read_as_is():
    run = load_measured(DATA / "cbsim_flat.json")
    assert run.format == "cbsim"
    assert run.metrics == {"ttft_mean": 0.025, "ttft_p99": 0.061, "itl_mean": 0.0093, "e2e_mean": 1.81,
                           "throughput_tokens_per_s": 1520.0}
    assert not run.has_lengths and run.source.endswith("cbsim_flat.json")


def test_vllm_milliseconds_become_seconds_and_failed_requests_are_left_out():
    run = load_measured(DATA / "vllm_serve.json")
    assert run.format == "vllm"
    assert run.metrics["ttft_mean"] == pytest.approx(0.029)
    assert run.metrics["ttft_p50"] == pytest.approx(0.0285)  # median_ttft_ms
    assert run.metrics["itl_p90"] == pytest.approx(0.0134)
    assert run.metrics["throughput_requests_per_s"] == 4.444  # already per second
    assert "e2e_mean" not in run.metrics  # e2el was not among --percentile-metrics
    assert set(run.metrics) <= set(METRICS)  # std and p99.9 have no cbsim name
    assert (run.request_rate, run.burstiness, run.max_concurrency, run.duration) == (8.0, 1.0, None, 0.9)
    assert run.num_failed == 1  # "Server disconnected", output_len 0
    assert run.input_lens.tolist() == [512, 128, 190, 64]
    assert run.output_lens.tolist() == [4, 2, 4, 1]
    assert len(run.itls) == 3 + 1 + 3
    assert run.e2e == pytest.approx([0.041 + 0.036, 0.022 + 0.010, 0.035 + 0.037, 0.018])
    assert run.tpots == pytest.approx([0.012, 0.010, 0.037 / 3])  # the 1-token request has no TPOT
    assert run.start_times == pytest.approx([0.0, 0.1, 0.5, 0.62])


def test_sglang_last_line_is_read_and_zeros_are_not_measured():
    run = load_measured(DATA / "sglang_bench.jsonl")
    assert run.format == "sglang"
    assert run.metrics["e2e_mean"] == pytest.approx(0.080)  # mean_e2e_latency_ms of the last line
    assert run.metrics["e2e_p50"] == pytest.approx(0.079)
    assert run.metrics["ttft_p99"] == pytest.approx(0.047)
    assert "itl_mean" not in run.metrics and run.skipped == ("mean_itl_ms",)
    assert math.isinf(run.request_rate) and run.max_concurrency == 4
    assert run.input_lens.tolist() == [256] * 3 and len(run.itls) == 9


def test_vllm_request_rate_inf_string(tmp_path):
    path = write_json(tmp_path, {"request_rate": "inf", "mean_ttft_ms": 10.0, "completed": 1})
    run = load_measured(path)
    assert run.format == "vllm" and math.isinf(run.request_rate) and run.metrics == {"ttft_mean": 0.01}


@pytest.mark.parametrize("content, key, expected", [
    ('{"ttft_mean": NaN}', "ttft_mean", "finite number > 0"),
    ('{"ttft_p99": -0.2}', "ttft_p99", "finite number > 0"),
    ('{"ttft_p99": 0}', "ttft_p99", "finite number > 0"),
    ('{"ttft_p99": "fast"}', "ttft_p99", "finite number > 0"),
    ('{"ttft_p95": 0.2}', "ttft_p95", "ttft_mean, ttft_p50"),
    ("ttft_mean: 0.2", "<file>", "valid JSON"),
    ("ttft_mean: 0.2\nitl_mean: 0.1\n", "<file>", "valid JSON (Expecting value: line 1 column 1"),
    ("", "<file>", "the file is empty"),
    ("[0.1, 0.2]", "<root>", "a JSON object"),
    ("{}", "<root>", "at least one metric"),
    ('{"mean_ttft_ms": -3.0, "completed": 2}', "mean_ttft_ms", "finite number >= 0 (milliseconds)"),
    ('{"mean_ttft_ms": 3.0, "request_rate": "fast"}', "request_rate", "'inf'"),
    ('{"mean_ttft_ms": 3.0, "input_lens": [10, 0], "output_lens": [2, 2]}', "input_lens[1]", "integer >= 1"),
    ('{"mean_ttft_ms": 3.0, "input_lens": [10, 5], "output_lens": [2]}', "output_lens", "one entry per request"),
    ('{"mean_ttft_ms": 3.0, "input_lens": [1], "output_lens": [2], "itls": [[0.1, NaN]]}', "itls[0][1]",
     "finite number >= 0"),
])
def test_bad_measured_files_name_the_file_and_key(tmp_path, content, key, expected):
    path = write_json(tmp_path, content)
    with pytest.raises(ConfigError) as err:
        load_measured(path)
    message = str(err.value)
    assert message.startswith(f"{path}: {key}: expected"), message
    assert expected in message


def test_a_bad_line_of_json_lines_is_named(tmp_path):
    path = write_json(tmp_path, '{"mean_ttft_ms": 3.0}\n{"mean_ttft_ms": -1}\n', "runs.jsonl")
    with pytest.raises(ConfigError, match=r"runs.jsonl \(line 2, the last run\): mean_ttft_ms: expected"):
        load_measured(path)


def test_missing_file():
    with pytest.raises(ConfigError, match="expected an existing file of measured results"):
        load_measured(DATA / "nope.json")


# simulated metrics

def test_simulated_metrics_agree_with_the_summary(tiny):
    results, metrics = tiny
    for name in ("ttft_p50", "ttft_p90", "ttft_p99", "itl_p50", "itl_p90", "itl_p99", "e2e_p50", "e2e_p99",
                 "throughput_requests_per_s", "throughput_tokens_per_s"):
        assert metrics[name] == results.summary[name], name
    df = results.requests
    tpot = df.loc[df["output_len"] > 1, "tpot"]  # as vLLM and SGLang: single-token requests have no TPOT
    assert metrics["tpot_mean"] == pytest.approx(tpot.mean())
    assert metrics["tpot_p90"] == np.percentile(tpot, 90)
    itl = results.itl
    gaps = np.repeat(itl.values, itl.weights)
    assert metrics["itl_mean"] == pytest.approx(gaps.mean())
    assert metrics["e2e_p90"] == np.percentile(results.requests["e2e"], 90)
    assert set(metrics) == set(METRICS)


# compare

def test_round_trip_is_exact_and_a_scaled_measurement_gives_its_error(tmp_path, tiny):
    results, metrics = tiny
    exp = write_yaml(tmp_path, TINY)
    same = compare(exp, write_json(tmp_path, metrics, "same.json"))
    assert set(same.rows) == set(METRICS)
    assert all(abs(row.error) < 1e-12 for row in same.rows.values())
    assert not same.notes
    slower = compare(exp, MeasuredRun({k: 1.25 * v for k, v in metrics.items()}))
    assert all(row.error == pytest.approx(-0.2) for row in slower.rows.values())  # (x - 1.25x) / 1.25x


def test_workload_from_measured_lengths_round_trips_through_the_vllm_format(tmp_path, tiny):
    results, metrics = tiny
    measured = write_json(tmp_path, vllm_record(results, metrics, scale=1.25))
    exp = write_yaml(tmp_path, NO_WORKLOAD)
    out = tmp_path / "out"
    result = runner.invoke(app, ["compare", str(exp), str(measured), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "all at t=0 (request_rate inf)" in result.output
    assert "measured (ms)" in result.output and "error %" in result.output
    assert "-20.0" in result.output
    saved = json.loads((out / "compare.json").read_text())
    assert saved["meta"]["measured_format"] == "vllm" and saved["meta"]["measured_requests"] == 50
    for name in ("ttft_mean", "ttft_p50", "ttft_p99", "tpot_mean", "itl_p50", "itl_p99", "e2e_mean", "e2e_p99"):
        assert saved[name]["simulated"] == pytest.approx(metrics[name], rel=1e-12), name
        assert saved[name]["error"] == pytest.approx(-0.2), name
    assert (out / "compare_cdf.png").stat().st_size > 10_000
    replayed = run_experiment(out / "config.yaml").requests
    assert replayed["prompt_len"].tolist() == results.requests["prompt_len"].tolist()
    assert (replayed["arrival"] == 0).all()


def test_measured_workload_arrivals():
    lengths = dict(input_lens=np.array([100, 200, 300]), output_lens=np.array([5, 6, 7]))
    poisson, note = measured_workload(MeasuredRun({}, request_rate=4.0, **lengths), seed=7)
    arrivals = [r["arrival"] for r in poisson["requests"]]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert "Poisson at 4 req/s (seed 7)" in note
    assert measured_workload(MeasuredRun({}, request_rate=4.0, **lengths), seed=7)[0] == poisson
    timed, note = measured_workload(MeasuredRun({}, start_times=np.array([0.0, 0.5, 0.7]), **lengths), seed=7)
    assert [r["arrival"] for r in timed["requests"]] == [0.0, 0.5, 0.7] and "measured send times" in note
    assert [r["prompt_len"] for r in timed["requests"]] == [100, 200, 300]


def test_no_workload_and_no_lengths_is_a_user_error(tmp_path):
    exp = write_yaml(tmp_path, NO_WORKLOAD)
    with pytest.raises(ConfigError, match=r"exp.yaml: workload: expected a workload section, or a measured file"):
        compare(exp, DATA / "cbsim_flat.json")


@pytest.mark.parametrize("measured, message", [
    ('{"ttft_mean": -1}', "ttft_mean: expected a finite number > 0"),
    ('not json', "expected valid JSON"),
])
def test_cli_user_errors_exit_2_with_one_line(tmp_path, measured, message):
    exp = write_yaml(tmp_path, TINY)
    result = runner.invoke(app, ["compare", str(exp), str(write_json(tmp_path, measured))])
    assert result.exit_code == 2
    assert message in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
