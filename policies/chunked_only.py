"""Sarathi-Serve's chunked-prefills-only baseline: prefill-chunk steps and decode steps take turns.

The ablation baseline of Sarathi-Serve (OSDI'24; `SimpleChunkingScheduler` in microsoft/sarathi-serve):
prompts are split into chunks, but a chunk never shares a step with decodes. Turns alternate:

- prefill turn (the previous step ran no prefill): the next chunks of the prompts in progress, up to
  `chunk_size` tokens in all; a step that continues a prompt admits nobody. Only with no prompt in
  progress are waiting prompts admitted, FCFS, under the same chunk budget (all but the last whole,
  the last one chunked). If nothing can prefill, the step decodes, and the next is a prefill turn.
- decode turn (the previous step ran prefill chunks): one token for every running decode. With no
  decode to run the step prefills (Sarathi runs an empty iteration, then prefills; cbsim skips it).

So a decode waits at most one prefill step between two tokens, and while anything decodes a prompt
advances every other step. `max_num_seqs` bounds the running requests at admission, as in Sarathi,
so one decode step covers every running decode. `chunk_size` is a budget for the whole prefill step,
as Sarathi's, not a per-request cap; admission is FCFS and stops at the first prompt that does not fit
(no skipping). With `queue_policy: fair` (policies/fairness.py) prompts are admitted by their tenant's
virtual token counter instead, with optional token buckets and a minimum quantum per tenant that
orders a prefill turn's admissions (decodes never share a step with them).

Whose turn: the policy remembers whether its last plan that ran anything ran prefill. The state cannot
tell (a partial chunk leaves the same state as the decode step after it would). The replica runs every
non-empty plan, and its fast-forward repeats only decode plans, so "the last step decoded" stays true.
Fast-forward with requests waiting is allowed only after a decode step that a prefill turn fell back to
(nothing could be admitted, which lasts until an arrival, a completion or a preemption); after a decode
turn, the prefill turn that follows may admit.

KV: while a decode can run, a prompt in progress short of KV preempts only other prompts in progress,
then itself, and the step decodes instead (that frees KV: a decode short of KV evicts the last admitted,
the prompt in progress first); two prompts could otherwise take turns evicting each other (see
prefill_first). A waiting request with one token left (a swapped-out decode) rejoins in a decode step,
never beside a chunk, and only in a step that preempts nobody (vLLM V0's swap-in rule); prompts queued
behind it wait (FCFS, no overtaking).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import islice, takewhile

from cbsim.core.schema import option, require
from cbsim.sim.request import Request

from cbsim.policies.base import Budgets, Policy
from cbsim.policies.batch import BatchBuilder
from cbsim.policies.fairness import FairConfig, admit_fairly, bucket_reject_reason, make_fair
from cbsim.policies.helpers import admit_prefills, continue_prefills, fill_decodes, is_decode
from cbsim.policies.registry import register


@dataclass
class ChunkedOnlyConfig(Budgets, FairConfig):
    chunk_size: int = option(512, help="max prefill tokens per prefill step (Sarathi's chunk_size); prefill steps "
                             "and decode steps alternate, never mixed")

    def validate(self) -> None:
        Budgets.validate(self)
        self.validate_fair()
        require(self.chunk_size >= 1, "chunk_size", "an integer >= 1", self.chunk_size)


def resumes_as_decode(b: BatchBuilder, req: Request) -> bool:
    """A waiting request whose admission now would compute one token and sample (a swapped decode)."""
    return req.num_output_tokens > 0 and b.need(req) == 1


@register("chunked_only")
class ChunkedOnly(Policy):
    """Sarathi-Serve's chunked-prefills-only baseline: a step of prefill chunks, then a step of decodes, in turn."""

    Config = ChunkedOnlyConfig

    def __init__(self, config):
        super().__init__(config)
        self._prefilled = False  # the last plan that ran anything ran prefill chunks: the decodes' turn
        self._fell_back = False  # the last plan decoded on a prefill turn: no prefill could run
        self.fair = make_fair(config)

    def request_cap(self) -> int | None:
        return self.config.chunk_size

    def never_runs(self, req, state) -> str:
        return Policy.never_runs(self, req, state) or bucket_reject_reason(self.config, req)

    @property
    def steady_when_blocked(self) -> bool:
        """True only after a decode step that a prefill turn fell back to (see the module docstring)."""
        return self._fell_back and self.fair is None

    def schedule(self, state):
        if self.fair is not None:
            self.fair.observe(state)
        prefill_turn = not self._prefilled
        b, prefilled = self._plan(state, prefill_turn)
        if b.scheduled:
            self._prefilled = prefilled
            self._fell_back = prefill_turn and not prefilled
        plan = b.build()
        return plan if self.fair is None else self.fair.track(plan, state)

    def _plan(self, state, prefill_turn: bool) -> tuple[BatchBuilder, bool]:
        """The step's builder and whether it is a prefill step."""
        if prefill_turn:
            b = self._prefills(state, spare=is_decode)
            if b.scheduled:
                return b, True
        decodes = self._decodes(state)
        if decodes.scheduled:
            return decodes, False
        b = self._prefills(state, spare=None)  # no decode can run: a prompt may take a decode's KV
        return (b, True) if b.scheduled or b.preempted else (decodes, False)

    def _prefills(self, state, spare) -> BatchBuilder:
        """Chunks of the prompts in progress, or else new prompts, up to chunk_size tokens."""
        cfg = self.config
        b = self.builder(state, min(self.token_budget(state), cfg.chunk_size), cfg.max_num_seqs)
        continue_prefills(b, state.running, spare=spare)
        if b.scheduled or b.stalled:  # a prompt in progress goes first; a stalled one's room is not for a newcomer
            return b
        room = cfg.max_num_seqs - len(state.running)
        if room > 0:
            prompts = takewhile(lambda r: not resumes_as_decode(b, r), state.waiting)
            if self.fair is None:
                admit_prefills(b, islice(prompts, room))
            else:
                admit_fairly(self.fair, b, list(prompts), lambda reqs, most: admit_prefills(
                    b, takewhile(lambda r: len(b.admitted) < room, reqs), cap=most))
        return b

    def _decodes(self, state) -> BatchBuilder:
        """One token for every running decode; then swapped decodes rejoin if nobody was preempted."""
        cfg = self.config
        b = self.builder(state, self.token_budget(state), cfg.max_num_seqs)
        fill_decodes(b, state.running)
        room = cfg.max_num_seqs - len(state.running)
        if room > 0 and not b.preempted:
            resumed = takewhile(lambda r: resumes_as_decode(b, r), state.waiting)
            admit_prefills(b, islice(resumed, room), chunk=False)
        return b
