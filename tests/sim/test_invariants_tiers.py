"""Property-based invariants with lower KV tiers (sim/kv/tiers.py) behind the prefix cache, for every policy.

The shared-prefix workloads of test_invariants_prefix.py on small GPU caches, with one or two lower
tiers of random (often tiny) capacity, either write policy, either load mode and every preemption
mode (ENGINE_FIELDS: swap shares the cpu tier). Checked before every plan: the prefix-cache invariants (refcounts,
no held node evicted, free + held + evictable == total, free >= 0, restored units included) and the
tiers': each tier's used blocks are those of the units it holds, used (+ swapped requests on cpu) never
exceeds its capacity, a unit is in one tier at most, and the cpu tier's reservation is the swapped
blocks. Over the run: every request finishes with exactly output_len tokens or is rejected with a
reason, the cache ends unreferenced, computed + hit (GPU and restored) tokens == needed tokens when
nothing was preempted, and the same inputs give the same run.
"""
import numpy as np
import pytest
from hypothesis import event, given
from hypothesis import strategies as st

from cbsim.sim.kv.tiers import Tier, TierStore

from test_invariants_prefix import POLICIES, Checked, check_run, simulate
from test_invariants import ENGINE_FIELDS

TIERS = st.fixed_dictionaries({
    "cpu": st.integers(0, 80), "ssd": st.one_of(st.none(), st.integers(0, 120)),
    "write_policy": st.sampled_from(["write_through", "write_through_selective", "write_back"]), "layerwise": st.booleans(),
})
# test_invariants_prefix.SPECS, leaning to next turns (kind 1) of earlier requests: what tiers bring back
SPECS = st.lists(st.tuples(st.floats(0, 4, allow_nan=False), st.sampled_from([0, 1, 1, 1]), st.integers(0, 3),
                           st.integers(1, 6), st.integers(1, 60), st.integers(1, 30), st.integers(0, 2)),
                 min_size=2, max_size=16)
ENGINE = st.fixed_dictionaries({
    **ENGINE_FIELDS,
    "num_blocks": st.integers(8, 30),
    "hash_block_size": st.sampled_from([2, 4, 8, 16]),
    "prefix_caching": st.just(True),
})


def store_factory(spec: dict):
    def make(kv) -> TierStore:
        levels = [Tier("cpu", spec["cpu"], 1e9, 0.0)]  # the host link's (run_prefix)
        if spec["ssd"] is not None:
            levels.append(Tier("ssd", spec["ssd"], 5e8, 1e-4))
        return TierStore(levels, kv.prefix.unit_blocks, spec["write_policy"], spec["layerwise"])
    return make


def check_tiers(store: TierStore, host_blocks: int) -> None:
    seen = set()
    assert store.reserved == host_blocks
    for level, units in enumerate(store.levels):
        assert store.used[level] == len(units) * store.unit_blocks
        held = store.used[level] + (store.reserved if level == 0 else 0)
        # (swapped requests alone may fill cpu: a swap is refused beyond its capacity)
        assert held <= store.tiers[level].capacity_blocks
        for key, node in units.items():
            assert store.where[key] == level and key not in seen and (node.depth, node.key) == key
            seen.add(key)
    assert set(store.where) == seen


class CheckedTiers(Checked):
    def schedule(self, state):
        check_tiers(state.kv.prefix.tiers, state.kv.host_blocks)
        return super().schedule(state)


def run(policy, specs, engine, tiers, **kw):
    return simulate(policy, specs, engine, tiers=store_factory(tiers), **kw)


@pytest.mark.slow
@given(POLICIES, SPECS, ENGINE, TIERS)
def test_tier_invariants_hold_for_every_policy(policy, specs, engine, tiers):
    result = run(policy, specs, engine, tiers, wrap=CheckedTiers)
    check_run(result, policy, engine)
    store = result.caches[0].prefix.tiers
    check_tiers(store, result.caches[0].host_blocks)
    event("restored from a tier" if any(store.restored_units) else "no restore")
    assert store.reserved == 0  # every swapped request came back or left


@pytest.mark.slow
@given(POLICIES, SPECS, ENGINE, TIERS)
def test_tiered_runs_are_deterministic(policy, specs, engine, tiers):
    a = run(policy, specs, engine, tiers)
    b = run(policy, specs, engine, tiers)
    for x, y in zip(a.requests, b.requests):
        assert (x.status, x.first_token_time, x.completion_time, x.num_preemptions) == \
               (y.status, y.first_token_time, y.completion_time, y.num_preemptions)
    sa, sb = a.caches[0].prefix.tiers, b.caches[0].prefix.tiers
    assert sa.restored_tokens == sb.restored_tokens and sa.restored_units == sb.restored_units
    assert a.replicas[0].tiering.occupancy == b.replicas[0].tiering.occupancy
    ta, tb = a.recorder.step_table(), b.recorder.step_table()
    for name in ta:
        assert np.array_equal(ta[name], tb[name], equal_nan=True), name

