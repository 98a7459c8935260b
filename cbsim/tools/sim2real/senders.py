"""When the workload driver sends each request: at its arrival time (open loop), or when its client may
(closed loop: N concurrent clients, each sending its session's next turn a think time after the reply).

The closed-loop rule is cbsim's own, not a copy: `ClosedLoop` drives workloads/clients.py's ClientFeed (the
class the simulation's clients are) through its planning half, `_start_session` at the start and `leave`
on each reply, and pops the sends it plans from its `pending` heap; the simulation's delivery half (simpy
events, the router) is not used. The think times are the plan's, drawn by workloads.build_run from the
experiment's seed, so the real clients wait exactly what the simulated ones do. A request's send time is
its `arrival`: TTFT and E2E count from it, as `vllm bench serve` counts from its send.
"""
from __future__ import annotations

import heapq
import math
from types import SimpleNamespace


class OpenLoop:
    """Each request at its arrival time (ties in request order)."""

    def __init__(self, arrivals: list[float]):
        self.queue = sorted((a, i) for i, a in enumerate(arrivals))
        heapq.heapify(self.queue)

    @property
    def next_time(self) -> float:
        return self.queue[0][0] if self.queue else math.inf

    @property
    def left(self) -> int:
        return len(self.queue)

    def due(self, now: float) -> list[tuple[float, int]]:
        """(send time, request index) of every request due by `now`, in order."""
        out = []
        while self.queue and self.queue[0][0] <= now:
            out.append(heapq.heappop(self.queue))
        return out

    def replied(self, index: int, time: float) -> None:
        """Request `index` finished at `time` (open loop: nothing follows from it)."""


class ClosedLoop(OpenLoop):
    """The plan's clients (workloads/clients.py ClientPlan): at most max_concurrency requests in flight."""

    def __init__(self, arrivals: list[float], plan):
        from cbsim.workloads.clients import ClientFeed

        self.requests = [SimpleNamespace(id=i, arrival=a) for i, a in enumerate(arrivals)]
        self.feed = ClientFeed(None, self.requests, plan)  # plans the first sessions' sends
        self.queue = self.feed.pending  # (send time, request id), planned by the feed
        self.sent = 0

    @property
    def left(self) -> int:
        return len(self.requests) - self.sent

    def due(self, now: float) -> list[tuple[float, int]]:
        out = super().due(now)
        self.sent += len(out)
        self.feed.in_flight += len(out)
        return out

    def replied(self, index: int, time: float) -> None:
        self.feed.leave(self.requests[index], time)  # plans the session's next turn or the next session


def senders(arrivals: list[float], plan=None) -> OpenLoop:
    """The sender for a workload: closed loop when its client plan has a max_concurrency."""
    return ClosedLoop(arrivals, plan) if plan is not None and plan.closed_loop else OpenLoop(arrivals)
