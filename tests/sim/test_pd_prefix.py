"""Prefix caching together with P/D disaggregation (sim/pd.py, sim/kv/prefix.py, sim/kv/cache.py).

Semantics under test: a prefill replica's admission hits its own cache and computes only
prompt - hit tokens; the request holds its prompt's nodes there until its KV leaves the replica;
the last hop carries only the prompt tokens the chosen decode replica does not hold already
(pool mode's first hop: the whole prompt); decode room counts free + evictable blocks.

Invariants checked before every plan of every replica (hypothesis, random shared-prefix workloads,
both link modes, decode pools with and without a prefix cache, every preemption mode): refcounts
are never negative and equal the requests holding each node (requests running or waiting there,
KV held for a hand-off, cached units claimed by a reservation), a held node is never evicted,
evictable blocks are exactly those of unreferenced nodes, and free + own blocks of what sits on
the replica + referenced nodes + evictable == total. Over the run: every request finishes once
with exactly output_len tokens (first token on a prefill replica) or is rejected with a reason,
within bounded simulated time (no deadlock); every cache ends unreferenced with every block free
or cached; each hop carries the tokens specified; and tokens are conserved: computed + first
admission hits + re-admission hits == needed + tokens dropped by recompute preemptions.
"""
import math
from collections import Counter

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.api import run_experiment
from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.pd import PDSettings, PoolParts, build_pd
from cbsim.sim.metrics.recorder import Recorder
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Status
from cbsim.sim.simulation import ArrivalFeed, run_cluster

from factories import run_pd_cluster
from test_invariants_prefix import MAX_MODEL_LEN, check_tree, to_requests
from test_pd import LINKS, outcome
from test_prefix import chain_requests, run_prefix

MAX_TIME = 5_000.0  # far beyond any run below: a request left unfinished at this time is a deadlock


def run_pd(requests, *, prefill_policy=None, decode_policy=None, prefill_replicas=1, decode_replicas=1,
           prefill_blocks=200, decode_blocks=200, block_size=16, hash_block_size=16, decode_prefix=True,
           link=None, cost=None, preemption="recompute", watermark=0, check=False, fast_forward=True):
    """Simulate a P/D cluster with prefix caching on the prefill pool (and on the decode pool unless
    `decode_prefix` is False), unit cost unless `cost`; bounded by MAX_TIME."""
    cost_model = load_cost_model(cost or {"type": "unit"})
    replica_settings = ReplicaSettings(preemption_mode=preemption, max_model_len=10_000, swap_bandwidth=1e9,
                                       fast_forward=fast_forward)
    default = {"name": "sarathi", "token_budget": 32}

    def kv(blocks, prefix):
        return lambda: KVCache(blocks, block_size, watermark, False, 1.0, prefix_caching=prefix,
                               hash_block_size=hash_block_size)

    prefill = PoolParts(prefill_replicas, lambda: make_policy(prefill_policy or default), cost_model,
                        kv(prefill_blocks, True), replica_settings)
    decode = PoolParts(decode_replicas, lambda: make_policy(decode_policy or default), cost_model,
                       kv(decode_blocks, decode_prefix), replica_settings)
    return run_pd_cluster(requests, prefill, decode, link, check_caches if check else None, MAX_TIME)


# ---------------------------------------------------------------- the cluster-wide check


def located(replicas, cluster):
    """replica index -> (requests whose blocks sit there, holders of reserved room, ids claiming
    cached units there for a KV on its way)."""
    where = {r.index: ([], [], set()) for r in replicas}
    for r in replicas:
        where[r.index][0].extend(req for req in list(r.waiting) + list(r.running) + [q for _, q in r.landed]
                                 if req.num_blocks)
    for rec in cluster.records.values():
        if math.isnan(rec.released_src) and rec.req.num_blocks:
            where[rec.src.index][0].append(rec.req)
        if rec.holder is not None:
            where[rec.dst.index][1].append(rec.holder)
            where[rec.dst.index][2].add(rec.req.id)
    return where


def check_caches(replicas, cluster) -> None:
    for r in replicas:
        kv, cache = r.kv, r.kv.prefix
        reqs, holders, claims = located(replicas, cluster)[r.index]
        assert kv.free_blocks >= 0
        if cache is None:
            assert kv.free_blocks + sum(q.num_blocks for q in reqs + holders) == kv.num_blocks
            continue
        assert set(cache.paths) <= {q.id for q in reqs} | claims, f"replica {r.index}: a stale path"
        nodes, unreferenced = check_tree(cache)
        own = [q.num_blocks - cache.shared_blocks(q) for q in reqs] + [h.num_blocks for h in holders]
        assert min(own, default=0) >= 0
        referenced = (len(nodes) - unreferenced) * cache.unit_blocks
        assert kv.free_blocks + sum(own) + referenced + cache.evictable_blocks == kv.num_blocks, r.index


