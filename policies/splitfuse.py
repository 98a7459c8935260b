"""DeepSpeed-FastGen Dynamic SplitFuse: forwards of near-constant size.

Every step aims at exactly `token_budget` tokens: decodes first, then pieces of ongoing prompts,
then new prompts, any number of them; long prompts are split across steps and short prompts and
pieces are fused with the decodes until the budget is full. `min_chunk` avoids starting a prompt
with a sliver: a new prompt's first piece is at least that long (unless the prompt is shorter).

No per-request cap and no skipping, as in DeepSpeed-MII (mii/batching/ragged_batching.py
`_schedule_prompts`, microsoft/DeepSpeed-MII 40dc4476 in the stored index): a prompt takes
`min(len(input_tokens), max_ragged_batch_size - scheduled_length)` tokens, only the budget splits
it, and the scan ends (`break`) once the batch is full or the KV cache cannot hold a prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

from cbsim.schema import option, require

from .base import Budgets, Policy
from .batch import BatchBuilder
from .helpers import DynamicChunkConfig, admit_prefills, chunk_limit, continue_prefills, fill_decodes, make_dynamic
from .registry import register


@dataclass
class SplitFuseConfig(Budgets):
    token_budget: int | None = option(512, help="target tokens per forward pass")
    min_chunk: int = option(16, help="smallest first piece of a new prompt (a shorter prompt goes whole)")
    dynamic_chunk: DynamicChunkConfig | None = option(None, help="cost-aware piece sizes {target_chunk: 512}: "
                                                      "a prompt's pieces shrink as its history grows; null = off")

    def validate(self) -> None:
        Budgets.validate(self)
        require(self.min_chunk >= 1, "min_chunk", "an integer >= 1", self.min_chunk)


@register("splitfuse")
class SplitFuse(Policy):
    """Dynamic SplitFuse: split long prompts, fuse short ones and pieces with decodes to fill each forward."""

    Config = SplitFuseConfig

    def __init__(self, config):
        super().__init__(config)
        self.dynamic = make_dynamic(config.dynamic_chunk)

    def schedule(self, state):
        b = BatchBuilder(state, self.token_budget(state), self.config.max_num_seqs)
        others = fill_decodes(b, state.running)
        chunk = chunk_limit(self.dynamic, state)
        continue_prefills(b, others, chunk=chunk)
        admit_prefills(b, state.waiting, min_chunk=self.config.min_chunk, chunk_size=chunk)
        return b.build()
