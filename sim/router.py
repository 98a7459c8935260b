"""Routers: which replica an arriving request joins (colocated replicas; policies stay per replica).

Each router is a small class with `route(req) -> replica`; it reads the replicas' queues and KV
caches and never changes them. Ties go to the lowest replica index, so routing is deterministic.
"""
from __future__ import annotations

from typing import Sequence

from cbsim.sim.request import Request


def outstanding_tokens(replica, at: float | None = None) -> int:
    """Work a replica still owes: prompt and output tokens not yet computed, routed (not yet
    visible: it arrived during a step), waiting and running; at time `at`, less what the steps of a run
    in flight that ended before then computed (sim/run_progress.py)."""
    total = -replica.progress.tokens_done(at) if at is not None and replica.progress is not None else 0
    for req in replica.incoming:
        total += req.prompt_len + req.output_len - req.num_computed_tokens
    for req in replica.waiting:
        total += req.prompt_len + req.output_len - req.num_computed_tokens
    for req in replica.running:
        total += req.prompt_len + req.output_len - req.num_computed_tokens
    return total


class RoundRobin:
    """Each arrival to the next replica in turn, whatever they hold: so where the k-th request a replica will
    receive sits among those not routed yet is known ahead (`upcoming`), and a replica's run may look ahead
    at its own arrivals (sim/simulation.py RoutedArrivals)."""

    def __init__(self, replicas: Sequence):
        self.replicas = replicas
        self.next = 0

    def route(self, req: Request):
        replica = self.replicas[self.next]
        self.next = (self.next + 1) % len(self.replicas)
        return replica

    def upcoming(self, position: int, k: int) -> int:
        """Of the requests not routed yet, the place (0: the next one) of the k-th that will go to the replica
        at `position` in the routed-over list."""
        count = len(self.replicas)
        return (position - self.next) % count + k * count


class LeastLoaded:
    """The replica with the fewest outstanding tokens (ties: lowest index). It reads nothing a run in flight
    does not report (`sees_runs`: outstanding_tokens at the arrival), so a replica's runs go on past the
    arrivals routed elsewhere (sim/simulation.py)."""

    sees_runs = True

    def __init__(self, replicas: Sequence):
        self.replicas = replicas

    def route(self, req: Request):
        return min(self.replicas, key=lambda r: (outstanding_tokens(r, req.arrival), r.index))


class KVAware:
    """The replica with the most KV blocks available (free + evictable; ties: least loaded)."""

    def __init__(self, replicas: Sequence):
        self.replicas = replicas

    def route(self, req: Request):
        return min(self.replicas, key=lambda r: (-r.kv.available_blocks, outstanding_tokens(r), r.index))


def cached_tokens(replica, req: Request) -> int:
    """Tokens of `req`'s prompt prefix that `replica`'s prefix cache holds now (0 without one)."""
    prefix = replica.kv.prefix
    return 0 if prefix is None else len(prefix.lookup(req)) * prefix.unit_tokens


def num_requests(replica) -> int:
    """Requests a replica holds: routed but not yet visible, waiting, and running."""
    return len(replica.incoming) + len(replica.waiting) + len(replica.running)


class PrefixAffinity:
    """The replica whose prefix cache holds the longest prefix of the request (ties: least loaded).

    Guard against hot spots (as SGLang's cache-aware router): when the replicas' request counts
    differ by more than `balance_abs` and the largest exceeds `balance_rel` x the smallest, route to
    the least loaded replica instead (a prefix every request shares, such as a system prompt, would
    otherwise draw all traffic to the first replica that cached it).
    """

    balance_abs = 32
    balance_rel = 1.0001

    def __init__(self, replicas: Sequence):
        self.replicas = replicas

    def route(self, req: Request):
        counts = [num_requests(r) for r in self.replicas]
        if max(counts) - min(counts) > self.balance_abs and max(counts) > self.balance_rel * min(counts):
            return min(self.replicas, key=lambda r: (outstanding_tokens(r), r.index))
        return min(self.replicas, key=lambda r: (-cached_tokens(r, req), outstanding_tokens(r), r.index))


class SessionAffinity:
    """Keep a session on its replica: a request of an agentic session (`req.session`, workloads/agentic.py)
    joins the replica its session's first request joined; that first request, and a request of no
    session, joins the least loaded replica (ties: lowest index).

    As vLLM production-stack's `--routing-logic session` (SessionRouter, routing_logic.py: the session id
    from the `--session-key` header picks a replica on a consistent-hash ring; no session id: the replica
    with the lowest QPS) and llm-d's `session-affinity-scorer` (the replica that served the session
    before, named by a session cookie). Where the first replica is picked differs (a hash ring spreads
    sessions blindly, this picks the least loaded); that the session then stays is the same. A session
    stays whatever the replica's load (production-stack's ring does not rebalance either).
    """

    def __init__(self, replicas: Sequence):
        self.replicas = replicas
        self.home: dict[int, object] = {}  # session -> its replica

    def route(self, req: Request):
        home = self.home.get(req.session) if req.session is not None else None
        if home is None:
            home = min(self.replicas, key=lambda r: (outstanding_tokens(r), r.index))
            if req.session is not None:
                self.home[req.session] = home
        return home


ROUTERS = {"round_robin": RoundRobin, "least_loaded": LeastLoaded, "kv_aware": KVAware,
           "prefix_affinity": PrefixAffinity, "session_affinity": SessionAffinity}
