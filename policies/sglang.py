"""SGLang's scheduler: an ordered waiting queue, a prefill adder, and prefill batches first.

Each step:
1. Order the waiting queue by `schedule_policy`: fcfs; lpm (longest cached prefix first, fcfs once
   more than lpm_fallback_queue_len wait); dfs_weight (depth-first over the radix tree of the
   waiting requests' cached prefixes, heavier subtrees first, a node's own requests after its
   children, as SGLang does); lof (longest output first); random (a seeded random rank per
   request); priority (larger first); routing_key (requests whose key the most running requests
   share first; the key is the request's tenant, or its `priority` when it has none); fair
   (per-tenant virtual token counters with `tenant_weights`, policies/fairness.py); sjf (least estimated
   remaining work: prompt left after the cache hit plus outputs left, by an oracle or a seeded
   predictor with lognormal error); edf (earliest TTFT deadline). Ties keep queue order.
   Guardrails: requests that have waited more than aging_seconds go first, in queue order; only
   the first reorder_window of the others are reordered (the rest follow in queue order);
   requests holding KV (P/D: landed) keep the head. Deadline slack (`deadline_slack`, as fairness.py):
   a request whose TTFT deadline (ttft_deadline, as edf) minus now is below the slack goes first,
   earliest deadline first, after the landed ones and before the aged ones, whatever the order
   (it overrides lpm's and dfs_weight's cache affinity). Cache-aware orders (lpm, dfs_weight) without a
   prefix cache are fcfs.
2. Prefill adder: the chunked request in flight (at most one) continues; then waiting requests are
   admitted in order under the token budget (max_prefill_tokens), the chunk budget
   (chunked_prefill_size), KV (free + evictable blocks, after prefix hits) and max_num_seqs, which
   bounds the running requests (SGLang's max_running_requests), not only one step's rows. A
   prompt that does not fit whole is cut to the chunk budget left, aligned down to the KV block
   size, and becomes the chunked request, which closes the batch. The adder stops at the first
   request that does not fit, whatever stops it (KV, max_prefill_tokens, the chunk budget, the
   running-request limit): SGLang does not skip a head of line that a budget blocks
   (python/sglang/srt/managers/scheduler.py get_new_batch_prefill: `if res !=
   AddReqResult.CONTINUE: ... break` after PrefillAdder.add_one_req, schedule_policy.py, returns
   NO_TOKEN or OTHER; sgl-project/sglang d51c1c21 / 00550cd1 in the stored index).
   chunked_prefill_size is that chunk budget, shared by the step's prefills, not a per-request
   cap. In-batch dedupe (cache-aware orders) is the one skip: a request whose next uncached block
   another request in flight or in this batch is about to compute is held (skipped) until that KV
   exists, when it hits instead of computing it again.
3. A non-empty prefill batch runs (with every running decode when enable_mixed_chunk: they take
   their tokens from both budgets first); otherwise one decode step of the running requests.

LoRA (`max_loras`, policies/lora.py): a waiting request whose adapter would take the step past
max_loras adapters (those of the running batch and of the requests added so far) is skipped, as
SGLang's get_new_batch_prefill does in current versions (`can_run_lora_batch` over the running
batch's lora ids; earlier versions ended the scan there). The encoder budget (policies/encoder.py)
cuts a prompt's chunk before an image it cannot encode.

edf rejects early: a new request that could not meet its deadline even if its prefill ran alone
now (chunk cost by the run's cost model) is rejected at arrival or, later, while waiting
(plan.rejected); it is rejected only in a step that runs something else (a rejection-only plan
would cost a step), so a replica with nothing else to do serves it late instead.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from cbsim.core.schema import option, require
from cbsim.core.units import Seconds
from cbsim.sim.request import Request
from cbsim.sim.state import SchedulerState
from cbsim.workloads.prefixes import block_hash

from cbsim.policies.base import Budgets, Policy, SteadyAdmission
from cbsim.policies.batch import BatchBuilder
from cbsim.policies.fairness import FairQueue, check_weights, urgent_first
from cbsim.policies.helpers import DynamicChunkConfig, fill_decodes, is_decode, make_dynamic
from cbsim.policies.registry import register

ORDERS = ("fcfs", "lpm", "dfs_weight", "lof", "random", "priority", "routing_key", "sjf", "edf", "fair")
CACHE_AWARE = ("lpm", "dfs_weight")


@dataclass
class SGLangConfig(Budgets):
    token_budget: int | None = option(16384, help="max prefill tokens per step (SGLang max_prefill_tokens); null = "
                                      "max_model_len")
    chunked_prefill_size: int | None = option(8192, help="max tokens of one prefill batch; a prompt that does not "
                                              "fit is cut (aligned down to the KV block size) and finishes in later "
                                              "steps, one chunked request at a time; null = whole prompts only")
    schedule_policy: Literal[ORDERS] = option("fcfs", help="waiting-queue order: " + " | ".join(ORDERS))
    lpm_fallback_queue_len: int = option(128, help="lpm: with more waiting requests than this, order fcfs")
    enable_mixed_chunk: bool = option(False, help="run the running decodes in the same step as a prefill batch "
                                      "(otherwise a prefill batch stalls them for that step)")
    in_batch_dedupe: bool = option(True, help="lpm/dfs_weight: hold a request whose next uncached prefix block "
                                   "another request is about to compute, until it is cached")
    reorder_window: int | None = option(None, help="only the first N waiting requests are reordered; null = all")
    aging_seconds: Seconds | None = option(None, help="a request waiting longer than this is served first, in "
                                         "queue order; null = no aging")
    seed: int = option(0, help="seed of the random order and of the sjf predictor's errors")
    output_estimate_error: float = option(0.0, help="sjf: sigma of the log of the output-length predictor's "
                                          "multiplicative error; 0 = oracle (the true output length)")
    ttft_deadline: Seconds = option(1.0, help="edf and deadline_slack: seconds after arrival by which the first "
                                  "token is due")
    ttft_deadline_per_token: float = option(0.0, help="edf and deadline_slack: extra deadline seconds per prompt token")
    deadline_slack: float | None = option(None, help="a waiting request whose TTFT deadline is less than this many "
                                          "seconds away goes first (earliest deadline first), overriding any order "
                                          "(lpm's cache affinity included); null = off")
    tenant_weights: dict | None = option(None, help="fair: {tenant: weight}; unlisted tenants weigh 1")
    dynamic_chunk: DynamicChunkConfig | None = option(None, help="cost-aware chunk sizes {target_chunk: 512}: "
                                                      "chunks shrink as a prompt's history grows; null = off")

    def validate(self) -> None:
        Budgets.validate(self)
        require(self.chunked_prefill_size is None or self.chunked_prefill_size >= 1, "chunked_prefill_size",
                "an integer >= 1 or null", self.chunked_prefill_size)
        require(self.lpm_fallback_queue_len >= 0, "lpm_fallback_queue_len", "an integer >= 0",
                self.lpm_fallback_queue_len)
        require(self.reorder_window is None or self.reorder_window >= 1, "reorder_window", "an integer >= 1 or null",
                self.reorder_window)
        require(self.aging_seconds is None or self.aging_seconds >= 0, "aging_seconds", "seconds >= 0 or null",
                self.aging_seconds)
        require(self.output_estimate_error >= 0, "output_estimate_error", "a number >= 0", self.output_estimate_error)
        require(self.ttft_deadline > 0, "ttft_deadline", "seconds > 0", self.ttft_deadline)
        require(self.ttft_deadline_per_token >= 0, "ttft_deadline_per_token", "seconds >= 0",
                self.ttft_deadline_per_token)
        require(self.deadline_slack is None or (math.isfinite(self.deadline_slack) and self.deadline_slack >= 0),
                "deadline_slack", "seconds >= 0 or null", self.deadline_slack)
        check_weights(self.tenant_weights)
        require(self.schedule_policy == "fair" or not self.tenant_weights, "tenant_weights",
                "null unless schedule_policy is fair", self.tenant_weights)


@register("sglang")
class SGLang(Policy):
    """SGLang: ordered waiting queue (fcfs/lpm/dfs_weight/...), prefill adder, prefill first, radix prefix cache."""

    Config = SGLangConfig

    def __init__(self, config):
        super().__init__(config)
        self.dynamic = make_dynamic(config.dynamic_chunk)
        self._estimates: dict[int, float] = {}  # sjf: request id -> estimated output length (memo)
        self.fair = FairQueue(config.tenant_weights) if config.schedule_policy == "fair" else None

    @property
    def chunks_prompts(self) -> bool:
        return self.config.chunked_prefill_size is not None

    @property
    def steady_when_blocked(self) -> bool:
        """Aging and deadlines change the plan with time alone, fair counters with every decode."""
        cfg = self.config
        return cfg.aging_seconds is None and cfg.deadline_slack is None and cfg.schedule_policy not in ("edf", "fair")

    def request_cap(self) -> int | None:
        return self.config.chunked_prefill_size

    def steady_chunks(self, state):
        cfg = self.config
        if cfg.schedule_policy not in ("fcfs", "lpm") or cfg.enable_mixed_chunk or not self.steady_when_blocked \
                or self.dynamic is not None:  # another order, decodes beside prefills, or chunks that change
            return None
        budget = self.token_budget(state)  # a prefill batch: max_prefill_tokens and the chunk budget
        return (budget if cfg.chunked_prefill_size is None else min(budget, cfg.chunked_prefill_size)), None

    def steady_admission(self, state):
        """Prefill batches run alone (decodes wait), a prompt admitted whole; lpm orders the queue as fcfs
        while nothing waiting is in the cache (a prompt run admits only such requests: sim/prompt_run.py)."""
        if not self.admits_by_budgets(state):
            return None
        return SteadyAdmission(self.config.max_num_seqs, whole_prompts=True, prefill_only=True)

    def never_runs(self, req: Request, state: SchedulerState) -> str:
        reason = Policy.never_runs(self, req, state)
        if reason or self.config.schedule_policy != "edf" or state.chunk_cost is None:
            return reason
        fastest = self._fastest_ttft(req, state)
        if fastest > self._slack(req):
            return (f"edf: its prefill alone takes {fastest:.4g} s, more than its TTFT deadline of "
                    f"{self._slack(req):.4g} s")
        return ""

    # -- the step ---------------------------------------------------------------------------
    def schedule(self, state):
        if self.fair is None:
            return self._schedule(state)
        self.fair.observe(state)
        return self.fair.track(self._schedule(state), state)

    def _schedule(self, state):
        rejected = self._unmeetable(state) if self.config.schedule_policy == "edf" else ()
        if rejected:
            plan = self._plan(state, set(rejected))
            if not plan.is_empty:
                return dataclasses.replace(plan, rejected=rejected)
        return self._plan(state)

    def _plan(self, state, skip: set[int] = frozenset()):
        """A prefill batch if one can run, else a decode step. The chunked request does not take the
        KV of a request that could decode instead (prefill-first, that request might never decode
        and two prompts could evict each other forever), unless no decode can run at all."""
        b = self._prefill_batch(state, skip, spare=is_decode)
        if b.num_prefills or b.admitted:  # admitted: also a swapped-out decode coming back
            return b.build()
        decodes = self.builder(state, None, self.config.max_num_seqs)
        fill_decodes(decodes, state.running)
        if decodes.scheduled:
            return decodes.build()
        b = self._prefill_batch(state, skip, spare=None)
        return b.build() if b.num_prefills or b.admitted or b.preempted else decodes.build()

    def _prefill_batch(self, state, skip: set[int], spare) -> BatchBuilder:
        b = self.builder(state, self.token_budget(state), self.config.max_num_seqs)
        if self.config.enable_mixed_chunk:
            fill_decodes(b, state.running)
        self._add_prefills(state, b, skip, spare)
        return b

    def _add_prefills(self, state, b: BatchBuilder, skip: set[int], spare=None) -> None:
        """The prefill adder: the chunked request in flight, then waiting requests in order (not
        those in `skip`); the queue is ordered only if some room is left."""
        chunk_size = self.config.chunked_prefill_size
        chunk_left = (chunk_size if chunk_size is not None else math.inf) - len(b.scheduled)  # mixed decodes
        in_flight = False
        for req in state.running:
            if not req.in_prefill or req.is_done or b.is_scheduled(req) or b.is_out(req):
                continue
            n = self._chunk(state, req.need, req.num_computed_tokens, min(b.tokens_left, chunk_left))
            n = b.fit_encoder(req, n)
            if n <= 0 or b.seqs_left <= 0 or not b.schedule_running(req, n, spare=spare):
                in_flight = True
                continue
            chunk_left -= n
            in_flight |= n < req.need
        if (b.seqs_left <= 0 or b.tokens_left <= 0 or chunk_left <= 0 or not state.waiting or b.stalled
                or b.free - state.kv.watermark_blocks < 1):  # every admission takes a new block
            return
        slots = self.config.max_num_seqs - sum(not b.is_out(r) for r in state.running)  # max running requests
        dedupe = self._dedupe(state, b)
        for req in self.order(state, b):
            if b.seqs_left <= 0 or b.tokens_left <= 0 or chunk_left <= 0 or slots <= 0:
                return
            if req.id in skip or (dedupe is not None and dedupe.holds(req, b)) or not b.lora_allows(req):
                continue
            need = b.need(req)
            room = min(b.tokens_left, chunk_left)
            n = self._chunk(state, need, b.computed(req), room) if self.chunks_prompts else need
            fitted = b.fit_encoder(req, n)
            if fitted < n and not self.chunks_prompts:
                return
            n = fitted
            if n <= 0 or (n < need and in_flight) or not b.admit(req, n):
                return
            chunk_left -= n
            slots -= 1
            if dedupe is not None:
                dedupe.add(req, b)
            if n < need:
                return  # the new chunked request closes the batch

    def _chunk(self, state, need: int, history: int, room: int) -> int:
        """Tokens of a prefill with `need` left and `history` cached, given `room`: all of it if it
        fits (and the dynamic chunk allows), else aligned down to whole KV blocks (or, when less than
        a block is left, what is left)."""
        limit = room if self.dynamic is None else min(room, self.dynamic.limit(state, history))
        if need <= limit:
            return need
        if not self.chunks_prompts:
            return 0
        block = state.kv.block_size
        return limit // block * block or limit

    # -- the waiting-queue order -------------------------------------------------------------
    def order(self, state: SchedulerState, b: BatchBuilder) -> list[Request]:
        """The waiting requests in the order the prefill adder considers them."""
        cfg = self.config
        waiting = list(state.waiting)
        head = [r for r in waiting if r.num_blocks]  # P/D: landed, holding KV
        rest = [r for r in waiting if not r.num_blocks] if head else waiting
        urgent, rest = urgent_first(rest, state.now, self._deadline, cfg.deadline_slack)
        aged = []
        if cfg.aging_seconds is not None:
            aged = [r for r in rest if state.now - r.arrival > cfg.aging_seconds]
            if aged:
                old = set(map(id, aged))
                rest = [r for r in rest if id(r) not in old]
        window = len(rest) if cfg.reorder_window is None else cfg.reorder_window
        return head + urgent + aged + self._sorted(rest[:window], state, b, len(waiting)) + rest[window:]

    def _sorted(self, reqs: list[Request], state, b: BatchBuilder, queue_len: int) -> list[Request]:
        name = self.config.schedule_policy
        if name in CACHE_AWARE and b.prefix is None:
            name = "fcfs"
        if name == "lpm" and queue_len > self.config.lpm_fallback_queue_len:
            name = "fcfs"
        if name == "fcfs" or len(reqs) < 2:
            return reqs
        if name == "dfs_weight":
            return dfs_weight_order(reqs, b)
        if name == "fair":
            return list(self.fair.order(reqs, b.need))
        return sorted(reqs, key=self._key(name, state, b))

    def _key(self, name: str, state, b: BatchBuilder):
        cfg = self.config
        if name == "lpm":
            return lambda r: -b.hit(r)
        if name == "lof":
            return lambda r: -r.output_len
        if name == "random":
            return lambda r: block_hash(cfg.seed, r.id)
        if name == "priority":
            return lambda r: -r.priority
        if name == "routing_key":
            running: dict = {}
            for r in state.running:
                running[routing_key(r)] = running.get(routing_key(r), 0) + 1
            first: dict = {}
            for i, r in enumerate(state.waiting):
                first.setdefault(routing_key(r), i)
            return lambda r: (-running.get(routing_key(r), 0), first[routing_key(r)])
        if name == "sjf":
            return lambda r: b.need(r) + max(self._estimate(r) - r.num_output_tokens, 1.0)
        return self._deadline  # edf

    def _estimate(self, req: Request) -> float:
        """Predicted output length: the true one, or times a seeded lognormal error per request."""
        sigma = self.config.output_estimate_error
        if sigma == 0:
            return float(req.output_len)
        value = self._estimates.get(req.id)
        if value is None:
            z = np.random.default_rng([self.config.seed, req.id]).standard_normal()
            value = self._estimates[req.id] = req.output_len * math.exp(sigma * z)
        return value

    # -- edf ---------------------------------------------------------------------------------
    def _slack(self, req: Request) -> float:
        return self.config.ttft_deadline + self.config.ttft_deadline_per_token * req.prompt_len

    def _deadline(self, req: Request) -> float:
        return req.arrival + self._slack(req)

    def _fastest_ttft(self, req: Request, state: SchedulerState) -> float:
        """Its prefill run alone, now, over its cached prefix (a lower bound on the time to its first token)."""
        hit = len(state.kv.prefix.match(req)) * state.kv.prefix.unit_tokens if state.kv.prefix is not None else 0
        return state.chunk_cost(req.prompt_len - hit, hit)

    def _unmeetable(self, state: SchedulerState) -> tuple[int, ...]:
        """New waiting requests (no progress, no KV) that can no longer get their first token in time."""
        if state.chunk_cost is None:
            return tuple(r.id for r in state.waiting if self._fresh(r) and state.now > self._deadline(r))
        return tuple(r.id for r in state.waiting
                     if self._fresh(r) and state.now + self._fastest_ttft(r, state) > self._deadline(r))

    @staticmethod
    def _fresh(req: Request) -> bool:
        return not (req.num_computed_tokens or req.num_output_tokens or req.num_blocks or req.num_swapped_blocks)

    # -- in-batch dedupe ---------------------------------------------------------------------
    def _dedupe(self, state, b: BatchBuilder) -> "InBatchDedupe | None":
        if (b.prefix is None or not self.config.in_batch_dedupe
                or self.config.schedule_policy not in CACHE_AWARE):
            return None
        return InBatchDedupe(state, b)


def routing_key(req: Request):
    """The routing_key order's key: the tenant, or the priority for a request without one."""
    return req.priority if req.tenant is None else req.tenant


