"""`cbsim tune`: on a tiny case the staged search finds the configuration an exhaustive capacity
sweep over the same candidate grid finds; a rerun runs nothing and writes the same bytes; bad tune
files name the file and key (CLI exit 2); the chosen config runs and its flags resolve back."""
from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cbsim.tools.sweep.capacity import find_capacity
from cbsim.cli.app import app
from cbsim.config import load_config
from cbsim.core.errors import ConfigError
from cbsim.tools.tune.tune import load_tune, run_tune
from cbsim.tools.tune.flags import flags_text
from cbsim.tools.tune.plots import pareto_front
from cbsim.tools.tune.report import write_outputs
from paths import ROOT

BASE = {
    "name": "tiny",
    "model": "llama-3-8b",
    "cost_model": {"type": "linear", "base": 0.01, "per_token": 1e-4},
    "cluster": {"kv_cache": {"num_blocks": 4000}},
    "policy": {"name": "sarathi", "token_budget": 64},
    "workload": {"num_requests": 40, "arrival": {"type": "poisson", "rate": 10.0},
                 "prompt_len": {"type": "uniform", "min": 16, "max": 400},
                 "output_len": {"type": "uniform", "min": 4, "max": 30}},
    "output": {"plots": False, "trace": False},
}
SLO = {"ttft_p99": 0.4, "itl_p99": 0.05}
SEARCH = {"lo": 4.0, "rel_tol": 0.1, "seeds": [0]}
GRID = {"token_budget": [64, 256, 1024], "chunk_size": [None, 32, 128],
        "partial_prefills": [{"max_num_partial_prefills": 1}, {"max_num_partial_prefills": 4}]}
KEYS = {"token_budget": "policy.token_budget", "chunk_size": "policy.chunk_size"}
SKIP = {"parallelism": [], "policy": [], "max_num_seqs": [], "admission": [], "queue_policy": [], "pd": []}


def write_tune(folder: Path, **changes) -> Path:
    (folder / "tiny.yaml").write_text(yaml.safe_dump(BASE))
    spec = {"name": "tiny_tune", "base": "tiny.yaml", "slo": SLO, "gpus": {"count": 1}, "search": SEARCH,
            "stages": {**SKIP, **GRID}}
    spec.update(changes)
    path = folder / "tune.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def _rank(result, slo) -> tuple[float, float]:
    """goodput per GPU, then the SLO headroom at capacity (as the tune ranks; computed here anew)."""
    if result.rate is None:
        return (-1.0, -math.inf)
    rows = result.points[result.points["rate"] == result.rate]
    headroom = min((limit - rows[m].max()) / limit for m, limit in slo.items())
    return (result.rate / result.num_gpus, headroom)


def _overrides(stage: str, value) -> list[str]:
    """The experiment keys a stage candidate of GRID sets (spelled out here, not taken from tune)."""
    if stage == "partial_prefills":
        return [f"policy.{k}={v}" for k, v in value.items()]
    return [f"{KEYS[stage]}={'null' if value is None else value}"]


def _chosen(config, grid: dict) -> tuple:
    policy = config.policy
    values = []
    for stage in grid:
        if stage == "partial_prefills":
            values.append(policy["max_num_partial_prefills"])
        else:
            values.append(policy[KEYS[stage].split(".")[1]])
    return tuple(values)


@pytest.mark.parametrize("grid", [
    pytest.param({k: GRID[k] for k in ("token_budget", "chunk_size")}, id="budget-x-chunk"),
    pytest.param(GRID, id="budget-x-chunk-x-partial", marks=pytest.mark.slow),
])
def test_tune_finds_what_an_exhaustive_sweep_finds(tmp_path, grid):
    """The staged search (one knob at a time) against capacity searches over the whole product."""
    path = write_tune(tmp_path, stages={**SKIP, "token_budget": [], "chunk_size": [], "partial_prefills": [], **grid})
    tuned = run_tune(path, tmp_path / "out", workers=1)
    base = str(tmp_path / "tiny.yaml")
    exhaustive = {}
    for combo in itertools.product(*grid.values()):
        overrides = [o for stage, value in zip(grid, combo) for o in _overrides(stage, value)]
        result = find_capacity(base, SLO, overrides=overrides, **{**SEARCH, "seeds": tuple(SEARCH["seeds"])})
        key = tuple(v["max_num_partial_prefills"] if isinstance(v, dict) else v for v in combo)
        exhaustive[key] = _rank(result, SLO)
    best_key = max(exhaustive.values())
    winners = {combo for combo, key in exhaustive.items() if key == best_key}
    chosen = _chosen(tuned.best.point.config, grid)
    assert best_key[0] > 0 and tuned.best.record["fail_rate"] is not None  # a finite, non-trivial capacity
    assert chosen in winners, (chosen, sorted(exhaustive.items(), key=lambda kv: kv[1], reverse=True)[:3])
    assert tuned.best.record["rate"] == pytest.approx(best_key[0])
    assert len(tuned.records) < len(exhaustive)  # and it ran fewer capacity searches


