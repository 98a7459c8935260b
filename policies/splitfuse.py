"""DeepSpeed-FastGen Dynamic SplitFuse: forwards of near-constant size.

Every step aims at exactly `token_budget` tokens: decodes first, then pieces of ongoing prompts,
then new prompts, any number of them; long prompts are split across steps and short prompts and
pieces are fused with the decodes until the budget is full. `min_chunk` avoids starting a prompt
with a sliver: a new prompt's first piece is at least that long (unless the prompt is shorter).
"""
from __future__ import annotations

from dataclasses import dataclass

from cbsim.schema import option, require

from .base import Budgets, Policy
from .batch import BatchBuilder
from .helpers import admit_prefills, continue_prefills, fill_decodes
from .registry import register


@dataclass
class SplitFuseConfig(Budgets):
    token_budget: int | None = option(512, help="target tokens per forward pass")
    min_chunk: int = option(16, help="smallest first piece of a new prompt (a shorter prompt goes whole)")

    def validate(self) -> None:
        Budgets.validate(self)
        require(self.min_chunk >= 1, "min_chunk", "an integer >= 1", self.min_chunk)


@register("splitfuse")
class SplitFuse(Policy):
    """Dynamic SplitFuse: split long prompts, fuse short ones and pieces with decodes to fill each forward."""

    Config = SplitFuseConfig

    def schedule(self, state):
        b = BatchBuilder(state, self.token_budget(state), self.config.max_num_seqs)
        fill_decodes(b, state.running)
        continue_prefills(b, state.running)
        admit_prefills(b, state.waiting, min_chunk=self.config.min_chunk)
        return b.build()
