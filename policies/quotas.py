"""Arrival admission: per-tenant quotas (LiteLLM's per-key max_parallel_requests) and an overload state.

Both judge a request at its arrival, before any of its work runs, and reject it with a reason
(prefixed "admission:", counted once in num_rejected_admission: the replica sets the reason once,
when it rejects the arriving request). They see what the replica holds: its waiting and running
requests, plus those accepted at arrivals it has not made visible yet (routed there by the same
instant: `ArrivalGate` remembers what it accepted, each until the replica's clock passes its
arrival, by when it is in the queue, or was rejected by a later check).

Per-tenant quota (`tenant_quotas`, a list of {tenant, max_requests, max_tokens}): a request is
rejected when its tenant already has max_requests requests here (waiting or running), or when its
own prompt + output tokens would take the tenant's in-flight tokens (prompt + output of each of its
requests here) past max_tokens. Both are per replica (each replica's policy judges its own arrivals); a cluster-wide quota would
sit at the router. The request cap is LiteLLM proxy's per-key `max_parallel_requests`
(docs.litellm.ai, "Virtual Keys" / "Budgets, Rate Limits": a request over it gets HTTP 429); the
token cap is its analogue in tokens (in flight, not per minute: a per-minute token rate is the fair
queue's token bucket, policies/fairness.py). A request with no tenant is not limited.

Overload state (`overload`): the replica enters it when, at an arrival, its queue holds at least
enter_queued requests (waiting, preempted ones included), or enter_queued_tokens prompt tokens still to
compute (the queue's backlog of prefill work, the signal Mooncake's early rejection predicts from:
Qin et al., FAST 2025), or when the
queue's predicted TTFT reaches enter_predicted_ttft seconds: the queued prompt tokens over the rate of
full prefill chunks (the policy's token budget) run alone, by the run's cost model (state.chunk_cost;
the cold-start seed of sim/admission.py's TTFTPredictor, without its running average). Every request
arriving while it is overloaded is rejected ("overload"); it leaves the state at the first arrival
that finds every signal given at or below its exit threshold. The
band between exit and enter is the hysteresis: without it (exit = enter) admission flips with
every departure, the oscillation Mooncake reports for early rejection (Qin et al., "Mooncake",
FAST 2025, §7.3, load fluctuation between rejection decisions). SGLang's --max-queued-requests is
the band-less case (sim/admission.py queue_full_reason). No engine has the band: the thresholds are
the user's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from cbsim.core.schema import option, require
from cbsim.sim.admission import REASON_PREFIX
from cbsim.sim.request import Request, Status
from cbsim.sim.state import SchedulerState


@dataclass
class TenantQuotaConfig:
    """One tenant's cap on what it may have in flight on a replica."""

    tenant: str = option(help="the tenant it limits (a request's `tenant`)")
    max_requests: int | None = option(None, help="most of its requests waiting or running at once; null = no cap")
    max_tokens: int | None = option(None, help="most prompt + output tokens of its requests waiting or running at "
                                    "once; null = no cap")

    def validate(self) -> None:
        require(self.max_requests is None or self.max_requests >= 1, "max_requests", "an integer >= 1 or null",
                self.max_requests)
        require(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "an integer >= 1 or null",
                self.max_tokens)
        require(self.max_requests is not None or self.max_tokens is not None, "max_requests",
                "max_requests or max_tokens (a quota with neither limits nothing)", None)


@dataclass
class OverloadConfig:
    """Thresholds of the overload state, with hysteresis (enter above, leave at or below)."""

    enter_queued: int | None = option(None, help="enter when an arrival finds this many requests queued; null = "
                                      "not by requests")
    exit_queued: int = option(0, help="leave when an arrival finds at most this many queued (< enter_queued)")
    enter_queued_tokens: int | None = option(None, help="enter when an arrival finds this many prompt tokens "
                                             "queued still to compute; null = not by tokens")
    exit_queued_tokens: int = option(0, help="leave when at most this many are queued (< enter_queued_tokens)")
    enter_predicted_ttft: float | None = option(None, help="enter when the queued prompt tokens would take this many "
                                                "seconds to prefill in full chunks alone (by the cost model); null "
                                                "= not by predicted TTFT")
    exit_predicted_ttft: float = option(0.0, help="leave when they would take at most this long (< enter)")

    def validate(self) -> None:
        require(self.enter_queued is not None or self.enter_queued_tokens is not None
                or self.enter_predicted_ttft is not None, "enter_queued",
                "enter_queued, enter_queued_tokens or enter_predicted_ttft", None)
        if self.enter_predicted_ttft is not None:
            require(math.isfinite(self.enter_predicted_ttft) and self.enter_predicted_ttft > 0,
                    "enter_predicted_ttft", "seconds > 0", self.enter_predicted_ttft)
            require(0 <= self.exit_predicted_ttft < self.enter_predicted_ttft, "exit_predicted_ttft",
                    f"seconds >= 0 and below enter_predicted_ttft ({self.enter_predicted_ttft:g})",
                    self.exit_predicted_ttft)
        if self.enter_queued is not None:
            require(self.enter_queued >= 1, "enter_queued", "an integer >= 1", self.enter_queued)
            require(0 <= self.exit_queued < self.enter_queued, "exit_queued",
                    f"an integer >= 0 and below enter_queued ({self.enter_queued})", self.exit_queued)
        if self.enter_queued_tokens is not None:
            require(self.enter_queued_tokens >= 1, "enter_queued_tokens", "an integer >= 1",
                    self.enter_queued_tokens)
            require(0 <= self.exit_queued_tokens < self.enter_queued_tokens, "exit_queued_tokens",
                    f"an integer >= 0 and below enter_queued_tokens ({self.enter_queued_tokens})",
                    self.exit_queued_tokens)


