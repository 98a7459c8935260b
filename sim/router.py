"""Routers: which replica an arriving request joins (colocated replicas; policies stay per replica)."""
from __future__ import annotations

from typing import Sequence

from .request import Request


def outstanding_tokens(replica) -> int:
    """Work a replica still owes: prompt and output tokens not yet computed, waiting and running."""
    total = 0
    for req in replica.waiting:
        total += req.prompt_len + req.output_len - req.num_computed_tokens
    for req in replica.running:
        total += req.prompt_len + req.output_len - req.num_computed_tokens
    return total


class RoundRobin:
    def __init__(self, replicas: Sequence):
        self.replicas = replicas
        self.next = 0

    def route(self, req: Request):
        replica = self.replicas[self.next]
        self.next = (self.next + 1) % len(self.replicas)
        return replica


class LeastLoaded:
    """The replica with the fewest outstanding tokens (ties: lowest index)."""

    def __init__(self, replicas: Sequence):
        self.replicas = replicas

    def route(self, req: Request):
        return min(self.replicas, key=lambda r: (outstanding_tokens(r), r.index))


ROUTERS = {"round_robin": RoundRobin, "least_loaded": LeastLoaded}
