"""Lower KV tiers behind the prefix cache: CPU DRAM, local SSD, a remote store (one replica's).

What the engines do, and what cbsim keeps of it:
- SGLang HiCache (python/sglang/srt/mem_cache/hiradix_cache.py, docs/advanced_features/hicache_design.md):
  one radix tree whose nodes record where their KV is (GPU L1, host L2, storage L3). `write_through`
  copies a node to host as soon as it is inserted (`write_through_selective` once it is hit again),
  asynchronously on its own stream; `write_back` copies it only when the GPU evicts it, and the eviction
  waits for that copy. A later match that ends in host-only nodes loads them back to the GPU, the load
  overlapped layer by layer with the forward that needs them.
- vLLM's OffloadingConnector (vllm-project/vllm @7368908, vllm/distributed/kv_transfer/kv_connector/v1/
  offloading_connector.py, vllm/v1/kv_offload/ with an LRU CPU manager): `_get_reqs_to_store` stores every
  full block a step computes (write-through, asynchronously); `get_num_new_matched_tokens` looks the CPU up
  after the GPU's hit and returns its tokens with load_async True, so the request waits
  (WAITING_FOR_REMOTE_KVS) while its blocks load and the other requests run.
- LMCache (LMCacheConnectorV1): chunks are stored after prefill to its CPU / disk / remote backends
  (write-through) and, without `use_layerwise`, loaded before the forward that needs them (blocking).

The model: a prefix-cache unit (sim/kv/prefix.py Node) that leaves the GPU keeps a copy in the first
tier that has it, under the write policy: `write_through` (a copy is made when a request computes or
hits a unit that has none; an eviction without a copy drops it), `write_through_selective` (the same
from its second request on) or `write_back` (a copy is made when the GPU evicts it). Every
tier is LRU; a tier that overflows demotes its least recently used unit to the next tier, and the last
one drops it. Copies stay while the unit is on the GPU again (inclusive, as HiCache and the CPU
manager keep them). A request whose prefix continues, beyond the GPU's cached path, in units some tier
holds restores them: they are read back at that tier's bandwidth (sim/kv/tier_traffic.py books the
bytes on the tier's links) and the step that admits it waits for them (sim/replica.py).

Swap shares the CPU tier (sim/preemption.py): a swapped-out request's blocks take CPU-tier room
(`reserved`), demoting cached units to make it; swap is refused (recompute) only when the swapped
blocks alone would not fit.

Invariants: for every tier, used + (tier 0: reserved) <= capacity (in blocks), used is the blocks of
the units it holds; a unit is in at most one tier; `where` maps exactly the held units to their tier.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


# write policy -> hits at which a unit is copied to tier 0 (write_back: at eviction instead)
WRITE_THRESHOLDS = {"write_through": 1, "write_through_selective": 2}


@dataclass(frozen=True)
class Tier:
    """One lower tier: its name, capacity in KV blocks, read/write bandwidth (bytes/s) and latency (s)."""

    name: str
    capacity_blocks: int
    bandwidth: float
    latency: float = 0.0


class TierStore:
    """The units the lower tiers hold, LRU per tier, and the blocks to move since the last step."""

    def __init__(self, tiers: list[Tier], unit_blocks: int, write_policy: str = "write_through",
                 layerwise: bool = True):
        if not tiers or write_policy not in ("write_through", "write_through_selective", "write_back"):
            raise ValueError("a TierStore needs tiers and a write policy write_through(_selective) or write_back")
        self.tiers = tiers
        self.unit_blocks = unit_blocks
        self.write_policy = write_policy
        self.layerwise = layerwise  # restores overlap the forward layer by layer (else the step waits for them)
        self.levels: list[OrderedDict] = [OrderedDict() for _ in tiers]  # (depth, key) -> Node, LRU first
        self.where: dict[tuple, int] = {}  # (depth, key) -> tier index
        self.used = [0] * len(tiers)  # blocks of the held units, per tier
        self.reserved = 0  # CPU-tier blocks held by swapped-out requests (sim/preemption.py)
        # blocks to move, drained by TierTraffic each step: reads (restores) and writes, per tier
        self.reads = [0] * len(tiers)
        self.writes = [0] * len(tiers)
        self.sync_writes = 0  # write_back: blocks the GPU evicted this step, written to tier 0 before reuse
        self.restored_units = [0] * len(tiers)  # units read back over the run, per tier
        self.written_units = [0] * len(tiers)  # units written into each tier (stores and demotions)
        self.dropped_units = 0  # units the last tier let go
        self.restored_tokens: dict[int, list[int]] = {}  # request id -> tokens restored per tier (first admission)
        self.restoring: list[int] = []  # requests that restored since the last step was booked

    # -- queries ---------------------------------------------------------------------------
    @staticmethod
    def key(node) -> tuple:
        return node.depth, node.key

    def find(self, depth: int, key: int):
        """The node a tier holds for unit `depth` with chain key `key`, if it is off the GPU (else None)."""
        level = self.where.get((depth, key))
        if level is None:
            return None
        node = self.levels[level][(depth, key)]
        return node if node.parent is None else None

    def level_of(self, node) -> int:
        return self.where[self.key(node)]

    def room(self, level: int) -> int:
        """Blocks tier `level` can still take without demoting."""
        return self.tiers[level].capacity_blocks - self.used[level] - (self.reserved if level == 0 else 0)

    # -- changes ---------------------------------------------------------------------------
    def stored(self, node) -> None:
        """A request computed `node` (published it) or took it from the GPU cache: its hits grow, and a
        write-through policy copies a unit without a copy once its hits reach the threshold (SGLang
        HiRadixCache._inc_hit_count: 1 for write_through, 2 for write_through_selective; vLLM's connector
        stores every block of a request's that the CPU lacks)."""
        node.hits += 1
        threshold = WRITE_THRESHOLDS.get(self.write_policy)
        if threshold is not None and node.hits >= threshold and self.key(node) not in self.where:
            self._put(node, 0)

    def evicted(self, node) -> None:
        """The GPU evicted `node`: it lives on where a tier has a copy; write_back makes the copy now."""
        level = self.where.get(self.key(node))
        if level is not None:
            self.levels[level][self.key(node)] = node  # (the same unit: keep this object, the one detached)
            return
        if self.write_policy == "write_back" and self._put(node, 0) == 0:
            self.sync_writes += self.unit_blocks  # (booked apart from the other writes: the step waits for it)
            self.writes[0] -= self.unit_blocks

    def restore(self, node, request_id: int, unit_tokens: int, first: bool) -> int:
        """`node` goes back to the GPU for `request_id`: its tier's blocks are read; it stays there (LRU
        refreshed). Returns its tier."""
        key = self.key(node)
        level = self.where[key]
        self.levels[level].move_to_end(key)
        self.reads[level] += self.unit_blocks
        self.restored_units[level] += 1
        if not self.restoring or self.restoring[-1] != request_id:
            self.restoring.append(request_id)
        if first:
            per = self.restored_tokens.setdefault(request_id, [0] * len(self.tiers))
            per[level] += unit_tokens
        return level

    def reserve(self, blocks: int) -> bool:
        """Swap-out of `blocks` blocks into the CPU tier: demote cached units until they fit; False (and
        nothing changed) if they cannot fit even with tier 0 emptied of cached units."""
        if self.reserved + blocks > self.tiers[0].capacity_blocks:
            return False
        self.reserved += blocks
        self._make_room(0, 0)
        return True

    def unreserve(self, blocks: int) -> None:
        self.reserved -= blocks

    def _put(self, node, level: int) -> int | None:
        """Copy `node` into tier `level` (MRU), or the first tier below it that can ever hold a unit;
        returns the tier written, None if none was (a copy was there already, or every tier is too small)."""
        key = self.key(node)
        have = self.where.get(key)
        if have is not None:
            self.levels[have][key] = node
            self.levels[have].move_to_end(key)
            return None
        if self.unit_blocks > self.tiers[level].capacity_blocks - (self.reserved if level == 0 else 0):
            return self._put(node, level + 1) if level + 1 < len(self.tiers) else self._drop()
        self._make_room(level, self.unit_blocks)
        self.levels[level][key] = node
        self.where[key] = level
        self.used[level] += self.unit_blocks
        self.writes[level] += self.unit_blocks
        self.written_units[level] += 1
        return level

    def _make_room(self, level: int, blocks: int) -> None:
        """Demote tier `level`'s least recently used units until `blocks` more fit."""
        units = self.levels[level]
        while units and self.room(level) < blocks:
            key, node = units.popitem(last=False)
            del self.where[key]
            self.used[level] -= self.unit_blocks
            if level + 1 < len(self.tiers):
                self._put(node, level + 1)
            else:
                self._drop()

    def _drop(self) -> None:
        self.dropped_units += 1

    def occupancy(self) -> tuple:
        """Blocks each tier holds now (tier 0: cached units and swapped requests)."""
        return tuple(self.used[i] + (self.reserved if i == 0 else 0) for i in range(len(self.tiers)))
