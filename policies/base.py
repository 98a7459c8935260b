"""What every policy shares: the budget fields of its config and the Policy interface.

Beside the token and sequence budgets, every policy takes the step constraints of vLLM V1's
`Scheduler.schedule()` (vllm/v1/core/sched/scheduler.py @00024d31) that do not depend on its order:
the encoder budget of multimodal requests (policies/encoder.py), LoRA adapters per step and their
residency (policies/lora.py), and the arrival admission of per-tenant quotas and the overload state
(policies/quotas.py). All are off by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cbsim.core.schema import option, require
from cbsim.sim.plan import StepPlan
from cbsim.sim.request import Request
from cbsim.sim.state import SchedulerState

from cbsim.policies.batch import BatchBuilder, StepExtras
from cbsim.policies.encoder import EncoderConfig, encoder_reject_reason
from cbsim.policies.lora import LoraResidency, LoraResidencyConfig
from cbsim.policies.quotas import ArrivalGate, OverloadConfig, TenantQuotaConfig, check_quotas


@dataclass(frozen=True)
class SteadyAdmission:
    """A policy's admission as a prompt run applies it (Policy.steady_admission): the head of the queue's
    first chunk is min(its prompt, tokens left, the policy's cap), taken if a sequence (max_num_seqs) and a
    token are left, the chunk is at least min(min_chunk, its prompt) beside other rows, and its KV blocks
    fit beside the watermark; the scan ends at the first that is not taken. Beside a prompt's last chunk
    only if that chunk is not long (more than long_threshold tokens; None: none is). `whole_prompts`: a
    prompt is taken only whole (Orca); `reserve(req)`: the tokens of KV an admission reserves up front
    (admit_prefills' `reserve`; None: none). `prefill_only`: a step that admits runs its prompts alone, the
    running decodes wait (vLLM V0's prefill-first), so the prompt has the whole token budget and every
    sequence."""

    max_num_seqs: int
    long_threshold: int | None = None
    min_chunk: int = 1
    whole_prompts: bool = False
    reserve: Callable[[Request], int] | None = None
    prefill_only: bool = False


@dataclass
class Budgets:
    """Per-step limits every policy respects."""

    token_budget: int | None = option(None, help="max tokens scheduled per step (vLLM max_num_batched_tokens); "
                                      "null = max_model_len for whole-prompt policies")
    max_num_seqs: int = option(256, help="max sequences per step (also the batch size of static and orca)")
    encoder: EncoderConfig | None = option(None, help="multimodal requests' encoder budget and time "
                                           "{seconds_per_token, max_num_encoder_input_tokens, encoder_cache_size, "
                                           "disable_chunked_mm_input} (policies/encoder.py, vLLM V1); null = off")
    max_loras: int | None = option(None, help="LoRA adapters one step may serve (vLLM --max-loras): a waiting "
                                   "request whose adapter is not among the step's is skipped once that many are "
                                   "(policies/lora.py); null = no limit")
    lora_residency: LoraResidencyConfig | None = option(None, help="with max_loras: GPU slots and a host cache of "
                                                        "adapters, LRU, and the load time a miss adds to the step "
                                                        "{pcie_bandwidth_gb_s, rank, model, target_modules | "
                                                        "adapter_bytes, max_cpu_loras, disk_bandwidth_gb_s}; null = "
                                                        "adapters are free to switch")
    tenant_quotas: list[TenantQuotaConfig] | None = option(None, help="per-tenant caps judged at arrival "
                                                           "[{tenant, max_requests, max_tokens}]: an arrival over its "
                                                           "tenant's cap is rejected (policies/quotas.py)")
    overload: OverloadConfig | None = option(None, help="overload state with hysteresis {enter_queued, exit_queued, "
                                             "enter_queued_tokens, exit_queued_tokens, enter_predicted_ttft, "
                                             "exit_predicted_ttft}: arrivals are rejected from when the queue "
                                             "reaches an enter threshold until it drains to the exits")

    def validate(self) -> None:
        require(self.token_budget is None or self.token_budget >= 1, "token_budget", "an integer >= 1 or null",
                self.token_budget)
        require(self.max_num_seqs >= 1, "max_num_seqs", "an integer >= 1", self.max_num_seqs)
        require(self.max_loras is None or self.max_loras >= 1, "max_loras", "an integer >= 1 or null",
                self.max_loras)
        require(self.lora_residency is None or self.max_loras is not None, "lora_residency",
                "null unless max_loras is set (its GPU slots)", "a mapping")
        if self.lora_residency is not None and self.lora_residency.max_cpu_loras is not None:
            require(self.lora_residency.max_cpu_loras >= self.max_loras, "lora_residency.max_cpu_loras",
                    f"at least max_loras ({self.max_loras}), as vLLM's LoRAConfig requires",
                    self.lora_residency.max_cpu_loras)
        check_quotas(self.tenant_quotas)


class Policy:
    """Interface: `schedule(state) -> StepPlan`, a pure function of the state.

    `steady_when_blocked`: if a step schedules only decodes while requests wait, the same waiting
    requests stay blocked until an arrival, a completion or a preemption (true for every policy whose
    admission does not depend on time); the replica may then skip ahead over identical decode steps.
    """

    name = "base"
    Config = Budgets
    steady_when_blocked = True
    chunks_prompts = True  # False: a prompt (and a recompute) must fit one step's token budget

    def __init__(self, config):
        self.config = config
        self.extras = make_extras(config)
        quotas, overload = getattr(config, "tenant_quotas", None), getattr(config, "overload", None)
        self.gate = (ArrivalGate(quotas, overload, getattr(config, "token_budget", None))
                     if quotas or overload else None)

    def schedule(self, state: SchedulerState) -> StepPlan:
        """Called at the start of every step of the replica; returns what that step runs."""
        raise NotImplementedError

    def builder(self, state: SchedulerState, token_budget: int | None, max_num_seqs: int) -> BatchBuilder:
        """A BatchBuilder for one step under this policy's budgets (encoder, LoRA) as well."""
        return BatchBuilder(state, token_budget, max_num_seqs, self.extras)

    def token_budget(self, state: SchedulerState) -> int:
        budget = self.config.token_budget
        return state.max_model_len if budget is None else budget

    def request_cap(self) -> int | None:
        """The most prompt tokens one request advances in a step beside the token budget (None: no cap)."""
        return None

    def steady_chunks(self, state: SchedulerState) -> tuple[int, int | None] | None:
        """(token budget, per-request cap) when this policy's plan, while the running requests are decodes
        and one prompt in progress and no arrival intervenes, is every decode (one token each) and then
        the prompt's next chunk, min(its tokens left, budget - decodes, cap), for as long as KV allows;
        once the prompt caught up, every decode; a finished request leaves and changes nothing else; and
        a waiting request is not admitted into a step that the chunk fills to the budget. The replica may
        then skip ahead (sim/fast_forward.py prompt_run). None (the default): plans are not that
        predictable. tests/sim/test_fast_path.py holds every policy that says so to stepping one by one."""
        return None

    def steady_admission(self, state: SchedulerState) -> SteadyAdmission | None:
        """How this policy admits, when beside steady_chunks it admits waiting requests in queue order
        exactly as admit_prefills does into a step whose running requests all decode or whose prompt in
        progress runs its last chunk (SteadyAdmission says the limits), and judges an arrival by the
        request alone (no quotas or overload state): a prompt run may then admit arrivals itself
        (sim/prompt_run.py). None (the default): an arrival ends a run."""
        return None

    def admits_by_budgets(self, state: SchedulerState) -> bool:
        """Whether steady_chunks holds and only the budgets shape an admission: no encoder budget or LoRA
        slots (they shape it) and no tenant quotas or overload state (they judge arrivals by the state)."""
        return self.steady_chunks(state) is not None and self.extras is None and self.gate is None

    def reject_reason(self, req: Request, state: SchedulerState) -> str:
        """Why `req`, arriving now, is rejected: this policy could never run it, or arrival admission
        (tenant quotas, overload) refuses it. Empty if it is accepted."""
        reason = self.never_runs(req, state)
        if not reason and self.gate is not None:
            reason = self.gate.reject_reason(req, state)
        return reason

    def never_runs(self, req: Request, state: SchedulerState) -> str:
        """Why this policy could never run `req` (checked at arrival); empty if it can."""
        encoder = self.extras.encoder if self.extras is not None else None
        if encoder is not None:
            reason = encoder_reject_reason(encoder, req, self.token_budget(state), self.request_cap(),
                                           self.chunks_prompts)
            if reason:
                return reason
        if self.chunks_prompts:
            return ""
        budget = self.token_budget(state)
        if req.prompt_len + req.output_len - 1 > budget:
            return (f"prompt_len + output_len - 1 = {req.prompt_len + req.output_len - 1} exceeds the token "
                    f"budget {budget} of {self.name}, which does not chunk prompts (a recompute could not run)")
        return ""


def make_extras(config) -> StepExtras | None:
    """The per-step constraints beside tokens and sequences a policy's config asks for (None: none)."""
    encoder = getattr(config, "encoder", None)
    max_loras = getattr(config, "max_loras", None)
    residency = getattr(config, "lora_residency", None)
    if encoder is None and max_loras is None:
        return None
    return StepExtras(encoder=encoder, encoder_budget=getattr(config, "token_budget", None), max_loras=max_loras,
                      residency=None if residency is None else LoraResidency(residency, max_loras))
