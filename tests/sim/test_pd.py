"""Prefill/decode disaggregation (sim/pd.py): hand-off timing, backpressure, links, pool mode, and
property tests of the invariants over random workloads and tight decode KV caches.

Invariants checked (hypothesis): every request finishes once with exactly output_len tokens (or
is rejected with a reason); its first token comes from a prefill replica and the rest from one
decode replica; at every step of every replica, the blocks in use are exactly those of the
requests (and reservations) located there, and a request is counted on two replicas only while
its KV is moving (from the reservation until the hop that leaves the prefill side ends); transfers on
a link never overlap beyond its lanes; KV is all free at the end; tokens are conserved (computed =
needed + recomputed); and the run never deadlocks.
"""
import math

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from cbsim.api import run_experiment
from cbsim.tools.sweep.capacity import num_gpus
from cbsim.config import load_config
from cbsim.core.errors import ConfigError
from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.kv.link import KVLink
from cbsim.sim.metrics import MetricsConfig, handoff_frame, request_frame, step_frame
from cbsim.sim.pd import PDSettings, PoolParts
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Status

from factories import make_requests, run_pd_cluster


def kv_ledger(replicas, cluster) -> dict[int, dict[int, int]]:
    """replica index -> {request id: blocks} for every block-holding thing located there."""
    ledger = {r.index: {} for r in replicas}
    for r in replicas:
        for req in list(r.waiting) + list(r.running) + [req for _, req in r.landed]:
            if req.num_blocks:
                ledger[r.index][req.id] = req.num_blocks
    for rec in cluster.records.values():
        if math.isnan(rec.released_src) and rec.req.num_blocks:
            ledger[rec.src.index][rec.req.id] = rec.req.num_blocks
        if rec.holder is not None:
            ledger[rec.dst.index][rec.req.id] = rec.holder.num_blocks
    return ledger


def check_kv_places(replicas, cluster) -> None:
    ledger = kv_ledger(replicas, cluster)
    places: dict[int, list[int]] = {}
    for r in replicas:
        assert r.kv.used_blocks == sum(ledger[r.index].values()), f"replica {r.index} leaks blocks"
        for rid in ledger[r.index]:
            places.setdefault(rid, []).append(r.index)
    for rid, where in places.items():
        rec = cluster.records.get(rid)
        moving = rec is not None and rec.holder is not None and math.isnan(rec.released_src)
        assert len(where) == (2 if moving else 1), (rid, where)


def run_pd(specs, *, prefill_policy=None, decode_policy=None, prefill_replicas=1, decode_replicas=1,
           prefill_blocks=1000, decode_blocks=1000, block_size=4, link=None, cost=None, preemption="recompute",
           watermark=0, check=False, fast_forward=True, max_time=None):
    """Simulate a P/D cluster on CPU (unit cost unless `cost`); with `check`, every plan of every
    replica is preceded by check_kv_places; `max_time` ends the simulation there."""
    reqs = make_requests(specs)
    cost_model = load_cost_model(cost or {"type": "unit"})
    settings = ReplicaSettings(preemption_mode=preemption, max_model_len=10_000, swap_bandwidth=1e9,
                               fast_forward=fast_forward)
    default = {"name": "sarathi", "token_budget": 32}
    prefill = PoolParts(prefill_replicas, lambda: make_policy(prefill_policy or default), cost_model,
                        lambda: KVCache(prefill_blocks, block_size, watermark, False, 1.0), settings)
    decode = PoolParts(decode_replicas, lambda: make_policy(decode_policy or default), cost_model,
                       lambda: KVCache(decode_blocks, block_size, watermark, False, 1.0), settings)
    recorder, replicas, cluster = run_pd_cluster(reqs, prefill, decode, link, check_kv_places if check else None,
                                                 max_time=max_time)
    return reqs, recorder, replicas, cluster


# ---------------------------------------------------------------- exact scenarios (unit cost: 1 s per step)