def test_resume_runs_nothing_and_writes_the_same_bytes(tmp_path):
    path = write_tune(tmp_path, stages={**SKIP, "token_budget": [64, 512], "chunk_size": [None, 64],
                                        "partial_prefills": []})
    out = tmp_path / "out"
    first = run_tune(path, out, workers=1)
    write_outputs(first, out)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert {"tune.csv", "tune.parquet", "best.yaml", "best_flags.txt", "report.md", "pareto.png"} <= set(before)
    assert json.loads(before[".cbsim-complete"])["files"] == sorted(  # the marker, written last (issue 26)
        ["tune.csv", "tune.parquet", "best.yaml", "best_flags.txt", "report.md", "pareto.png"])
    second = run_tune(path, out, workers=1)
    write_outputs(second, out)
    assert first.ran >= 3 and second.ran == 0
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    # best.yaml runs as is, at the capacity the tune found
    best = load_config(out / "best.yaml")
    assert best.workload["arrival"]["rate"] == pytest.approx(first.best.record["rate"])
    assert best.policy == first.best.point.config.policy


def test_report_explains_every_stage(tmp_path):
    path = write_tune(tmp_path, stages={**SKIP, "token_budget": [64, 1024], "chunk_size": [], "partial_prefills": []})
    result = run_tune(path, tmp_path / "out", workers=1)
    files = write_outputs(result, tmp_path / "out", plots=False)
    report = files["report"].read_text()
    for name in ("parallelism", "policy", "token_budget", "chunk_size", "admission", "pd"):
        assert f"### {name}" in report
    assert "skipped by the tune file" in report and "Chosen: **" in report
    table = result and __import__("pandas").read_csv(tmp_path / "out" / "tune.csv")
    assert table.loc[0, "chosen"]  # the chosen deployment ranks first
    assert list(table["rank"]) == list(range(1, len(table) + 1))


def test_pd_stage_splits_the_budget(tmp_path):
    path = write_tune(tmp_path, gpus={"count": 2}, set={"cluster.replicas": 2},
                      stages={**SKIP, "token_budget": [], "chunk_size": [], "partial_prefills": [],
                              "pd": ["colocated", {"prefill": 1, "decode": 1}]})
    result = run_tune(path, tmp_path / "out", workers=1)
    files = write_outputs(result, tmp_path / "out", plots=False)
    outcome = next(o for o in result.stages if o.stage.name == "pd")
    assert outcome.status == "searched" and [c.label for c in outcome.candidates] == ["colocated", "1P + 1D GPUs"]
    split = outcome.candidates[1].point.config
    assert split.cluster.mode == "pd" and split.cluster.prefill.replicas == 1 and split.cluster.decode.replicas == 1
    assert all(c.record["num_gpus"] == 2 and c.record["status"] == "ok" for c in outcome.candidates)
    table = __import__("pandas").read_parquet(files["table"])
    assert set(table["mode"]) == {"colocated", "pd"}
    assert "1P + 1D GPUs" in files["report"].read_text()


def test_defaults_the_cost_model_refuses_skip_the_stage(tmp_path):
    """The linear cost model has no tp: every default TP candidate is refused, the stage is skipped."""
    path = write_tune(tmp_path, stages={**SKIP, "parallelism": None, "token_budget": [64, 256], "chunk_size": [],
                                        "partial_prefills": []})
    spec = yaml.safe_load(path.read_text())
    del spec["stages"]["parallelism"]
    path.write_text(yaml.safe_dump(spec))
    outcome = run_tune(path, tmp_path / "out", workers=1).stages[0]
    assert outcome.stage.name == "parallelism" and outcome.status == "skipped"
    assert outcome.dropped and "cost_model.tp" in outcome.dropped[0]


