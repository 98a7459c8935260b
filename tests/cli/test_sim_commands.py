"""The commands that run simulations (run, sweep, capacity, tune) alike: one progress style
(cbsim/cli/progress.py), a rich bar on stderr that names what it runs, ends before the results are printed,
is off with -q / --log-level warning, and never changes a result (the same bytes with and without it);
cbsim's -v / -q / --log-level acting on each; --seed on each."""
from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from cbsim.cli.app import app
from factories import TINY_EXPERIMENT, write_experiment

BAR = "━"  # rich's bar glyph: the one style


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def sweep_file(folder):
    (folder / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    sweep = folder / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"name": "tiny_sweep", "base": "tiny.yaml",
                                     "grid": {"policy.token_budget": [64, 128]}, "seeds": [0]}))
    return sweep


def tune_file(folder):
    (folder / "tiny.yaml").write_text(yaml.safe_dump(TINY_EXPERIMENT))
    skip = ("parallelism", "policy", "max_num_seqs", "chunk_size", "partial_prefills", "admission", "queue_policy", "pd")
    path = folder / "tune.yaml"
    path.write_text(yaml.safe_dump({"name": "tiny_tune", "base": "tiny.yaml", "slo": {"ttft_p99": 0.4},
                                    "gpus": {"count": 1}, "search": {"lo": 4.0, "rel_tol": 0.5, "seeds": [0]},
                                    "stages": {**{name: [] for name in skip}, "token_budget": [64, 128]}}))
    return path


def command(name: str, folder) -> list:
    """Each command that runs simulations, on a tiny case, writing under `folder`."""
    if name == "run":
        return ["run", write_experiment(folder, TINY_EXPERIMENT), "--out", folder / "run"]
    if name == "sweep":
        return ["sweep", sweep_file(folder), "--out", folder / "sweep", "--workers", "1", "--no-plots"]
    if name == "capacity":
        return ["capacity", write_experiment(folder, TINY_EXPERIMENT), "--slo", "ttft_p99=50ms", "--tol", "0.5"]
    return ["tune", tune_file(folder), "--out", folder / "tune", "--workers", "1", "--no-plots"]


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
    sweep = sweep_file(tmp_path)
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
    path = tune_file(tmp_path)
    result = invoke("tune", path, "--out", tmp_path / "out", "--workers", "1", "--no-plots")
    assert result.exit_code == 0, result.output
    assert "tune tiny_tune" in result.stderr and "last: token_budget" in result.stderr, result.stderr
    assert BAR in result.stderr and BAR not in result.stdout
    assert result.stdout.startswith("tune tiny_tune: stages in their fixed order")
    assert "  token_budget = " in result.stdout


@pytest.mark.parametrize("name", ["run", "sweep", "capacity", "tune"])
def test_log_level_and_verbosity_reach_every_command(tmp_path, name):
    """cbsim's -v / -q / --log-level (before the command) act on each command: no bar above info."""
    for flags, bar in ((["-v"], True), (["--log-level", "info"], True), (["--log-level", "warning"], False),
                       (["--log-level", "error"], False), (["-q"], False)):
        folder = tmp_path / "_".join(flags)
        folder.mkdir()
        result = invoke(*flags, *command(name, folder))
        assert result.exit_code == 0, (flags, result.output)
        assert (BAR in result.stderr) is bar, (flags, result.stderr)
    bad = invoke("--log-level", "loud", *command(name, tmp_path))
    assert bad.exit_code == 2 and "--log-level" in bad.output


def test_seed_replaces_the_files_seeds_of_sweep_capacity_and_tune(tmp_path):
    import pandas as pd

    sweep = invoke(*command("sweep", tmp_path), "--seed", "7", "--seed", "8")
    assert sweep.exit_code == 0, sweep.output
    table = pd.read_csv(tmp_path / "sweep" / "results.csv")
    assert sorted(set(table["seed"])) == [7, 8] and len(table) == 4  # 2 grid points x the 2 seeds given
    capacity = invoke(*command("capacity", tmp_path), "--seed", "3", "--out", tmp_path / "probes.csv")
    assert capacity.exit_code == 0, capacity.output
    assert set(pd.read_csv(tmp_path / "probes.csv")["seed"]) == {3}
    tune = invoke(*command("tune", tmp_path), "--seed", "1", "--seed", "2")
    assert tune.exit_code == 0, tune.output
    assert "seeds [1, 2]" in (tmp_path / "tune" / "report.md").read_text()


@pytest.mark.parametrize("name", ["sweep", "capacity", "tune"])
def test_a_seed_given_twice_is_refused_naming_the_flag(tmp_path, name):
    result = invoke(*command(name, tmp_path), "--seed", "1", "--seed", "1")
    assert result.exit_code == 2 and "--seed" in result.output and "Traceback" not in result.output, result.output