def check_end(requests, recorder, replicas, cluster, num_prefill: int) -> None:
    tokens = Counter()
    first_replica = {}
    runs, steps = recorder.run_table(), recorder.step_table()
    for rid, first, count in sorted(zip(runs["request_id"], runs["first_step"], runs["tokens"]),
                                    key=lambda run: steps["end"][run[1]]):
        tokens[int(rid)] += int(count)
        first_replica.setdefault(int(rid), int(steps["replica"][first]))
    for req in requests:
        assert req.status in (Status.FINISHED, Status.REJECTED), f"request {req.id} stuck: {req}"
        if req.status == Status.REJECTED:
            assert req.reject_reason and tokens[req.id] == 0
            continue
        assert tokens[req.id] == req.num_output_tokens == req.output_len
        assert first_replica[req.id] < num_prefill
        assert (req.id in cluster.records) == (req.output_len > 1)
    assert cluster.is_idle
    for r in replicas:
        kv = r.kv
        assert kv.available_blocks == kv.num_blocks, f"replica {r.index} leaks blocks"
        if kv.prefix is not None:
            assert not kv.prefix.paths and all(node.refs == 0 for node in kv.prefix.nodes())
            assert kv.prefix.evictable_blocks == kv.prefix.cached_blocks
    for rec in cluster.records.values():
        check_hops(rec, cluster.settings)
    computed = int(steps["prefill_tokens"].sum() + steps["decode_tokens"].sum())
    finished = [r for r in requests if r.status == Status.FINISHED]
    needed = sum(r.prompt_len + r.output_len - 1 for r in finished)
    recomputed = sum(row[4] for r in replicas for row in r.preemption_log)
    first_hits = sum(sum(r.kv.prefix.hit_tokens.values()) for r in replicas[:num_prefill])
    readmit_hits = sum(sum(r.kv.prefix.readmit_hit_tokens.values()) for r in replicas if r.kv.prefix is not None)
    assert not any(r.kv.prefix.hit_tokens for r in replicas[num_prefill:] if r.kv.prefix is not None)
    assert computed + first_hits + readmit_hits == needed + recomputed


def check_hops(rec, link: PDSettings) -> None:
    """The hops carry the whole prompt to the pool, and only what the decode replica lacks to it."""
    req, dst = rec.req, rec.dst
    unit = dst.kv.prefix.unit_tokens if dst.kv.prefix is not None else None
    assert 0 <= rec.cached_on_decode <= req.prompt_len
    assert rec.cached_on_decode == 0 if unit is None else rec.cached_on_decode % unit == 0
    sizes = [hop.nbytes for hop in rec.hops]
    last = (req.prompt_len - rec.cached_on_decode) * link.bytes_per_token
    assert sizes == ([req.prompt_len * link.bytes_per_token, last] if link.link_mode == "pool" else [last])


# ---------------------------------------------------------------- exact scenarios (unit cost: 1 s per step)


def two_turns(own_a=10, own_b=20, gap=50):
    """Request 0 and, `gap` s later, request 1 with the same 4-block (64-token) prefix."""
    return chain_requests([(0, 1, 4, own_a, 3), (gap, 1, 4, own_b, 3)])


def prefill_rows(recorder, request):
    """Prefill tokens of the steps of `request`'s prefill replica from its first step to its first token."""
    steps = recorder.step_table()
    first = request.first_scheduled_step
    return [int(steps["prefill_tokens"][i]) for i in range(first, request.first_token_step + 1)
            if steps["replica"][i] == steps["replica"][first]]


def test_a_prefill_hit_computes_only_the_rest_and_the_decode_cache_shrinks_the_transfer():
    reqs = two_turns()
    recorder, replicas, cluster = run_pd(reqs, check=True)
    a, b = reqs
    prefill, decode = replicas[0].kv.prefix, replicas[1].kv.prefix
    assert prefill.hit_tokens == {0: 0, 1: 64}
    assert prefill_rows(recorder, a) == [32, 32, 10]  # 74 tokens at 32 a step
    assert prefill_rows(recorder, b) == [84 - 64]  # prefill step tokens = prompt - hit
    rec_a, rec_b = cluster.records[a.id], cluster.records[b.id]
    # the decode replica cached request 0's 4 full prompt blocks when it landed: only 20 tokens move
    assert (rec_a.cached_on_decode, rec_b.cached_on_decode) == (0, 64)
    assert [h.nbytes for h in rec_a.hops] == [74.0] and [h.nbytes for h in rec_b.hops] == [20.0]
    hop = rec_b.hops[0]
    assert hop.end - hop.start == 0.5 + 20 / 10.0  # latency + missing tokens x 1 byte / 10 B/s
    assert rec_b.landed == hop.end and b.completion_time == rec_b.landed + 2  # two decode steps
    # the hit, the published prefix and the transfer saving are all units: the decode side caches b's 5th
    assert decode.num_nodes == 5 and prefill.num_nodes == 5
    check_end(reqs, recorder, replicas, cluster, 1)


