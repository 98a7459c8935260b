"""LoRA adapters per batch: vLLM's `--max-loras`, the adapters one step may serve.

vLLM V1 (vllm/v1/core/sched/scheduler.py, `schedule()`): the adapters of the running requests
scheduled in the step form a set; a waiting request whose adapter is not in it is skipped (it
stays waiting, later requests may start) when the set already holds `max_loras` adapters, and
otherwise joins it. Requests of the base model (no adapter) are never held back. The running set
never exceeds the limit, because only admissions add adapters.

Not modelled: the loading of an adapter that is not resident on the GPU (vLLM's `max_cpu_loras`
cache and the copy it pays), which would add time to the step that first serves it.
"""
from __future__ import annotations

from typing import Iterable

from cbsim.sim.request import Request


class LoraSlots:
    """The adapters a step serves, at most `max_loras` of them."""

    def __init__(self, max_loras: int, scheduled: Iterable[Request]):
        self.max_loras = max_loras
        self.adapters = {r.adapter for r in scheduled if r.adapter is not None}

    def allows(self, req: Request) -> bool:
        """Whether `req` may join the step (its adapter is served already, or a slot is free)."""
        adapter = req.adapter
        return adapter is None or adapter in self.adapters or len(self.adapters) < self.max_loras

    def take(self, req: Request) -> None:
        if req.adapter is not None:
            self.adapters.add(req.adapter)
