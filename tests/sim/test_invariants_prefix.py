"""Property-based invariants with prefix caching (mostly on), for every policy, over random shared-prefix workloads.

Random workloads mix shared system prompts and conversations whose turns extend an earlier turn's
prompt, with KV block sizes and hash block sizes drawn independently. Checked before every plan:
refcounts are never negative and equal the number of requests holding each node, a held node is
never evicted, evictable blocks are exactly those of unreferenced nodes, and free + held
(requests' own blocks + referenced nodes) + evictable == total. Per plan: token and sequence
budgets. Over the run: every request finishes with exactly output_len tokens (or is rejected with a
reason), the cache ends unreferenced with every block available, computed + hit tokens == needed
tokens when nothing was preempted, and fast-forward changes nothing.
"""
from collections import Counter

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cbsim.sim.request import Request, Status
from cbsim.workloads.prefixes import content_id, hash_chain

from test_invariants import CHUNKED_ONLY, ENGINE_FIELDS, ORCA, PREFILL_FIRST, SPLITFUSE, STATIC
from test_prefix import chain, run_prefix

ORDERS = ["fcfs", "lpm", "dfs_weight", "lof", "random", "priority", "routing_key", "sjf", "edf"]

POLICIES = st.one_of(
    STATIC, ORCA, PREFILL_FIRST, SPLITFUSE, CHUNKED_ONLY,
    st.builds(lambda b, k, p, d: {"name": "sarathi", "token_budget": b, "max_num_seqs": k,
                                  "max_num_partial_prefills": p, "dynamic_chunk": d},
              st.integers(1, 96), st.integers(1, 8), st.integers(1, 3),
              st.sampled_from([None, {"target_chunk": 32}])),
    st.builds(lambda o, b, c, k, mixed, window, aging, dedupe: {
        "name": "sglang", "schedule_policy": o, "token_budget": b, "chunked_prefill_size": c, "max_num_seqs": k,
        "enable_mixed_chunk": mixed, "reorder_window": window, "aging_seconds": aging, "in_batch_dedupe": dedupe,
        "output_estimate_error": 0.5, "ttft_deadline": 3.0},
        st.sampled_from(ORDERS), st.integers(64, 256), st.one_of(st.none(), st.integers(1, 96)),
        st.integers(1, 8), st.booleans(), st.one_of(st.none(), st.integers(1, 4)),
        st.one_of(st.none(), st.floats(0, 3)), st.booleans()),
)

MAX_MODEL_LEN = 256

# (gap, kind, a, b, own tokens, output, priority): kind 0 = system prompt a with b hash blocks then
# `own` tokens; kind 1 = the next turn of earlier request a: its prompt and a reply (b tokens) and `own` more
SPECS = st.lists(st.tuples(st.floats(0, 4, allow_nan=False), st.integers(0, 1), st.integers(0, 3),
                           st.integers(0, 6), st.integers(1, 60), st.integers(1, 30), st.integers(0, 2)),
                 min_size=1, max_size=16)

ENGINE = st.fixed_dictionaries({
    **ENGINE_FIELDS,
    "num_blocks": st.integers(8, 120),
    "hash_block_size": st.sampled_from([2, 4, 8, 16, 32]),
    "prefix_caching": st.sampled_from([True, True, False]),  # off: sglang and dynamic chunks without a cache
})


