"""Static (request-level) batching: a batch runs until its longest member finishes.

When the replica is empty it takes up to `max_num_seqs` waiting requests (FCFS, whole prompts,
KV reserved for prompt + output), prefills them together, then decodes them together. A member
that finishes keeps its slot and its KV as a padding row (charged, producing nothing); nobody
joins until the batch drains, and every member completes when the batch ends.
"""
from __future__ import annotations

from dataclasses import dataclass

from cbsim.core.schema import option

from cbsim.policies.base import Budgets, Policy
from cbsim.policies.helpers import admit_prefills
from cbsim.policies.registry import register


@dataclass
class StaticConfig(Budgets):
    max_num_seqs: int = option(8, help="batch size")


@register("static")
class Static(Policy):
    """Request-level batching: no one joins or leaves until the whole batch is done."""

    Config = StaticConfig
    chunks_prompts = False

    def schedule(self, state):
        b = self.builder(state, self.token_budget(state), self.config.max_num_seqs)
        if state.running:
            for req in state.running:
                if req.is_done:
                    b.add_padding(req)
                else:
                    b.schedule_running(req, req.need, preempt=False)
            return b.build(hold_finished=True)
        admit_prefills(b, state.waiting, chunk=False, reserve=lambda r: r.prompt_len + r.output_len)
        return b.build(hold_finished=True)
