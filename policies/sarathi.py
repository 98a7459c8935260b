"""Sarathi-Serve stall-free batching (vLLM chunked prefill): decodes never wait for a prefill."""
from __future__ import annotations

from dataclasses import dataclass

from cbsim.schema import option, require

from .base import Budgets, Policy
from .batch import BatchBuilder
from .helpers import (DynamicChunkConfig, PrefillLimit, admit_prefills, chunk_limit, continue_prefills,
                      fill_decodes, make_dynamic)
from .registry import register


@dataclass
class SarathiConfig(Budgets):
    token_budget: int | None = option(512, help="tokens per step: decodes first, prefill chunks fill the rest")
    max_num_partial_prefills: int = option(1, help="max prefill rows a step leaves unfinished (chunked prompts "
                                           "in flight); prompts that complete within the step are not limited")
    max_long_partial_prefills: int = option(1, help="of those, max rows whose remaining prompt exceeds "
                                            "long_prefill_token_threshold (lets short prompts overtake long ones)")
    long_prefill_token_threshold: int | None = option(None, help="remaining prompt tokens above which a prefill "
                                                      "counts as long; null = no distinction")
    dynamic_chunk: DynamicChunkConfig | None = option(None, help="cost-aware chunk sizes {target_chunk: 512}: "
                                                      "chunks shrink as a prompt's history grows; null = off")

    def validate(self) -> None:
        Budgets.validate(self)
        require(self.max_num_partial_prefills >= 1, "max_num_partial_prefills", "an integer >= 1",
                self.max_num_partial_prefills)
        require(self.max_long_partial_prefills >= 1, "max_long_partial_prefills", "an integer >= 1",
                self.max_long_partial_prefills)


@register("sarathi")
class Sarathi(Policy):
    """Stall-free: all running decodes first, then ongoing partial prefills, then new prefills, chunked."""

    Config = SarathiConfig

    def __init__(self, config):
        super().__init__(config)
        self.dynamic = make_dynamic(config.dynamic_chunk)

    def schedule(self, state):
        cfg = self.config
        b = BatchBuilder(state, self.token_budget(state), cfg.max_num_seqs)
        others = fill_decodes(b, state.running)
        limit = PrefillLimit(cfg.max_num_partial_prefills, cfg.max_long_partial_prefills,
                             cfg.long_prefill_token_threshold)
        chunk = chunk_limit(self.dynamic, state)
        continue_prefills(b, others, limit, chunk=chunk)
        admit_prefills(b, state.waiting, limit=limit, chunk_size=chunk)
        return b.build()
