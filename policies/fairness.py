"""Per-tenant fair sharing of one replica's waiting queue, as a helper policies compose.

A queue policy that favours cache locality needs a guardrail against starvation, at least one of: a reorder window,
aging, a tenant token bucket or weighted fair queue, deadline slack overriding cache affinity, and a
minimum service quantum per round. vLLM V1 has no tenant fairness (only `priority` scheduling);
SGLang has priority scheduling and a `routing_key` order. What this module defines:

Service (the counter). A tenant's service is the tokens computed for its requests on this replica:
the `num_computed_tokens` of its requests in the state (running or waiting) plus, for each request
that has left the state (finished, rejected, handed off), its `num_computed_tokens` when it left
(prompt + output - 1 for a finished one). The helper keeps the requests holding progress that it
saw in the state or admitted in its own plans (a dict in the policy of each replica, no global)
and reads them again at the next step, so fast-forwarded decode runs and completions count
exactly; nothing in the event loop changes (a P/D hand-off is read one step after it left, so a
few decode tokens on the other side may count). A recompute preemption resets a
request's counter, so its tenant's service drops by the work thrown away (service is progress
held, not GPU time spent); a prefix-cache hit counts as service.

Virtual token counter (the order). counter(t) = service(t) / weight(t) + lift(t), the Virtual
Token Counter of Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024, VTC), with
its lift: when a tenant becomes active (has requests in the state after a step where it had none)
its counter is raised to the smallest counter of the tenants active before, so idle time banks no
credit. Waiting requests are ordered by start tag, as in Start-time Fair Queueing (Goyal, Vin,
Cheng, SIGCOMM 1996): a tenant's k-th waiting request (in queue order) gets start tag
counter(t) + (remaining prompt of its k earlier waiting requests) / weight(t); ties keep queue order.
Requests without a tenant form one tenant (None) of weight 1.

Token buckets (rate limits). A bucket of `rate` tokens/s holding at most `burst` tokens, full at
the first step: it refills by rate x the time since the previous step, and admitting a waiting
request takes its whole remaining prompt (after a prefix hit) from it. A request is admitted only
if its tenant's bucket holds that many tokens; else its tenant's requests are passed over this step
(others may start). Decodes and chunks of prompts already admitted are not limited (a decode never
stalls). Two modes (`token_bucket_mode`). work_conserving (the default): in a step that would
otherwise run nothing, requests are admitted past their buckets (which go negative), so a replica
never idles while a tenant is throttled. strict: a throttled tenant stays idle until its bucket
holds its first waiting request's prompt, even on an idle replica: the empty plan then carries
`idle_until`, the time the first such bucket refills (level + rate x t >= prompt), so the replica
sleeps until then or until an arrival or completion changes the state; a prompt larger than its
tenant's burst could never pass, so strict mode rejects it at arrival. This is the rate limit
providers enforce (HTTP 429 until tokens accrue; OpenAI and Anthropic meter tokens per minute
this way). The meter is what providers' tokens-per-minute limits meter (input tokens at admission).

Minimum service quantum. Each step every tenant with prefill work (a waiting request or a prompt
in flight) has first claim on `quantum` tokens, Deficit Round Robin's per-round quantum (Shreedhar
and Varghese, SIGCOMM 1995): the decodes leave quantum x (such tenants) tokens of the budget, at
most half of it, so decodes always progress (with the whole budget held, prompts in flight could
preempt each other's decoders forever: a property test found it); decodes cut off get what is
left after the prefills; the prompts in flight continue; then one
quantum round visits the waiting tenants by counter, admitting each one's first waiting request
with at most what the budget leaves after quantum for each tenant still to visit (at least
quantum); the rest of the queue follows by start tag.

Deadline slack (`urgent_first`). A request whose TTFT deadline minus now is below the slack goes
first, earliest deadline first, ahead of any order (lpm's cache affinity included): when the slack
runs low, the deadline overrides cache affinity.
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Literal

from cbsim.core.schema import option, require
from cbsim.sim.plan import StepPlan
from cbsim.sim.request import Request
from cbsim.sim.state import SchedulerState

from cbsim.policies.batch import BatchBuilder

FAIR_ORDERS = ("fcfs", "fair")
REFILL_TOLERANCE = 1e-9  # a bucket refilled to a prompt's size by float arithmetic passes it (no 1e-16 s waits)


@dataclass
class TokenBucketConfig:
    """One tenant's rate limit on admitted prompt tokens."""

    tenant: str = option(help="the tenant it limits (a request's `tenant`)")
    rate: float = option(help="tokens per second added to the bucket (> 0)")
    burst: float = option(help="most tokens the bucket holds, its level at the start (>= 1)")

    def validate(self) -> None:
        require(self.rate > 0, "rate", "tokens per second > 0", self.rate)
        require(self.burst >= 1, "burst", "tokens >= 1", self.burst)


