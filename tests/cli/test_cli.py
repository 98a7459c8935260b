"""The command line as a user meets it: runs, overrides, clean errors with exit code 2."""
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cbsim.cli.app import app
from paths import ROOT

runner = CliRunner()
PROFILES = ROOT / "sim" / "costmodels" / "profiles"

TINY = {
    "name": "tiny", "seed": 3, "cost_model": {"type": "linear", "base": 0.01, "per_token": 1e-4},
    "cluster": {"kv_cache": {"num_blocks": 400}},
    "policy": {"name": "sarathi", "token_budget": 128},
    "workload": {"num_requests": 40, "arrival": {"type": "poisson", "rate": 20.0},
                 "prompt_len": {"type": "uniform", "min": 10, "max": 300},
                 "output_len": {"type": "uniform", "min": 1, "max": 40}},
    "output": {"plots": False, "trace": False},
}


def write(tmp_path, data, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_figures_only_when_asked(tmp_path):
    """No figures by default (issue 29: most of a short run's time); --plots draws them whatever the file
    says, --no-plots leaves them out whatever it says."""
    pngs = lambda folder: sorted(p.name for p in folder.glob("*.png"))  # noqa: E731
    plain = write(tmp_path, {**TINY, "output": {}}, "plain.yaml")
    asked = write(tmp_path, {**TINY, "output": {"plots": True}}, "asked.yaml")
    for args, folder, drawn in (([str(plain)], "a", False), ([str(plain), "--plots"], "b", True),
                                ([str(asked)], "c", True), ([str(asked), "--no-plots"], "d", False)):
        result = runner.invoke(app, ["run", *args, "--out", str(tmp_path / folder), "-q"])
        assert result.exit_code == 0, result.output
        assert bool(pngs(tmp_path / folder)) == drawn, args
    assert "dashboard.png" in pngs(tmp_path / "b") and "latency_cdf.png" in pngs(tmp_path / "b")


def test_run_writes_every_output(tmp_path):
    exp = write(tmp_path, {**TINY, "output": {"plots": True, "trace": True}})
    out = tmp_path / "out"
    result = runner.invoke(app, ["run", str(exp), "--out", str(out)])
    assert result.exit_code == 0, result.output
    for name in ("config.yaml", "requests.parquet", "steps.parquet", "summary.json",
                 "latency_cdf.png", "step_timeline.png", "kv_usage.png", "trace.json"):
        assert (out / name).is_file(), name
    assert not list(out.glob("*.csv"))  # CSV only on request (output.formats)
    summary = json.loads((out / "summary.json").read_text())
    for key in ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99", "itl_p50", "itl_p90",
                "itl_p99", "itl_max", "e2e_p50", "e2e_p99", "throughput_tokens_per_s", "throughput_requests_per_s",
                "goodput_requests_per_s", "slo_attainment", "dec_at_p_mean", "dec_at_p_min", "short_p_mean",
                "short_p_max", "num_long_requests", "num_stalls", "num_preemptions", "num_rejected", "makespan",
                "sim_wall_seconds"):
        assert key in summary, key
    assert summary["num_finished"] == 40
    assert "ttft_p50" in result.output


