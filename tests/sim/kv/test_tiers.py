"""Lower KV tiers (sim/kv/tiers.py): the store's LRU, demotion and capacity; restores in a run."""
import pytest

from cbsim.sim.kv.prefix import Node
from cbsim.sim.kv.tiers import Tier, TierStore

from test_prefix import chain_requests, run_prefix


def detached(depth: int, key: int) -> Node:
    return Node(None, key, depth)


def test_lru_demotes_to_the_next_tier_and_the_last_drops():
    store = TierStore([Tier("cpu", 4, 1e9), Tier("ssd", 4, 1e8)], unit_blocks=2, write_policy="write_back")
    nodes = [detached(1, k) for k in range(4)]
    for node in nodes:
        store.evicted(node)  # write_back: the eviction writes it, synchronously
    assert store.sync_writes == 8 and store.writes == [0, 4]  # units 0, 1 demoted to ssd
    assert [store.where[(1, k)] for k in range(4)] == [1, 1, 0, 0]
    store.restore(nodes[2], request_id=7, unit_tokens=32, first=True)  # refreshed: most recently used
    store.evicted(detached(1, 9))
    assert store.where[(1, 3)] == 1 and store.where[(1, 2)] == 0  # 3 was least recently used
    assert store.dropped_units == 1 and (1, 0) not in store.where  # ssd's oldest was dropped
    assert store.occupancy() == (4, 4) and store.restored_tokens == {7: [32, 0]}


def test_write_through_copies_at_publish_and_evictions_without_a_copy_vanish():
    store = TierStore([Tier("cpu", 2, 1e9)], unit_blocks=1)
    a, b, c = detached(1, 1), detached(2, 2), detached(3, 3)
    store.stored(a)
    store.stored(b)
    store.stored(c)  # a demoted off the only tier: dropped
    assert store.writes == [3] and store.dropped_units == 1
    store.evicted(a)  # no copy: nothing written, it is gone
    assert store.find(1, 1) is None and store.sync_writes == 0
    store.evicted(c)
    assert store.find(3, 3) is c


def test_swap_reservations_demote_cached_units_and_refuse_beyond_capacity():
    store = TierStore([Tier("cpu", 6, 1e9), Tier("ssd", 10, 1e8)], unit_blocks=2)
    for k in range(3):
        store.stored(detached(1, k))
    assert store.reserve(4) and store.used == [2, 4] and store.room(0) == 0
    assert not store.reserve(3)  # 4 + 3 > 6: the victim recomputes
    store.unreserve(4)
    assert store.reserved == 0


def _turns(gpu_blocks: int, tiers, bandwidth: float = 1e9, layerwise: bool = True, policy: str = "write_through"):
    """Request 0 has a 64-token prefix; requests 1-3 fill a small GPU cache with other prefixes; request 4
    comes back to prefix 0 with more tokens (a next turn)."""
    specs = [(0, 0, 4, 0, 2), (1, 1, 4, 0, 2), (2, 2, 4, 0, 2), (3, 3, 4, 0, 2), (4, 0, 4, 16, 2)]

    def store(kv):
        return TierStore([Tier("cpu", 40, bandwidth, 0.0)], kv.prefix.unit_blocks, policy, layerwise)
    return run_prefix({"name": "sarathi", "token_budget": 512, "max_num_seqs": 4}, chain_requests(specs),
                      num_blocks=gpu_blocks, cost={"type": "linear", "base": 0.01, "per_token": 1e-5},
                      tiers=store if tiers else None, swap_bandwidth=bandwidth)


def test_a_prefix_evicted_from_the_gpu_is_restored_from_cpu():
    plain, tiered = _turns(12, False), _turns(12, True)
    last = 4
    assert plain.caches[0].prefix.hit_tokens.get(last, 0) == 0  # evicted: recomputed
    assert tiered.caches[0].prefix.hit_tokens[last] == 64  # restored instead
    store = tiered.caches[0].prefix.tiers
    assert store.restored_tokens == {last: [64]} and store.restored_units == [4]
    steps_plain, steps_tiered = plain.recorder.step_table(), tiered.recorder.step_table()
    assert steps_tiered["prefill_tokens"].sum() == steps_plain["prefill_tokens"].sum() - 64


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_slow_restore_stretches_the_step_that_admits_it(layerwise):
    fast, slow = _turns(12, True, 1e12, layerwise), _turns(12, True, 1e3, layerwise)  # 4 blocks x 16 KiB
    restore = 4 * 16 * 1024.0 / 1e3  # seconds at 1 kB/s (run_prefix: 1024 bytes per token)
    delay = slow.requests[4].first_token_time - fast.requests[4].first_token_time
    assert delay == pytest.approx(restore, rel=0.05)
    assert slow.replicas[0].tiering.request_stall[4] == pytest.approx(restore, rel=0.05)


def test_write_back_steps_wait_for_the_units_they_evict_and_write_through_steps_do_not():
    slow = 1e3  # bytes/s: a 16-block write takes 16 s
    back = _turns(12, True, slow, policy="write_back").replicas[0].tiering
    through = _turns(12, True, slow, policy="write_through").replicas[0].tiering
    prefix = 4 * 16 * 1024.0 / slow  # seconds to move one 4-block prefix (1024 bytes per token)
    assert through.restore_stall == pytest.approx(prefix, rel=1e-3)  # request 4's restore, nothing else
    assert back.restore_stall >= 2 * prefix  # and at least one evicted prefix written back first


def test_selective_write_through_copies_a_unit_at_its_second_request_and_again_after_a_drop():
    store = TierStore([Tier("cpu", 1, 1e9)], unit_blocks=1, write_policy="write_through_selective")
    a, b = detached(1, 1), detached(2, 2)
    store.stored(a)
    assert store.where == {} and store.writes == [0]  # one request: no copy yet
    store.stored(a)
    assert store.where == {(1, 1): 0}
    store.stored(b)
    store.stored(b)  # b's copy demotes a's off the only tier
    assert store.dropped_units == 1 and (1, 1) not in store.where
    store.stored(a)  # a third request takes a: copied again
    assert store.where == {(1, 1): 0} and store.written_units == [3]
