"""What every policy shares: the budget fields of its config and the Policy interface."""
from __future__ import annotations

from dataclasses import dataclass

from cbsim.schema import option, require
from cbsim.sim.plan import StepPlan
from cbsim.sim.request import Request
from cbsim.sim.state import SchedulerState


@dataclass
class Budgets:
    """Per-step limits every policy respects."""

    token_budget: int | None = option(None, help="max tokens scheduled per step (vLLM max_num_batched_tokens); "
                                      "null = max_model_len for whole-prompt policies")
    max_num_seqs: int = option(256, help="max sequences per step (also the batch size of static and orca)")

    def validate(self) -> None:
        require(self.token_budget is None or self.token_budget >= 1, "token_budget", "an integer >= 1 or null",
                self.token_budget)
        require(self.max_num_seqs >= 1, "max_num_seqs", "an integer >= 1", self.max_num_seqs)


class Policy:
    """Interface: `schedule(state) -> StepPlan`, a pure function of the state.

    `steady_when_blocked`: if a step schedules only decodes while requests wait, the same waiting
    requests stay blocked until an arrival, a completion or a preemption (true for every policy whose
    admission does not depend on time); the replica may then skip ahead over identical decode steps.
    """

    name = "base"
    Config = Budgets
    steady_when_blocked = True
    chunks_prompts = True  # False: a prompt (and a recompute) must fit one step's token budget

    def __init__(self, config):
        self.config = config

    def schedule(self, state: SchedulerState) -> StepPlan:
        """Called at the start of every step of the replica; returns what that step runs."""
        raise NotImplementedError

    def token_budget(self, state: SchedulerState) -> int:
        budget = self.config.token_budget
        return state.max_model_len if budget is None else budget

    def reject_reason(self, req: Request, state: SchedulerState) -> str:
        """Why this policy could never run `req` (checked at arrival); empty if it can."""
        if self.chunks_prompts:
            return ""
        budget = self.token_budget(state)
        if req.prompt_len + req.output_len - 1 > budget:
            return (f"prompt_len + output_len - 1 = {req.prompt_len + req.output_len - 1} exceeds the token "
                    f"budget {budget} of {self.name}, which does not chunk prompts (a recompute could not run)")
        return ""
