"""`cbsim run` without a file (vllm bench serve's flags), --seed, --version and logging (issue 30)."""
import logging
import math

import pytest
import yaml
from typer.testing import CliRunner

from cbsim.cli.app import app
from cbsim.cli.logs import configure, progress_wanted
from cbsim.cli.quick_run import quick_experiment
from cbsim.config import load_config
from cbsim.core.errors import ConfigError

runner = CliRunner()
FLAGS = ["run", "--model", "llama-3-8b", "--gpu", "a100", "--request-rate", "8", "--num-prompts", "40",
         "--input-len", "256", "--output-len", "16", "--policy", "orca", "--max-concurrency", "4", "-q"]


def test_a_run_without_a_file_builds_the_experiment_from_the_flags(tmp_path):
    result = runner.invoke(app, FLAGS + ["--out", str(tmp_path), "--goodput", "ttft:500", "--seed", "3"])
    assert result.exit_code == 0, result.output
    cfg = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert (cfg["model"], cfg["cost_model"]["gpu"], cfg["policy"]["name"], cfg["seed"]) == ("llama-3-8b", "a100",
                                                                                           "orca", 3)
    workload = cfg["workload"]
    assert workload["arrival"] == {"type": "poisson", "rate": 8.0} and workload["num_requests"] == 40
    assert workload["prompt_len"] == {"type": "fixed", "value": 256} and workload["max_concurrency"] == 4
    assert cfg["metrics"]["slo"]["ttft"] == 0.5
    assert "num_finished             40" in result.output and "slo_attainment" in result.output


def test_vllm_bench_defaults_and_aliases():
    data = quick_experiment(model="x/Y", gpu="h100", tp=1, rate=math.inf, num_prompts=10, input_len=100, output_len=10,
                            range_ratio=0.5, burstiness=4.0, policy=None, max_concurrency=None, seed=0, goodput=None,
                            dataset_name="random")
    assert data["workload"]["arrival"] == {"type": "all_at_once"} and data["name"] == "x--Y-h100"
    assert data["workload"]["prompt_len"] == {"type": "uniform", "min": 50, "max": 150}
    bursty = quick_experiment(**{**dict(model="m", gpu="h100", tp=1, num_prompts=1, input_len=1, output_len=1,
                                        range_ratio=0, policy=None, max_concurrency=None, seed=0, goodput=None,
                                        dataset_name="random"), "rate": 2.0, "burstiness": 4.0})
    assert bursty["workload"]["arrival"] == {"type": "gamma", "rate": 2.0, "cv": 0.5}


def test_random_flag_names_are_accepted(tmp_path):
    result = runner.invoke(app, ["run", "--dataset-name", "random", "--random-input-len", "64", "--random-output-len",
                                 "8", "--num-prompts", "5", "--out", str(tmp_path), "-q"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["workload"]["output_len"]["value"] == 8


@pytest.mark.parametrize("args, words", [(["--dataset-name", "sharegpt"], "--dataset-name: expected random"),
                                         (["--goodput", "e2el:900"], "--goodput: expected ttft or tpot"),
                                         (["--policy", "nope"], "policy.name")])
def test_bad_quick_flags_are_one_line_errors(args, words):
    result = runner.invoke(app, ["run", "--num-prompts", "5"] + args)
    assert result.exit_code == 2 and words in result.output


def test_a_file_with_quick_flags_is_refused_but_seed_and_goodput_apply(tmp_path):
    result = runner.invoke(app, ["run", "experiments/quickstart.yaml", "--model", "llama-3-8b"])
    assert result.exit_code == 2 and "--model: expected no experiment file" in result.output
    result = runner.invoke(app, ["run", "experiments/quickstart.yaml", "--seed", "7", "--goodput", "tpot:30",
                                 "--set", "workload.num_requests=20", "--set", "output.plots=false", "--set",
                                 "output.trace=false", "--out", str(tmp_path), "-q"])
    assert result.exit_code == 0, result.output
    cfg = load_config(tmp_path / "config.yaml")
    assert cfg.seed == 7 and cfg.metrics.slo.tpot == 0.03 and cfg.metrics.slo.ttft == 2.0


def test_version():
    result = runner.invoke(app, ["--version"])
    from cbsim import __version__

    assert result.exit_code == 0 and result.output.strip() == f"cbsim {__version__}"


def test_log_levels_decide_warnings_and_progress(capsys):
    try:
        configure("info")
        assert progress_wanted(False) and not progress_wanted(True)
        logging.getLogger("cbsim").warning("trace rows dropped")
        assert "warning: trace rows dropped" in capsys.readouterr().err
        configure("warning")
        assert not progress_wanted(False)
        configure("error")
        logging.getLogger("cbsim").warning("hidden")
        assert "hidden" not in capsys.readouterr().err
    finally:
        configure("info")


def test_app_quiet_and_log_level_options():
    assert runner.invoke(app, ["-q", "policies"]).exit_code == 0
    assert runner.invoke(app, ["--log-level", "debug", "policies"]).exit_code == 0
    result = runner.invoke(app, ["--log-level", "loud", "policies"])
    assert result.exit_code == 2 and "--log-level" in result.output