def test_prefill_hands_off_after_its_first_token_and_transfer_time_is_latency_plus_bytes_over_bandwidth():
    reqs, recorder, replicas, cluster = run_pd([(0, 40, 3)])
    (req,) = reqs
    rec = cluster.records[req.id]
    # prompt 40 at 32 tokens per step: two prefill steps on replica 0 end at t=2; the first token is
    # shown once the KV lands on the decode replica (first_token_on: decode, the default)
    assert rec.prefilled == 2.0 and req.first_token_time == 6.5
    hop = rec.hops[0]
    assert (hop.start, hop.end) == (2.0, 2.0 + 0.5 + 40 / 10.0)  # latency + 40 tokens x 1 byte / 10 B/s
    assert rec.landed == 6.5 and rec.released_src == 6.5 and rec.decode_admitted == 6.5
    assert req.status == Status.FINISHED and req.replica == 1 and req.completion_time == 8.5
    steps = step_frame(recorder)
    assert list(steps["replica"]) == [0, 0, 1, 1]
    assert steps.loc[steps.replica == 0, "decode_tokens"].sum() == 0  # the prefill replica never decodes
    assert all(r.kv.free_blocks == r.kv.num_blocks for r in replicas)


def test_first_token_on_decode_adds_the_transfer_to_ttft():
    on_prefill, *_ = run_pd([(0, 40, 3)], link=PDSettings(latency=0.5, bandwidth=10.0, bytes_per_token=1.0,
                                                          first_token_on="prefill"))
    on_decode, *_ = run_pd([(0, 40, 3)])  # the default: every token comes from the decode replica
    assert on_decode[0].first_token_time - on_prefill[0].first_token_time == 4.5
    assert on_decode[0].completion_time == on_prefill[0].completion_time


def test_a_one_token_request_ends_on_the_prefill_replica_without_a_transfer():
    reqs, _, replicas, cluster = run_pd([(0, 20, 1)])
    assert reqs[0].status == Status.FINISHED and reqs[0].replica == 0 and not cluster.records


def test_backpressure_keeps_kv_on_the_prefill_side_until_the_decode_side_has_room():
    # the decode cache (10 blocks of 4) fits one request of 24 + 14 tokens at a time
    reqs, _, replicas, cluster = run_pd([(0, 24, 14), (0, 24, 14)], decode_blocks=10)
    first, second = (cluster.records[r.id] for r in reqs)
    assert first.reserved == first.prefilled  # room at once
    assert second.reserved == reqs[0].completion_time  # room only when the first finished
    assert second.hops[0].submitted == second.reserved  # the transfer starts only after the reservation
    assert second.released_src == second.hops[0].end  # prefill-side KV held until its hop ended
    frame = handoff_frame(cluster.records.values())
    assert frame.set_index("request_id").loc[1, "backpressure_wait"] == second.reserved - second.prefilled > 0
    assert all(r.status == Status.FINISHED for r in reqs)


def test_a_single_lane_link_serves_transfers_one_after_another():
    # two prompts finish in the same prefill step and share the replica's link
    reqs, _, _, cluster = run_pd([(0, 10, 2), (0, 10, 2)])
    a, b = (cluster.records[r.id].hops[0] for r in reqs)
    assert a.start == 1.0 and b.start == a.end and b.queued == a.end - 1.0
    lanes2, _, _, cluster2 = run_pd([(0, 10, 2), (0, 10, 2)],
                                    link=PDSettings(latency=0.5, bandwidth=10.0, lanes=2, bytes_per_token=1.0))
    a, b = (cluster2.records[r.id].hops[0] for r in lanes2)
    assert a.start == b.start == 1.0 and a.lane != b.lane


