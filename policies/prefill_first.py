"""vLLM V0 default scheduling: prefill-first.

A step is prefill-only whenever some prefill can run (a waiting prompt that fits, or, with
chunking, an unfinished prompt); otherwise it is decode-only. With `chunk_size`, a long prompt is
split into chunks of at most chunk_size tokens per step, but the chunks still run before any
decode: every running decode stalls until the prompt is done (dec@P = 0, the starvation case).
A prompt in progress that runs out of KV does not preempt a request whose prompt is done while
that request can decode instead: in a prefill-first loop it might never get to, and two prompts
would take turns evicting each other forever. The step then decodes, which frees KV.

Fairness (`queue_policy: fair`, policies/fairness.py): new prompts are admitted by their tenant's
virtual token counter, under optional token buckets and a minimum quantum per tenant (the quantum
round orders the admissions of a prefill step; decodes never share it, so nothing is held back from
them). vLLM V0 had no tenant fairness.
"""
from __future__ import annotations

from dataclasses import dataclass

from cbsim.core.schema import option, require

from cbsim.policies.base import Budgets, Policy, SteadyAdmission
from cbsim.policies.batch import BatchBuilder
from cbsim.policies.fairness import FairConfig, admit_fairly, bucket_reject_reason, make_fair
from cbsim.policies.helpers import (DynamicChunkConfig, admit_prefills, chunk_limit, continue_prefills, fill_decodes, is_decode,
                      make_dynamic)
from cbsim.policies.registry import register


@dataclass
class PrefillFirstConfig(Budgets, FairConfig):
    chunk_size: int | None = option(None, help="max prefill tokens per step; null = whole prompts only")
    dynamic_chunk: DynamicChunkConfig | None = option(None, help="with chunk_size: cost-aware chunk sizes "
                                                      "{target_chunk: 512}, shrinking as a prompt's history "
                                                      "grows; null = off")

    def validate(self) -> None:
        Budgets.validate(self)
        self.validate_fair()
        require(self.chunk_size is None or self.chunk_size >= 1, "chunk_size", "an integer >= 1 or null",
                self.chunk_size)
        if self.dynamic_chunk is not None:
            require(self.chunk_size is not None, "dynamic_chunk", "null unless chunk_size is set (dynamic "
                    "chunks split prompts)", "a mapping")


@register("prefill_first")
class PrefillFirst(Policy):
    """vLLM V0: prefill-only steps while any prompt can be admitted, else decode-only steps."""

    Config = PrefillFirstConfig

    def __init__(self, config):
        super().__init__(config)
        self.dynamic = make_dynamic(config.dynamic_chunk)
        self.fair = make_fair(config)
        self.steady_when_blocked = self.fair is None

    def request_cap(self) -> int | None:
        return self.config.chunk_size

    def never_runs(self, req, state) -> str:
        return Policy.never_runs(self, req, state) or bucket_reject_reason(self.config, req)

    @property
    def chunks_prompts(self) -> bool:
        return self.config.chunk_size is not None

    def steady_chunks(self, state):
        if self.fair is not None or self.chunks_prompts:  # the order changes with service; chunks run before decodes
            return None
        return self.token_budget(state), None  # a prompt runs whole in the step that admits it

    def steady_admission(self, state):
        if not self.admits_by_budgets(state):
            return None
        return SteadyAdmission(self.config.max_num_seqs, whole_prompts=True, prefill_only=True)

    def schedule(self, state):
        if self.fair is None:
            return self._schedule(state)
        self.fair.observe(state)
        return self.fair.track(self._schedule(state), state)

    def _schedule(self, state):
        b = self._prefills(state, spare=is_decode)
        if b.scheduled:
            return b.build()
        decodes = self.builder(state, self.token_budget(state), self.config.max_num_seqs)
        fill_decodes(decodes, state.running)
        if decodes.scheduled:
            return decodes.build()
        b = self._prefills(state, spare=None)  # no decode can run: a prompt may take a decode's KV
        return b.build() if b.scheduled or b.preempted else decodes.build()

    def _prefills(self, state, spare) -> BatchBuilder:
        """A prefill-only step: prompts in progress, then new ones. A prompt short of KV preempts
        others except those `spare` holds back; if it must preempt itself, nobody is admitted."""
        cfg = self.config
        budget = self.token_budget(state)
        if cfg.chunk_size is not None:
            budget = min(budget, cfg.chunk_size)
        b = self.builder(state, budget, cfg.max_num_seqs)
        chunk = chunk_limit(self.dynamic, state)
        continue_prefills(b, state.running, chunk=chunk, spare=spare)
        if not b.stalled:  # the room a stalled prompt frees is not for a newcomer
            admit_fairly(self.fair, b, state.waiting, lambda reqs, most: admit_prefills(
                b, reqs, chunk=self.chunks_prompts, chunk_size=chunk, cap=most))
        return b