class InBatchDedupe:
    """Prefix units about to be computed (by running prefills or by requests admitted in this plan);
    a waiting request whose first uncached unit is one of them is held until it is cached."""

    def __init__(self, state: SchedulerState, b: BatchBuilder):
        self.prefix = b.prefix
        self.pending: set[tuple[int, int]] = set()
        for req in state.running:
            if req.in_prefill:
                self._add_units(req, len(self.prefix.held(req)))

    def holds(self, req: Request, b: BatchBuilder) -> bool:
        unit = len(b.cached_path(req))
        return unit < self.prefix.num_units(req) and (unit, self.prefix.unit_key(req, unit)) in self.pending

    def add(self, req: Request, b: BatchBuilder) -> None:
        self._add_units(req, len(b.cached_path(req)))

    def _add_units(self, req: Request, start: int) -> None:
        prefix = self.prefix
        for unit in range(start, prefix.num_units(req)):
            self.pending.add((unit, prefix.unit_key(req, unit)))


def dfs_weight_order(reqs: list[Request], b: BatchBuilder) -> list[Request]:
    """SGLang's DFS-weight order: over the tree of the requests' cached paths, visit children by
    weight (waiting requests at or below them; ties: first seen), each node's own requests (whose
    cached prefix ends there) after its children; requests with no cached prefix come last.

    Only the nodes where paths end or branch matter, so the tree is compressed to those: walking up
    from each path's end to the first node an earlier walk saw marks the branch points; each cache
    node is touched at most twice, with a dictionary or set lookup."""
    root = b.prefix.root
    own: dict[object, list[Request]] = {}
    for req in reqs:
        path = b.cached_path(req)
        own.setdefault(path[-1] if path else root, []).append(req)
    seen = {root: -1}  # node -> index of the first walk through it
    branch = {root}
    for walk, last in enumerate(own):
        node = last
        while node not in seen:
            seen[node] = walk
            node = node.parent
        branch.add(node)
    branch.update(own)
    children: dict[object, list] = {node: [] for node in branch}
    parent_of = {}
    for node in branch:
        if node is not root:
            up = node.parent
            while up not in branch:
                up = up.parent
            parent_of[node] = up
            children[up].append(node)
    weight = {node: len(own.get(node, ())) for node in branch}
    for node in sorted(parent_of, key=lambda n: -n.depth):
        weight[parent_of[node]] += weight[node]
    out: list[Request] = []
    stack: list[tuple[object, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out.extend(own.get(node, ()))
            continue
        stack.append((node, True))
        ranked = sorted(children[node], key=lambda n: (-weight[n], seen[n]))
        stack.extend((child, False) for child in reversed(ranked))
    return out
