"""Runs that finish nothing, or are cut short, still say what happened (issue 26, defects 5 and 15): a run
in which every request is rejected (no step at all) writes a summary with the rejections by reason instead
of dividing by a zero total step time; `sim.max_time` counts what it cut, labels the requests that never
arrived and prints a warning (sim/metrics/unfinished.py)."""
import json

import pandas as pd

from factories import TINY_EXPERIMENT, cli, write_experiment

from cbsim.api import run_experiment
from cbsim.core.atomic import is_complete
from cbsim.sim.metrics import rejection_summary
from cbsim.tools.sweep.sweep import run_sweep

TINY = {**TINY_EXPERIMENT, "seed": 1, "cluster": {"kv_cache": {"num_blocks": 2}},  # too small for any request
        "workload": {**TINY_EXPERIMENT["workload"], "prompt_len": {"type": "fixed", "value": 300},
                     "output_len": {"type": "fixed", "value": 10}}}


def test_a_run_rejecting_every_request_writes_its_summary_with_the_reasons(tmp_path):
    result = cli("run", write_experiment(tmp_path, TINY), "--out", tmp_path / "out", "-q")
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["num_rejected"] == 5 and summary["num_finished"] == 0 and summary["num_steps"] == 0
    assert summary["rejected_reasons"] == {"needs 20 KV blocks, the cache has 2 usable": 5}
    assert summary["kv_usage_mean"] is None and summary["mfu_mean"] is None
    assert "needs 20 KV blocks" in result.output and is_complete(tmp_path / "out")


def test_a_sweep_point_rejecting_everything_is_ok_not_failed():
    spec = {"name": "rej", "base": TINY, "grid": {"cluster.kv_cache.num_blocks": [2, 400]}}
    table = run_sweep(spec, workers=1)
    assert list(table["status"]) == ["ok", "ok"]
    assert list(table["num_finished"]) == [0, 5]


def test_reasons_that_differ_only_in_their_numbers_are_counted_together():
    table = pd.DataFrame({"status": ["rejected", "finished", "rejected", "rejected"],
                          "reject_reason": ["needs 20 KV blocks, the cache has 2 usable", "",
                                            "prompt_len + output_len = 5000 exceeds max_model_len = 4096",
                                            "needs 31 KV blocks, the cache has 2 usable"]})
    assert rejection_summary(table) == {"rejected_reasons": {
        "needs 20 KV blocks, the cache has 2 usable": 2,
        "prompt_len + output_len = 5000 exceeds max_model_len = 4096": 1}}
    assert rejection_summary(table[table["status"] == "finished"]) == {}


CUT = {**TINY, "cluster": {"kv_cache": {"num_blocks": 400}},
       "workload": {**TINY["workload"], "num_requests": 30}, "sim": {"max_time": 0.5}}


def test_max_time_counts_what_it_cut_and_labels_requests_that_never_arrived():
    res = run_experiment(CUT)
    cut, table = res.summary["cut_at_max_time"], res.requests
    late = table["arrival"] >= 0.5
    assert cut["not_arrived"] == late.sum() > 0
    assert set(table.loc[late, "status"]) == {"not_arrived"}
    assert "not_arrived" not in set(table.loc[~late, "status"])
    unfinished = ~table["status"].isin(["finished", "rejected", "not_arrived"])
    assert cut["unfinished"] == unfinished.sum() > 0
    assert res.summary["num_finished"] + cut["unfinished"] + cut["not_arrived"] == 30
    assert "cut_at_max_time" not in run_experiment({**CUT, "sim": {"max_time": 1e6}}).summary


def test_max_time_prints_a_warning(tmp_path):
    result = cli("run", write_experiment(tmp_path, CUT), "--out", tmp_path / "out", "-q")
    assert result.exit_code == 0, result.output
    assert "warning: sim.max_time = 0.5 s stopped the run" in result.output
