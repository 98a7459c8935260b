"""preemption.mode auto: per victim, swap when out-and-back-in over the host link (plus the link's
queue) is faster than recomputing its tokens, else recompute; the summary reports recomputed
tokens and swapped bytes in every mode."""
import pytest
import simpy

from cbsim.api import run_experiment
from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.metrics import preemption_frame
from cbsim.sim.metrics.recorder import Recorder
from cbsim.sim.replica import Replica, ReplicaSettings
from cbsim.sim.request import Status
from cbsim.sim.simulation import simulate

from factories import make_requests

LINEAR = {"type": "linear", "base": 0.0, "per_token": 0.001}  # recomputing n tokens: n ms


def tight_run(swap_bandwidth):
    """Two long decoders on a cache that cannot hold both to the end (as in test_replica)."""
    reqs = make_requests([(0, 16, 60), (0, 16, 60)])
    settings = ReplicaSettings(preemption_mode="auto", swap_bandwidth=swap_bandwidth, max_model_len=1000)
    _, pool = simulate(reqs, lambda: make_policy({"name": "orca", "kv_reservation": "paged"}),
                       load_cost_model(LINEAR), lambda: KVCache(8, 16, 0, False, 1024.0), settings)
    assert all(r.status == Status.FINISHED for r in reqs)
    return preemption_frame(pool)


def test_auto_swaps_when_the_host_link_is_fast():
    log = tight_run(swap_bandwidth=1e9)  # 2 x ~64 KiB at 1 GB/s: ~0.1 ms against tens of ms of prefill
    assert len(log) and (log["mode"] == "swap").all() and (log["swapped_bytes"] > 0).all()


def test_auto_recomputes_when_the_host_link_is_slow():
    log = tight_run(swap_bandwidth=1e5)  # the same bytes take about a second each way
    assert len(log) and (log["mode"] == "recompute").all() and (log["recomputed_tokens"] > 0).all()


def test_a_victim_queued_behind_another_swap_recomputes_instead():
    # each victim: 32 computed tokens in 2 blocks of 16 x 1,000 bytes; the link moves 32 kB in 12.5 ms,
    # so swapping alone costs 25 ms < 32 ms of recompute, but behind the first swap-out 37.5 ms > 32 ms
    env = simpy.Environment()
    settings = ReplicaSettings(preemption_mode="auto", swap_bandwidth=32_000 / 0.0125, max_model_len=1000)
    replica = Replica(env, 0, make_policy({"name": "sarathi"}), load_cost_model(LINEAR),
                      KVCache(10, 16, 0, False, 1000.0), Recorder(), settings, lambda: float("inf"))
    first, second = make_requests([(0, 32, 10), (0, 32, 10)])
    for req in (first, second):
        replica.kv.grow(req, 2)
        req.num_computed_tokens, req.status = 32, Status.RUNNING
        replica.state.running.append(req)
        replica.by_id[req.id] = req
    assert replica._preempt(first) == 32_000 and first.status == Status.SWAPPED
    assert replica._preempt(second) == 0.0 and second.status == Status.PREEMPTED
    assert second.num_computed_tokens == 0 and replica.host_link.backlog(0.0) == pytest.approx(0.0125)
    assert [row[3] for row in replica.preemption_log] == ["swap", "recompute"]
    assert replica.preemption_log[1][4] == 32


@pytest.mark.parametrize("mode", ["recompute", "swap", "auto"])
def test_summary_reports_recomputed_tokens_and_swapped_bytes(mode):
    res = run_experiment("experiments/regression/sarathi_kv_recompute.yaml",
                         overrides=[f"preemption.mode={mode}", "preemption.swap_bandwidth_gb_s=3",
                                    "workload.num_requests=200"])
    s, steps, req = res.summary, res.steps, res.requests
    assert s["num_preemptions"] > 0
    computed = steps["prefill_tokens"].sum() + steps["decode_tokens"].sum()
    finished = req[req["status"] == "finished"]
    needed = (finished["prompt_len"] + finished["output_len"] - 1).sum()
    assert s["num_recomputed_tokens"] == computed - needed  # exactly the extra prefill work
    assert s["swapped_bytes"] == pytest.approx(steps["swap_bytes"].sum())  # every swap, out and in
    assert s["num_recompute_preemptions"] + s["num_swap_preemptions"] == s["num_preemptions"]
    if mode == "recompute":
        assert s["swapped_bytes"] == 0
    if mode == "swap":
        assert s["num_recomputed_tokens"] == 0
    if mode == "auto":
        assert s["num_swap_preemptions"] > 0 and s["num_recompute_preemptions"] > 0
