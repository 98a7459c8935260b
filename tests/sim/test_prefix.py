"""Prefix caching: the radix tree, hits at admission, LRU eviction, metrics, routers, dynamic chunks.

Also holds the factories the other prefix tests import (run_prefix, chain_requests, run_config).
"""
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from cbsim.build import build_replica_parts
from cbsim.config import load_config
from cbsim.core.errors import ConfigError
from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.kv.cache import KVCache, KVCacheError
from cbsim.sim.metrics import (cached_token_column, itl_distribution, prefix_summary, readmit_hit_column,
                               request_frame, step_frame,
                               summarize)
from cbsim.sim.kv.prefix import PrefixCache
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Request, Status
from cbsim.sim.router import ROUTERS
from cbsim.sim.shape import StepShape
from cbsim.sim.simulation import simulate
from cbsim.workloads import build_requests, parse_workload
from cbsim.workloads.prefixes import content_id, hash_chain


# ---------------------------------------------------------------- factories


def chain(owner: int, blocks: int, kind: int = 1) -> tuple[int, ...]:
    """A hash chain of `blocks` blocks of content `owner` (kind 1: shared prompts, 2: private text)."""
    return hash_chain(content_id(kind, owner, j) for j in range(blocks))


def chain_requests(specs, hash_block: int = 16) -> list[Request]:
    """Requests from (arrival, shared prefix id, shared blocks, own tokens, output[, priority]):
    the prompt is the shared prefix's blocks then `own` tokens; the chain covers every full block."""
    out = []
    for i, spec in enumerate(specs):
        arrival, prefix, shared, own, output = spec[:5]
        prompt = shared * hash_block + own
        hashes = chain(prefix, shared)
        private = hash_chain((content_id(2, i, j) for j in range(prompt // hash_block - shared)),
                             parent=hashes[-1] if hashes else 0)
        out.append(Request(i, float(arrival), prompt, output, prefix_hashes=hashes + private,
                           priority=spec[5] if len(spec) > 5 else 0))
    return out


@dataclass
class PrefixRun:
    requests: list
    recorder: object
    replicas: list
    caches: list = field(default_factory=list)
    policies: list = field(default_factory=list)


def run_prefix(policy: dict, requests: list[Request], *, num_blocks: int = 1000, block_size: int = 16,
               hash_block_size: int | None = 16, watermark_blocks: int = 0, prefix_caching: bool = True,
               cost: dict | None = None, max_model_len: int = 100_000, preemption: str = "recompute",
               victim: str = "last_admitted", fast_forward: bool = True, replicas: int = 1,
               router: str = "round_robin", reserve_full_prompt: bool = False, wrap=None,
               tiers=None, swap_bandwidth: float = 1e9) -> PrefixRun:
    """Simulate on CPU with a prefix-caching KV cache (unit cost model unless `cost` is given);
    `wrap(policy)` may wrap each replica's policy (tracing, checks); `tiers(kv)` may give each cache's
    lower tiers (a sim/kv/tiers.py TierStore)."""
    caches, policies = [], []

    def new_kv():
        kv = KVCache(num_blocks, block_size, watermark_blocks, reserve_full_prompt, 1024.0,
                     prefix_caching=prefix_caching, hash_block_size=hash_block_size)
        if tiers is not None and kv.prefix is not None:
            kv.prefix.tiers = tiers(kv)
        caches.append(kv)
        return kv

    def new_policy():
        p = make_policy(policy)
        if wrap is not None:
            p = wrap(p)
        policies.append(p)
        return p

    settings = ReplicaSettings(preemption_mode=preemption, victim=victim, max_model_len=max_model_len,
                               fast_forward=fast_forward and tiers is None, swap_bandwidth=swap_bandwidth)
    recorder, pool = simulate(requests, new_policy, load_cost_model(cost or {"type": "unit"}), new_kv, settings,
                              replicas=replicas, router=router)
    return PrefixRun(requests, recorder, pool, caches, policies)


def run_config(source, overrides=()):
    """Run an experiment (YAML path or mapping) with its cluster.kv_cache prefix settings wired into
    the KV caches (what run_experiment does once it passes them on); returns (summary, request table)."""
    cfg = load_config(source, list(overrides))
    rng = np.random.default_rng(cfg.seed)
    workload = parse_workload(cfg.workload, "workload")
    requests = build_requests(workload, rng, Path(cfg.source).parent if cfg.source else None)
    _, cost, make_kv, settings = build_replica_parts(cfg)
    template, kv_cfg = make_kv(), cfg.cluster.kv_cache
    hash_block = kv_cfg.hash_block_size or workload.hash_block_size
    caches = []

    def new_kv():
        kv = KVCache(template.num_blocks, template.block_size, template.watermark_blocks,
                     template.reserve_full_prompt, template.bytes_per_token, prefix_caching=kv_cfg.prefix_caching,
                     hash_block_size=hash_block)
        caches.append(kv)
        return kv

    recorder, _ = simulate(requests, lambda: make_policy(cfg.policy), cost, new_kv, settings,
                           replicas=cfg.cluster.replicas, router=cfg.cluster.router)
    steps = step_frame(recorder)
    table = request_frame(requests, recorder, steps, cfg.metrics)
    table["cached_tokens"] = cached_token_column(table["request_id"].to_numpy(), caches)
    summary = summarize(table, steps, recorder, cfg.metrics, itl=itl_distribution(recorder, requests, steps))
    summary.update(prefix_summary(table, caches))
    return summary, table


SGLANG = {"name": "sglang", "token_budget": 4096, "chunked_prefill_size": 512}


# ---------------------------------------------------------------- the radix tree


def test_publish_acquire_release_share_and_count_blocks():
    kv = KVCache(100, 16, prefix_caching=True, hash_block_size=16)
    a, b = chain_requests([(0, 7, 4, 10, 1), (0, 7, 4, 30, 1)])
    kv.grow(a, kv.blocks_for(a.prompt_len))
    kv.publish(a, a.prompt_len)  # 4 shared blocks + 0 full private ones (10 tokens)
    assert kv.prefix.num_nodes == 4 and kv.prefix.shared_blocks(a) == 4 and kv.free_blocks == 95
    assert kv.acquire_prefix(b) == 64 and b.num_computed_tokens == 64 and b.num_blocks == 4
    assert [n.refs for n in kv.prefix.held(b)] == [2, 2, 2, 2]
    assert kv.free_blocks == 95  # nothing new: the hit blocks were already held by a
    kv.release(a)
    assert kv.free_blocks == 96 and kv.prefix.evictable_blocks == 0  # a's own block freed, shared ones still held
    kv.release(b)
    assert kv.free_blocks == 96 and kv.prefix.evictable_blocks == 4 and kv.prefix.num_nodes == 4
    assert kv.available_blocks == 100


def test_a_hit_never_covers_the_whole_sequence():
    kv = KVCache(100, 16, prefix_caching=True, hash_block_size=16)
    a, b = chain_requests([(0, 1, 4, 0, 1), (0, 1, 4, 0, 1)])  # prompts of exactly 4 blocks
    kv.grow(a, 4)
    kv.publish(a, 64)
    kv.release(a)
    assert kv.acquire_prefix(b) == 48  # the last block is computed again, so a token can be sampled
    assert b.need == 16


def test_duplicate_units_are_shared_and_the_copy_freed():
    kv = KVCache(100, 16, prefix_caching=True, hash_block_size=16)
    a, b = chain_requests([(0, 3, 2, 5, 1), (0, 3, 2, 5, 1)])
    for req in (a, b):  # both computed the same prefix in the same step
        kv.grow(req, 3)
    kv.publish(a, a.prompt_len)
    kv.publish(b, b.prompt_len)
    assert kv.prefix.num_nodes == 2 and kv.free_blocks == 100 - 3 - 1  # b's copy of the 2 blocks went back
    assert kv.prefix.held(a) == kv.prefix.held(b)


def test_lru_evicts_leaves_first_and_never_a_referenced_block():
    kv = KVCache(12, 16, prefix_caching=True, hash_block_size=16)
    a, b, c = chain_requests([(0, 1, 4, 0, 1), (0, 2, 4, 0, 1), (0, 3, 3, 0, 1)])
    for req in (a, b):
        kv.grow(req, 4)
        kv.publish(req, 64)
        kv.release(req)  # a is now less recently used than b
    assert kv.free_blocks == 4 and kv.prefix.evictable_blocks == 8 and kv.available_blocks == 12
    kv.acquire_prefix(c)  # c hits nothing; 3 of its blocks: 4 free, no eviction yet
    kv.grow(c, 3)
    assert kv.prefix.evicted_blocks == 0
    d = chain_requests([(0, 2, 4, 0, 1)])[0]  # shares b's prefix: hits 3 of b's blocks
    assert kv.acquire_prefix(d) == 48
    kv.grow(d, 8)  # 5 more: 1 free, so a's blocks go (leaf first), b's stay referenced
    assert kv.prefix.evicted_blocks == 4 and kv.free_blocks == 0
    assert all(node.parent is not None for node in kv.prefix.held(d))
    with pytest.raises(KVCacheError):
        kv.grow(c, 100)


def test_units_span_several_kv_blocks_and_hash_blocks():
    cache = PrefixCache(block_size=16, hash_block_size=512)
    assert (cache.unit_tokens, cache.unit_blocks, cache.hashes_per_unit) == (512, 32, 1)
    cache = PrefixCache(block_size=32, hash_block_size=16)
    assert (cache.unit_tokens, cache.unit_blocks, cache.hashes_per_unit) == (32, 1, 2)
    req = Request(0, 0.0, 1000, 1, prefix_hashes=chain(0, 2))  # 1000 tokens, 2 hashes of 512 (Mooncake: ceil)
    assert PrefixCache(16, 512).num_units(req) == 1  # only full hash blocks of the prompt count


def test_hits_advance_in_whole_hash_blocks_of_512():
    reqs = chain_requests([(0, 5, 3, 100, 2), (1, 5, 3, 40, 2)], hash_block=512)
    run = run_prefix(SGLANG, reqs, num_blocks=400, hash_block_size=512)
    assert run.caches[0].prefix.hit_tokens == {0: 0, 1: 1536}
    assert all(r.status == Status.FINISHED for r in reqs)


# ---------------------------------------------------------------- in simulations


def test_a_later_request_hits_and_computes_only_the_rest():
    reqs = chain_requests([(0, 1, 8, 20, 3), (50, 1, 8, 20, 3)])
    run = run_prefix(SGLANG, reqs, cost={"type": "linear", "base": 0.01, "per_token": 0.001})
    steps = run.recorder.step_table()
    assert run.caches[0].prefix.hit_tokens == {0: 0, 1: 128}
    assert steps["prefill_tokens"].sum() == 148 + 20  # the second prompt: only its own 20 tokens
    assert reqs[1].first_token_time - reqs[1].arrival < reqs[0].first_token_time - reqs[0].arrival


def test_prefix_caching_off_or_without_hashes_changes_nothing():
    specs = [(0.1 * i, i % 3, 4, 10 + i, 5) for i in range(12)]
    base = run_prefix({"name": "sarathi", "token_budget": 64}, chain_requests(specs), num_blocks=40,
                      prefix_caching=False)
    plain = [Request(r.id, r.arrival, r.prompt_len, r.output_len) for r in chain_requests(specs)]
    nohash = run_prefix({"name": "sarathi", "token_budget": 64}, plain, num_blocks=40)
    for name, column in base.recorder.step_table().items():
        assert np.array_equal(column, nohash.recorder.step_table()[name]), name
    cached = run_prefix({"name": "sarathi", "token_budget": 64}, chain_requests(specs), num_blocks=40)
    assert cached.recorder.step_table()["prefill_tokens"].sum() < base.recorder.step_table()["prefill_tokens"].sum()


def test_metrics_count_first_admission_hits():
    reqs = chain_requests([(0, 1, 8, 20, 3), (50, 1, 8, 20, 3), (60, 2, 2, 3, 1)])
    run = run_prefix(SGLANG, reqs)
    table = request_frame(reqs, run.recorder, step_frame(run.recorder))
    table["cached_tokens"] = cached_token_column(table["request_id"].to_numpy(), run.caches)
    assert table["cached_tokens"].tolist() == [0, 128, 0]
    summary = prefix_summary(table, run.caches)
    assert summary == {"prefix_hit_tokens": 128, "prefix_hit_rate": pytest.approx(128 / (148 + 148 + 35)),
                       "prefix_readmit_hit_tokens": 0, "evicted_blocks": 0}
    off = prefix_summary(table.drop(columns="cached_tokens"), [KVCache(10, 16)])
    assert off == {"prefix_hit_tokens": 0, "prefix_hit_rate": None, "prefix_readmit_hit_tokens": 0,
                   "evicted_blocks": 0}


def test_preemption_puts_prompt_blocks_in_the_cache_and_the_retry_hits_them():
    reqs = chain_requests([(0, 1, 6, 4, 30), (0, 2, 6, 4, 30)])
    run = run_prefix({"name": "sarathi", "token_budget": 200}, reqs, num_blocks=16)
    assert sum(r.num_preemptions for r in reqs) >= 1 and all(r.status == Status.FINISHED for r in reqs)
    steps = run.recorder.step_table()
    recomputed = steps["prefill_tokens"].sum() - sum(r.prompt_len for r in reqs)
    victim = max(reqs, key=lambda r: r.num_preemptions)
    assert 0 < recomputed < victim.prompt_len + victim.output_len  # the cached prompt blocks were not redone
    ids = np.array([r.id for r in reqs])
    readmit, first = readmit_hit_column(ids, run.caches), cached_token_column(ids, run.caches)
    assert readmit[ids == victim.id][0] > 0  # the retry's hit is counted apart from the first admission's
    assert prefix_summary(pd.DataFrame({"request_id": ids, "cached_tokens": first, "prompt_len": 96,
                                        "first_scheduled": 0.0}), run.caches)["prefix_readmit_hit_tokens"] == readmit.sum()


# ---------------------------------------------------------------- routers


def test_kv_aware_and_prefix_affinity_routing():
    reqs = chain_requests([(0, 1, 8, 4, 40), (0.5, 2, 8, 4, 40), (1, 1, 8, 4, 2), (1.1, 3, 1, 4, 2)])
    run = run_prefix(SGLANG, reqs, replicas=2, router="prefix_affinity")
    assert [r.replica for r in reqs] == [0, 1, 0, 0]  # request 2 follows its prefix; 3 ties -> least loaded
    # kv_aware: request 1 goes where more blocks are available (replica 0 holds request 0's)
    reqs = chain_requests([(0, 1, 8, 4, 40), (0.5, 2, 8, 4, 40), (1, 3, 1, 4, 2)])
    run_prefix(SGLANG, reqs, replicas=2, router="kv_aware")
    assert [r.replica for r in reqs] == [0, 1, 0]
    assert {"kv_aware", "prefix_affinity", "round_robin", "least_loaded"} <= set(ROUTERS)


def test_prefix_affinity_falls_back_to_least_loaded_when_imbalanced():
    specs = [(0.001 * i, 1, 4, 4, 20) for i in range(80)]  # all share a prefix: affinity alone piles them up
    reqs = chain_requests(specs)
    run_prefix({**SGLANG, "max_num_seqs": 4}, reqs, replicas=2, router="prefix_affinity")
    counts = np.bincount([r.replica for r in reqs], minlength=2)
    assert counts[1] >= (80 - 33) // 2  # beyond 32 requests of imbalance, every other one goes to replica 1


# ---------------------------------------------------------------- dynamic chunking


def chunk_trace(policy: dict, prompt: int, cost: dict):
    """(chunk, history) of every prefill row of one long request alone, in order."""
    rows = []

    class Trace:
        def __init__(self, inner):
            self.inner, self.name, self.config = inner, inner.name, inner.config
            self.steady_when_blocked = inner.steady_when_blocked

        def schedule(self, state):
            plan = self.inner.schedule(state)
            by_id = {r.id: r for r in list(state.running) + list(state.waiting)}
            rows.extend((n, by_id[rid].num_computed_tokens) for rid, n in plan.scheduled.items()
                        if by_id[rid].num_output_tokens == 0)
            return plan

        def reject_reason(self, req, state):
            return self.inner.reject_reason(req, state)

    run_prefix(policy, [Request(0, 0.0, prompt, 2)], num_blocks=5000, cost=cost, prefix_caching=False, wrap=Trace)
    return rows


ROOFLINE = {"type": "roofline", "gpu": "h100", "tp": 1}


@pytest.mark.parametrize("policy", [
    {"name": "sarathi", "token_budget": 2048},
    {"name": "splitfuse", "token_budget": 2048},
    {"name": "prefill_first", "chunk_size": 2048},
    {"name": "sglang", "chunked_prefill_size": 2048},
])
def test_dynamic_chunks_shrink_with_history_at_constant_marginal_cost(policy):
    rows = chunk_trace({**policy, "dynamic_chunk": {"target_chunk": 512}}, 30_000, ROOFLINE)
    cost = load_cost_model(ROOFLINE)

    def alone(c, h):
        return cost.step_time(StepShape(prefill=((c, h),)))

    target = alone(512, 0)
    chunks = [c for c, _ in rows]
    assert chunks[0] == 512 and sum(chunks) == 30_000
    assert all(a >= b for a, b in zip(chunks[:-2], chunks[1:-1])) and chunks[-2] < 512
    for c, h in rows[:-1]:  # the last chunk is whatever is left
        assert c % 16 == 0
        # tolerance: the alignment to whole KV blocks, i.e. the cost of one more block
        assert alone(c, h) <= target < alone(c + 16, h)
        assert target - alone(c, h) <= alone(c + 16, h) - alone(c, h)
    assert chunks[-2] < chunks[0] / 2  # the roofline's attention term: late chunks are much smaller


def test_dynamic_chunk_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="dynamic_chunk"):
        make_policy({"name": "prefill_first", "dynamic_chunk": {"target_chunk": 512}})
    with pytest.raises(ConfigError, match="target_chunk"):
        make_policy({"name": "sarathi", "dynamic_chunk": {"target_chunk": 0}})


# ---------------------------------------------------------------- configuration


def test_kv_cache_config_prefix_fields_and_routers():
    workload = {"requests": [{"arrival": 0, "prompt_len": 10, "output_len": 2}]}
    cfg = load_config({"workload": workload, "cluster": {
        "router": "prefix_affinity", "kv_cache": {"num_blocks": 100, "prefix_caching": True, "hash_block_size": 512}}})
    assert cfg.cluster.kv_cache.prefix_caching and cfg.cluster.kv_cache.hash_block_size == 512
    assert not load_config({"workload": workload}).cluster.kv_cache.prefix_caching
    with pytest.raises(ConfigError, match="cluster.kv_cache.hash_block_size"):
        load_config({"workload": workload, "cluster": {"kv_cache": {"hash_block_size": 0}}})
    with pytest.raises(ConfigError, match="cluster.router"):
        load_config({"workload": workload, "cluster": {"router": "nearest"}})