def check_quotas(quotas: list[TenantQuotaConfig] | None) -> None:
    names = [q.tenant for q in quotas or ()]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    require(duplicate is None, "tenant_quotas", "one quota per tenant", duplicate)


def queued_prompt_tokens(req: Request) -> int:
    """Prompt (or recompute) tokens a queued request still has to compute."""
    return max(req.prompt_len + req.num_output_tokens - req.num_computed_tokens, 0)


class ArrivalGate:
    """One replica's quotas and overload state, judged at each arrival (Policy.reject_reason)."""

    def __init__(self, quotas: list[TenantQuotaConfig] | None, overload: OverloadConfig | None,
                 chunk: int | None = None):
        self.quotas = {q.tenant: q for q in quotas or ()}
        self.chunk = chunk  # tokens of a full prefill chunk (the policy's token budget; None: max_model_len)
        self.overload = overload
        self.overloaded = False
        self.entries = 0  # times the overload state was entered
        self.rejected = {"quota": 0, "overload": 0}
        self._accepted: list[Request] = []  # accepted at arrival, perhaps not yet in the state

    def reject_reason(self, req: Request, state: SchedulerState) -> str:
        """Why `req`, arriving now, is rejected (empty: accepted, and remembered until visible)."""
        pending = self._pending(state)
        reason = self._overload_reason(state, pending) or self._quota_reason(req, state, pending)
        if reason:
            self.rejected["overload" if "overload" in reason else "quota"] += 1
            return reason
        self._accepted.append(req)
        return ""

    def _pending(self, state: SchedulerState) -> list[Request]:
        """Requests accepted here that the state does not show yet: arrivals after the last step's start
        (the replica makes every arrival up to a step's start visible before it plans the step; one at
        that very instant may be either)."""
        now = state.now
        self._accepted = [r for r in self._accepted if r.arrival >= now and r.status != Status.REJECTED]
        if not self._accepted:
            return []
        visible = {r.id for r in (*state.waiting, *state.running, *state.in_flight)}  # an arrival at `now` may be
        return [r for r in self._accepted if r.id not in visible]

    def _overload_reason(self, state: SchedulerState, pending: list[Request]) -> str:
        cfg = self.overload
        if cfg is None:
            return ""
        queued = len(state.waiting) + len(pending)
        tokens = sum(map(queued_prompt_tokens, state.waiting)) + sum(map(queued_prompt_tokens, pending))
        ttft = self._predicted_ttft(state, tokens) if cfg.enter_predicted_ttft is not None else 0.0
        over = ((cfg.enter_queued is not None and queued >= cfg.enter_queued)
                or (cfg.enter_queued_tokens is not None and tokens >= cfg.enter_queued_tokens)
                or (cfg.enter_predicted_ttft is not None and ttft >= cfg.enter_predicted_ttft))
        clear = ((cfg.enter_queued is None or queued <= cfg.exit_queued)
                 and (cfg.enter_queued_tokens is None or tokens <= cfg.exit_queued_tokens)
                 and (cfg.enter_predicted_ttft is None or ttft <= cfg.exit_predicted_ttft))
        if not self.overloaded and over:
            self.overloaded = True
            self.entries += 1
        elif self.overloaded and clear:
            self.overloaded = False
        if not self.overloaded:
            return ""
        predicted = f", {ttft:.3g} s to prefill" if cfg.enter_predicted_ttft is not None else ""
        return (f"{REASON_PREFIX} overload: the replica is overloaded ({queued} requests and {tokens} prompt tokens "
                f"queued{predicted}; it leaves at exit_queued {cfg.exit_queued}, exit_queued_tokens "
                f"{cfg.exit_queued_tokens}, exit_predicted_ttft {cfg.exit_predicted_ttft:g} for the thresholds set)")

    def _predicted_ttft(self, state: SchedulerState, tokens: int) -> float:
        """Seconds to prefill `tokens` in full chunks run alone, by the replica's cost model (0 without one)."""
        if state.chunk_cost is None or tokens <= 0:
            return 0.0
        chunk = self.chunk or state.max_model_len
        return tokens / chunk * state.chunk_cost(chunk, 0)

    def _quota_reason(self, req: Request, state: SchedulerState, pending: list[Request]) -> str:
        quota = self.quotas.get(req.tenant) if req.tenant is not None else None
        if quota is None:
            return ""
        mine = [r for r in (*state.waiting, *state.running, *state.in_flight, *pending) if r.tenant == req.tenant]
        if quota.max_requests is not None and len(mine) >= quota.max_requests:
            return (f"{REASON_PREFIX} tenant quota: tenant {req.tenant!r} has {len(mine)} requests in flight "
                    f"(max_requests {quota.max_requests})")
        tokens = sum(r.prompt_len + r.output_len for r in mine)
        own = req.prompt_len + req.output_len
        if quota.max_tokens is not None and tokens + own > quota.max_tokens:
            return (f"{REASON_PREFIX} tenant quota: tenant {req.tenant!r} has {tokens} tokens in flight, + {own} "
                    f"would exceed max_tokens {quota.max_tokens}")
        return ""
