"""Sweeps (grid expansion, validation, table, resume, failures, determinism, backends), the sweep
plots and CLI, and the capacity search on a config whose capacity is known analytically."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import typer
import yaml
from typer.testing import CliRunner

from cbsim.api import run_experiment
from cbsim.tools.sweep.capacity import find_capacities, find_capacity, meets_slo, num_gpus, per_gpu_capacity
from cbsim.config import load_config
from cbsim.core.errors import ConfigError
from cbsim.tools.sweep.sweep import NONDETERMINISTIC, expand_grid, load_sweep, run_sweep, save_table, sweep_points
from cbsim.tools.sweep.plots import knee_index, knob_series, write_sweep_plots
from paths import ROOT

REPO = ROOT

TINY = {
    "name": "tiny",
    "model": "llama-3-8b",
    "cost_model": {"type": "linear", "base": 0.01, "per_token": 1e-4},
    "cluster": {"kv_cache": {"num_blocks": 4000}},
    "policy": {"name": "sarathi", "token_budget": 64},
    "workload": {"num_requests": 30, "arrival": {"type": "poisson", "rate": 20.0},
                 "prompt_len": {"type": "uniform", "min": 16, "max": 200},
                 "output_len": {"type": "uniform", "min": 4, "max": 20}},
    "metrics": {"long_prompt_threshold": 128},
    "output": {"dir": "should-not-be-written", "plots": False, "trace": False},
}
GRID = {"policy.name": ["sarathi", "splitfuse"], "policy.token_budget": [32, 128]}


def write_sweep(folder: Path, **changes) -> Path:
    """tiny.yaml and sweep.yaml (2 x 2 grid x 2 seeds unless changed) in `folder`."""
    (folder / "tiny.yaml").write_text(yaml.safe_dump(TINY))
    spec = {"name": "tiny_sweep", "base": "tiny.yaml", "set": {"workload.num_requests": 30}, "grid": GRID,
            "seeds": [0, 1], **changes}
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def deterministic(table: pd.DataFrame) -> pd.DataFrame:
    return table.drop(columns=list(NONDETERMINISTIC))


# ------------------------------------------------------------------------------- grid and spec


def test_expand_grid_is_the_product_in_key_order_and_lists_concatenate():
    assert expand_grid({"a": [1, 2], "b": ["x", "y"]}) == [
        {"a": 1, "b": "x"}, {"a": 1, "b": "y"}, {"a": 2, "b": "x"}, {"a": 2, "b": "y"}]
    assert expand_grid([{"a": [1]}, {"b": [3, 4], "c": [None]}]) == [{"a": 1}, {"b": 3, "c": None}, {"b": 4, "c": None}]


def test_points_resolve_base_relative_to_the_sweep_file_and_ids_follow_the_config(tmp_path):
    path = write_sweep(tmp_path)
    spec = load_sweep(path)
    assert spec.base == str((tmp_path / "tiny.yaml").resolve())
    points = sweep_points(spec)
    assert [(p.params["policy.name"], p.params["policy.token_budget"], p.seed) for p in points][:3] == [
        ("sarathi", 32, 0), ("sarathi", 32, 1), ("sarathi", 128, 0)]
    assert len({p.id for p in points}) == 8
    assert all(p.config.output.dir is None for p in points)
    # Only what decides results enters the id: the same sweep gives the same ids, an edited base new ones.
    assert [p.id for p in sweep_points(load_sweep(path))] == [p.id for p in points]
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump({**TINY, "cost_model": {"type": "linear", "base": 0.02}}))
    assert not {p.id for p in sweep_points(load_sweep(path))} & {p.id for p in points}


@pytest.mark.parametrize("changes, key, expected", [
    ({"grid": {"policy.token_budgett": [64]}}, "grid.policy.token_budgett", "one of the keys"),
    ({"grid": {"workload.arival.rate": [1.0]}}, "grid.workload.arival.rate", "at workload.arival"),
    ({"grid": {"policy.token_budget": [0]}}, "grid.policy.token_budget", ">= 1"),
    ({"grid": {"policy.token_budget": [64, 64]}}, "grid.policy.token_budget", "distinct values"),
    ({"grid": {"policy.token_budget": []}}, "grid.policy.token_budget", "non-empty list"),
    ({"grid": {"seed": [1, 2]}}, "grid.seed", "seeds:"),
    ({"grid": []}, "grid", "non-empty list"),
    ({"grid": [{"policy.name": ["orca"]}, "oops"]}, "grid[1]", "non-empty mapping"),
    ({"set": {"policy.token_budget": 64}}, "set.policy.token_budget", "not also in the grid"),
    ({"set": {"workload.num_requests": -3}}, "set.workload.num_requests", ">= 1"),
    ({"seeds": [1, 1]}, "seeds", "distinct"),
    ({"base": "missing.yaml"}, "base", "existing experiment"),
    ({"plot": {"x": "policy.max_num_seqs"}}, "plot.x", "grid keys"),
    ({"grdi": {}}, "grdi", "one of the keys"),
])
def test_invalid_sweeps_fail_before_anything_runs_naming_the_file_and_key(tmp_path, changes, key, expected):
    path = write_sweep(tmp_path, **changes)
    with pytest.raises(ConfigError) as info:
        run_sweep(path, out_dir=tmp_path / "out", workers=1)
    assert info.value.file == str(path)
    assert info.value.path == key
    assert expected in str(info.value)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ running sweeps


def test_two_by_two_by_two_sweep_gives_one_tidy_row_per_point_and_seed(tmp_path):
    table = run_sweep(write_sweep(tmp_path), out_dir=tmp_path / "out", workers=1)
    assert len(table) == 8
    assert list(table.columns[:3]) == ["policy.name", "policy.token_budget", "seed"]
    assert list(table.columns[-3:]) == ["status", "error", "point_id"]
    summary = run_experiment(TINY | {"seed": 1, "output": {"dir": None}},
                             overrides=["policy.name=splitfuse", "policy.token_budget=128"]).summary
    assert set(summary) <= set(table.columns)
    assert (table["status"] == "ok").all() and table["error"].isna().all()
    row = table[(table["policy.name"] == "splitfuse") & (table["policy.token_budget"] == 128) & (table["seed"] == 1)]
    assert row["itl_p99"].item() == summary["itl_p99"] and row["num_steps"].item() == summary["num_steps"]
    assert table.groupby(["policy.name", "policy.token_budget"]).size().tolist() == [2, 2, 2, 2]
    stored = pd.read_parquet(tmp_path / "out" / "results.parquet")
    pd.testing.assert_frame_equal(stored, table, check_dtype=False, check_exact=True)
    assert len(pd.read_csv(tmp_path / "out" / "results.csv")) == 8
    assert len(list((tmp_path / "out" / "points").glob("*.json"))) == 8
    assert not (tmp_path / "should-not-be-written").exists()


def test_rerun_after_deleting_points_recomputes_only_those(tmp_path):
    path, out = write_sweep(tmp_path), tmp_path / "out"
    first = run_sweep(path, out_dir=out, workers=1)
    files = sorted((out / "points").glob("*.json"))
    deleted, kept = files[:3], files[3:]
    for file in deleted:
        file.unlink()
    mtimes = {f: f.stat().st_mtime_ns for f in kept}
    computed = []
    again = run_sweep(path, out_dir=out, workers=1, on_point=lambda record, done, total: computed.append(record))
    assert sorted(r["point_id"] for r in computed) == sorted(f.stem for f in deleted)
    assert {f: f.stat().st_mtime_ns for f in kept} == mtimes
    pd.testing.assert_frame_equal(deterministic(again), deterministic(first), check_exact=True)


def test_a_killed_sweep_resumes_where_it_stopped(tmp_path):
    path, out = write_sweep(tmp_path), tmp_path / "out"

    def die_after_three(record, done, total):
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_sweep(path, out_dir=out, workers=1, on_point=die_after_three)
    assert len(list((out / "points").glob("*.json"))) == 3
    assert not list((out / "points").glob(".*"))  # no temporary file left behind
    computed, started = [], []
    table = run_sweep(path, out_dir=out, workers=1, on_start=lambda done, total: started.append((done, total)),
                      on_point=lambda record, done, total: computed.append(done))
    assert started == [(3, 8)] and computed == [4, 5, 6, 7, 8]
    assert (table["status"] == "ok").all()


def test_a_failing_point_is_recorded_and_the_others_run(tmp_path):
    trace = tmp_path / "tiny_trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:00:{i:02d}.0000000,{40 + 7 * i},{3 + i % 5}\n" for i in range(20)))
    base = {k: v for k, v in TINY.items() if k != "workload"} | {"workload": {"trace": {"format": "azure",
                                                                                        "path": "tiny_trace.csv"}}}
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(base))
    spec = {"base": "tiny.yaml", "grid": {"workload.trace.path": ["tiny_trace.csv", "missing.csv"],
                                          "policy.token_budget": [32, 64]}}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    table = run_sweep(path, out_dir=tmp_path / "out", workers=2)
    assert table["status"].tolist() == ["ok", "ok", "failed", "failed"]
    assert table["error"].iloc[2].startswith("ConfigError") and "missing.csv" in table["error"].iloc[2]
    assert table["num_requests"].tolist()[:2] == [20, 20] and table["ttft_p50"].iloc[2:].isna().all()
    record = json.loads((tmp_path / "out" / "points" / f"{table['point_id'].iloc[3]}.json").read_text())
    assert record["status"] == "failed" and record["summary"] == {}
    # A rerun keeps failed points unless asked to retry them.
    counts = []
    run_sweep(path, out_dir=tmp_path / "out", workers=1, on_point=lambda *a: counts.append(1))
    assert counts == []
    run_sweep(path, out_dir=tmp_path / "out", workers=1, retry_failed=True, on_point=lambda *a: counts.append(1))
    assert len(counts) == 2


def test_results_do_not_depend_on_the_worker_count(tmp_path):
    path = write_sweep(tmp_path)
    one = run_sweep(path, workers=1)
    two = run_sweep(path, workers=2)
    pd.testing.assert_frame_equal(deterministic(one), deterministic(two), check_exact=True)


def test_ray_backend_matches_local(tmp_path):
    pytest.importorskip("ray")
    path = write_sweep(tmp_path, grid={"policy.token_budget": [32, 128]}, seeds=[0])
    local = run_sweep(path, workers=1)
    remote = run_sweep(path, out_dir=tmp_path / "out", workers=2, backend="ray")
    pd.testing.assert_frame_equal(deterministic(local), deterministic(remote), check_exact=True)
    assert len(list((tmp_path / "out" / "points").glob("*.json"))) == 2


def test_inline_spec_with_a_list_of_grids_and_mixed_columns(tmp_path):
    spec = {"name": "chunks", "base": TINY, "seeds": [3], "grid": [
        {"policy.name": ["sarathi"], "policy.token_budget": [32, 128]},
        {"policy.name": ["prefill_first"], "policy.token_budget": [None], "policy.chunk_size": [32, 128]}]}
    table = run_sweep(spec, out_dir=tmp_path, workers=1)
    assert table["policy.chunk_size"].isna().tolist() == [True, True, False, False]
    assert str(table["policy.token_budget"].dtype) == "Int64"
    assert knob_series(table, ["policy.chunk_size", "policy.token_budget"]).tolist() == [32, 128, 32, 128]
    assert (table["dec_at_p_mean"].iloc[2:] == 0).all()  # prefill_first never decodes during a prefill
    assert (table["seed"] == 3).all()
    mixed = pd.DataFrame({"k": [1, "auto", None], "seed": [0, 0, 0]})
    save_table(mixed, tmp_path / "mixed")
    stored = pd.read_parquet(tmp_path / "mixed" / "results.parquet")["k"].tolist()
    assert stored[:2] == ["1", "auto"] and pd.isna(stored[2])


def test_shipped_sweep_files_are_valid():
    files = sorted((REPO / "experiments" / "sweeps").glob("*.yaml"))
    assert files
    for file in files:
        spec = load_sweep(file)
        assert sweep_points(spec), file
        assert set(spec.plot.metrics) <= set(run_experiment(TINY | {"output": {"dir": None}}).summary)


# ---------------------------------------------------------------------------------- plots, CLI


def test_knee_is_the_point_farthest_from_the_chord():
    assert knee_index([0, 1, 2, 3, 4], [0, 0.1, 0.2, 0.5, 4.0]) == 3
    assert knee_index([0, 1, 2, 3], [0, 1, 2, 3]) is None  # a straight line has no knee
    assert knee_index([1, 2], [1, 5]) is None


def test_sweep_plots_are_written(tmp_path):
    table = run_sweep(write_sweep(tmp_path), workers=1)
    paths = write_sweep_plots(table, tmp_path / "plots", "policy.token_budget", ["ttft_p50", "itl_p99"], title="t")
    assert [p.name for p in paths] == ["metrics_vs_knob.png", "paired_ratios.png", "itl_vs_throughput.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)


def cli_app() -> typer.Typer:
    from cbsim.cli import sweep as sweep_cli

    app = typer.Typer()
    sweep_cli.register(app)
    return app


def test_sweep_and_capacity_commands(tmp_path):
    runner = CliRunner()
    path = write_sweep(tmp_path, grid={"policy.token_budget": [32, 128]}, seeds=[0])
    result = runner.invoke(cli_app(), ["sweep", str(path), "--out", str(tmp_path / "out"), "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert "2 runs, 0 failed" in result.output
    assert (tmp_path / "out" / "metrics_vs_knob.png").is_file() and (tmp_path / "out" / "results.csv").is_file()
    bad = runner.invoke(cli_app(), ["sweep", str(write_sweep(tmp_path, grid={"policy.nope": [1]}))])
    assert bad.exit_code == 2 and "grid.policy.nope" in bad.output
    experiment = tmp_path / "capacity.yaml"
    experiment.write_text(yaml.safe_dump(CAPACITY))
    result = runner.invoke(cli_app(), ["capacity", str(experiment), "--slo", "queue_delay_p50=0.05", "--policy",
                                       "static", "--policy", "{name: static, max_num_seqs: 2}", "--tol", "0.02",
                                       "--out", str(tmp_path / "probes.csv")])
    assert result.exit_code == 0, result.output
    assert "static  " in result.output and "{max_num_seqs: 2, name: static}" in result.output
    assert set(pd.read_csv(tmp_path / "probes.csv")["policy"]) == {"static", "{max_num_seqs: 2, name: static}"}
    bad = runner.invoke(cli_app(), ["capacity", str(experiment), "--slo", "itl_p99"])
    assert bad.exit_code == 2 and "--slo" in bad.output


# ------------------------------------------------------------------------------------ capacity

# One request at a time (static, batch 1), 10 output tokens, 0.01 s per step: service takes 0.1 s,
# so requests queue as soon as the constant arrival rate exceeds 10/s. Above that, request n waits
# n (0.1 - 1/rate); the median of 40 requests stays under 0.05 s up to about 10.26/s.
CAPACITY = {
    "model": "llama-3-8b", "cost_model": {"type": "unit", "seconds": 0.01},
    "cluster": {"kv_cache": {"num_blocks": 4000}}, "policy": {"name": "static", "max_num_seqs": 1},
    "workload": {"num_requests": 40, "arrival": {"type": "constant", "rate": 4.0},
                 "prompt_len": {"type": "fixed", "value": 32}, "output_len": {"type": "fixed", "value": 10}},
    "output": {"plots": False, "trace": False},
}
SLO = {"queue_delay_p50": 0.05}


def summary_at(rate: float) -> dict:
    return run_experiment(CAPACITY, overrides=[f"workload.arrival.rate={rate!r}"]).summary


def test_capacity_bisection_finds_the_known_bracket_and_is_tight():
    result = find_capacity(CAPACITY, SLO, rel_tol=0.01)
    assert 10.0 <= result.rate <= 10.5
    assert result.fail_rate <= result.rate * 1.01
    assert meets_slo(summary_at(result.rate), SLO)
    assert not meets_slo(summary_at(result.rate * 1.01), SLO)
    probes = result.points
    assert probes["rate"].iloc[0] == 4.0 and probes["probe"].tolist() == list(range(len(probes)))
    assert probes.loc[probes["rate"] == result.rate, "meets"].item()
    assert result.rate_per_gpu == result.rate


def test_capacity_brackets_downward_and_respects_hi():
    down = find_capacity(CAPACITY, SLO, lo=40.0, rel_tol=0.05)
    assert down.points["rate"].tolist()[:3] == [40.0, 20.0, 10.0]
    assert 10.0 <= down.rate < down.fail_rate <= down.rate * 1.05
    assert 10.25 < down.fail_rate  # 10.25/s still meets it: median wait about 20 x (0.1 - 1/10.25) = 0.049 s
    capped = find_capacity(CAPACITY, SLO, lo=2.0, hi=8.0)
    assert capped.rate == 8.0 and capped.fail_rate is None and len(capped.points) == 2
    never = find_capacity(CAPACITY, {"ttft_p50": 1e-9}, lo=1.0, max_expansions=2)  # no prefill is that fast
    assert never.rate is None and never.fail_rate == 0.25


def test_capacity_per_policy_seeds_and_gpus():
    results = find_capacities(CAPACITY, SLO, ["static", {"name": "static", "max_num_seqs": 2}], rel_tol=0.05,
                              seeds=(0, 1))
    single, double = results["static"], results["{max_num_seqs: 2, name: static}"]
    assert double.rate > 1.5 * single.rate  # two requests share each step
    assert set(single.points["seed"]) == {0, 1}
    cfg = load_config(CAPACITY | {"cluster": {"replicas": 3, "tp": 2, "kv_cache": {"num_blocks": 4000}}})
    assert num_gpus(cfg) == 6
    assert per_gpu_capacity(single, cfg.to_dict()) == pytest.approx(single.rate / 6)
    with pytest.raises(ConfigError, match="slo.itl_p98"):
        find_capacity(CAPACITY, {"itl_p98": 0.1})


def test_capacity_does_not_count_rates_where_requests_are_rejected():
    # Prompts of 8 to 40 tokens plus 10 output tokens, at most 40 in all: the longer ones are rejected.
    rejecting = ["cluster.max_model_len=40", "workload.prompt_len={type: uniform, min: 8, max: 40}"]
    result = find_capacity(CAPACITY, SLO, overrides=rejecting, max_expansions=2)
    assert result.rate is None
    assert result.points["queue_delay_p50"].notna().all() and (result.points["finished_fraction"] < 0.9).all()
    assert find_capacity(CAPACITY, SLO, overrides=rejecting, min_finished=0.0, lo=1.0, hi=2.0).rate == 2.0


def test_meets_slo_treats_undefined_metrics_and_unfinished_requests_as_violations():
    assert meets_slo({"a": 0.1, "b": 2}, {"a": 0.1, "b": 2.0})
    assert meets_slo({"a": 0.1, "num_requests": 100, "num_finished": 99}, {"a": 0.1}, min_finished=0.99)
    assert not meets_slo({"a": 0.1, "num_requests": 100, "num_finished": 98}, {"a": 0.1}, min_finished=0.99)
    assert not meets_slo({"a": None}, {"a": 1.0})
    assert not meets_slo({"a": float(np.nan)}, {"a": 1.0})
    assert not meets_slo({}, {"a": 1.0})


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads child processes from /proc")
def test_a_killed_sweep_leaves_no_worker_running(tmp_path):
    """kill -9 of the parent: its pool workers exit too (issue 14: tie the workers to the parent)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "sweep.py"
    script.write_text(
        "from cbsim.tools.sweep.sweep import run_sweep\n"
        "base = {'name': 'k', 'model': 'tiny', 'cost_model': {'type': 'unit'}, 'policy': {'name': 'sarathi'},\n"
        "        'cluster': {'kv_cache': {'num_blocks': 2000}}, 'output': {'plots': False},\n"
        "        'workload': {'num_requests': 20000, 'arrival': {'type': 'poisson', 'rate': 50.0},\n"
        "                     'prompt_len': {'type': 'fixed', 'value': 64}, 'output_len': {'type': 'fixed', 'value': 64}}}\n"
        "spec = {'base': base, 'grid': {'policy.max_num_seqs': [8, 16, 32, 64]}, 'seeds': [0, 1]}\n"
        f"run_sweep(spec, out_dir={str(tmp_path / 'out')!r}, workers=2)\n")
    proc = subprocess.Popen([sys.executable, str(script)], cwd=ROOT)

    def children() -> list[int]:
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == proc.pid:
                    found.append(int(entry.name))
        return found

    deadline = time.time() + 60
    while len(children()) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    workers = children()
    assert len(workers) >= 2, "the sweep did not start its workers"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in workers) and time.time() < deadline:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)
