"""DeepSpeed-FastGen Dynamic SplitFuse: forwards of near-constant size.

Every step aims at exactly `token_budget` tokens: decodes first, then pieces of ongoing prompts,
then new prompts, any number of them; long prompts are split across steps and short prompts and
pieces are fused with the decodes until the budget is full. `min_chunk` avoids starting a prompt
with a sliver: a new prompt's first piece is at least that long (unless the prompt is shorter).

No per-request cap and no skipping, as in DeepSpeed-MII (mii/batching/ragged_batching.py
`_schedule_prompts`, microsoft/DeepSpeed-MII 40dc4476 in the stored index): a prompt takes
`min(len(input_tokens), max_ragged_batch_size - scheduled_length)` tokens, only the budget splits
it, and the scan ends (`break`) once the batch is full or the KV cache cannot hold a prompt.

Fairness (`queue_policy: fair`, policies/fairness.py; DeepSpeed-MII has none): new prompts by their
tenant's virtual token counter, with optional token buckets and a minimum quantum per tenant that
the decodes leave (as in sarathi).
"""
from __future__ import annotations

from dataclasses import dataclass

from cbsim.core.schema import option, require

from cbsim.policies.base import Budgets, Policy, SteadyAdmission
from cbsim.policies.fair_step import FairStep
from cbsim.policies.fairness import FairConfig, bucket_reject_reason, make_fair
from cbsim.policies.helpers import DynamicChunkConfig, admit_prefills, chunk_limit, continue_prefills, make_dynamic
from cbsim.policies.registry import register


@dataclass
class SplitFuseConfig(Budgets, FairConfig):
    token_budget: int | None = option(512, help="target tokens per forward pass")
    min_chunk: int = option(16, help="smallest first piece of a new prompt (a shorter prompt goes whole)")
    dynamic_chunk: DynamicChunkConfig | None = option(None, help="cost-aware piece sizes {target_chunk: 512}: "
                                                      "a prompt's pieces shrink as its history grows; null = off")

    def validate(self) -> None:
        Budgets.validate(self)
        self.validate_fair()
        require(self.min_chunk >= 1, "min_chunk", "an integer >= 1", self.min_chunk)


@register("splitfuse")
class SplitFuse(Policy):
    """Dynamic SplitFuse: split long prompts, fuse short ones and pieces with decodes to fill each forward."""

    Config = SplitFuseConfig

    def __init__(self, config):
        super().__init__(config)
        self.dynamic = make_dynamic(config.dynamic_chunk)
        self.fair = make_fair(config)
        self.steady_when_blocked = self.fair is None

    def steady_chunks(self, state):
        if self.fair is not None or self.dynamic is not None:  # the order or the piece changes with service
            return None
        return self.token_budget(state), None

    def steady_admission(self, state):
        if not self.admits_by_budgets(state):
            return None
        return SteadyAdmission(self.config.max_num_seqs, min_chunk=self.config.min_chunk)

    def never_runs(self, req, state) -> str:
        return Policy.never_runs(self, req, state) or bucket_reject_reason(self.config, req)

    def schedule(self, state):
        b = self.builder(state, self.token_budget(state), self.config.max_num_seqs)
        step = FairStep(self.fair, b, state)  # fairness around the step (policies/fair_step.py), if on
        chunk = chunk_limit(self.dynamic, state)
        continue_prefills(b, step.decodes(), chunk=chunk)
        if not b.preempted:  # no newcomer into the room a preemption made (as vLLM V1; MII never preempts)
            step.admit(lambda reqs, most: admit_prefills(b, reqs, min_chunk=self.config.min_chunk, chunk_size=chunk,
                                                         cap=most))
        return step.build()
