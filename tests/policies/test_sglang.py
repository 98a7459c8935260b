"""The sglang policy: waiting-queue orders, guardrails, the prefill adder, dedupe, edf rejections."""
from collections import deque
from pathlib import Path

import pytest

from cbsim.core.errors import ConfigError
from cbsim.policies import make_policy
from cbsim.policies.batch import BatchBuilder
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.request import Request, Status
from cbsim.sim.state import SchedulerState
from cbsim.workloads.prefixes import content_id, hash_chain

from test_prefix import chain, chain_requests, run_config, run_prefix
from paths import ROOT



def ordered(config: dict, waiting, running=(), kv=None, now=0.0):
    """The order `sglang` with `config` gives `waiting` (ids)."""
    policy = make_policy({"name": "sglang", **config})
    state = SchedulerState(kv=kv or KVCache(1000, 16, prefix_caching=True), max_model_len=100_000, now=now,
                           waiting=deque(waiting), running=list(running))
    return [r.id for r in policy.order(state, BatchBuilder(state, None, 256))]


def cached(kv: KVCache, owner: int, blocks: int) -> None:
    """Put `blocks` blocks of shared prompt `owner` in the cache, unreferenced."""
    req = Request(-1 - owner, 0.0, blocks * 16, 1, prefix_hashes=chain(owner, blocks))
    kv.grow(req, blocks)
    kv.publish(req, blocks * 16)
    kv.release(req)


def plain(specs):
    return [Request(i, a, p, o, priority=pr) for i, (a, p, o, pr) in enumerate(specs)]


# ---------------------------------------------------------------- orders


def test_lpm_orders_by_cached_prefix_and_falls_back_to_fcfs():
    kv = KVCache(1000, 16, prefix_caching=True)
    cached(kv, 1, 2)
    cached(kv, 2, 6)
    reqs = chain_requests([(0, 9, 4, 5, 1), (0, 1, 4, 5, 1), (0, 2, 8, 5, 1), (0, 1, 2, 5, 1)])
    assert ordered({"schedule_policy": "lpm"}, reqs, kv=kv) == [2, 1, 3, 0]  # 96, 32, 32 (queue order), 0
    assert ordered({"schedule_policy": "lpm", "lpm_fallback_queue_len": 3}, reqs, kv=kv) == [0, 1, 2, 3]
    assert ordered({"schedule_policy": "lpm"}, reqs, kv=KVCache(1000, 16)) == [0, 1, 2, 3]  # no cache: fcfs


def test_dfs_weight_visits_heavier_subtrees_first():
    kv = KVCache(1000, 16, prefix_caching=True)
    p = chain(1, 3)  # cached: root -> p0 -> p1 -> p2, and root -> p0 -> q1
    q = p[:1] + hash_chain([content_id(2, 77, 1)], parent=p[0])
    for i, hashes in enumerate((p, q)):
        holder = Request(-1 - i, 0.0, len(hashes) * 16, 1, prefix_hashes=hashes)
        kv.grow(holder, len(hashes))
        kv.publish(holder, holder.prompt_len)
        kv.release(holder)

    def req(i, hashes):  # the cached path, then one private block
        own = hash_chain([content_id(2, i, 0)], parent=hashes[-1])
        return Request(i, 0.0, len(hashes) * 16 + 20, 1, prefix_hashes=hashes + own)

    r1, r2, r3, r4, r5 = req(1, q), req(2, p), req(3, p), req(4, chain(7, 2)), req(5, p[:1])
    # weights: p0 4, p1 and p2 2, q1 1: p-branch (2, 3), then q1 (1), then p0's own (5), root's own (4)
    assert ordered({"schedule_policy": "dfs_weight"}, [r1, r2, r3, r4, r5], kv=kv) == [2, 3, 1, 5, 4]


def test_cache_agnostic_orders():
    reqs = plain([(0, 10, 5, 0), (1, 10, 50, 2), (2, 10, 20, 1), (3, 10, 50, 1)])
    assert ordered({"schedule_policy": "fcfs"}, reqs) == [0, 1, 2, 3]
    assert ordered({"schedule_policy": "lof"}, reqs) == [1, 3, 2, 0]
    assert ordered({"schedule_policy": "priority"}, reqs) == [1, 2, 3, 0]
    shuffled = ordered({"schedule_policy": "random", "seed": 1}, reqs)
    assert sorted(shuffled) == [0, 1, 2, 3] and shuffled == ordered({"schedule_policy": "random", "seed": 1}, reqs)
    assert len({tuple(ordered({"schedule_policy": "random", "seed": s}, reqs)) for s in range(8)}) > 1
    assert ordered({"schedule_policy": "sjf"}, reqs) == [0, 2, 1, 3]  # 10 + 5 < 10 + 20 < 10 + 50 (ties: queue)