@pytest.mark.parametrize("changes, key", [
    ({"stages": {"token_budget": [0]}}, "stages.token_budget[0]"),
    ({"stages": {"warp_speed": [1]}}, "stages.warp_speed"),
    ({"stages": {"parallelism": [3]}}, "stages.parallelism[0]"),
    ({"stages": {"partial_prefills": [{"max_num_partial_prefills": 0}]}}, "stages.partial_prefills[0]"),
    ({"slo": {"ttft_p99": -1}}, "slo.ttft_p99"),
    ({"gpus": {"count": 0}}, "gpus.count"),
    ({"set": {"policy.token_budget": -3}}, "set.policy.token_budget"),
    ({"search": {"rel_tol": 0}}, "search.rel_tol"),
    ({"stages": {"policy": ["sarathi", "warp"]}}, "stages.policy[1]"),
    ({"stages": {"pd": [{"prefill": 3, "decode": 1}]}}, "stages.pd[0]"),
    ({"stages": {"queue_policy": [{"router": "nearest"}]}}, "stages.queue_policy[0]"),
])
def test_bad_tune_file_names_file_and_key(tmp_path, changes, key):
    path = write_tune(tmp_path, **changes)
    with pytest.raises(ConfigError) as err:
        run_tune(path, tmp_path / "out", workers=1)
    assert err.value.path.startswith(key) and err.value.file == str(path)


def test_unknown_slo_metric_is_a_config_error(tmp_path):
    path = write_tune(tmp_path, slo={"ttft_p99.9": 1.0}, stages={**SKIP, "token_budget": [64, 128],
                                                                "chunk_size": [], "partial_prefills": []})
    with pytest.raises(ConfigError) as err:
        run_tune(path, tmp_path / "out", workers=1)
    assert "slo.ttft_p99.9" in str(err.value) and str(path) in str(err.value)


def test_cli_exits_2_on_a_bad_tune_file(tmp_path):
    path = write_tune(tmp_path, stages={"token_budget": "many"})
    result = CliRunner().invoke(app, ["tune", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert "stages.token_budget" in result.output and str(path) in result.output


def test_cli_runs_then_resumes(tmp_path):
    path = write_tune(tmp_path, stages={**SKIP, "token_budget": [64, 256], "chunk_size": [], "partial_prefills": []})
    args = ["tune", str(path), "--out", str(tmp_path / "out"), "--workers", "1", "--no-plots"]
    first = CliRunner().invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "token_budget = " in first.output and "2 capacity searches run" in first.output
    assert (tmp_path / "out" / "best.yaml").is_file() and not (tmp_path / "out" / "pareto.png").exists()
    second = CliRunner().invoke(app, args)
    assert second.exit_code == 0 and "0 capacity searches run" in second.output


def test_flags_of_a_sarathi_and_an_sglang_deployment():
    sarathi = load_config({**BASE, "cost_model": {"type": "roofline", "gpu": "h100", "tp": 2},
                           "cluster": {"replicas": 2},
                           "policy": {"name": "sarathi", "token_budget": 2048, "max_num_seqs": 128, "chunk_size": 512}})
    text = flags_text(sarathi)
    assert "vllm serve MODEL --max-num-batched-tokens 2048 --max-num-seqs 128 --long-prefill-token-threshold 512" in text
    assert "--tensor-parallel-size 2" in text and "--no-enable-prefix-caching" in text
    assert "2 such instances" in text and "partial-prefill limit" in text  # V1 lifts cbsim's limit of 1
    sglang = load_config({**BASE, "cost_model": {"type": "roofline", "gpu": "h100"},
                          "policy": {"name": "sglang", "token_budget": 4096, "chunked_prefill_size": None,
                                     "schedule_policy": "lpm"}})
    text = flags_text(sglang)
    assert "--max-prefill-tokens 4096 --chunked-prefill-size -1" in text and "--schedule-policy lpm" in text
    assert "differs" not in text
    orca = load_config({**BASE, "policy": {"name": "splitfuse"}})
    assert "none: policy splitfuse" in flags_text(orca)


def test_pareto_front():
    assert pareto_front([(1.0, 1.0), (2.0, 3.0), (1.5, 0.5), (3.0, 3.0), (0.5, 0.2)]) == [4, 0, 1]


def test_shipped_tune_file_loads():
    spec = load_tune(ROOT / "experiments" / "tune" / "quickstart_2xh100.yaml")
    assert spec.gpus.count == 2 and set(spec.slo) == {"ttft_p99", "itl_p99"}


def test_cli_names_each_candidate_and_warns_of_short_probes(tmp_path):
    """Progress names the stage and candidate it ran; probes of a few simulated seconds are warned about."""
    path = write_tune(tmp_path, stages={**SKIP, "token_budget": [64, 256], "chunk_size": [], "partial_prefills": []})
    result = CliRunner().invoke(app, ["tune", str(path), "--out", str(tmp_path / "out"), "--workers", "1",
                                      "--no-plots"])
    assert result.exit_code == 0, result.output
    assert re.search(r"token_budget (64|256)\S*: capacity", result.stderr), result.stderr  # cbsim/cli/progress.py
    assert "warning: tune tiny_tune: a capacity probe simulated only" in result.output
