"""Requests as columns (sim/request_table.py) change nothing: random workloads through every policy, as a
list of Request objects and as a RequestTable, give the same step table, the same token runs, the same
requests field for field and the same metrics; also when max_time cuts the run (live requests left) and
in a P/D cluster."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.metrics import MetricsConfig, itl_distribution, request_frame, step_frame, summarize
from cbsim.sim.pd import PDSettings, PoolParts, simulate_pd
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Request, Status
from cbsim.sim import request_table
from cbsim.sim.request_table import RequestTable
from cbsim.sim.simulation import simulate
from cbsim.workloads import parse_workload
from factories import assert_same_run

POLICIES = {
    "static": {"name": "static", "max_num_seqs": 6},
    "orca": {"name": "orca", "max_num_seqs": 8},
    "prefill_first": {"name": "prefill_first", "max_num_seqs": 8},
    "sarathi": {"name": "sarathi", "token_budget": 64, "max_num_seqs": 8},
    "splitfuse": {"name": "splitfuse", "token_budget": 64, "max_num_seqs": 8},
    "sglang": {"name": "sglang", "max_num_seqs": 8},
    "chunked_only": {"name": "chunked_only", "token_budget": 64, "max_num_seqs": 8},
}
COST = load_cost_model({"type": "vidur", "gpu": "a100", "model": "llama-2-7b", "tp": 1, "engine": "none"})
# (arrival gap, prompt, output, priority): bursts and pauses; enough requests that the table retires some,
# and some longer than max_model_len (400) in all, which are rejected with a reason
WORKLOADS = st.lists(st.tuples(st.sampled_from([0.0, 0.0, 0.01, 0.2, 1.0]), st.integers(1, 330), st.integers(1, 120),
                               st.integers(0, 2)), min_size=1, max_size=90)


def requests_of(specs) -> list[Request]:
    requests, t = [], 0.0
    for i, (gap, prompt, output, priority) in enumerate(specs):
        t += gap
        requests.append(Request(i, t, prompt, output, priority=priority))
    return requests


def run(requests, policy: str, num_blocks: int, mode: str, max_time: float | None, replicas: int):
    settings_ = ReplicaSettings(max_model_len=400, swap_bandwidth=1e9, preemption_mode=mode)
    recorder, _ = simulate(requests, lambda: make_policy(POLICIES[policy]), COST,
                           lambda: KVCache(num_blocks, 16, 1, False, 1024.0), settings_, replicas=replicas,
                           router="least_loaded", max_time=max_time)
    return recorder


def assert_same_metrics(listed, table, recorder) -> None:
    steps = step_frame(recorder)
    one, other = (request_frame(r, recorder, steps, MetricsConfig()) for r in (listed, table))
    pd.testing.assert_frame_equal(one, other)
    itl_one, itl_other = (itl_distribution(recorder, r, steps) for r in (listed, table))
    assert np.array_equal(itl_one.values, itl_other.values) and np.array_equal(itl_one.weights, itl_other.weights)
    assert summarize(one, steps, recorder, MetricsConfig(), itl=itl_one) == \
        summarize(other, steps, recorder, MetricsConfig(), itl=itl_other)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(sorted(POLICIES)), WORKLOADS, st.integers(26, 200), st.sampled_from(["recompute", "swap"]),
       st.sampled_from([None, 3.0]), st.sampled_from([1, 2]), st.sampled_from([1, 64]))
def test_a_table_runs_exactly_as_a_list(policy, specs, num_blocks, mode, max_time, replicas, sweep_min):
    listed = requests_of(specs)
    recorder = run(listed, policy, num_blocks, mode, max_time, replicas)
    with pytest.MonkeyPatch.context() as patch:  # 1: a sweep at every arrival and step, so requests retire mid-run
        patch.setattr(request_table, "SWEEP_MIN", sweep_min)
        table = RequestTable.of(requests_of(specs))
        table_recorder = run(table, policy, num_blocks, mode, max_time, replicas)
    assert_same_run((listed, recorder), (list(table), table_recorder))
    assert [asdict(r) for r in listed] == [asdict(r) for r in table], "a field differs"
    assert_same_metrics(listed, table, table_recorder)
    assert table.done_count() == sum(r.status >= Status.FINISHED for r in listed)


@pytest.mark.parametrize("gap", [0.5, 0.0002])
def test_finished_requests_leave_the_live_set(gap, monkeypatch):
    """The memory claim itself: finished requests do not stay objects, with arrivals spread out and in a
    burst that arrives before the first finishes (then the replica's steps sweep)."""
    most = [0]
    sweep = RequestTable.retire_done

    def watched(self, force=False):
        sweep(self, force)
        if not force:
            most[0] = max(most[0], sum(r.status >= Status.FINISHED for r in self._live.values()))

    monkeypatch.setattr(RequestTable, "retire_done", watched)
    table = RequestTable.of(requests_of([(gap, 100, 20, 0)] * 2000))
    run(table, "sarathi", 200, "recompute", None, 1)
    assert all(r.status == Status.FINISHED for r in table) and not table._live
    assert most[0] < 200, most[0]  # finished but not yet folded in: a tenth of the requests at most


def test_pd_cluster_with_a_table():
    specs = [(0.05, 150, 30, 0)] * 60 + [(0.0, 20, 5, 0)] * 20
    results = []
    for requests in (requests_of(specs), RequestTable.of(requests_of(specs))):
        settings_ = ReplicaSettings(max_model_len=400, swap_bandwidth=1e9)
        parts = [PoolParts(1, lambda: make_policy(POLICIES["sarathi"]), COST,
                           lambda: KVCache(120, 16, 1, False, 1024.0), settings_) for _ in range(2)]
        recorder, _, _ = simulate_pd(requests, parts[0], parts[1], PDSettings())
        results.append((requests, recorder))
    assert_same_run((results[0][0], results[0][1]), (list(results[1][0]), results[1][1]))
    assert_same_metrics(results[0][0], results[1][0], results[1][1])


@settings(max_examples=30, deadline=None)
@given(WORKLOADS, st.lists(st.floats(0.0, 2.0), min_size=90, max_size=90))
def test_rows_in_id_order_arrive_in_arrival_order(specs, delays):
    """Rows stay in id order and arrive as a stable sort by arrival would order a list, also after the
    front end has moved every arrival (api.client_frontend)."""
    listed = requests_of(specs)
    table = RequestTable.of(requests_of(specs))
    moved = np.array(delays[:len(listed)])
    sent = table.shift_arrivals(moved)
    for req, delay in zip(listed, moved.tolist()):
        req.arrival += delay
    assert np.array_equal(sent, [a for a, *_ in np.cumsum([[g] for g, *_ in specs], axis=0)])
    in_order = sorted(listed, key=lambda r: r.arrival)
    run(in_order, "sarathi", 80, "recompute", None, 1)
    run(table, "sarathi", 80, "recompute", None, 1)
    assert [asdict(r) for r in listed] == [asdict(r) for r in table]


@pytest.mark.parametrize("name", ["quickstart", "regression/sarathi_kv_swap", "regression/sarathi_kv_recompute",
                                  "pd_vs_colocated", "pipeline_parallel"])
def test_an_experiment_gives_the_same_tables_from_a_table(name, monkeypatch):
    """run_experiment builds plain workloads as tables: the same requests, steps and summary as from a list."""
    import cbsim.api as api
    from cbsim.workloads import build as workload_build

    overrides = ["workload.num_requests=150", "output.plots=false"]
    cfg = api.load_config(f"experiments/{name}.yaml", overrides)
    workload = workload_build.build_run(parse_workload(cfg.workload, "workload"), np.random.default_rng(cfg.seed),
                                        Path("experiments"), as_table=True)
    assert isinstance(workload.requests, RequestTable)
    table_run = api.run_experiment(f"experiments/{name}.yaml", overrides=overrides)
    build = workload_build.build_run
    monkeypatch.setattr(api, "build_run", lambda *args, as_table=False, **kw: build(*args, **kw))
    list_run = api.run_experiment(f"experiments/{name}.yaml", overrides=overrides)
    pd.testing.assert_frame_equal(table_run.requests, list_run.requests)
    pd.testing.assert_frame_equal(table_run.steps, list_run.steps)
    table_run.summary.pop("sim_wall_seconds"), list_run.summary.pop("sim_wall_seconds")
    assert table_run.summary == list_run.summary
    table_run.requests.loc[0, ["arrival", "prompt_len", "replica"]] = [1.0, 7, 0]  # a user may edit the frame


def test_what_a_table_refuses():
    with pytest.raises(ValueError, match="text-only"):
        RequestTable.of([Request(0, 0.0, 10, 5, tenant="a")])
    with pytest.raises(ValueError, match="one value per request"):
        RequestTable([0.0, 1.0], [10], [5, 5])
