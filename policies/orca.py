"""Orca iteration-level scheduling: the batch changes every step, prompts run whole.

Each step: every running request decodes one token, and waiting requests join (FCFS, up to the
batch size `max_num_seqs`) with their whole prompt in the same step. Orca reserves KV for a
request's maximum length (prompt + max output) at admission, so it never preempts; `paged`
allocates block by block instead, like vLLM, and may preempt.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cbsim.core.schema import option

from cbsim.policies.base import Budgets, Policy, SteadyAdmission
from cbsim.policies.helpers import admit_prefills, fill_decodes
from cbsim.policies.registry import register


@dataclass
class OrcaConfig(Budgets):
    max_num_seqs: int = option(64, help="max batch size")
    kv_reservation: Literal["max_len", "paged"] = option("max_len", help="reserve KV for prompt + output at "
                                                         "admission (Orca), or allocate page by page")


@register("orca")
class Orca(Policy):
    """Iteration-level batching: running decodes plus whole new prompts in the same step."""

    Config = OrcaConfig
    chunks_prompts = False

    def schedule(self, state):
        cfg = self.config
        b = self.builder(state, self.token_budget(state), cfg.max_num_seqs)
        fill_decodes(b, state.running)
        admit_prefills(b, state.waiting, chunk=False, reserve=self.reserve())
        return b.build()

    def reserve(self):
        """The KV tokens an admission reserves up front (None: page by page)."""
        return _max_length if self.config.kv_reservation == "max_len" else None

    def steady_chunks(self, state):
        return self.token_budget(state), None  # a prompt runs whole in the step that admits it

    def steady_admission(self, state):
        if not self.admits_by_budgets(state):
            return None
        return SteadyAdmission(self.config.max_num_seqs, whole_prompts=True, reserve=self.reserve())


def _max_length(req) -> int:
    return req.prompt_len + req.output_len