def test_set_overrides_reach_the_run(tmp_path):
    exp = write(tmp_path, TINY)
    result = runner.invoke(app, ["run", str(exp), "--set", "policy.token_budget=64", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load((tmp_path / "o" / "config.yaml").read_text())
    assert resolved["policy"]["token_budget"] == 64


@pytest.mark.parametrize("change, key, expected", [
    ({"policy": {"name": "fastest"}}, "policy.name", "one of"),
    ({"policy": {"name": "sarathi", "token_budget": "big"}}, "policy.token_budget", "an integer"),
    ({"policy": {"name": "sarathi", "token_budget": -5}}, "policy.token_budget", ">= 1"),
    ({"workload": {"num_requests": 5, "arrival": {"type": "poisson", "rate": 1.0},
                   "prompt_len": {"type": "fixed", "value": -3}, "output_len": {"type": "fixed", "value": 4}}},
     "workload.prompt_len.value", ">= 1"),
    ({"workload": {"num_requests": 5, "prompt_len": {"type": "fixed", "value": 3},
                   "output_len": {"type": "fixed", "value": 4}}}, "workload.arrival", ""),
    ({"cost_model": {"type": "roofline", "gpu": "tpu9"}}, "cost_model.gpu", ""),
    ({"cluster": {"replicas": "two"}}, "cluster.replicas", "an integer"),
    ({"preemption": {"mode": "pause"}}, "preemption.mode", "recompute"),
    ({"colour": "blue"}, "colour", "one of the keys"),
    ({"cost_model": {"type": "fitted", "profile": str(PROFILES / "vidur" / "a100-llama-2-70b-tp2.json")}},
     "cost_model.profile", "has type 'vidur'"),
    ({"cost_model": {"type": "vidur", "profile": str(PROFILES / "fitted" / "a100-llama-2-70b-tp2-published.json")}},
     "cost_model.profile", "has type 'fitted'"),
    ({"cost_model": {"type": "fitted", "profile": "no/such/profile.json"}}, "cost_model.profile", "an existing file"),
])
def test_bad_input_names_file_key_and_expectation(tmp_path, change, key, expected):
    exp = write(tmp_path, {**TINY, **change})
    for command in ("validate", "run"):
        result = runner.invoke(app, [command, str(exp), "--out", str(tmp_path / "o")] if command == "run"
                               else [command, str(exp)])
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
        assert str(exp) in result.output and key in result.output and expected in result.output


def test_missing_file_and_bad_yaml_are_user_errors(tmp_path):
    result = runner.invoke(app, ["run", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "nope.yaml" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy: {name: [unclosed\n")
    result = runner.invoke(app, ["validate", str(bad)])
    assert result.exit_code == 2 and "bad.yaml" in result.output and "valid YAML" in result.output


def test_policies_lists_every_policy_with_help():
    result = runner.invoke(app, ["policies"])
    assert result.exit_code == 0
    for name in ("static", "orca", "prefill_first", "sarathi", "splitfuse"):
        assert name in result.output
    assert "max_num_partial_prefills" in result.output and "chunk_size" in result.output


def test_readme_starts_with_the_two_commands():
    head = (ROOT / "README.md").read_text().splitlines()[:6]
    assert any("cbsim run experiments/quickstart.yaml" in line for line in head)
    assert any("python -m pytest" in line for line in head)


@pytest.mark.parametrize("path", sorted((ROOT / "experiments").glob("*.yaml")))
def test_shipped_experiments_validate(path):
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 0, result.output


def test_printed_summary_shows_units():
    from cbsim.cli.app import summary_text

    assert summary_text("ttft_p50", 0.06934) == "69.34 ms" and summary_text("makespan", 73.13) == "73.13 s"
    assert summary_text("throughput_tokens_per_s", 1976.0) == "1976 tokens/s"
    assert summary_text("slo_attainment", 1) == "100 %" and summary_text("num_finished", 500) == "500"
    assert summary_text("ttft_p99", None) == "n/a"
    assert summary_text("ttft_p50", 44.46) == "44.46 s"
    assert summary_text("ttft_p50", 9.5) == "9500 ms"


def test_run_prints_what_it_resolved(tmp_path):
    from cbsim.cli.app import resolved_line
    from cbsim.config import load_config

    cfg = load_config("experiments/quickstart.yaml")
    assert resolved_line(cfg, {0: 28181}) == ("resolved: roofline (gpu h100, tp 1), engine vllm-v1, "
                                              "KV 28,181 x 16 tokens per replica, 1 x sarathi")
    pd_cfg = load_config("experiments/pd_vs_colocated.yaml")
    assert "P/D (prefill: 2 x prefill_first, decode: 1 x sarathi)" in resolved_line(pd_cfg, {0: 5, 1: 5, 2: 7})
    pp_cfg = load_config("experiments/pipeline_parallel.yaml")
    assert resolved_line(pp_cfg, {0: 87772}).startswith("resolved: roofline (gpu h100, tp 4, pp 2), ")
