"""Wiring of one simulated cluster: an arrivals process, a router and the replica processes.

Invariant: requests reach the router in arrival order at their arrival time, before any step
that starts at that same instant (URGENT events), or, where one replica receives every arrival and
runs a prompt run, by its next step's start (it pulls them itself at its steps' starts); the run
ends when every request has finished or been rejected, or at `max_time`. `simulate` wires colocated replicas; `run_cluster` drives any
wiring (sim/pd.py builds P/D pools and adds its own "not done yet": requests between the pools).
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, Sequence

import simpy

from cbsim.sim.clock import UrgentTimeout, delay_to
from cbsim.sim.cost import CostModel
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.metrics.recorder import Recorder
from cbsim.sim.dp_lockstep import lockstep_groups
from cbsim.sim.pipeline import make_replica
from cbsim.sim.replica import Replica, ReplicaSettings
from cbsim.sim.request import Request
from cbsim.sim.request_table import RequestTable
from cbsim.sim.router import ROUTERS
from cbsim.sim.row_order import by_replica


class ArrivalFeed:
    """Delivers requests to the router in arrival order, at their arrival times.

    `deliver_until(t)` routes every request with arrival <= t that has not been routed yet; the
    feed's own process calls it when SimPy's clock reaches the next arrival (or, while the one
    replica that receives them all is amid a prompt run, at the run's end: `taken_until`), and a
    replica calls it at each step start (with its exact clock), so a request is visible to every step
    that starts at or after its arrival whatever SimPy's rounding.
    """

    def __init__(self, env, requests: Sequence[Request]):
        self.env = env
        self.requests = requests
        table = isinstance(requests, RequestTable)  # sim/request_table.py: objects made as requests arrive
        self.retire = requests.retire_done if table else None
        self.take = requests.arrive if table else requests.__getitem__
        self.index = 0
        self.next_time = self.take(0).arrival if len(requests) else math.inf  # the next arrival (inf: none left)
        self.router = None
        self.on_done = lambda: None
        # until when the one replica that receives every arrival takes each itself, at its steps' starts
        # (amid a prompt run: Replica.takes_arrivals_until); the feed need not wake for them before then
        self.taken_until = lambda: -math.inf

    def deliver_until(self, time: float) -> None:
        requests = self.requests
        while self.next_time <= time:
            req = self.take(self.index)
            self.index += 1
            self.next_time = self.take(self.index).arrival if self.index < len(requests) else math.inf
            self.router.route(req).enqueue(req)
        if self.retire is not None:
            self.retire()
        if self.index == len(requests):
            self.on_done()

    def peek(self, k: int) -> Request | None:
        """The k-th request not routed yet (k = 0: the next), made as it will arrive; None past the last.
        Routing is left to its time (a prompt run looks ahead: sim/prompt_run.py)."""
        index = self.index + k
        return self.take(index) if index < len(self.requests) else None

    def time_of(self, k: int) -> float:
        """When the k-th request not routed yet arrives (inf: past the last)."""
        req = self.peek(k)
        return math.inf if req is None else req.arrival

    def run(self):
        env = self.env
        while self.index < len(self.requests):
            arrival = self.next_time
            wake = max(arrival, self.taken_until())
            if wake > env.now:
                yield UrgentTimeout(env, delay_to(env.now, wake))
            self.deliver_until(max(env.now, arrival))
        self.on_done()


RUN_AHEAD = 2  # a least-loaded replica's runs price steps up to the (RUN_AHEAD x replicas)-th next arrival


class RoutedArrivals:
    """The requests one replica of several will receive, looked at before they are routed, where the router
    routes by count alone (RoundRobin.upcoming): `peek(k)`, the k-th of them (ArrivalFeed.peek's contract),
    and `next_time`, when the next one arrives. A run of that replica takes them as a lone replica's run
    takes the feed's (sim/prompt_run.py), and other replicas' arrivals are no outside event for it; the feed
    still routes every request at its time."""

    def __init__(self, feed: ArrivalFeed, position: int):
        self.feed = feed
        self.position = position  # the replica's place in the list the router routes over

    def peek(self, k: int) -> Request | None:
        return self.feed.peek(self.feed.router.upcoming(self.position, k))

    @property
    def next_time(self) -> float:
        return self.feed.time_of(self.feed.router.upcoming(self.position, 0))


def simulate(requests: Sequence[Request], make_policy: Callable[[], object], cost: CostModel,
             make_kv: Callable[[], KVCache], settings: ReplicaSettings, replicas: int = 1,
             router: str = "round_robin", max_time: float | None = None,
             noise: Callable[[], float] | None = None, progress=None,
             clients=None) -> tuple[Recorder, list[Replica]]:
    """Run the requests (sorted by arrival) through `replicas` colocated replicas; returns what was
    recorded. `progress`: a sim.progress.Progress that reports a long run (None: silent).
    `clients`: a workloads.clients.ClientPlan (timeouts, closed-loop clients); None: open loop.
    A cost model with `pipeline_stages` P > 1 gets pipelined replicas (sim/pipeline.py).
    (P/D clusters: sim/pd.py, simulate_pd.)"""
    if isinstance(requests, RequestTable) and clients is not None:
        raise ValueError("closed-loop clients and client timeouts need the requests as a list, not a RequestTable")
    env = simpy.Environment()
    recorder = Recorder()
    feed = (clients and clients.feed(env, requests)) or ArrivalFeed(env, requests)
    if clients is not None:
        settings = replace(settings, client_timeout=clients.timeout)
    routes = ROUTERS[router]
    sees_runs = clients is None and getattr(routes, "sees_runs", False)
    if replicas > 1 and router != "round_robin" and not sees_runs:  # it reads the replicas' state at each arrival
        settings = replace(settings, runs_end_before_horizon=True)
        if clients is not None and clients.sequenced:  # a reply elsewhere may route a request amid a run,
            settings = replace(settings, fast_forward=False)  # whose steps are committed only at its end
    groups = lockstep_groups(env, cost, settings, replicas)  # data-parallel attention ranks (sim/dp_lockstep.py)
    pool = [make_replica(env, i, make_policy(), cost, make_kv(), recorder, settings, lambda: feed.next_time,
                         noise=noise, pull=feed.deliver_until, group=groups[i]) for i in range(replicas)]
    if hasattr(feed, "attach"):  # closed loop: the clients hear when a request leaves
        feed.attach(pool)
    if clients is None and replicas == 1:  # every arrival goes to it, open loop: a prompt run may look ahead
        pool[0].arrivals = feed
        feed.taken_until = lambda: pool[0].takes_arrivals_until
    elif clients is None and hasattr(routes, "upcoming"):  # each sees its own arrivals ahead
        for position, replica in enumerate(pool):
            view = replica.arrivals = RoutedArrivals(feed, position)
            replica.horizon = lambda view=view: view.next_time  # other replicas' arrivals do not touch it
    elif sees_runs:  # the router reads what a run in flight reports: an arrival routed here cuts the run
        for replica in pool:
            # (an arrival elsewhere does not end a run; the horizon only bounds the steps a run prices ahead:
            # about one arrival in `replicas` comes here, and a run it cuts wasted the steps priced past it)
            replica.horizon = lambda: feed.time_of(RUN_AHEAD * replicas - 1)
            replica.cut_by_arrivals = True
    run_cluster(env, feed, pool, pool, router, max_time, progress=progress)
    return recorder, pool


def run_cluster(env, feed: ArrivalFeed, replicas: Sequence[Replica], entry: Sequence[Replica], router: str,
                max_time: float | None, busy: Callable[[], bool] = lambda: False, progress=None) -> None:
    """Route arrivals over `entry` and run until every request is done (or `max_time`); then the
    replicas' recorder holds its rows in the step table's order (sim/row_order.py).

    Done: the feed is empty, every replica idle with nothing landed, and `busy()` false (P/D: no
    request waiting for decode room or on a link). `progress` watches from a process of its own."""
    drained = env.event()

    def check_drained():
        if (feed.next_time == math.inf and not drained.triggered and not busy()
                and all(r.is_idle and not r.landed for r in replicas)):
            drained.succeed()

    for replica in replicas:
        replica.on_idle = check_drained
        replica.stop_time = math.inf if max_time is None else max_time  # fast-forwarded runs end before it
    feed.router = ROUTERS[router](entry)
    feed.on_done = check_drained
    env.process(feed.run())
    if progress is not None:
        env.process(progress.watch(env, feed))
    env.run(until=drained if max_time is None else max_time)
    if progress is not None:
        progress.finish(env, feed)
    if isinstance(feed.requests, RequestTable):  # fold in the requests that finished since the last sweep
        feed.requests.retire_done(force=True)
    by_replica(replicas[0].recorder, feed.requests)  # the step table's row order, one rule