def to_requests(specs, hash_block: int) -> list[Request]:
    """Shared-prefix requests; every chain covers all full hash blocks of its prompt."""
    rows, t = [], 0.0
    for i, (gap, kind, a, b, own, output, prio) in enumerate(specs):
        t = round(t + gap, 3)
        if kind == 1 and rows:
            prev = rows[a % len(rows)]
            shared_tokens, hashes = prev.prompt_len + b, prev.prefix_hashes
        else:
            shared_tokens, hashes = b * hash_block, chain(a, b)
        prompt = min(shared_tokens + own, MAX_MODEL_LEN - output)
        hashes = hashes[: prompt // hash_block]
        tail = hash_chain((content_id(2, i, j) for j in range(len(hashes), prompt // hash_block)),
                          parent=hashes[-1] if hashes else 0)
        rows.append(Request(i, t, prompt, output, prefix_hashes=hashes + tail, priority=prio))
    return rows


class Checked:
    """Wraps a policy: checks the KV and prefix-cache invariants on every state it plans from."""

    def __init__(self, inner):
        self.inner, self.name, self.config = inner, inner.name, inner.config
        self.steady_when_blocked = inner.steady_when_blocked
        self.plans = []

    def schedule(self, state):
        if state.kv.prefix is not None:
            check_cache(state)
        plan = self.inner.schedule(state)
        self.plans.append(plan)
        return plan

    def reject_reason(self, req, state):
        return self.inner.reject_reason(req, state)


def check_tree(cache) -> tuple[list, int]:
    """Refcounts equal the held paths, held nodes are in the tree, evictable = unreferenced units.
    Returns (every node, the unreferenced count)."""
    expected = Counter(node for path in cache.paths.values() for node in path)
    nodes = list(cache.nodes())
    assert len(nodes) == cache.num_nodes
    for node in nodes:
        assert node.refs >= 0 and node.refs == expected[node]
    for node in expected:  # a held node is never evicted
        assert node.parent is not None and node.parent.children.get(node.key) is node
    unreferenced = sum(node.refs == 0 for node in nodes)
    assert cache.evictable_blocks == unreferenced * cache.unit_blocks
    return nodes, unreferenced


def check_cache(state) -> None:
    kv, cache = state.kv, state.kv.prefix
    holders = list(state.running) + [r for r in state.waiting if r.num_blocks]
    assert set(cache.paths) <= {r.id for r in state.running}
    nodes, unreferenced = check_tree(cache)
    own = [r.num_blocks - cache.shared_blocks(r) for r in holders]
    assert kv.free_blocks >= 0 and min(own, default=0) >= 0
    referenced = (len(nodes) - unreferenced) * cache.unit_blocks
    assert kv.free_blocks + sum(own) + referenced + cache.evictable_blocks == kv.num_blocks
    assert kv.available_blocks == kv.free_blocks + cache.evictable_blocks


def check_run(run, policy, engine) -> None:
    budget = policy.get("token_budget") or MAX_MODEL_LEN
    if policy["name"] == "sglang":
        budget = max(budget, policy["max_num_seqs"])  # a decode-only step is bounded by max_num_seqs
    for plan in run.policies[0].plans:
        assert sum(plan.scheduled.values()) <= budget
        assert len(plan.scheduled) + len(plan.padding) <= policy["max_num_seqs"]
        assert all(n >= 1 for n in plan.scheduled.values())
        assert not set(plan.preempted) & set(plan.scheduled) and not set(plan.rejected) & set(plan.scheduled)
    steps = run.recorder.step_table()
    assert (steps["kv_blocks_used"] <= engine["num_blocks"]).all()
    kv = run.caches[0]
    assert kv.available_blocks == engine["num_blocks"]  # everything released: free or cached
    if kv.prefix is not None:
        assert not kv.prefix.paths and all(node.refs == 0 for node in kv.prefix.nodes())
        assert kv.prefix.evictable_blocks == kv.prefix.cached_blocks
    tokens = Counter()
    runs = run.recorder.run_table()
    for rid, count in zip(runs["request_id"], runs["tokens"]):
        tokens[int(rid)] += int(count)
    for req in run.requests:
        assert req.status in (Status.FINISHED, Status.REJECTED)
        if req.status == Status.REJECTED:
            assert req.reject_reason and tokens[req.id] == 0
            continue
        assert tokens[req.id] == req.output_len == req.num_output_tokens
    computed = steps["prefill_tokens"].sum() + steps["decode_tokens"].sum()
    needed = sum(r.prompt_len + r.output_len - 1 for r in run.requests if r.status == Status.FINISHED)
    hit_tokens = kv.prefix.hit_tokens if kv.prefix is not None else {}
    hits = sum(hit_tokens.get(r.id, 0) for r in run.requests if r.status == Status.FINISHED)
    if not steps["preemptions"].any():
        assert computed + hits == needed


def simulate(policy, specs, engine, **kw):
    return run_prefix(policy, to_requests(specs, engine["hash_block_size"]), max_model_len=MAX_MODEL_LEN,
                      **engine, **kw)


@pytest.mark.slow
@given(POLICIES, SPECS, ENGINE)
def test_prefix_invariants_hold_for_every_policy(policy, specs, engine):
    run = simulate(policy, specs, engine, wrap=Checked)
    check_run(run, policy, engine)


@pytest.mark.slow
@given(POLICIES, SPECS, ENGINE)
def test_fast_forward_changes_nothing_with_prefix_caching(policy, specs, engine):
    fast = simulate(policy, specs, engine, fast_forward=True)
    slow = simulate(policy, specs, engine, fast_forward=False)
    for a, b in zip(fast.requests, slow.requests):
        assert (a.status, a.first_token_time, a.completion_time, a.num_preemptions, a.first_token_step) == \
               (b.status, b.first_token_time, b.completion_time, b.num_preemptions, b.first_token_step)
    if engine["prefix_caching"]:
        assert fast.caches[0].prefix.hit_tokens == slow.caches[0].prefix.hit_tokens
        assert fast.caches[0].prefix.evicted_blocks == slow.caches[0].prefix.evicted_blocks
    fs, ss = fast.recorder.step_table(), slow.recorder.step_table()
    for name in fs:
        assert np.array_equal(fs[name], ss[name]), name
