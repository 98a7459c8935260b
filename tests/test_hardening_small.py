"""The smaller defects of issue 26 (item 16), each a one-line error with exit code 2 or a run that
works, never a traceback."""
import yaml
from typer.testing import CliRunner

from factories import assert_user_error

from cbsim.cli import app

runner = CliRunner()
TINY = {
    "name": "tiny", "seed": 3, "cost_model": {"type": "linear", "base": 0.01, "per_token": 1e-4},
    "cluster": {"kv_cache": {"num_blocks": 400}}, "policy": {"name": "sarathi", "token_budget": 128},
    "workload": {"num_requests": 5, "arrival": {"type": "poisson", "rate": 20.0},
                 "prompt_len": {"type": "fixed", "value": 100}, "output_len": {"type": "fixed", "value": 5}},
    "output": {"plots": False},
}


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])


def experiment(tmp_path, **changes):
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump({**TINY, **changes}))
    return path


def test_a_sigma_of_minus_zero_runs_as_zero(tmp_path):
    workload = {**TINY["workload"], "prompt_len": {"type": "lognormal", "median": 100, "sigma": -0.0}}
    result = cli("run", experiment(tmp_path, workload=workload), "--out", tmp_path / "o", "-q")
    assert result.exit_code == 0, result.output


def test_a_stage_rate_of_2_to_the_63_is_refused(tmp_path):
    workload = {**TINY["workload"], "arrival": {"type": "stages", "stages": [{"rate": 2.0**63, "duration": 1}]}}
    assert_user_error(cli("validate", experiment(tmp_path, workload=workload)), "workload.arrival.stages",
                      "at most 10,000,000 arrivals")


def test_a_run_name_too_long_for_a_folder_is_refused(tmp_path):
    assert_user_error(cli("validate", experiment(tmp_path, name="x" * 300)), "exp.yaml", "name", "at most 200 bytes")
    assert_user_error(cli("run", experiment(tmp_path), "--set", "name=" + "é" * 150), "name", "at most 200 bytes")


def test_a_repeated_slo_is_refused_not_silently_replaced(tmp_path):
    assert_user_error(cli("capacity", experiment(tmp_path), "--slo", "ttft_p99=1", "--slo", "ttft_p99=2"),
                      "--slo", "each metric once")


def test_an_os_error_is_one_line(tmp_path, monkeypatch):
    import errno
    import os

    def refuse(*args, **kwargs):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "x"))

    monkeypatch.setattr("cbsim.cli.check_target", refuse, raising=False)
    monkeypatch.setattr("cbsim.core.atomic.check_target", refuse)
    assert_user_error(cli("run", experiment(tmp_path), "--out", tmp_path / "o"), "Permission denied")


def test_calibrate_with_too_few_evaluations_is_one_line(tmp_path):
    import json

    measured = tmp_path / "bench.json"
    measured.write_text(json.dumps({"ttft_mean": 0.05, "itl_p50": 0.01}))
    result = cli("calibrate", "--serving", f"{experiment(tmp_path)}={measured}", "--max-evals", "0",
                 "--out", tmp_path / "engine.json")
    assert_user_error(result, "--max-evals", "more than")
    assert not (tmp_path / "engine.json").exists()


def test_arrivals_beyond_the_clock_are_refused_by_validate_naming_the_workload(tmp_path):
    """A rate of 1e-300, a trace row in year 9999 and an explicit arrival of 1e300 s passed validate and
    then failed at the first step, blamed on cost_model."""
    import json

    slow = {**TINY["workload"], "arrival": {"type": "poisson", "rate": 1e-300}}
    assert_user_error(cli("validate", experiment(tmp_path, workload=slow)), "workload.arrival", "clock")
    explicit = {"requests": [{"arrival": 1e300, "prompt_len": 10, "output_len": 2}]}
    assert_user_error(cli("validate", experiment(tmp_path, workload=explicit)), "workload.requests", "arrival")
    year_9999 = 253402300799  # 9999-12-31 in Unix seconds
    rows = [{"timestamp": t * 1000, "input_length": 100, "output_length": 5, "hash_ids": [0]} for t in (0, year_9999)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    trace = {"trace": {"format": "mooncake", "path": "t.jsonl", "slot_width": 0}}
    assert_user_error(cli("validate", experiment(tmp_path, workload=trace)), "workload.trace", "clock")