def test_pool_mode_frees_the_prefill_side_after_the_first_hop_even_without_decode_room():
    link = PDSettings(link_mode="pool", latency=0.5, bandwidth=10.0, pool_bandwidth=20.0, bytes_per_token=1.0)
    reqs, _, _, cluster = run_pd([(0, 24, 14), (0, 24, 14)], decode_blocks=10, link=link)
    second = cluster.records[reqs[1].id]
    to_pool, from_pool = second.hops
    assert (to_pool.kind, from_pool.kind) == ("to_pool", "from_pool")
    assert second.released_src == to_pool.end == second.in_pool  # freed before any decode room existed
    assert second.reserved == reqs[0].completion_time > second.in_pool
    assert from_pool.end - from_pool.start == pytest.approx(0.5 + 24 / 20.0)  # at the pool's bandwidth
    assert from_pool.link.startswith("decode")


def test_kv_link_lanes_and_backlog():
    link = KVLink("x", bandwidth=2.0, latency=1.0, lanes=2)
    first, second, third = (link.submit(0.0, 4.0) for _ in range(3))
    assert (first.start, first.end, second.start, third.start) == (0.0, 3.0, 0.0, 3.0)
    assert link.backlog(1.0) == 2.0 and link.busy_seconds() == 9.0


def test_dec_at_p_counts_decodes_on_the_prefill_replica():
    reqs, recorder, _, _ = run_pd([(0, 8, 20), (1, 200, 3)], prefill_policy={"name": "sarathi", "token_budget": 16})
    steps = step_frame(recorder)
    frame = request_frame(reqs, recorder, steps, MetricsConfig(long_prompt_threshold=100))
    long = frame[frame.prompt_len == 200].iloc[0]
    # the long prompt prefills on replica 0 while the short request decodes on replica 1: 0 there
    assert long["dec_at_p"] == 0 and long["replica"] == 1
    assert steps.loc[steps.step == reqs[1].first_scheduled_step, "replica"].item() == 0


# ---------------------------------------------------------------- property tests


WORKLOADS = st.lists(st.tuples(st.floats(0, 4, allow_nan=False), st.integers(1, 60), st.integers(1, 30)),
                     min_size=1, max_size=14)
DECODE_POLICIES = [{"name": "sarathi", "token_budget": 16}, {"name": "sarathi", "token_budget": 64},
                   {"name": "orca", "kv_reservation": "paged", "max_num_seqs": 3}]
# chunked prefill_first only on the prefill side: under recompute pressure it can thrash forever
# (two recomputes preempting each other while decodes starve), colocated too; a prefill replica
# never preempts (it reserves whole prompts)
PREFILL_POLICIES = st.sampled_from(DECODE_POLICIES + [{"name": "prefill_first", "chunk_size": 24}])
DECODE_POLICIES = st.sampled_from(DECODE_POLICIES)
CLUSTERS = st.fixed_dictionaries({
    "prefill_replicas": st.integers(1, 2), "decode_replicas": st.integers(1, 2),
    "decode_blocks": st.integers(23, 60),  # 23 x 4 tokens fit the largest request (90) plus the watermark
    "prefill_blocks": st.integers(16, 60), "watermark": st.integers(0, 1),
    "preemption": st.sampled_from(["recompute", "swap", "auto"]),
    "cost": st.sampled_from([{"type": "unit"}, {"type": "linear", "base": 0.01, "per_token": 0.001}]),
})


def make_link(mode, lanes, first, router, latency) -> PDSettings:
    return PDSettings(link_mode=mode, latency=latency, bandwidth=40.0, lanes=lanes, pool_bandwidth=25.0,
                      first_token_on=first, decode_router=router, bytes_per_token=1.0)


LINKS = st.builds(
    make_link, st.sampled_from(["p2p", "pool"]), st.integers(1, 2), st.sampled_from(["prefill", "decode"]),
    st.sampled_from(["round_robin", "least_loaded", "prefix_affinity"]), st.sampled_from([0.0, 0.25, 1.0]))


def to_specs(rows):
    t, out = 0.0, []
    for gap, prompt, output in rows:
        t += gap
        out.append((round(t, 3), prompt, output))
    return out


