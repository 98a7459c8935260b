"""Sarathi-Serve stall-free batching (vLLM chunked prefill): decodes never wait for a prefill.

Each step: every running decode (one token each), then the next chunk of the prompts in progress,
then new prompts from the waiting queue, chunked to what the token budget leaves.

Per-request cap: a prompt advances at most `long_prefill_token_threshold` tokens in one step, as in
vLLM V1 (vllm/v1/core/sched/scheduler.py `schedule()`, commit 00024d31 in the stored index: for
running and for waiting requests, `if 0 < long_prefill_token_threshold < num_new_tokens:
num_new_tokens = long_prefill_token_threshold`, then `min(num_new_tokens, token_budget)`), and at
most `chunk_size` tokens (Sarathi-Serve's chunk size: Agrawal et al., OSDI 2024); the token budget left over goes to the
next prompts. The threshold also classifies a prompt as long (more than that many tokens left) for
`max_long_partial_prefills` (vLLM V0's PartialPrefillMetadata, see helpers.PrefillLimit). With
`max_num_partial_prefills > 1` and no threshold, prompts are classified at 4 % of max_model_len, as
vLLM's SchedulerConfig sets the threshold (vllm/config/scheduler.py `__post_init__`, commit
01230b40: `int(max_model_len * 0.04)`), but nothing is capped: only V0 honoured
max_num_partial_prefills > 1, and V0 used the threshold to classify, not to cap (its per-request
limit was max_num_batched_tokens // schedulable_prefills); V1 caps, but refuses partial prefills > 1.

Skipping a blocked head of line: a waiting prompt that the partial-prefill limits hold back is
skipped and later prompts may start (vLLM V0 vllm/core/scheduler.py `_schedule_prefills`:
`leftover_waiting_sequences.appendleft(seq_group); continue`); a prompt that KV, max_num_seqs or
the token budget stops ends the scan (V0: `AllocStatus.LATER: break`; V1: `allocate_slots` is None:
`break`). `strict_fcfs: true` ends the scan at a prompt the limits hold back as well.

No admission in a step that preempts: a running request short of KV preempts victims (BatchBuilder),
and then no waiting request joins that step, as in vLLM V1 (scheduler.py `schedule()`, 00024d31: `if not
preempted_reqs and ...:` before the waiting loop): the room a victim frees is not for a newcomer.

Default token budget 8192: the max_num_batched_tokens of vLLM V1, which
is V1's `vllm serve` default on GPUs with >= 70 GiB other than A100 (H100, H200, MI300:
vllm/engine/arg_utils.py `get_batch_defaults`, UsageContext.OPENAI_API_SERVER: 8192); on an A100 or
a smaller GPU `vllm serve` uses 2048, and the offline LLM class 16384 or 8192.

Fairness (`queue_policy: fair`, policies/fairness.py; vLLM has no tenant fairness): new prompts are
admitted by their tenant's virtual token counter (weights `tenant_weights`) instead of arrival,
optionally under per-tenant token buckets and with a minimum service quantum per tenant and step.
The order changes as service accrues, so a blocked queue is not steady (no fast-forward past it).
"""
from __future__ import annotations

from dataclasses import dataclass

from cbsim.core.schema import option, require

from cbsim.policies.base import Budgets, Policy, SteadyAdmission
from cbsim.policies.fair_step import FairStep
from cbsim.policies.fairness import FairConfig, bucket_reject_reason, make_fair
from cbsim.policies.helpers import (DynamicChunkConfig, PrefillLimit, admit_prefills, chunk_limit, continue_prefills,
                      make_dynamic, run_in_admission_order)
from cbsim.policies.registry import register

LONG_PREFILL_FRACTION = 0.04  # vLLM SchedulerConfig: threshold = 4 % of max_model_len when unset