def test_sjf_predictor_errors_are_seeded_per_request():
    reqs = plain([(0, 10, 100, 0), (0, 10, 110, 0), (0, 10, 120, 0), (0, 10, 130, 0), (0, 10, 140, 0)])
    noisy = {"schedule_policy": "sjf", "output_estimate_error": 1.0}
    orders = [ordered({**noisy, "seed": s}, reqs) for s in range(6)]
    assert all(sorted(o) == [0, 1, 2, 3, 4] for o in orders)
    assert orders[3] == ordered({**noisy, "seed": 3}, reqs)  # pure: same state and seed, same order
    assert any(o != [0, 1, 2, 3, 4] for o in orders)  # the errors reorder an oracle's order
    assert ordered({"schedule_policy": "sjf"}, reqs) == [0, 1, 2, 3, 4]


def test_routing_key_follows_the_running_batch():
    running = plain([(0, 10, 5, 2), (0, 10, 5, 2), (0, 10, 5, 1)])
    waiting = [Request(10 + i, 1.0, 10, 5, priority=p) for i, p in enumerate([0, 1, 2, 1, 0])]
    assert ordered({"schedule_policy": "routing_key"}, waiting, running) == [12, 11, 13, 10, 14]


def test_edf_orders_by_deadline_with_a_per_token_term():
    reqs = plain([(0.0, 2000, 5, 0), (0.5, 100, 5, 0), (0.2, 100, 5, 0)])
    config = {"schedule_policy": "edf", "ttft_deadline": 1.0, "ttft_deadline_per_token": 0.001}
    assert ordered(config, reqs) == [2, 1, 0]  # deadlines 3.0, 1.6, 1.3


def test_aging_and_reorder_window_bound_the_reordering():
    reqs = plain([(0, 10, 1, 0), (1, 10, 2, 0), (2, 10, 3, 0), (3, 10, 4, 0), (4, 10, 5, 0)])
    assert ordered({"schedule_policy": "lof"}, reqs) == [4, 3, 2, 1, 0]
    assert ordered({"schedule_policy": "lof", "reorder_window": 3}, reqs) == [2, 1, 0, 3, 4]
    # at t = 4.5 requests 0 and 1 have waited more than 3 s: they go first, in queue order
    assert ordered({"schedule_policy": "lof", "aging_seconds": 3.0}, reqs, now=4.5) == [0, 1, 4, 3, 2]
    landed = plain([(0, 10, 1, 0)])[0]
    landed.id, landed.num_blocks = 9, 1  # P/D: KV already here
    assert ordered({"schedule_policy": "lof"}, reqs + [landed]) == [9, 4, 3, 2, 1, 0]


def test_config_errors_and_steadiness():
    with pytest.raises(ConfigError, match="policy.schedule_policy"):
        make_policy({"name": "sglang", "schedule_policy": "longest"})
    with pytest.raises(ConfigError, match="policy.aging_seconds"):
        make_policy({"name": "sglang", "aging_seconds": -1})
    assert make_policy({"name": "sglang"}).steady_when_blocked
    assert not make_policy({"name": "sglang", "aging_seconds": 5}).steady_when_blocked
    assert not make_policy({"name": "sglang", "schedule_policy": "edf"}).steady_when_blocked


# ---------------------------------------------------------------- the prefill adder


class Trace:
    """Keeps (plan, {id: (need, computed, outputs)}) of every step."""

    def __init__(self, inner):
        self.inner, self.name, self.config = inner, inner.name, inner.config
        self.steady_when_blocked = inner.steady_when_blocked
        self.steps = []

    def schedule(self, state):
        plan = self.inner.schedule(state)
        reqs = {r.id: (r.need, r.num_output_tokens) for r in list(state.running) + list(state.waiting)}
        self.steps.append((plan, reqs))
        return plan

    def reject_reason(self, req, state):
        return self.inner.reject_reason(req, state)


def test_one_chunked_request_at_a_time_aligned_to_blocks():
    reqs = plain([(0, 1000, 3, 0), (0, 700, 3, 0), (0.5, 40, 3, 0)])
    run = run_prefix({"name": "sglang", "chunked_prefill_size": 300}, reqs, prefix_caching=False, wrap=Trace)
    partial_steps = 0
    for plan, reqs_then in run.policies[0].steps:
        partial = [(rid, n) for rid, n in plan.scheduled.items() if n < reqs_then[rid][0]]
        assert len(partial) <= 1
        assert all(n % 16 == 0 for _, n in partial)
        assert sum(plan.scheduled.values()) <= 300
        partial_steps += bool(partial)
    assert partial_steps >= 5 and all(r.status == Status.FINISHED for r in reqs)


