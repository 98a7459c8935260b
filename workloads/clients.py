"""Clients: closed-loop senders with a concurrency limit and think time, and client timeouts.

Invariant: a closed-loop run keeps at most `max_concurrency` requests in flight (sent and neither
finished nor failed). Each client holds one *session* at a time (a lone request is a session of
one turn) and sends its turns one after another: the first when the client is free and the
session's planned time has come, whichever is later (as `vllm bench serve --max-concurrency`
holds requests drawn at a rate behind a semaphore), each later turn `think` seconds after the
previous turn's reply. Sessions start in the order of their planned times. Every send time is
decided by the simulation's own events and think times drawn before the run (indexed by request,
not by client), so a run is as deterministic as an open-loop one; requests leaving at one instant
all leave before any replica plans at that instant (the replicas yield once after a commit),
sends due at one instant go out in request-id order, and a request sent to a replica during a
fast-forwarded run cuts the run at its arrival, so fast-forward changes nothing.

A request's `arrival` becomes the time it reaches the scheduler: the client's send time plus the
engine's front-end delay when the run models one (`client_arrival` holds the send times then).
A reply counts when the scheduler finishes the request (the front end's streaming lag is not
waited for). A failed turn (rejected, timed out) does not end its session: the next turn is sent
as if the reply had come, with the prompt the plan gave it.

Agentic sessions (workloads/agentic.py) are programs rather than chains: a request may wait for
several others (a turn for the slowest of its parallel tool calls, a parent turn for its
sub-agents), given in `waits` as (request, delay) pairs; it is sent at the latest of those replies
plus their delays, once all of them have left. A client holds a whole session (its sub-agents
included, so a session may have several requests in flight) and takes the next one when every
request of it has left. Without `max_concurrency` every session has its own client (sessions start
at their planned times, open loop). Plain sessions are the special case of one wait on the previous
turn, delayed by the think time, and keep their own path here.

Timeouts are the replicas' (sim/replica.py, `client_timeout`); the feed only learns that a
request left, by `leave`.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from cbsim.sim.clock import UrgentTimeout, delay_to
from cbsim.sim.request import Request, Status


@dataclass
class ClientPlan:
    """What the clients of a run do, fixed before it starts (built by workloads/build.py)."""

    timeout: float | None = None  # seconds from arrival after which a request is aborted; None: never
    max_concurrency: int | None = None  # closed loop when set
    think: np.ndarray | None = None  # by request id: seconds a client waits after a reply before sending it
    sessions: list[list[int]] | None = None  # request ids of each session, turns in order (closed loop)
    client_arrival: np.ndarray | None = None  # by request id: client send times, when a front end delays arrival
    # agentic sessions: by request id, the (request, delay) pairs it waits for (empty: a session's start)
    waits: list[tuple[tuple[int, float], ...]] | None = None

    @property
    def closed_loop(self) -> bool:
        return self.max_concurrency is not None

    @property
    def sequenced(self) -> bool:
        """Sends follow replies: a closed loop, or agentic sessions (open loop or not)."""
        return self.closed_loop or self.waits is not None

    def feed(self, env, requests):
        """The arrival feed of a run whose sends follow replies (None: open loop, the plain ArrivalFeed)."""
        return ClientFeed(env, requests, self) if self.sequenced else None


class ClientFeed:
    """Delivers requests like sim.simulation.ArrivalFeed, but sends each when its client may: the
    same interface (`next_time`, `deliver_until`, `run`, `router`, `on_done`, `index`), plus `leave`,
    which the replicas call when a request finishes or fails."""

    def __init__(self, env, requests, plan: ClientPlan):
        self.env = env
        self.requests = requests
        self.plan = plan
        self.router = None
        self.on_done = lambda: None
        self.index = 0  # requests sent so far
        by_id = {req.id: req for req in requests}
        self.by_id = by_id
        client = plan.client_arrival
        self.planned = {rid: (req.arrival if client is None else float(client[rid])) for rid, req in by_id.items()}
        self.delay = {rid: req.arrival - self.planned[rid] for rid, req in by_id.items()}  # front end
        sessions = plan.sessions or [[req.id] for req in requests]
        self.sessions = sorted(sessions, key=lambda s: (self.planned[s[0]], s[0]))
        self.turn = {rid: (s, k) for s in range(len(self.sessions)) for k, rid in enumerate(self.sessions[s])}
        self.next_session = 0
        self.pending: list[tuple[float, int]] = []  # (arrival at the scheduler, request id): ties go by id
        self.send_time: dict[int, float] = {}  # request id -> when its client sends it
        self.in_flight = 0
        self.max_in_flight = 0
        self._wake = None
        if plan.waits is not None:
            self._program(plan.waits)
        clients = len(self.sessions) if plan.max_concurrency is None else plan.max_concurrency
        for _ in range(min(clients, len(self.sessions))):
            self._start_session(0.0, first=True)

    def _program(self, waits) -> None:
        """Agentic sessions: who waits for whom, and how many requests of each session are left."""
        self.waits = waits
        self.missing = [len(w) for w in waits]  # replies each request still waits for
        self.dependents: list[list[int]] = [[] for _ in waits]
        for rid, pairs in enumerate(waits):
            for pred, _ in pairs:
                self.dependents[pred].append(rid)
        self.replied: dict[int, float] = {}  # request id -> when it left
        self.left = [len(session) for session in self.sessions]

    # -- planning sends ------------------------------------------------------------------
    def _start_session(self, free_at: float, first: bool = False) -> None:
        """A client free at `free_at` takes the next session, if any."""
        if self.next_session < len(self.sessions):
            rid = self.sessions[self.next_session][0]
            self.next_session += 1
            think = 0.0 if first else self._think(rid)
            self._schedule(max(free_at + think, self.planned[rid]), rid)

    def _think(self, rid: int) -> float:
        return 0.0 if self.plan.think is None else float(self.plan.think[rid])

    def _schedule(self, time: float, rid: int) -> None:
        """Plan `rid`'s send at `time` (client clock); it reaches the scheduler a front-end delay later."""
        self.send_time[rid] = time
        heapq.heappush(self.pending, (time + self.delay[rid], rid))
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def leave(self, req: Request, time: float) -> None:
        """`req` finished or failed at `time`: its client sends the session's next turn, or is free."""
        self.in_flight -= 1
        s, k = self.turn[req.id]
        if self.plan.waits is not None:
            self._release(req.id, s, time)
            return
        session = self.sessions[s]
        if k + 1 < len(session):
            self._schedule(time + self._think(session[k + 1]), session[k + 1])
        else:
            self._start_session(time)

    def _release(self, rid: int, s: int, time: float) -> None:
        """Agentic: `rid` left at `time`; send each request that waited for it and now for nobody, at
        the latest of its waits' replies plus delays; a session with nothing left frees its client."""
        self.replied[rid] = time
        for waiter in self.dependents[rid]:
            self.missing[waiter] -= 1
            if self.missing[waiter] == 0:
                self._schedule(max(self.replied[p] + delay for p, delay in self.waits[waiter]), waiter)
        self.left[s] -= 1
        if self.left[s] == 0:
            self._start_session(time)

    # -- the ArrivalFeed interface -------------------------------------------------------
    @property
    def next_time(self) -> float:
        """When the next planned send reaches the scheduler (inf: none planned)."""
        return self.pending[0][0] if self.pending else math.inf

    def deliver_until(self, time: float) -> None:
        """Send every planned request that reaches the scheduler by `time`."""
        while self.pending and self.next_time <= time:
            arrival, rid = heapq.heappop(self.pending)
            req = self.by_id[rid]
            req.arrival = arrival
            if self.plan.client_arrival is not None:
                self.plan.client_arrival[rid] = self.send_time[rid]
            self.index += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            self.router.route(req).enqueue(req)
            if req.status == Status.REJECTED:  # refused at arrival: the client has its answer now
                self.leave(req, req.arrival)
        if self.index == len(self.requests):
            self.on_done()

    def run(self):
        """Send each planned request when its time comes (an urgent timeout, as ArrivalFeed), and wait
        for replies when none is due (a reply that plans a send wakes it). Never sends early."""
        env = self.env
        while self.index < len(self.requests):
            due = self.next_time
            if due > env.now:
                self._wake = env.event()
                wait = [self._wake] if due == math.inf else [UrgentTimeout(env, delay_to(env.now, due)), self._wake]
                yield env.any_of(wait)
                self._wake = None
                continue  # a reply may have planned an earlier send: look again
            self.deliver_until(env.now)
        self.on_done()

    # -- wiring --------------------------------------------------------------------------
    def attach(self, replicas) -> None:
        """Hear from every replica when a request leaves (a reply elsewhere may send a request to a
        replica in the middle of a fast-forwarded run: the replica then cuts the run short)."""
        for replica in replicas:
            replica.on_leave = self.leave
