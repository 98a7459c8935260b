"""SchedulerState: the read-only view a policy decides from.

The replica owns the containers and lends them; a policy reads them and returns a StepPlan, and
must never mutate them (the replica applies plans). `running` is in admission order.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Literal

from cbsim.sim.admission import DecodeReserve
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.request import Request
from cbsim.sim.shape import StepShape


Victim = Literal["last_admitted", "lowest_priority", "shortest_remaining", "lowest_cache_value"]  # policies/batch.py


@dataclass(slots=True)
class SchedulerState:
    kv: KVCache
    max_model_len: int
    victim: Victim = "last_admitted"
    now: float = 0.0
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    # seconds of one prefill chunk (c new tokens over h cached ones) run alone, by the replica's cost
    # model; filled by the replica, for cost-aware policies (dynamic chunking); None: unknown
    chunk_cost: Callable[[int, int], float] | None = None
    # admission signals (sim/admission.py), each None or False when off:
    swapped_first: bool = False  # vLLM V0: no prompt while a request is swapped out, no swap-in in a preempting step
    reserve: DecodeReserve | None = None  # SGLang's reserve for the running requests' future decode tokens
    step_cap: float | None = None  # seconds a step may take while requests decode (TPOT slack)
    step_time: Callable[[StepShape], float] | None = None  # the replica's cost model, for step_cap
    admit_paused: bool = False  # P/D prefill side: the transfer queue is over admission.pd_backpressure
    # pipeline parallelism (sim/pipeline.py): running requests whose micro-batch is in flight. They are
    # not in `running` (nothing can be scheduled for them until their output returns, and they cannot
    # be preempted) but hold their KV blocks and count toward per-replica totals (max_num_seqs as vLLM
    # counts it, tenant service and quotas); empty without PP
    in_flight: tuple[Request, ...] = ()
    spec: object = None  # the replica's Speculator (sim/speculative.py): decodes verify k drafts; None: off
