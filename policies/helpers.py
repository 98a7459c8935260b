"""Small building blocks that policies compose: decodes, ongoing prefills, admissions.

Each helper walks a queue in order and stops at the first request that does not fit (no
overtaking), so FCFS order holds unless a policy reorders the queue itself.
"""
from __future__ import annotations

from typing import Callable, Iterable

from cbsim.sim.request import Request

from .batch import BatchBuilder


def is_decode(req: Request) -> bool:
    """A request whose prompt is done and that is one token behind."""
    return req.num_output_tokens > 0 and req.need == 1


class PrefillLimit:
    """At most `max_partial` prefill rows per step left unfinished by it (ongoing or new chunks; a
    prompt that completes in the step does not count), and at most `max_long` rows whose remaining
    prompt exceeds `threshold` tokens."""

    def __init__(self, max_partial: int | None = None, max_long: int | None = None, threshold: int | None = None):
        self.max_partial = max_partial
        self.max_long = max_long
        self.threshold = threshold
        self.partial_taken = 0
        self.long_taken = 0

    def is_long(self, req: Request) -> bool:
        return self.threshold is not None and req.need > self.threshold

    def allows(self, req: Request, num_tokens: int) -> bool:
        if self.max_partial is not None and num_tokens < req.need and self.partial_taken >= self.max_partial:
            return False
        return not (self.max_long is not None and self.is_long(req) and self.long_taken >= self.max_long)

    def take(self, req: Request, num_tokens: int) -> None:
        self.partial_taken += num_tokens < req.need
        self.long_taken += self.is_long(req)


def fill_decodes(b: BatchBuilder, running: Iterable[Request]) -> None:
    """One token for every running decode, oldest first, preempting others when KV runs short."""
    b.schedule_decodes(running)


def continue_prefills(b: BatchBuilder, running: Iterable[Request], limit: PrefillLimit | None = None,
                      max_chunk: int | None = None) -> None:
    """Next chunk of every running request still in prefill, in admission order."""
    for req in running:
        outputs = req.num_output_tokens
        if outputs >= req.output_len or (outputs and req.prompt_len + outputs - req.num_computed_tokens == 1):
            continue  # done, or a decode
        if b.is_scheduled(req) or b.is_out(req):
            continue
        if b.seqs_left <= 0 or b.tokens_left <= 0:
            return
        n = min(req.need, b.tokens_left, max_chunk or req.need)
        if limit and not limit.allows(req, n):
            return
        if b.schedule_running(req, n) and limit:
            limit.take(req, n)


def admit_prefills(b: BatchBuilder, waiting: Iterable[Request], chunk: bool = True,
                   limit: PrefillLimit | None = None, min_chunk: int = 1,
                   reserve: Callable[[Request], int] | None = None) -> None:
    """Admit waiting requests in queue order while the budgets allow, then stop.

    chunk=True: the last one admitted may get only part of its prompt (what the token budget
    leaves, but not less than min_chunk unless that finishes it or the step is otherwise empty);
    chunk=False: whole prompts only.
    `reserve(req)` asks for KV blocks for that many tokens up front (e.g. prompt + max output).
    """
    for req in waiting:
        if b.seqs_left <= 0 or b.tokens_left <= 0:
            return
        n = min(req.need, b.tokens_left) if chunk else req.need
        if (n < min(min_chunk, req.need) and b.scheduled) or (limit and not limit.allows(req, n)):
            return
        if not b.admit(req, n, reserve(req) if reserve else 0):
            return
        if limit:
            limit.take(req, n)