def test_without_a_decode_cache_the_whole_prompt_moves():
    reqs = two_turns()
    recorder, replicas, cluster = run_pd(reqs, decode_prefix=False, check=True)
    assert replicas[0].kv.prefix.hit_tokens == {0: 0, 1: 64}  # the prefill side still hits
    assert [cluster.records[r.id].hops[0].nbytes for r in reqs] == [74.0, 84.0]
    check_end(reqs, recorder, replicas, cluster, 1)


def test_pool_mode_sends_the_whole_prompt_to_the_store_and_the_missing_part_on():
    link = PDSettings(link_mode="pool", latency=0.5, bandwidth=10.0, pool_bandwidth=20.0, bytes_per_token=1.0)
    reqs = two_turns()
    recorder, replicas, cluster = run_pd(reqs, link=link, check=True)
    to_pool, from_pool = cluster.records[reqs[1].id].hops
    assert (to_pool.kind, to_pool.nbytes, from_pool.kind, from_pool.nbytes) == ("to_pool", 84.0, "from_pool", 20.0)
    assert from_pool.end - from_pool.start == 0.5 + 20 / 20.0
    check_end(reqs, recorder, replicas, cluster, 1)


def test_prefill_refcounts_are_released_when_the_kv_leaves_and_decode_claims_held_until_landing():
    seen = []

    class Probe:  # samples the caches at every plan of the decode replica
        def __init__(self, inner):
            self.inner, self.name, self.config = inner, inner.name, inner.config
            self.steady_when_blocked = inner.steady_when_blocked

        def schedule(self, state):
            seen.append((state.now, *({rid: len(path) for rid, path in r.kv.prefix.paths.items()}
                                      for r in replicas)))
            return self.inner.schedule(state)

        def reject_reason(self, req, state):
            return self.inner.reject_reason(req, state)

    link = PDSettings(latency=5.0, bandwidth=10.0, bytes_per_token=1.0)  # a slow hop: plans happen during it
    # a long-running request 1 keeps the decode replica planning while request 2's KV moves
    reqs = chain_requests([(0, 1, 4, 10, 3), (40, 2, 1, 4, 40), (50, 1, 4, 20, 3)])
    cost_model = load_cost_model({"type": "unit"})
    replica_settings = ReplicaSettings(max_model_len=10_000)
    kv = lambda: KVCache(200, 16, 0, False, 1.0, prefix_caching=True, hash_block_size=16)  # noqa: E731
    prefill = PoolParts(1, lambda: make_policy({"name": "sarathi", "token_budget": 32}), cost_model, kv,
                        replica_settings)
    decode = PoolParts(1, lambda: Probe(make_policy({"name": "sarathi", "token_budget": 32})), cost_model, kv,
                       replica_settings)
    env, recorder = simpy.Environment(), Recorder()
    feed = ArrivalFeed(env, reqs)
    replicas, cluster = build_pd(env, recorder, feed, prefill, decode, link)  # the probe reads `replicas`
    run_cluster(env, feed, replicas, cluster.prefill, "round_robin", MAX_TIME, busy=lambda: not cluster.is_idle)
    rec = cluster.records[2]
    during = [row for row in seen if rec.reserved < row[0] < rec.landed]
    assert during, "no decode plan during the transfer"
    for _, prefill_paths, decode_paths in during:
        assert prefill_paths[2] == 5  # the sender holds its 5 full prompt units until the hop ends
        assert decode_paths[2] == 4  # the receiver holds the 4 it had cached
    after = [row for row in seen if row[0] >= rec.landed]
    assert after and all(2 not in row[1] for row in after)  # released on the prefill side after the hand-off
    assert rec.cached_on_decode == 64 and rec.hops[0].nbytes == 20
    check_end(reqs, recorder, replicas, cluster, 1)


