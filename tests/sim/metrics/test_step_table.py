"""The step table never held whole (sim/metrics/step_table.py): its columns, its blocks of rows and the
files written from it are the whole frame's, value for value and byte for byte."""
import numpy as np
import pandas as pd
import pytest

from cbsim.api import run_experiment
from cbsim.sim.metrics import densified
from cbsim.sim.metrics import step_table
from cbsim.sim.metrics.step_table import NAMES
from cbsim.sim.outputs import parquet
from cbsim.sim.outputs.trace_export import write_chrome_trace

BASE = {
    "seed": 3, "model": "llama-3-8b", "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1},
    "policy": {"name": "sarathi", "token_budget": 256},
    "workload": {"num_requests": 80, "arrival": {"type": "poisson", "rate": 30.0},
                 "prompt_len": {"type": "uniform", "min": 10, "max": 900},
                 "output_len": {"type": "uniform", "min": 1, "max": 40}},
    "output": {"plots": False},
}
RUNS = {  # one replica (starts made a block at a time), three (the start column made once), P/D, swaps
    "one": {**BASE, "name": "one"},
    "three": {**BASE, "name": "three", "cluster": {"replicas": 3, "router": "least_loaded"}},
    "pd": {**BASE, "name": "pd", "cluster": {"mode": "pd", "prefill": {"replicas": 1}, "decode": {"replicas": 2}}},
    "swap": {**BASE, "name": "swap", "cluster": {"kv_cache": {"num_blocks": 90}}, "preemption": {"mode": "swap"}},
}


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request):
    return run_experiment(RUNS[request.param])


def test_columns_and_blocks_are_the_whole_frames(run, monkeypatch):
    monkeypatch.setattr(step_table, "SCRATCH", 5)  # rows made 5 at a time
    table = run.step_table
    whole = densified(run.steps)
    assert list(whole.columns) == list(NAMES) == table.columns and len(table) == len(whole) > 20
    for name in NAMES:
        column = table[name]
        assert column.dtype == whole[name].dtype, name
        np.testing.assert_array_equal(column.to_numpy(), whole[name].to_numpy(), err_msg=name)
    for lo, hi in ((0, 7), (5, 23), (len(table) - 4, len(table) + 10), (3, 3)):
        pd.testing.assert_frame_equal(table.rows(lo, hi), whole.iloc[lo:hi], check_exact=True)
    assert pd.concat(list(table.blocks(11))).equals(whole)
    assert "mfu" in table and "nope" not in table
    with pytest.raises(KeyError):
        table["nope"]


def test_files_written_from_it_are_the_frames(run, tmp_path, monkeypatch):
    """Parquet by row groups (of 7 here), CSV by blocks (of 5) and the trace's head: the bytes the whole
    frame writes."""
    monkeypatch.setattr(parquet, "ROW_GROUP", 7)
    monkeypatch.setattr(parquet, "CSV_ROWS", 5)
    monkeypatch.setattr(step_table, "SCRATCH", 3)
    parquet.write_parquet(run.step_table, tmp_path / "a.parquet")
    parquet.write_parquet(run.steps, tmp_path / "b.parquet")
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    parquet.write_csv(run.step_table, tmp_path / "a.csv")
    run.steps.to_csv(tmp_path / "b.csv", index=False)
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()
    for limit in (0, 9, 10**6):
        write_chrome_trace(run.step_table, tmp_path / "a.json", limit)
        write_chrome_trace(run.steps, tmp_path / "b.json", limit)
        assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


def test_an_empty_run_writes_the_empty_tables(tmp_path):
    """Every request rejected: no step; the table and the files are the empty frame's."""
    cfg = {**BASE, "name": "empty", "workload": {**BASE["workload"], "prompt_len": {"type": "fixed", "value": 8000},
                                                "output_len": {"type": "fixed", "value": 500}}}
    res = run_experiment(cfg)
    assert len(res.step_table) == 0 and list(res.step_table.rows(0, 5).columns) == list(NAMES)
    parquet.write_csv(res.step_table, tmp_path / "a.csv")
    res.steps.to_csv(tmp_path / "b.csv", index=False)
    assert (tmp_path / "a.csv").read_bytes() == (tmp_path / "b.csv").read_bytes()
    parquet.write_parquet(res.step_table, tmp_path / "a.parquet")
    parquet.write_parquet(res.steps, tmp_path / "b.parquet")
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
