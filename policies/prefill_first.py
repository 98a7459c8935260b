"""vLLM V0 default scheduling: prefill-first.

A step is prefill-only whenever some prefill can run (a waiting prompt that fits, or, with
chunking, an unfinished prompt); otherwise it is decode-only. With `chunk_size`, a long prompt is
split into chunks of at most chunk_size tokens per step, but the chunks still run before any
decode: every running decode stalls until the prompt is done (dec@P = 0, the starvation case).
"""
from __future__ import annotations

from dataclasses import dataclass

from cbsim.schema import option, require

from .base import Budgets, Policy
from .batch import BatchBuilder
from .helpers import admit_prefills, continue_prefills, fill_decodes
from .registry import register


@dataclass
class PrefillFirstConfig(Budgets):
    chunk_size: int | None = option(None, help="max prefill tokens per step; null = whole prompts only")

    def validate(self) -> None:
        Budgets.validate(self)
        require(self.chunk_size is None or self.chunk_size >= 1, "chunk_size", "an integer >= 1 or null",
                self.chunk_size)


@register("prefill_first")
class PrefillFirst(Policy):
    """vLLM V0: prefill-only steps while any prompt can be admitted, else decode-only steps."""

    Config = PrefillFirstConfig

    @property
    def chunks_prompts(self) -> bool:
        return self.config.chunk_size is not None

    def schedule(self, state):
        cfg = self.config
        budget = self.token_budget(state)
        if cfg.chunk_size is not None:
            budget = min(budget, cfg.chunk_size)
        b = BatchBuilder(state, budget, cfg.max_num_seqs)
        continue_prefills(b, state.running)
        admit_prefills(b, state.waiting, chunk=self.chunks_prompts)
        if b.scheduled or b.preempted:
            return b.build()
        b = BatchBuilder(state, self.token_budget(state), cfg.max_num_seqs)
        fill_decodes(b, state.running)
        return b.build()