def test_decode_room_counts_evictable_blocks():
    # 10 decode blocks of 4 tokens; each request leaves 6 cached prompt blocks behind there: only 4
    # blocks stay free, fewer than the next request's 7. Counting free blocks alone deadlocked.
    reqs = chain_requests([(10 * i, 100 + i, 6, 0, 2) for i in range(4)], hash_block=4)
    recorder, replicas, cluster = run_pd(reqs, decode_blocks=10, block_size=4, hash_block_size=4, check=True)
    assert all(r.status == Status.FINISHED for r in reqs)
    assert replicas[1].kv.prefix.evicted_blocks > 0
    check_end(reqs, recorder, replicas, cluster, 1)


def test_a_readmission_hit_is_counted_apart_from_the_first_admission():
    # colocated: request 1 is preempted (recompute) and its retry hits its own cached prompt blocks
    reqs = chain_requests([(0, 1, 6, 4, 30), (0, 2, 6, 4, 30)])
    run = run_prefix({"name": "sarathi", "token_budget": 200}, reqs, num_blocks=16)
    cache = run.caches[0].prefix
    victim = max(reqs, key=lambda r: r.num_preemptions)
    assert victim.num_preemptions >= 1 and all(r.status == Status.FINISHED for r in reqs)
    assert cache.hit_tokens == {0: 0, 1: 0}  # first admissions: nothing cached yet
    assert cache.readmit_hit_tokens[victim.id] >= 96  # at least its 6 shared prompt blocks
    steps = run.recorder.step_table()
    computed = steps["prefill_tokens"].sum() + steps["decode_tokens"].sum()
    recomputed = sum(row[4] for row in run.replicas[0].preemption_log)
    needed = sum(r.prompt_len + r.output_len - 1 for r in reqs)
    assert computed + sum(cache.readmit_hit_tokens.values()) == needed + recomputed


# ---------------------------------------------------------------- property test


# test_invariants_prefix.to_requests rows, denser: (gap, kind, a, b, own tokens, output, priority); kind 0 =
# system prompt a with b hash blocks then `own` tokens; kind 1 = the next turn of earlier request a
SPECS = st.lists(st.tuples(st.floats(0, 1.5, allow_nan=False), st.integers(0, 1), st.integers(0, 3),
                           st.integers(0, 6), st.integers(1, 60), st.integers(1, 80), st.integers(0, 2)),
                 min_size=3, max_size=16)
PREFILL_POLICIES = st.sampled_from([
    {"name": "sarathi", "token_budget": 32}, {"name": "sarathi", "token_budget": 96},
    {"name": "sglang", "schedule_policy": "lpm", "token_budget": 128, "chunked_prefill_size": 48},
    {"name": "sglang", "schedule_policy": "dfs_weight", "token_budget": 256},
    {"name": "sglang", "schedule_policy": "fcfs", "token_budget": 64, "chunked_prefill_size": 32,
     "in_batch_dedupe": False},
    {"name": "prefill_first", "chunk_size": 24}])
DECODE_POLICIES = st.sampled_from([
    {"name": "sarathi", "token_budget": 16}, {"name": "sarathi", "token_budget": 64},
    {"name": "orca", "kv_reservation": "paged", "max_num_seqs": 3}])
CLUSTERS = st.fixed_dictionaries({
    "prefill_replicas": st.integers(1, 2), "decode_replicas": st.integers(1, 2),
    "block_size": st.sampled_from([1, 4, 16]), "hash_block_size": st.sampled_from([2, 4, 8, 16, 32]),
    # in tokens (divided by the block size below): the decode side fits the largest request (256 + 1)
    "prefill_tokens": st.integers(260, 800), "decode_tokens": st.integers(260, 700),
    "watermark": st.integers(0, 1), "decode_prefix": st.sampled_from([True, True, False]),
    "preemption": st.sampled_from(["recompute", "swap", "auto"]),
    "cost": st.sampled_from([{"type": "unit"}, {"type": "linear", "base": 0.01, "per_token": 0.001}]),
})