def token_runs_by_request(recorder, requests):
    runs = recorder.run_table()
    steps = recorder.step_table()
    found = {}
    for rid, first, last, tokens in zip(runs["request_id"], runs["first_step"], runs["last_step"], runs["tokens"]):
        found.setdefault(int(rid), []).append((int(steps["replica"][first]), int(tokens), float(steps["end"][first])))
    for req in requests:  # runs still open (none when everything finished)
        assert req.run_tokens == 0
    return found


@pytest.mark.slow
@given(WORKLOADS, PREFILL_POLICIES, DECODE_POLICIES, CLUSTERS, LINKS)
def test_pd_invariants(rows, prefill_policy, decode_policy, cluster, link):
    reqs, recorder, replicas, pd = run_pd(to_specs(rows), prefill_policy=prefill_policy, decode_policy=decode_policy,
                                          link=link, check=True, **cluster)
    num_prefill = cluster["prefill_replicas"]
    runs = token_runs_by_request(recorder, reqs)
    for req in reqs:
        if req.status == Status.REJECTED:
            assert req.reject_reason
            continue
        assert req.status == Status.FINISHED and req.num_output_tokens == req.output_len
        mine = sorted(runs[req.id], key=lambda run: run[2])
        assert sum(tokens for _, tokens, _ in mine) == req.output_len
        assert mine[0][0] < num_prefill and mine[0][1] == 1  # the first token, on a prefill replica
        assert all(replica >= num_prefill for replica, _, _ in mine[1:])  # the rest on the decode side
        assert len({replica for replica, _, _ in mine[1:]}) <= 1
        if req.output_len > 1:
            rec = pd.records[req.id]
            assert rec.prefilled <= rec.reserved <= rec.landed <= req.completion_time
            if link.first_token_on == "decode":
                assert req.first_token_time == rec.landed
    assert all(r.kv.free_blocks == r.kv.num_blocks for r in replicas)
    assert pd.is_idle
    for kv_link in pd.links:
        for lane in range(kv_link.lanes):
            booked = sorted((t.start, t.end) for t in kv_link.log if t.lane == lane)
            assert all(later[0] >= earlier[1] for earlier, later in zip(booked, booked[1:]))
        assert all(t.start >= t.submitted for t in kv_link.log)
    steps = recorder.step_table()
    computed = steps["prefill_tokens"].sum() + steps["decode_tokens"].sum()
    needed = sum(r.prompt_len + r.output_len - 1 for r in reqs if r.status == Status.FINISHED)
    recomputed = sum(row[4] for r in replicas for row in r.preemption_log)
    assert computed == needed + recomputed


# ---------------------------------------------------------------- through the experiment API


PD_EXPERIMENT = {
    "name": "pd-test", "model": "llama-3-8b", "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1},
    "cluster": {"mode": "pd", "kv_cache": {"block_size": 16, "num_blocks": 400},
                "prefill": {"replicas": 2, "policy": {"name": "prefill_first", "token_budget": 4096}},
                "decode": {"replicas": 1, "policy": {"name": "sarathi", "token_budget": 256}, "num_blocks": 300},
                "link": {"latency_s": 0.001, "bandwidth_gb_s": 10}},
    "workload": {"num_requests": 60, "arrival": {"type": "poisson", "rate": 20},
                 "prompt_len": {"type": "uniform", "min": 200, "max": 2000},
                 "output_len": {"type": "uniform", "min": 2, "max": 60}},
    "metrics": {"slo": {"ttft": 0.5, "tpot": 0.05}},
    "output": {"plots": False, "trace": False},
}


