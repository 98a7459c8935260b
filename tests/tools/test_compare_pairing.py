"""`cbsim compare`'s per-request pairing and warm-up exclusion (cbsim/tools/compare/pairing.py): measured
request i beside simulated request i, the per-request error distribution beside the aggregate, and the first
requests (or seconds) left out of both sides' latencies."""
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from cbsim.api import run_experiment
from cbsim.cli.app import app
from cbsim.core.errors import ConfigError
from cbsim.tools.compare.compare import compare
from cbsim.tools.compare.measured import simulated_metrics
from cbsim.tools.compare.pairing import Warmup
from test_compare import DATA, NO_WORKLOAD, TINY, vllm_record, write_json, write_yaml

runner = CliRunner()
POISSON = {**TINY, "workload": {**TINY["workload"], "arrival": {"type": "poisson", "rate": 40.0}}}


@pytest.fixture(scope="module")
def tiny():
    results = run_experiment(TINY)
    return results, simulated_metrics(results)


@pytest.fixture(scope="module")
def poisson():
    results = run_experiment(POISSON)
    return results, simulated_metrics(results)


def measured_file(tmp_path, run, scale=1.0, name="measured.json", **changes):
    record = vllm_record(*run, scale=scale)
    record.update(changes)
    return write_json(tmp_path, record, name)


def test_replayed_requests_pair_by_index_and_a_uniform_error_is_every_requests_error(tmp_path, tiny):
    exp = write_yaml(tmp_path, NO_WORKLOAD)
    same = compare(exp, measured_file(tmp_path, tiny))
    assert set(same.per_request) == {"ttft", "tpot", "e2e"}
    assert same.per_request["ttft"].pairs == 50 and same.per_request["e2e"].pairs == 50
    assert same.per_request["tpot"].pairs == int((tiny[0].requests["output_len"] > 1).sum())
    assert all(abs(e.median) < 1e-9 and e.p90_abs < 1e-9 for e in same.per_request.values())
    slower = compare(exp, measured_file(tmp_path, tiny, scale=1.25, name="slower.json"))
    for errors in slower.per_request.values():
        assert errors.median == pytest.approx(-0.2) and errors.p90_abs == pytest.approx(0.2)
        assert errors.median_diff < 0


def test_pairing_shows_what_the_aggregate_hides(tmp_path, tiny):
    """The measured TTFTs shuffled among the requests: the same distribution (aggregate error 0), but each
    request's own TTFT is off."""
    results, metrics = tiny
    record = vllm_record(results, metrics)
    record["ttfts"] = list(np.random.default_rng(0).permutation(record["ttfts"]))
    result = compare(write_yaml(tmp_path, NO_WORKLOAD), write_json(tmp_path, record))
    assert abs(result.rows["ttft_p50"].error) < 1e-12 and abs(result.rows["ttft_mean"].error) < 1e-12
    assert result.per_request["ttft"].p90_abs > 0.2


def test_an_own_workload_pairs_only_when_it_is_the_measured_requests(tmp_path, tiny):
    measured = measured_file(tmp_path, tiny)
    own = compare(write_yaml(tmp_path, TINY), measured)  # the same seed: the same lengths in the same order
    assert own.per_request["ttft"].pairs == 50
    other = compare(write_yaml(tmp_path, {**TINY, "seed": 4}, "other.yaml"), measured)
    assert other.per_request == {}
    assert any(note.startswith("no per-request pairing: the experiment's workload") for note in other.notes)
    flat = compare(write_yaml(tmp_path, TINY), DATA / "cbsim_flat.json")
    assert flat.per_request == {} and not any("pairing" in note for note in flat.notes)


def test_warmup_requests_are_left_out_of_both_sides(tmp_path, tiny):
    results, _ = tiny
    result = compare(write_yaml(tmp_path, NO_WORKLOAD), measured_file(tmp_path, tiny), warmup=Warmup(requests=10))
    kept = results.requests.iloc[10:]
    assert result.rows["ttft_mean"].measured == pytest.approx(kept["ttft"].mean(), rel=1e-12)
    assert result.rows["ttft_mean"].simulated == pytest.approx(kept["ttft"].mean(), rel=1e-12)
    gaps = np.concatenate([np.diff(results.token_times(i)) for i in kept["request_id"]])
    assert result.rows["itl_p99"].measured == pytest.approx(np.percentile(gaps, 99), rel=1e-12)
    assert all(abs(row.error) < 1e-9 for row in result.rows.values())
    assert not any(name.startswith("throughput") for name in result.rows)  # whole-run numbers: not compared
    assert result.per_request["ttft"].pairs == 40
    assert any(note.startswith("warm-up: the first 10 requests left out") for note in result.notes)
    whole = compare(write_yaml(tmp_path, NO_WORKLOAD), measured_file(tmp_path, tiny))
    assert result.rows["ttft_mean"].measured != whole.rows["ttft_mean"].measured


def test_warmup_seconds_by_the_measured_send_times(tmp_path, poisson):
    results, _ = poisson
    starts = results.requests["arrival"].tolist()
    measured = measured_file(tmp_path, poisson, start_times=starts, request_rate=40.0)
    result = compare(write_yaml(tmp_path, NO_WORKLOAD), measured, warmup=Warmup(seconds=0.5))
    kept = results.requests[results.requests["arrival"] - starts[0] >= 0.5]
    assert 0 < len(kept) < 50 and result.per_request["ttft"].pairs == len(kept)
    assert result.rows["e2e_p90"].measured == pytest.approx(np.percentile(kept["e2e"], 90), rel=1e-9)
    assert all(abs(row.error) < 1e-9 for row in result.rows.values())
    with pytest.raises(ConfigError, match="--warmup-s: expected a measured file with per-request start_times"):
        compare(write_yaml(tmp_path, NO_WORKLOAD), measured_file(tmp_path, poisson, name="no_starts.json"),
                warmup=Warmup(seconds=0.5))


def test_cli_prints_the_pairs_and_writes_them(tmp_path, tiny):
    out = tmp_path / "out"
    args = ["compare", str(write_yaml(tmp_path, NO_WORKLOAD)), str(measured_file(tmp_path, tiny, scale=1.25))]
    result = runner.invoke(app, args + ["--out", str(out), "--warmup", "5"])
    assert result.exit_code == 0, result.output
    assert "paired requests" in result.stdout and "ttft_per_request" in result.stdout
    assert "    45           -20.0           20.0" in result.stdout, result.stdout
    saved = json.loads((out / "compare.json").read_text())
    assert saved["per_request"]["e2e"]["pairs"] == 45 and saved["per_request"]["e2e"]["median_error"] == \
        pytest.approx(-0.2)
    assert saved["meta"]["warmup"] == {"requests": 5, "seconds": 0.0}


@pytest.mark.parametrize("extra, measured, message", [
    (["--warmup", "50"], None, "--warmup: expected a warm-up that leaves some of the 50 measured requests"),
    (["--warmup", "2", "--warmup-s", "1"], None, "--warmup: expected --warmup or --warmup-s, not both"),
    (["--warmup", "2"], DATA / "cbsim_flat.json", "cbsim_flat.json: --warmup: expected a measured file with "
                                                  "per-request details"),
])
def test_cli_warmup_errors_exit_2_with_one_line(tmp_path, tiny, extra, measured, message):
    exp = write_yaml(tmp_path, NO_WORKLOAD if measured is None else TINY)
    result = runner.invoke(app, ["compare", str(exp), str(measured or measured_file(tmp_path, tiny)), *extra])
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output
