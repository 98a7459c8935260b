"""One progress style (cbsim/cli/progress.py) for run, sweep, capacity and tune: a rich bar on stderr that
names what it runs, ends before the results are printed, is off with -q / --log-level warning, and never
changes a result (the same bytes with and without it)."""
from __future__ import annotations

import json

import yaml
from typer.testing import CliRunner

from cbsim.cli.app import app
from factories import TINY_EXPERIMENT, write_experiment

BAR = "━"  # rich's bar glyph: the one style


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_run_draws_one_bar_naming_the_experiment_on_stderr_and_nothing_when_quiet(tmp_path):
    exp = write_experiment(tmp_path, TINY_EXPERIMENT)
    loud = invoke("run", exp, "--out", tmp_path / "loud")
    assert loud.exit_code == 0, loud.output
    assert "run tiny" in loud.stderr and BAR in loud.stderr and "5/5" in loud.stderr, loud.stderr
    assert BAR not in loud.stdout and "[" not in loud.stdout.split("results:")[0]  # results only on stdout
    for flags in (["-q"], ["--log-level", "warning"]):
        quiet = invoke(*flags, "run", exp, "--out", tmp_path / "quiet")
        assert quiet.exit_code == 0 and quiet.stderr == "", quiet.stderr
    assert invoke("run", exp, "-q", "--out", tmp_path / "q2").stderr == ""
    for name in ("summary.json", "requests.parquet", "steps.parquet"):  # progress never changes a result
        loud_bytes = (tmp_path / "loud" / name).read_bytes()
        if name == "summary.json":  # the wall time is the one field that differs run to run
            loud_json, quiet_json = (json.loads((tmp_path / d / name).read_text()) for d in ("loud", "quiet"))
            loud_json.pop("sim_wall_seconds"), quiet_json.pop("sim_wall_seconds")
            assert loud_json == quiet_json
        else:
            assert loud_bytes == (tmp_path / "quiet" / name).read_bytes()


def test_sweep_bar_names_the_sweep_and_its_last_point(tmp_path):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"name": "tiny_sweep", "base": "tiny.yaml",
                                     "grid": {"policy.token_budget": [64, 128]}, "seeds": [0]}))
    result = invoke("sweep", sweep, "--out", tmp_path / "out", "--workers", "1", "--no-plots")
    assert result.exit_code == 0, result.output
    assert "sweep tiny_sweep" in result.stderr and "2/2" in result.stderr, result.stderr
    assert "policy.token_budget=" in result.stderr and BAR in result.stderr
    assert result.stdout.startswith("2 runs, 0 failed")  # the bar ended first, on stderr
    assert invoke("-q", "sweep", sweep, "--out", tmp_path / "out", "--no-plots").stderr == ""


def test_capacity_bar_names_the_probe(tmp_path):
    exp = write_experiment(tmp_path, TINY_EXPERIMENT)
    result = invoke("capacity", exp, "--slo", "ttft_p99=50ms", "--tol", "0.5")
    assert result.exit_code == 0, result.output
    assert "capacity sarathi: rate " in result.stderr and ", seed 0" in result.stderr and BAR in result.stderr
    assert result.stdout.startswith("capacity (workload.arrival.rate)")
    assert BAR not in invoke("capacity", exp, "--slo", "ttft_p99=50ms", "--tol", "0.5", "-q").stderr


def test_tune_bar_names_stage_and_candidate_and_the_stage_lines_follow_it(tmp_path):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    skip = ("parallelism", "policy", "max_num_seqs", "chunk_size", "partial_prefills", "admission", "queue_policy", "pd")
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny_tune", "base": "tiny.yaml", "slo": {"ttft_p99": 0.4},
                                    "gpus": {"count": 1}, "search": {"lo": 4.0, "rel_tol": 0.5, "seeds": [0]},
                                    "stages": {**{name: [] for name in skip}, "token_budget": [64, 128]}}))
    result = invoke("tune", path, "--out", tmp_path / "out", "--workers", "1", "--no-plots")
    assert result.exit_code == 0, result.output
    assert "tune tiny_tune" in result.stderr and "last: token_budget" in result.stderr, result.stderr
    assert BAR in result.stderr and BAR not in result.stdout
    assert result.stdout.startswith("tune tiny_tune: stages in their fixed order")
    assert "  token_budget = " in result.stdout