@dataclass
class FairConfig:
    """The fair-queue options a policy config mixes in (sarathi, prefill_first, splitfuse, chunked_only)."""

    queue_policy: Literal[FAIR_ORDERS] = option("fcfs", help="order of new prompts: fcfs (arrival), or fair "
                                                "(per-tenant virtual token counters, policies/fairness.py)")
    tenant_weights: dict | None = option(None, help="fair: {tenant: weight}; a tenant's share of service is "
                                         "proportional to its weight; unlisted tenants weigh 1")
    min_quantum: int = option(0, help="fair: tokens of every step's budget each tenant with prefill work (a "
                              "waiting prompt or one in flight) has first claim on; decodes leave them, up to half "
                              "the budget; 0 = none")
    token_buckets: list[TokenBucketConfig] | None = option(None, help="fair: per-tenant rate limits on admitted "
                                                           "prompt tokens, [{tenant, rate (tokens/s), burst}]")
    token_bucket_mode: Literal["work_conserving", "strict"] = option(
        "work_conserving", help="work_conserving: a step that would run nothing admits past the buckets; strict: "
        "a throttled tenant waits until its bucket refills, even on an idle replica")

    def validate_fair(self) -> None:
        check_weights(self.tenant_weights)
        require(self.min_quantum >= 0, "min_quantum", "tokens >= 0", self.min_quantum)
        fair_only = self.tenant_weights or self.min_quantum or self.token_buckets
        require(self.queue_policy == "fair" or not fair_only, "queue_policy",
                "fair (tenant_weights, min_quantum and token_buckets apply to the fair order)", self.queue_policy)
        names = [b.tenant for b in self.token_buckets or ()]
        duplicate = next((n for n in names if names.count(n) > 1), None)
        require(duplicate is None, "token_buckets", "one bucket per tenant", duplicate)


def make_fair(config) -> "FairQueue | None":
    """The policy's fair queue, or None for fcfs."""
    if config.queue_policy != "fair":
        return None
    return FairQueue(config.tenant_weights, config.min_quantum, config.token_buckets or (),
                     strict=config.token_bucket_mode == "strict")


def bucket_reject_reason(config, req: Request) -> str:
    """Strict buckets: a prompt larger than its tenant's burst could never be admitted."""
    if getattr(config, "token_bucket_mode", None) != "strict":
        return ""
    for bucket in config.token_buckets or ():
        if bucket.tenant == req.tenant and req.prompt_len > bucket.burst:
            return (f"its prompt of {req.prompt_len} tokens exceeds the burst {bucket.burst:g} of tenant "
                    f"{req.tenant!r}'s token bucket, which strict mode never exceeds")
    return ""


def check_weights(weights: dict | None, key: str = "tenant_weights") -> None:
    """A mapping {tenant: weight > 0}."""
    for name, value in (weights or {}).items():
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        require(ok, f"{key}.{name}", "a weight > 0", value)


