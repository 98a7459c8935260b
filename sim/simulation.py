"""Wiring of one simulated cluster: an arrivals process, a router and the replica processes.

Invariant: requests reach the router in arrival order at their arrival time, before any step
that starts at that same instant (URGENT events); the run ends when every request has finished
or been rejected, or at `max_time`.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import simpy

from .clock import UrgentTimeout, delay_to
from .cost import CostModel
from .kv_cache import KVCache
from .recorder import Recorder
from .replica import Replica, ReplicaSettings
from .request import Request
from .router import ROUTERS


class ArrivalFeed:
    """Delivers requests to the router at their arrival times; knows when the next one comes."""

    def __init__(self, env, requests: Sequence[Request]):
        self.env = env
        self.requests = requests
        self.next_time = requests[0].arrival if requests else math.inf
        self.router = None
        self.on_done = lambda: None

    def run(self):
        env = self.env
        for req in self.requests:
            self.next_time = req.arrival
            if req.arrival > env.now:
                yield UrgentTimeout(env, delay_to(env.now, req.arrival))
            self.router.route(req).enqueue(req)
        self.next_time = math.inf
        self.on_done()


def simulate(requests: Sequence[Request], make_policy: Callable[[], object], cost: CostModel,
             make_kv: Callable[[], KVCache], settings: ReplicaSettings, replicas: int = 1,
             router: str = "round_robin", max_time: float | None = None) -> tuple[Recorder, list[Replica]]:
    """Run the requests (sorted by arrival) through `replicas` replicas; returns what was recorded."""
    env = simpy.Environment()
    recorder = Recorder()
    feed = ArrivalFeed(env, requests)
    drained = env.event()

    def check_drained():
        if feed.next_time == math.inf and not drained.triggered and all(r.is_idle for r in pool):
            drained.succeed()

    pool = [Replica(env, i, make_policy(), cost, make_kv(), recorder, settings, lambda: feed.next_time,
                    on_idle=check_drained) for i in range(replicas)]
    feed.router = ROUTERS[router](pool)
    feed.on_done = check_drained
    env.process(feed.run())
    env.run(until=drained if max_time is None else max_time)
    return recorder, pool