@dataclass
class SarathiConfig(Budgets, FairConfig):
    token_budget: int | None = option(8192, help="tokens per step (vLLM max_num_batched_tokens): decodes first, "
                                      "prefill chunks fill the rest; 8192 = vLLM V1's `vllm serve` default on an "
                                      "H100-class GPU (2048 on an A100)")
    max_num_partial_prefills: int = option(1, help="max prefill rows a step leaves unfinished (chunked prompts "
                                           "in flight); prompts that complete within the step are not limited")
    max_long_partial_prefills: int = option(1, help="of those, max rows whose remaining prompt exceeds "
                                            "long_prefill_token_threshold (lets short prompts overtake long ones)")
    long_prefill_token_threshold: int | None = option(None, help="most prompt tokens one request advances per "
                                                      "step (vLLM V1), and the remaining prompt above which a "
                                                      "prefill counts as long; null = no cap, and no long/short "
                                                      "distinction unless max_num_partial_prefills > 1, where "
                                                      "long means above 4% of max_model_len (vLLM)")
    running_order: str = option("decodes_first", help="decodes_first: every running decode, then the prompts in "
                                "progress (Sarathi-Serve); admission: the running requests in admission order, "
                                "each what it needs (vLLM V1's loop; server.version 0.32 or later sets it)")
    cap_lone_request: bool = option(True, help="false: long_prefill_token_threshold does not cap a request that is "
                                    "the only one running or waiting (vLLM 0.32: 'nobody to starve'; "
                                    "server.version 0.32 or later sets it)")
    chunk_size: int | None = option(None, help="most prompt tokens one request advances per step, without the "
                                    "long/short distinction (Sarathi-Serve's chunk size); null = no cap")
    strict_fcfs: bool = option(False, help="true: a waiting prompt the partial-prefill limits hold back stops "
                               "admission (no overtaking); false: it is skipped and later prompts may start, "
                               "as vLLM's _schedule_prefills does (leftover_waiting_sequences)")
    dynamic_chunk: DynamicChunkConfig | None = option(None, help="cost-aware chunk sizes {target_chunk: 512}: "
                                                      "chunks shrink as a prompt's history grows; null = off")

    def validate(self) -> None:
        Budgets.validate(self)
        require(self.max_num_partial_prefills >= 1, "max_num_partial_prefills", "an integer >= 1",
                self.max_num_partial_prefills)
        require(1 <= self.max_long_partial_prefills <= self.max_num_partial_prefills, "max_long_partial_prefills",
                f"an integer >= 1 and <= max_num_partial_prefills ({self.max_num_partial_prefills}), as vLLM's "
                "SchedulerConfig.verify_max_model_len requires", self.max_long_partial_prefills)
        require(self.long_prefill_token_threshold is None or self.long_prefill_token_threshold >= 1,
                "long_prefill_token_threshold", "an integer >= 1 or null", self.long_prefill_token_threshold)
        require(self.chunk_size is None or self.chunk_size >= 1, "chunk_size", "an integer >= 1 or null",
                self.chunk_size)
        require(self.running_order in ("decodes_first", "admission"), "running_order",
                "decodes_first or admission", self.running_order)
        require(self.running_order == "decodes_first" or (self.queue_policy == "fcfs" and self.dynamic_chunk is None
                                                          and self.encoder is None), "running_order",
                "decodes_first with queue_policy fair, dynamic_chunk or an encoder budget (the admission-order "
                "pass models none of them)", self.running_order)
        self.validate_fair()


@register("sarathi")
class Sarathi(Policy):
    """Stall-free: all running decodes first, then ongoing partial prefills, then new prefills, chunked."""

    Config = SarathiConfig

    def __init__(self, config):
        super().__init__(config)
        self.dynamic = make_dynamic(config.dynamic_chunk)
        self.fair = make_fair(config)
        self.steady_when_blocked = self.fair is None

    def request_cap(self) -> int | None:
        caps = [c for c in (self.config.long_prefill_token_threshold, self.config.chunk_size) if c is not None]
        return min(caps) if caps else None

    def step_cap(self, state) -> int | None:
        """request_cap in this step: without cap_lone_request, a request alone (running plus waiting)
        is capped by chunk_size only (vLLM 0.32 scheduler.py `schedule()`: long_prefill_token_threshold
        applies `if num_eligible_reqs > 1 else 0`)."""
        if not self.config.cap_lone_request and len(state.running) + len(state.waiting) <= 1:
            return self.config.chunk_size
        return self.request_cap()

    def steady_chunks(self, state):
        if self.fair is not None or self.dynamic is not None:  # the order or the chunk changes with service
            return None
        if not self.config.cap_lone_request and self.config.long_prefill_token_threshold is not None:
            return None  # the cap changes as requests arrive and leave
        if self.config.running_order == "admission":
            return None  # a prompt ahead of decodes may take their budget
        return self.token_budget(state), self.request_cap()

    def steady_admission(self, state):
        if not self.admits_by_budgets(state):
            return None
        return SteadyAdmission(self.config.max_num_seqs, self.long_threshold(state.max_model_len))

    def never_runs(self, req, state) -> str:
        return Policy.never_runs(self, req, state) or bucket_reject_reason(self.config, req)

    def long_threshold(self, max_model_len: int) -> int | None:
        """Remaining prompt tokens above which a prefill counts as long (None: no distinction)."""
        cfg = self.config
        if cfg.long_prefill_token_threshold is None and cfg.max_num_partial_prefills > 1:
            return max(1, int(max_model_len * LONG_PREFILL_FRACTION))
        return cfg.long_prefill_token_threshold

    def schedule(self, state):
        cfg = self.config
        b = self.builder(state, self.token_budget(state), cfg.max_num_seqs)
        step = FairStep(self.fair, b, state)  # fairness around the step (policies/fair_step.py), if on
        limit = PrefillLimit(cfg.max_num_partial_prefills, cfg.max_long_partial_prefills,
                             self.long_threshold(state.max_model_len))
        cap, chunk, skip = self.step_cap(state), chunk_limit(self.dynamic, state), not cfg.strict_fcfs
        if cfg.running_order == "admission":  # vLLM 0.32's one pass (never with the fair queue: validate)
            run_in_admission_order(b, state.running, cap)
        else:
            continue_prefills(b, step.decodes(), limit, max_chunk=cap, chunk=chunk, skip_blocked=skip)
        if not b.preempted:  # vLLM V1 schedules no waiting request in a step that preempts (`if not preempted_reqs:`)
            step.admit(lambda reqs, most: admit_prefills(b, reqs, limit=limit, chunk_size=chunk, cap=most,
                                                         skip_blocked=skip), cap)
        return step.build()