@pytest.mark.slow
@settings(max_examples=60)
@given(SPECS, PREFILL_POLICIES, DECODE_POLICIES, CLUSTERS, LINKS)
def test_pd_prefix_invariants(specs, prefill_policy, decode_policy, cluster, link):
    cluster = dict(cluster)
    block = cluster["block_size"]
    cluster["prefill_blocks"] = -(-cluster.pop("prefill_tokens") // block) + cluster["watermark"]
    cluster["decode_blocks"] = -(-cluster.pop("decode_tokens") // block) + cluster["watermark"]
    requests = to_requests(specs, cluster["hash_block_size"])
    assert max(r.prompt_len + r.output_len for r in requests) <= MAX_MODEL_LEN
    recorder, replicas, pd = run_pd(requests, prefill_policy=prefill_policy, decode_policy=decode_policy,
                                    link=link, check=True, **cluster)
    check_end(requests, recorder, replicas, pd, cluster["prefill_replicas"])
    # decode replicas fast-forward (the default above); stepping one by one gives the same run
    stepped = to_requests(specs, cluster["hash_block_size"])
    again = run_pd(stepped, prefill_policy=prefill_policy, decode_policy=decode_policy, link=link,
                   fast_forward=False, **cluster)
    assert outcome(requests, recorder, pd) == outcome(stepped, again[0], again[2])


# ---------------------------------------------------------------- through the experiment API


EXPERIMENT = {
    "name": "pd-prefix-test", "model": "llama-3-8b", "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1},
    "cluster": {"mode": "pd", "kv_cache": {"block_size": 16, "num_blocks": 600, "prefix_caching": True},
                "prefill": {"replicas": 2, "policy": {"name": "sglang", "token_budget": 4096}},
                "decode": {"replicas": 1, "policy": {"name": "sarathi", "token_budget": 256}, "num_blocks": 300},
                "link": {"latency_s": 0.001, "bandwidth_gb_s": 10}},
    "workload": {"num_requests": 80, "arrival": {"type": "poisson", "rate": 20},
                 "prompt_len": {"type": "uniform", "min": 20, "max": 300},
                 "output_len": {"type": "uniform", "min": 2, "max": 40},
                 "shared_prefix": {"mode": "multi_turn", "num_prefixes": 4, "prefix_len": 512, "turns": 4,
                                   "think_time": 1.0}},
    "sim": {"max_time": 600},
    "output": {"plots": False, "trace": False},
}


def test_run_experiment_with_prefix_caching_on_both_pools():
    res = run_experiment(EXPERIMENT)
    s, table = res.summary, res.requests
    assert s["num_finished"] + s["num_rejected"] == 80 and s["num_finished"] > 70
    assert 0.3 < s["prefix_hit_rate"] < 1 and s["evicted_blocks"] > 0  # the small decode cache evicts
    handed = table[table["output_len"] > 1]
    sent = res.transfers.loc[res.transfers["kind"] == "p2p", "bytes"].sum()
    assert s["kv_transfer_bytes"] == sent < handed["prompt_len"].sum() * 131072  # 128 KiB a token, less cached
    # what was not sent is exactly what the decode side had cached (hand-off column)
    assert sent == (handed["prompt_len"] - handed["cached_on_decode"]).sum() * 131072
    assert "readmit_cached_tokens" in table and (table["readmit_cached_tokens"] >= 0).all()
    off = run_experiment(EXPERIMENT, overrides=["cluster.kv_cache.prefix_caching=false"])
    assert off.summary["kv_transfer_bytes"] == pytest.approx(
        off.requests.loc[off.requests["output_len"] > 1, "prompt_len"].sum() * 131072)
    assert s["ttft_p50"] < off.summary["ttft_p50"]


def test_prefix_caching_can_be_set_per_pool():
    def run(prefill: bool, decode: bool):
        res = run_experiment(EXPERIMENT, overrides=[f"cluster.prefill.prefix_caching={str(prefill).lower()}",
                                                    f"cluster.decode.prefix_caching={str(decode).lower()}"])
        handed = res.requests[res.requests["output_len"] > 1]
        return res.summary, handed

    # prefill pool only (SGLang PD's default): prefill hits, every hand-off sends its whole prompt
    s, handed = run(True, False)
    assert s["prefix_hit_tokens"] > 0 and (handed["cached_on_decode"] == 0).all()
    assert s["kv_transfer_bytes"] == pytest.approx(handed["prompt_len"].sum() * 131072)
    # decode pool only: every prompt is computed in full, but hand-offs skip what the decode side holds
    s, handed = run(False, True)
    assert s["prefix_hit_tokens"] == 0 and handed["cached_on_decode"].sum() > 0
    assert s["kv_transfer_bytes"] == pytest.approx((handed["prompt_len"] - handed["cached_on_decode"]).sum() * 131072)


def test_prefix_affinity_decode_router_sends_less_kv():
    two = ["cluster.decode.replicas=2", "cluster.decode.num_blocks=200"]
    affinity = run_experiment(EXPERIMENT, overrides=two + ["cluster.decode_router=prefix_affinity"]).summary
    loaded = run_experiment(EXPERIMENT, overrides=two + ["cluster.decode_router=least_loaded"]).summary
    assert affinity["num_finished"] == loaded["num_finished"]
    assert affinity["kv_transfer_bytes"] < 0.9 * loaded["kv_transfer_bytes"]
