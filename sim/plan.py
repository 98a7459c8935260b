"""StepPlan: a policy's decision for one step, frozen.

A policy returns a plan; the replica applies it in two halves of one commit: at the step's start
(admissions, preemptions, KV blocks: the memory the step writes) and at its end (progress and
sampled tokens). `epochs` pins each scheduled entry to the request's epoch at planning time, so
an entry whose request was preempted in between is ignored instead of completing it twice.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class StepPlan:
    scheduled: dict[int, int] = field(default_factory=dict)  # request id -> num_new_tokens
    admitted: tuple[int, ...] = ()  # waiting requests that join the running set
    preempted: tuple[int, ...] = ()  # running requests evicted before the step runs
    padding: tuple[int, ...] = ()  # finished requests kept in the batch (charged, no token)
    hold_finished: bool = False  # keep finished requests (and their KV) until the whole batch is done
    epochs: dict[int, int] = field(default_factory=dict)
    blocks: dict[int, int] = field(default_factory=dict)  # request id -> KV blocks it holds during the step
    # waiting requests (holding no KV) the policy gives up on: they can no longer meet their deadline.
    # Applied at the step's start, before admissions; a plan must still schedule something else.
    rejected: tuple[int, ...] = ()
    # work beside the decoder's forward, charged in the same step (the replica adds extra_seconds to the
    # cost model's time, through StepShape): encoder input tokens encoded (policies/encoder.py) and the
    # seconds of the encoder and of LoRA adapter loads (policies/lora.py)
    encoder_tokens: int = 0
    extra_seconds: float = 0.0
    lora_loads: int = 0  # adapters copied into a GPU slot for this step
    # an empty plan that waits: nothing may run before this time (a token bucket refills, policies/fairness.py)
    # unless an arrival or a completion elsewhere changes the state first; None: an empty plan is a bug
    idle_until: float | None = None
    # the hot path's shortcut (BatchBuilder.schedule_decodes): the first len(decode_requests) entries of
    # `scheduled` are one-token decodes of these running requests, whose contexts (computed tokens + 1)
    # are decode_contexts, already checked against the KV budget; decode_grows: (request, blocks) for
    # those that cross into a new block. The replica's begin and commit take them as they are instead
    # of looking each up and classifying it again.
    decode_requests: tuple = ()
    decode_contexts: tuple[int, ...] = ()
    decode_grows: tuple = ()

    @property
    def num_new_tokens(self) -> dict[int, int]:
        return self.scheduled

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.padding and not self.preempted

    @property
    def total_tokens(self) -> int:
        return sum(self.scheduled.values())


EMPTY_PLAN = StepPlan()