@pytest.mark.parametrize("mixed", [False, True])
def test_prefill_batches_stall_decodes_unless_mixed(mixed):
    reqs = plain([(0, 20, 30, 0), (0, 20, 30, 0), (3, 2000, 2, 0)])
    run = run_prefix({"name": "sglang", "chunked_prefill_size": 256, "enable_mixed_chunk": mixed}, reqs,
                     prefix_caching=False, wrap=Trace)
    long_prefill = [(plan, then) for plan, then in run.policies[0].steps if 2 in plan.scheduled and then[2][1] == 0]
    decodes = [sum(1 for rid in plan.scheduled if then[rid][1] > 0) for plan, then in long_prefill]
    assert len(long_prefill) >= 7
    assert (min(decodes) == 2) if mixed else (max(decodes) == 0)


def test_in_batch_dedupe_computes_a_shared_prefix_once():
    specs = [(0, 4, 16, 10, 2)] * 4  # four requests, one uncached 256-token prefix
    for dedupe, hits in ((True, [0, 256, 256, 256]), (False, [0, 0, 0, 0])):
        reqs = chain_requests(specs)
        run = run_prefix({"name": "sglang", "schedule_policy": "lpm", "in_batch_dedupe": dedupe}, reqs)
        assert [run.caches[0].prefix.hit_tokens[r.id] for r in reqs] == hits


def test_lpm_does_not_starve_a_cold_request_with_aging():
    hot = [(0.2 * i, 1, 16, 20, 10) for i in range(100)]  # a hot prefix stream, faster than it is served
    specs = hot[:5] + [(1.0, 2, 16, 20, 10)] + hot[5:]  # request 5 is cold (a prefix nobody shares)
    waits = {}
    for aging in (None, 2.0):
        reqs = chain_requests(specs)
        config = {"name": "sglang", "schedule_policy": "lpm", "max_num_seqs": 2, "aging_seconds": aging}
        run_prefix(config, reqs, cost={"type": "linear", "base": 0.1, "per_token": 0.0005})
        assert all(r.status == Status.FINISHED for r in reqs)
        waits[aging] = reqs[5].first_scheduled - reqs[5].arrival
        assert max(r.first_scheduled for r in reqs) > 25.0  # the queue never drained early
    assert waits[2.0] <= 2.0 + 1.5  # served once it aged out, as soon as a slot freed
    assert waits[None] > 20.0  # without aging, every hot request waiting overtakes it


def test_edf_rejects_early_what_cannot_meet_its_deadline():
    specs = [(0.01 * i, 4000, 20, 0) for i in range(30)] + [(0.0, 60_000, 2, 0)]
    roofline = {"type": "roofline", "gpu": "h100", "tp": 1}
    late = {}
    for order in ("fcfs", "edf"):
        reqs = plain(specs)
        config = {"name": "sglang", "schedule_policy": order, "ttft_deadline": 1.5, "chunked_prefill_size": 8192}
        run_prefix(config, reqs, num_blocks=20_000, cost=roofline, max_model_len=70_000)
        late[order] = sum(r.status == Status.FINISHED and r.first_token_time - r.arrival > 1.5 for r in reqs)
        if order == "fcfs":
            assert all(r.status == Status.FINISHED for r in reqs)
    assert reqs[-1].status == Status.REJECTED and "deadline" in reqs[-1].reject_reason  # at arrival
    queue_rejects = [r for r in reqs[:-1] if r.status == Status.REJECTED]
    assert queue_rejects and all("while waiting" in r.reject_reason for r in queue_rejects)
    assert all(r.first_scheduled != r.first_scheduled for r in queue_rejects)  # never scheduled (NaN)
    assert all(r.status == Status.FINISHED for r in reqs if r not in queue_rejects and r is not reqs[-1])
    assert late["edf"] < late["fcfs"] / 3  # hopeless requests no longer delay the others past their deadline


# ---------------------------------------------------------------- the experiment


def test_lpm_hits_at_least_as_often_as_fcfs_on_the_shared_prefix_experiment():
    path = ROOT / "experiments" / "lpm_shared_prefix.yaml"
    rates = {}
    for order in ("fcfs", "lpm"):
        summary, table = run_config(path, [f"policy.schedule_policy={order}", "workload.num_requests=1000"])
        assert summary["num_finished"] == 1000
        assert summary["prefix_hit_tokens"] == table["cached_tokens"].sum() > 0
        rates[order] = summary["prefix_hit_rate"]
    assert rates["lpm"] >= rates["fcfs"]
