"""The step table's row order (sim/row_order.py): by replica, then each replica's own order; every step index
renumbered with the rows; the rows themselves unchanged."""
from __future__ import annotations

import numpy as np
import pytest

import cbsim.sim.simulation as simulation_module
from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Request
from cbsim.sim.request_table import RequestTable
from cbsim.sim.simulation import simulate

COST = load_cost_model({"type": "linear", "base": 0.01, "per_token": 0.001})


def requests(n: int = 40) -> list[Request]:
    rng = np.random.default_rng(3)
    arrivals = np.cumsum(rng.exponential(0.05, n))
    return [Request(i, float(t), int(rng.integers(5, 120)), int(rng.integers(2, 60))) for i, t in enumerate(arrivals)]


def run(reqs, router: str = "least_loaded", replicas: int = 3, fast_forward: bool = True, max_time=None):
    settings = ReplicaSettings(max_model_len=400, fast_forward=fast_forward)
    recorder, _ = simulate(reqs, lambda: make_policy({"name": "sarathi", "token_budget": 64, "max_num_seqs": 8}), COST,
                           lambda: KVCache(200, 16, 1, False, 1024.0), settings, replicas=replicas, router=router,
                           max_time=max_time)
    return recorder


@pytest.mark.parametrize("router", ["round_robin", "least_loaded"])
def test_rows_come_by_replica_then_in_each_replicas_order(router):
    table = run(requests(), router).step_table()
    replica, start, end = table["replica"], table["start"], table["end"]
    assert len(set(replica.tolist())) == 3
    assert (np.diff(replica) >= 0).all()
    same = replica[1:] == replica[:-1]
    assert (start[1:][same] >= end[:-1][same]).all()  # a replica's steps one after another


@pytest.mark.parametrize("max_time", [None, 1.5])
def test_the_step_indices_follow_their_rows(max_time):
    """A request's first token is sampled by the step its first_token_step names (its end, its replica),
    and its token runs name steps of its replica: the indices were renumbered with the rows."""
    reqs = requests()
    recorder = run(reqs, "round_robin", max_time=max_time)
    table, runs = recorder.step_table(), recorder.run_table()
    done = [r for r in reqs if r.first_token_step >= 0]
    assert done
    for req in done:
        assert table["end"][req.first_token_step] == req.first_token_time
        assert table["replica"][req.first_token_step] == req.replica
        assert table["replica"][req.first_scheduled_step] == req.replica
    replica_of = {r.id: r.replica for r in reqs}
    for rid, first, last in zip(runs["request_id"], runs["first_step"], runs["last_step"]):
        assert first <= last and table["replica"][first] == table["replica"][last] == replica_of[int(rid)]
    assert (np.diff(runs["first_step"]) >= 0).all()  # the token runs by first step


def test_the_order_moves_rows_and_changes_none(monkeypatch):
    """The rows are those recorded, each replica's in its own order (the recorded table sorted stably by
    replica); a request table and a list of requests are renumbered alike."""
    ordered = run(requests(), "least_loaded").step_table()
    listed = requests()
    table = RequestTable.of(requests())
    run(table, "least_loaded")
    run(listed, "least_loaded")
    for name in ("first_scheduled_step", "first_token_step", "last_token_step"):
        assert table.column(name).tolist() == [getattr(r, name) for r in listed], name
    monkeypatch.setattr(simulation_module, "by_replica", lambda recorder, reqs: None)
    recorded = run(requests(), "least_loaded").step_table()
    assert not np.array_equal(recorded["replica"], ordered["replica"])  # they interleaved as recorded
    order = np.argsort(recorded["replica"], kind="stable")
    for name in ordered:
        assert np.array_equal(recorded[name][order], ordered[name]), name


def test_the_recorder_is_reordered_in_place():
    """Every reference to the recorder (the replicas', a caller's) sees the ordered rows; it still records."""
    settings = ReplicaSettings(max_model_len=400)
    recorder, replicas = simulate(requests(), lambda: make_policy({"name": "sarathi", "token_budget": 64}), COST,
                                  lambda: KVCache(200, 16, 1, False, 1024.0), settings, replicas=3,
                                  router="least_loaded")
    assert all(replica.recorder is recorder for replica in replicas)
    assert (np.diff(recorder.step_table()["replica"]) >= 0).all()
    rows = recorder.num_steps
    recorder.add_step(0, 1e3, 1e3 + 1, 70_000, 1, 0, 1, 1, 0, 0.0)  # a value that widens a narrow column
    recorder.add_step(0, 1e3 + 1, 1e3 + 2, 5, 1, 0, 1, 1, 0, 0.0)  # through the appends bound after widening
    assert recorder.num_steps == rows + 2
    assert recorder.step_column("prefill_tokens")[-2:].tolist() == [70_000, 5]