def test_run_experiment_reports_pools_transfers_and_per_gpu_goodput():
    res = run_experiment(PD_EXPERIMENT)
    s = res.summary
    assert s["num_finished"] == 60 and s["num_handoffs"] == 60 and s["num_gpus"] == 3
    assert s["prefill_replicas"] == 2 and s["decode_replicas"] == 1
    assert 0 < s["prefill_utilization"] <= 1 and 0 < s["decode_utilization"] <= 1
    assert s["transfer_time_p50"] > 0.001 and s["transfer_time_p99"] >= s["transfer_time_p50"]
    assert s["goodput_per_gpu"] == pytest.approx(s["goodput_requests_per_s"] / 3)
    assert s["kv_transfer_bytes"] == pytest.approx(res.requests["prompt_len"].sum() * 131072)  # 128 KiB/token
    for column in ("prefill_replica", "decode_replica", "backpressure_wait", "transfer_time", "landed"):
        assert column in res.requests
    assert set(res.requests["prefill_replica"]) <= {0, 1} and set(res.requests["decode_replica"]) == {2}
    assert (res.transfers.loc[res.transfers.kind == "p2p", "duration"] > 0.001).all()
    assert res.kv_blocks == {0: 400, 1: 400, 2: 300}


def test_pd_config_is_validated_and_counts_gpus_per_pool():
    cfg = load_config({**PD_EXPERIMENT, "cluster": {**PD_EXPERIMENT["cluster"],
                                                    "decode": {"replicas": 2, "cost_model": {"tp": 2}}}})
    assert num_gpus(cfg) == 2 * 1 + 2 * 2
    with pytest.raises(ConfigError, match="cluster.decode"):
        load_config({**PD_EXPERIMENT, "cluster": {"mode": "pd", "prefill": {"replicas": 1}}})
    with pytest.raises(ConfigError, match="cluster.link.bandwidth_gb_s"):
        load_config({**PD_EXPERIMENT, "cluster": {**PD_EXPERIMENT["cluster"], "link": {"bandwidth_gb_s": 0}}})
    with pytest.raises(ConfigError, match="cluster.prefill.policy.name"):
        load_config({**PD_EXPERIMENT, "cluster": {**PD_EXPERIMENT["cluster"],
                                                  "prefill": {"replicas": 1, "policy": {"name": "static"}}}})


def test_requests_the_decode_pool_could_never_hold_are_rejected_at_arrival():
    reqs, _, _, _ = run_pd([(0, 20, 60), (0, 20, 10)], decode_blocks=15)
    assert reqs[0].status == Status.REJECTED and "decode replica" in reqs[0].reject_reason
    assert reqs[1].status == Status.FINISHED


def test_pd_runs_are_deterministic():
    a, b = run_experiment(PD_EXPERIMENT), run_experiment(PD_EXPERIMENT)
    assert a.requests.equals(b.requests) and a.steps.equals(b.steps)
    assert np.isfinite(a.requests["landed"]).all()


def test_a_whole_prompt_prefill_policy_judges_only_the_prompt():
    # prefill_first without chunks needs prompt + output - 1 <= budget colocated; a prefill replica only the prompt
    reqs, _, _, _ = run_pd([(0, 30, 20)], prefill_policy={"name": "prefill_first", "token_budget": 32})
    assert reqs[0].status == Status.FINISHED


def outcome(reqs, recorder, cluster) -> tuple:
    """Everything a run produced: step rows, token runs, request times, hand-off times and hops."""
    requests = [(r.id, r.status, r.replica, r.first_token_time, r.completion_time, r.num_preemptions,
                 r.first_scheduled) for r in reqs]
    handoffs = [(rid, rec.prefilled, rec.reserved, rec.released_src, rec.in_pool, rec.landed, rec.decode_admitted,
                 rec.cached_on_decode, [(h.link, h.start, h.end, h.nbytes) for h in rec.hops])
                for rid, rec in sorted(cluster.records.items())]
    steps = {name: [None if v != v else v for v in column.tolist()] for name, column in recorder.step_table().items()}
    runs = {name: column.tolist() for name, column in recorder.run_table().items()}
    return requests, handoffs, steps, runs  # (a step still running at max_time ends at NaN: None here, to compare)