class FairQueue:
    """One replica's fair-queueing state: the requests seen, each tenant's lift, the buckets.

    `observe(state)` is called once at the start of every step (it is idempotent at one instant);
    `order`, `admit` and `hold` then decide from what it saw; `track(plan, state)` sees the plan."""

    def __init__(self, weights: dict[str, float] | None = None, quantum: int = 0,
                 buckets: Iterable[TokenBucketConfig] = (), strict: bool = False):
        self.weights = {str(k): float(v) for k, v in (weights or {}).items()}  # YAML may give a key as a number
        self.quantum = quantum
        self.buckets = {b.tenant: b for b in buckets}
        self.strict = strict
        self.idle_until: float | None = None  # strict: when the first throttled bucket refills (set by admit)
        self._seen: dict[int, Request] = {}  # requests in the state at the last step
        self._left: dict[str | None, int] = {}  # tenant -> tokens of its requests that left the state
        self._lift: dict[str | None, float] = {}
        self._active: set[str | None] = set()
        self._filled: dict[str, tuple[float, float]] = {}  # tenant -> (level, time) at its last debit
        self._level: dict[str, float] = {}  # tenant -> bucket level now
        self._now = 0.0
        self.counter: dict[str | None, float] = {}
        self.waiting_tenants: set[str | None] = set()

    def weight(self, tenant: str | None) -> float:
        return self.weights.get(tenant, 1.0)

    # -- service ----------------------------------------------------------------------------
    def observe(self, state: SchedulerState) -> None:
        """Service and counters of every tenant from the requests in the state and those that left.

        Only requests holding progress are tracked: one that leaves with none adds nothing, and a
        recompute-preempted one (counter reset) leaves the tracked set at no cost."""
        current = {r.id: r for r in (*state.running, *state.in_flight)}  # in flight (PP): still here
        current.update((r.id, r) for r in state.waiting if r.num_computed_tokens)
        left = self._left
        for rid, req in self._seen.items():
            if rid not in current:
                left[req.tenant] = left.get(req.tenant, 0) + req.num_computed_tokens
        self._seen = current
        service = dict(left)
        for req in current.values():
            service[req.tenant] = service.get(req.tenant, 0) + req.num_computed_tokens
        self.waiting_tenants = {r.tenant for r in state.waiting}
        active = self.waiting_tenants | {r.tenant for r in (*state.running, *state.in_flight)}
        counter = {t: service.get(t, 0) / self.weight(t) + self._lift.get(t, 0.0) for t in active | set(service)}
        before = [counter[t] for t in self._active & active]
        if before:
            floor = min(before)
            for t in active - self._active:
                if counter[t] < floor:
                    self._lift[t] = self._lift.get(t, 0.0) + floor - counter[t]
                    counter[t] = floor
        self._active = active
        self.counter = counter
        for name, bucket in self.buckets.items():  # from the last debit, so the steps between do not matter
            level, since = self._filled.get(name, (float(bucket.burst), state.now))
            self._level[name] = min(float(bucket.burst), level + bucket.rate * (state.now - since))
        self._now = state.now

    def track(self, plan: StepPlan, state: SchedulerState) -> StepPlan:
        """Called with the plan the policy returns: its admitted requests join the tracked ones (one
        that finishes within the step, a prompt with one output token, leaves before the next
        `observe` sees it running). Returns the plan."""
        if plan.admitted:
            admitted = set(plan.admitted)
            self._seen.update((r.id, r) for r in state.waiting if r.id in admitted)
        if self.idle_until is not None and plan.is_empty:
            return dataclasses.replace(plan, idle_until=self.idle_until)
        return plan

    def order(self, reqs: Iterable[Request], need: Callable[[Request], int] = lambda r: r.need) -> Iterator[Request]:
        """`reqs` by start tag (tenant counter plus the tenant's earlier waiting prompt tokens over its
        weight; ties in queue order), lazily: a merge of the tenants' queues, so a scan that stops
        early costs little."""
        return self._merge(self._queues(reqs), need)

    @staticmethod
    def _queues(reqs: Iterable[Request]) -> dict[str | None, list[tuple[int, Request]]]:
        """Each tenant's requests (with their queue positions), in queue order."""
        queues: dict[str | None, list[tuple[int, Request]]] = {}
        for i, req in enumerate(reqs):
            queue = queues.get(req.tenant)
            if queue is None:
                queue = queues[req.tenant] = []
            queue.append((i, req))
        return queues

    def _merge(self, queues: dict, need: Callable[[Request], int]) -> Iterator[Request]:
        counter = self.counter
        heap = [(counter.get(t, 0.0), q[0][0], 0, t) for t, q in queues.items()]
        heapq.heapify(heap)
        while heap:
            tag, _, k, t = heap[0]
            queue = queues[t]
            req = queue[k][1]
            if k + 1 < len(queue):
                heapq.heapreplace(heap, (tag + need(req) / self.weight(t), queue[k + 1][0], k + 1, t))
            else:
                heapq.heappop(heap)
            yield req

    # -- the quantum's hold-back ----------------------------------------------------------------
    def hold(self, b: BatchBuilder, state: SchedulerState) -> int:
        """Take quantum x (tenants with prefill work: a waiting request or a prompt in flight) tokens
        out of the step's budget before the decodes (give them back with `release`); returns them."""
        if not self.quantum:
            return 0
        tenants = set(self.waiting_tenants)
        tenants.update(r.tenant for r in state.running if r.in_prefill and not r.is_done)
        held = min(self.quantum * len(tenants), b.tokens_left // 2)  # decodes keep half: they always progress
        b.tokens_left -= held
        return held

    @staticmethod
    def release(b: BatchBuilder, held: int) -> None:
        b.tokens_left += held

    # -- admissions ---------------------------------------------------------------------------
    def admit(self, b: BatchBuilder, waiting: Iterable[Request],
              admit: Callable[[Iterable[Request], int | None], None], cap: int | None = None) -> None:
        """Admit waiting requests fairly: the quantum round, then the rest by start tag, through
        `admit(requests, cap)` (the policy's own admission helper, which ends its scan where a budget
        stops it); buckets pass over throttled tenants. A step that would otherwise run nothing
        admits past the buckets (see the module docstring)."""
        queues = self._queues(waiting)
        spent: dict[str | None, list[Request]] = {}
        if self.quantum:
            self._quantum_round(b, queues, admit, cap, spent)
        rest = (r for r in self._merge(queues, b.need) if not b.is_scheduled(r))
        admit(self._within_buckets(b, rest, spent), cap)
        self.idle_until = None
        if self.buckets and not b.scheduled and not b.preempted:  # nothing else runs
            if self.strict:
                self.idle_until = self._refill_time(queues, b)
            else:  # work-conserving
                admit(self._merge(queues, b.need), cap)
        self._debit(b, waiting)

    def _quantum_round(self, b, queues, admit, cap, spent) -> None:
        """Each waiting tenant's first request, tenants by counter (ties: queue order)."""
        heads = sorted((self.counter.get(t, 0.0), q[0][0], q[0][1]) for t, q in queues.items())
        later = len(heads)
        for _, _, req in heads:
            later -= 1
            room = max(self.quantum, b.tokens_left - self.quantum * later)
            admit(self._within_buckets(b, [req], spent), room if cap is None else min(cap, room))

    def _within_buckets(self, b: BatchBuilder, reqs: Iterable[Request], spent: dict) -> Iterator[Request]:
        """`reqs`, less those whose tenant's bucket lacks their remaining prompt (after what this step
        already admitted: it reads the builder as admissions happen)."""
        if not self.buckets:
            yield from reqs
            return
        for req in reqs:
            t = req.tenant
            if t in self._level:
                charged = sum(b.need(r) for r in spent.get(t, ()) if b.is_scheduled(r))
                if self._level[t] - charged < b.need(req) * (1 - REFILL_TOLERANCE):
                    continue
                spent.setdefault(t, []).append(req)
            yield req

    def _refill_time(self, queues: dict, b: BatchBuilder) -> float | None:
        """The earliest time a throttled tenant's bucket holds its first waiting request's prompt
        (None if no waiting tenant is throttled: something else holds the queue back)."""
        times = []
        for tenant, queue in queues.items():
            bucket = self.buckets.get(tenant)
            if bucket is None:
                continue
            lack = b.need(queue[0][1]) - self._level[tenant]
            if lack > 0:
                times.append(self._now + lack / bucket.rate)
        return min(times) if times else None

    def _debit(self, b: BatchBuilder, waiting: Iterable[Request]) -> None:
        """Take every request admitted in this step (its remaining prompt) from its tenant's bucket."""
        if not self.buckets or not b.admitted:
            return
        admitted = set(b.admitted)
        for req in waiting:
            if req.id in admitted and req.tenant in self._level:
                self._level[req.tenant] -= b.need(req)
                self._filled[req.tenant] = (self._level[req.tenant], self._now)


def admit_fairly(fair: "FairQueue | None", b: BatchBuilder, waiting: Iterable[Request],
                 admit: Callable[[Iterable[Request], int | None], None], cap: int | None = None) -> None:
    """Admit `waiting` through `admit(requests, cap)`: in queue order without a fair queue, else fairly."""
    if fair is None:
        admit(waiting, cap)
    else:
        fair.admit(b, waiting, admit, cap)


def urgent_first(reqs: list[Request], now: float, deadline: Callable[[Request], float],
                 slack: float | None) -> tuple[list[Request], list[Request]]:
    """(urgent, rest): the requests whose deadline minus `now` is below `slack`, earliest deadline
    first (ties keep order), and the others in their order. slack None: nothing is urgent."""
    if slack is None:
        return [], reqs
    urgent = [r for r in reqs if deadline(r) - now < slack]
    if not urgent:
        return [], reqs
    marked = set(map(id, urgent))
    return sorted(urgent, key=deadline), [r for r in reqs if id(r) not in marked]
