"""The transfers of the lower KV tiers (sim/kv/tiers.py), booked on links (sim/kv/link.py) each step.

At a step's start the replica hands its tier traffic here: the blocks the step's admissions restore, the
write_back stores of the units it evicted, and the write-through copies and demotions since the last step.
Restores and write_back stores decide how long the step lasts (`step_time`); the others hold their links
beside the steps. Each sample of what the tiers hold is kept for the kv_tiers table and figure.
"""
from __future__ import annotations

from cbsim.sim.kv.link import KVLink
from cbsim.sim.kv.tiers import TierStore


class TierTraffic:
    """The transfers a step's tier traffic takes, on two links per tier (reads up to the GPU, writes down:
    PCIe and NVMe are full duplex); tier 0's read link is the replica's host link, shared with swap-ins.

    `book(start, block_bytes)` drains the store's counters at a step's start and returns (seconds the
    step's restores take, seconds its synchronous write_back stores take), each from `start`.
    Demotions and write_through copies are booked but waited for by nobody (they run beside the steps)."""

    def __init__(self, store: TierStore, host_link: KVLink, index: int):
        if host_link.bandwidth != store.tiers[0].bandwidth or host_link.latency != store.tiers[0].latency:
            raise ValueError("the first tier's bandwidth and latency are the host link's (cbsim/build.py)")
        self.store = store
        self.layerwise = store.layerwise
        self.read_links = [host_link] + [KVLink(f"{t.name}_read{index}", t.bandwidth, t.latency,
                                                key=f"cluster.kv_cache.tiers.levels[{i + 1}]")
                                         for i, t in enumerate(store.tiers[1:])]
        self.write_links = [KVLink(f"{t.name}_write{index}", t.bandwidth, t.latency,
                                   key=f"cluster.kv_cache.tiers.levels[{i}]") for i, t in enumerate(store.tiers)]
        self.occupancy: list[tuple] = []  # (time, blocks per tier, units restored so far per tier), when changed
        self.restore_stall = 0.0  # seconds steps waited beyond their compute for restores and stores
        self.request_stall: dict[int, float] = {}  # request id -> seconds its admission step waited on them

    @property
    def links(self) -> list[KVLink]:
        return self.read_links[1:] + self.write_links

    def book(self, start: float, block_bytes: float) -> tuple[float, float]:
        store = self.store
        read_end = write_end = start
        sync = store.sync_writes
        if sync:
            write_end = self.write_links[0].submit(start, sync * block_bytes, -1, "offload").end
            store.sync_writes = 0
        for level, blocks in enumerate(store.reads):
            if blocks:
                end = self.read_links[level].submit(start, blocks * block_bytes, -1, "restore").end
                read_end = max(read_end, end)
                store.reads[level] = 0
        for level, blocks in enumerate(store.writes):
            if blocks:
                self.write_links[level].submit(start, blocks * block_bytes, -1, "offload")
                store.writes[level] = 0
        now = store.occupancy(), tuple(store.restored_units)
        if not self.occupancy or self.occupancy[-1][1:] != now:
            self.occupancy.append((start, *now))
        return read_end - start, write_end - start

    def step_time(self, start: float, compute: float, block_bytes: float) -> float:
        """The step's whole time with its tier traffic: restores overlapped with the forward layer by layer
        (the step lasts the longer of the two) or, not layerwise, before it; write_back stores first."""
        restore, store_wait = self.book(start, block_bytes)
        whole = (max(compute, restore) if self.layerwise else compute + restore) + store_wait
        stall = max(0.0, whole - compute)
        self.restore_stall += stall
        for rid in self.store.restoring:
            self.request_stall[rid] = self.request_stall.get(rid, 0.0) + stall
        self.store.restoring = []
        return whole
