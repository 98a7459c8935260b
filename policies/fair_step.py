"""Fairness composed around one step of a decodes-first policy (Sarathi, SplitFuse), so the policy's
`schedule()` says only its own rule: every decode, the prompts in progress, then admissions.

Around that rule the fair queue (policies/fairness.py FairQueue, None: off) sees the state before the
step (`observe`), holds its quantum out of the token budget while the decodes are filled and gives it
back to the prompts, admits the waiting requests by tenant counter instead of queue order, lets the
decodes the hold-back left out run after the admissions, and sees the plan (`track`). Off, each call is
the plain step: decodes, admissions in queue order, the plan.
"""
from __future__ import annotations

from typing import Callable, Iterable

from cbsim.sim.plan import StepPlan
from cbsim.sim.request import Request
from cbsim.sim.state import SchedulerState

from cbsim.policies.batch import BatchBuilder
from cbsim.policies.fairness import FairQueue, admit_fairly
from cbsim.policies.helpers import fill_decodes


class FairStep:
    """One step's builder with the fair queue around it: `decodes`, then the policy's prompts in
    progress on the builder, then `admit`, then `build`."""

    __slots__ = ("fair", "b", "state", "held")

    def __init__(self, fair: FairQueue | None, b: BatchBuilder, state: SchedulerState):
        self.fair, self.b, self.state, self.held = fair, b, state, 0
        if fair is not None:
            fair.observe(state)

    def decodes(self) -> list[Request]:
        """Every running decode (fill_decodes), the quantum held out of the budget meanwhile; returns the
        running requests not taken as decodes."""
        fair, b = self.fair, self.b
        if fair is None:
            return fill_decodes(b, self.state.running)
        self.held = fair.hold(b, self.state)
        others = fill_decodes(b, self.state.running)
        if self.held:
            fair.release(b, self.held)
        return others

    def admit(self, admit: Callable[[Iterable[Request], int | None], None], cap: int | None = None) -> None:
        """The waiting requests through `admit(requests, cap)` (the policy's admit_prefills), in queue order
        or, fairly, by tenant counter."""
        admit_fairly(self.fair, self.b, self.state.waiting, admit, cap)

    def build(self) -> StepPlan:
        """The step's plan; with the fair queue, the decodes its hold-back left out join first."""
        fair, b = self.fair, self.b
        if fair is None:
            return b.build()
        if self.held:
            fill_decodes(b, self.state.running)  # decodes the quantum's hold-back left out
        return fair.track(b.build(), self.state)