# A prefill replica woken at the instant a decode run was planned: its step ends with the run's first one
WOKEN_AT_RUN_START = dict(
    rows=[(0.0, 3, 7), (0.0, 8, 9), (0.0, 1, 9), (1.0, 20, 4), (4.0, 30, 2), (0.0, 29, 1)],
    prefill_policy={"name": "sarathi", "token_budget": 16},
    decode_policy={"name": "orca", "kv_reservation": "paged", "max_num_seqs": 3},
    cluster={"prefill_replicas": 1, "decode_replicas": 1, "decode_blocks": 23, "prefill_blocks": 16, "watermark": 1,
             "preemption": "recompute", "cost": {"type": "unit"}},
    link=make_link("p2p", 1, "prefill", "round_robin", 0.25))


MAX_TIMES = st.one_of(st.none(), st.floats(0.5, 60, allow_nan=False))
# the decode pool's arrival gate reads decode replica 0's state at every arrival (PDCluster.reject_reason)
GATED_DECODE = {"name": "sarathi", "token_budget": 16, "overload": {"enter_queued": 1, "exit_queued": 0}}


@pytest.mark.slow
@given(WORKLOADS, PREFILL_POLICIES, st.one_of(DECODE_POLICIES, st.just(GATED_DECODE)), CLUSTERS, LINKS, MAX_TIMES)
@example(**WOKEN_AT_RUN_START, max_time=None)
def test_pd_fast_forward_changes_nothing(rows, prefill_policy, decode_policy, cluster, link, max_time):
    """Decode replicas advance runs of identical decode steps at once, past other replicas' steps, cut
    where a placement or a landing touches them (and by max_time); the result equals stepping one by one,
    bit for bit (1-2 replicas a pool, p2p and pool links, every decode router, tight decode KV, so that
    reservations block, a decode policy with an arrival gate)."""
    specs = to_specs(rows)
    on = run_pd(specs, prefill_policy=prefill_policy, decode_policy=decode_policy, link=link, max_time=max_time,
                **cluster)
    off = run_pd(specs, prefill_policy=prefill_policy, decode_policy=decode_policy, link=link, fast_forward=False,
                 max_time=max_time, **cluster)
    assert outcome(on[0], on[1], on[3]) == outcome(off[0], off[1], off[3])


def test_a_decode_run_goes_on_through_prefill_chunks_that_hand_nothing_off(monkeypatch):
    """A long prompt's chunks on the prefill replica end steps there; they touch nothing on the decode
    side, so the decode replica's run goes on through them (as stepping: same tables), cut only where a
    hand-off is placed and where its KV lands."""
    from cbsim.policies.sarathi import Sarathi

    plans = []
    schedule = Sarathi.schedule
    monkeypatch.setattr(Sarathi, "schedule", lambda self, state: plans.append(state) or schedule(self, state))
    specs = [(0, 8, 120), (2, 900, 3), (40, 900, 3)]  # two prompts of 29 chunks (budget 32) amid 119 decodes
    found = {}
    for fast in (True, False):
        plans.clear()
        reqs, recorder, replicas, cluster = run_pd(specs, fast_forward=fast)
        decode_state = replicas[1].state
        found[fast] = outcome(reqs, recorder, cluster), sum(1 for state in plans if state is decode_state)
    assert found[True][0] == found[False][0]
    assert found[False][1] > 120
    assert found[True][1] <= 10  # the first run, and two per hand-off (its placement, its landing) and after


def test_decode_replicas_fast_forward_between_hand_offs(monkeypatch):
    from cbsim.policies.sarathi import Sarathi

    plans = []
    schedule = Sarathi.schedule
    monkeypatch.setattr(Sarathi, "schedule", lambda self, state: plans.append(1) or schedule(self, state))
    counts = {}
    for fast in (True, False):
        plans.clear()
        reqs, recorder, _, _ = run_pd([(0, 8, 200), (0, 8, 150), (100, 8, 50)], fast_forward=fast)
        counts[fast] = (len(plans), recorder.num_steps)
    assert counts[True][1] == counts[False][1] > 150  # the same steps...
    assert counts[True][0] < counts[False][0] / 10  # ...planned in far fewer calls
