"""BatchBuilder: one step's plan, accumulated under the budgets without touching the state.

Invariants kept while building: tokens scheduled <= token budget, sequences (padding included)
<= max_num_seqs, KV blocks granted <= free blocks (+ blocks of victims preempted in this plan),
and a new admission leaves the watermark free. A running request short of blocks preempts
victims (last admitted, or lowest priority) among the running requests not yet scheduled in this
step, and finally itself (`stalled`: KV is exhausted; policies that run prefills before decodes
then admit nobody, or two prompts could take turns preempting each other forever).

Victims (state.victim), each the minimum of a key over the candidates, ties to the last admitted:
- last_admitted: the candidate admitted last, never the requester (vLLM V1 FCFS: running.pop()).
- lowest_priority: (priority, -admit_seq) over the candidates and the requester, which may thus
  preempt itself (vLLM V1 priority scheduling).
- shortest_remaining: (output tokens left, -admit_seq) over the candidates and the requester: the
  request with the fewest output tokens left (by its true output_len, which engines do not know).
- lowest_cache_value: (recompute tokens, -admit_seq) over the candidates and the requester, where
  recompute tokens = computed tokens minus those in prefix-cache units the request holds (they stay
  cached when it lets go, so a re-admission hits them): the KV that is cheapest to rebuild.

Admission signals (sim/admission.py), off unless the state carries them: the decode reserve
(SGLang's new_token_ratio: `reserved_tokens` kept for the running requests' future decodes, plus
each admitted whole prompt's own); the TPOT step cap (no admission into a step predicted longer
than state.step_cap while a running request decodes); vLLM V0's swapped queue (state.swapped_first:
no new prompt while a request is swapped out, no swap-in in a step that preempts); P/D backpressure
(state.admit_paused: no admission on a prefill replica while the transfer queue is over its limit).

Sliding window (state.kv.window, sim/kv/cache.py): a request's target is kv.held_for its step, which
may be below what it holds (blocks that left the window are freed before the step's new ones are
allocated, as vLLM's allocate_slots does): the difference returns to `free` for the requests after
it in the plan. Decodes then take schedule_running's path (`_schedule_windowed_decodes`), so the
plain path of schedule_decodes and the leading-decode shortcut stay as without a window.

Prefix caching (state.kv.prefix): `free` counts available blocks (free + evictable). A waiting
request that can hit the cache is admitted past its cached prefix (`hit`, the same path the replica
acquires at admission: the cache does not change between plan and admission); the hit's nodes that
nobody references yet stop being evictable, once per plan (`_refs` holds the plan's own reference
changes). A victim gives back its own blocks and the nodes only it references.

Step extras (`StepExtras`, from the policy's config; policies/base.py): the encoder budget of
multimodal requests (`fit_encoder` cuts a chunk before an encoder input that does not fit; the
input's tokens are taken when the request is scheduled), LoRA adapters per step (`lora_allows`),
and, at `build`, the encoder's seconds and the LoRA loads the plan charges (`extra_seconds`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from cbsim.sim.plan import StepPlan
from cbsim.sim.request import Request, Status
from cbsim.sim.shape import StepShape
from cbsim.sim.state import SchedulerState

from cbsim.policies.encoder import EncoderConfig, EncoderStep
from cbsim.policies.lora import LoraResidency, LoraSlots


@dataclass
class StepExtras:
    """A policy's per-step constraints beside tokens and sequences (policies/base.py make_extras)."""

    encoder: EncoderConfig | None = None
    encoder_budget: int | None = None  # the policy's token budget (the encoder's default budget); None: max_model_len
    max_loras: int | None = None
    residency: LoraResidency | None = None  # the policy's own (it persists across steps)


class BatchBuilder:
    def __init__(self, state: SchedulerState, token_budget: int | None, max_num_seqs: int,
                 extras: StepExtras | None = None):
        self.state = state
        self.kv = state.kv
        self.tokens_left = token_budget if token_budget is not None else 1 << 62
        self.seqs_left = max_num_seqs
        self.free = state.kv.free_blocks  # with prefix caching: + evictable (below)
        self.scheduled: dict[int, int] = {}
        self.epochs: dict[int, int] = {}
        self.blocks: dict[int, int] = {}
        self.admitted: list[int] = []
        self.preempted: list[int] = []
        self.padding: list[int] = []
        self._out: set[int] = set()  # ids preempted in this plan
        # the plan's leading decodes (StepPlan.decode_contexts): while `scheduled` holds only decodes taken
        # by schedule_decodes' plain path, their contexts and the blocks they grow to, for the replica's begin
        self._lead_requests: list[Request] = []
        self._lead_contexts: list[int] = []
        self._lead_grows: list[tuple[Request, int]] = []
        self.num_prefills = 0  # prefill rows (chunks or whole prompts) scheduled so far
        self.stalled = False  # a running request could not get KV and preempted itself: admit nobody
        self.prefix = state.kv.prefix  # None unless prefix caching is on
        if self.prefix is not None:
            self.free += self.prefix.evictable_blocks
        self._hits: dict[int, list] = {}  # request id -> cached path it would hit (memo)
        self._refs: dict = {}  # prefix node -> references this plan adds (+) or drops (-)
        reserve = state.reserve
        # decode reserve: future tokens of the running requests (x ratio) and of this plan's whole prompts (x 1)
        self._running_future = sum(map(reserve.future, state.running)) if reserve is not None else 0
        self._admitted_future = 0
        self._admitted_reqs: list[Request] = []  # for the step-time cap's shape
        self.extras = extras
        self.encoder = self.loras = None
        self._encoder_pending = (-1, 0)  # (request id, encoder tokens) of the last fit_encoder
        self._admitted_lora: list[Request] = []
        if extras is not None:
            if extras.encoder is not None:
                budget = extras.encoder_budget or state.max_model_len
                self.encoder = EncoderStep(extras.encoder, budget, state.running)
            if extras.max_loras is not None:
                self.loras = LoraSlots.seeded(extras.max_loras, state.running)

    # -- queries -------------------------------------------------------------------------
    @property
    def has_room(self) -> bool:
        return self.seqs_left > 0 and self.tokens_left > 0


    def is_out(self, req: Request) -> bool:
        return req.id in self._out

    def is_scheduled(self, req: Request) -> bool:
        return req.id in self.scheduled

    def hit(self, req: Request) -> int:
        """Tokens of `req` an admission now would find in the prefix cache (0 without one)."""
        if self.prefix is None:
            return 0
        return len(self.cached_path(req)) * self.prefix.unit_tokens

    def need(self, req: Request) -> int:
        """Tokens `req` must compute before its next output token, after any prefix-cache hit."""
        return req.need - self.hit(req) if self.prefix is not None else req.need

    def computed(self, req: Request) -> int:
        """Progress of `req` once admitted (history h of its next chunk)."""
        return req.num_computed_tokens + self.hit(req) if self.prefix is not None else req.num_computed_tokens

    def cached_path(self, req: Request) -> list:
        """The cached root path an admission of `req` now would hit (prefix caching only; memoised)."""
        path = self._hits.get(req.id)
        if path is None:
            path = self._hits[req.id] = self.prefix.match(req)
        return path

    # -- step extras (encoder budget, LoRA adapters) ---------------------------------------
    def fit_encoder(self, req: Request, num_tokens: int) -> int:
        """The tokens of `req` (from its progress, after any prefix hit for a waiting one) that the
        encoder budget lets run, at most `num_tokens`: cut before the first encoder input that does
        not fit (policies/encoder.py). The inputs it needs are taken if `req` is then scheduled."""
        if self.encoder is None or not req.mm_inputs or num_tokens <= 0:
            return num_tokens
        running = req.status == Status.RUNNING
        computed = req.num_computed_tokens if running else self.computed(req)
        n, tokens = self.encoder.fit(req, computed, num_tokens, running)
        self._encoder_pending = (req.id, tokens)
        return n

    def lora_allows(self, req: Request) -> bool:
        """Whether `req`'s adapter may join the step (max_loras; always without a limit)."""
        return self.loras is None or self.loras.allows(req)

    # -- running requests ----------------------------------------------------------------
    def schedule_running(self, req: Request, num_tokens: int, preempt: bool = True,
                         spare: Callable[[Request], bool] | None = None) -> bool:
        """Schedule `num_tokens` of a running request, preempting others (not those `spare` holds
        back) if KV is short.

        Returns False (nothing scheduled) if the request itself had to be preempted or, with
        preempt=False, if its blocks do not fit.
        """
        computed = req.num_computed_tokens
        window = self.kv.window is not None
        target = self.kv.held_for(req, computed, computed + num_tokens) if window else self.kv.blocks_for(
            computed + num_tokens)
        extra = target - req.num_blocks
        while extra > self.free:
            if not preempt:
                return False
            victim = self._pick_victim(req, spare)
            self._preempt(victim or req)
            if victim is None:
                self.stalled = True
                return False
        self._take(req, num_tokens, target, extra if window else max(extra, 0))  # a window's old blocks are freed
        return True

    def schedule_decodes(self, running) -> list[Request]:
        """One token for every running decode, in order, while budgets allow. Returns the requests
        of `running` it did not take as decodes, in order (all of `running` if the budgets stopped
        the scan), so a policy can continue prefills without scanning the decodes again.

        The hot path of every step, kept tight: a decode needs a new block only at a block
        boundary, and only a shortage takes the general (preempting) path.
        """
        if self.state.spec is not None:
            return self._schedule_each_decode(running, self._verify_tokens)
        if self.kv.window is not None:
            return self._schedule_each_decode(running, lambda req: 1)
        block_size = self.kv.block_size
        scheduled, epochs, blocks, out = self.scheduled, self.epochs, self.blocks, self._out
        room = min(self.seqs_left, self.tokens_left)
        taken = 0
        others = []
        lead_reqs, contexts, grows = self._lead_requests, self._lead_contexts, self._lead_grows
        lead = len(scheduled) == len(contexts)  # nothing else scheduled yet: the decodes taken lead the plan
        seen = bool(scheduled or out)  # else a request of `running` can be in neither until a preemption
        for req in running:
            if taken >= room:
                self._commit_taken(taken)
                return list(running)
            outputs = req.num_output_tokens
            computed = req.num_computed_tokens
            rid = req.id
            if not outputs or req.prompt_len + outputs - computed != 1 or (seen and (rid in scheduled or rid in out)):
                others.append(req)
                continue
            target = computed // block_size + 1  # blocks for computed + 1 tokens
            extra = target - req.num_blocks
            if extra > 0:
                if extra > self.free:
                    self._commit_taken(taken)
                    taken, room = 0, min(self.seqs_left, self.tokens_left)
                    if self.schedule_running(req, 1):  # preempts others, or itself
                        room -= 1
                    lead, seen = len(scheduled) == len(contexts), True
                    continue
                self.free -= extra
                if lead:
                    grows.append((req, target))
            scheduled[rid] = 1
            epochs[rid] = req.epoch
            blocks[rid] = target
            if lead:
                lead_reqs.append(req)
                contexts.append(computed + 1)
            taken += 1
        self._commit_taken(taken)
        return others

    def _schedule_each_decode(self, running, tokens: Callable[[Request], int]) -> list[Request]:
        """schedule_decodes one decode at a time through schedule_running (`tokens(req)` each), for a
        sliding window (kv.window: the target frees the blocks that left the window; 1 token) and for
        speculative decoding (_verify_tokens); the same order, budgets and result."""
        others = []
        for req in running:
            if min(self.seqs_left, self.tokens_left) <= 0:
                return list(running)
            if (not req.num_output_tokens or req.prompt_len + req.num_output_tokens - req.num_computed_tokens != 1
                    or req.id in self.scheduled or req.id in self._out):
                others.append(req)
                continue
            self.schedule_running(req, tokens(req))  # preempts others, or itself
        return others

    def _verify_tokens(self, req: Request) -> int:
        """Speculative decoding (state.spec, sim/speculative.py): a decode verifies its k drafts, 1 + k
        tokens, whose blocks include the k lookahead slots. As vLLM V1's scheduler
        (vllm/v1/core/sched/scheduler.py `schedule()`): num_new_tokens = num_tokens_with_spec -
        num_computed_tokens, then min(token_budget) (drafts past the budget are not verified) and at
        most max_model_len - 1 - num_computed_tokens."""
        limit = self.state.max_model_len - 1 - req.num_computed_tokens
        return max(1, min(1 + self.state.spec.k, self.tokens_left, limit))

    def _commit_taken(self, count: int) -> None:
        self.seqs_left -= count
        self.tokens_left -= count

    def add_padding(self, req: Request) -> None:
        """Keep a finished request's slot in the batch: charged like a decode row, no token."""
        self.padding.append(req.id)
        self.seqs_left -= 1

    # -- waiting requests ----------------------------------------------------------------
    def admit(self, req: Request, num_tokens: int, reserve_tokens: int = 0) -> bool:
        """Admit a waiting request with `num_tokens` this step if every budget allows.

        `num_tokens` counts from its progress after any prefix-cache hit (at most `need(req)`).
        KV: blocks for what it holds after the step, or for `reserve_tokens` if larger, or for its
        whole known input with reserve_full_prompt; the watermark must stay free (and the decode
        reserve, when on). Then the admission signals: swapped queue and step-time cap.
        """
        if self.seqs_left <= 0 or num_tokens > self.tokens_left or num_tokens <= 0:
            return False
        state = self.state
        if state.admit_paused:  # P/D backpressure (sim/pd.py PDCluster._backpressure)
            return False
        if state.swapped_first and not self._swap_order_allows(req):
            return False
        if state.step_cap is not None and not self._within_step_cap(req, num_tokens):
            return False
        if self.prefix is not None:
            return self._admit_with_prefix(req, num_tokens, reserve_tokens)
        alloc = self.kv.admission_tokens(req, req.num_computed_tokens + num_tokens, reserve_tokens)
        if self.kv.window is None:
            target = self.kv.blocks_for(alloc)
        else:
            target = self.kv.held_for(req, req.num_computed_tokens, alloc)
        extra = target - req.num_blocks
        if extra + self._input_gap(req, alloc) > \
                self.free - self.kv.watermark_blocks - self._reserve_blocks(req, alloc):
            return False
        self._take(req, num_tokens, target, extra)
        self._admitted(req, num_tokens)
        return True

    def _admit_with_prefix(self, req: Request, num_tokens: int, reserve_tokens: int) -> bool:
        path = self.cached_path(req)
        prefix = self.prefix
        held = req.num_blocks + len(path) * prefix.unit_blocks  # a hit request holds no blocks yet
        num_tokens = min(num_tokens, self.need(req))
        alloc = self.kv.admission_tokens(req, self.computed(req) + num_tokens, reserve_tokens)
        target = self.kv.blocks_for(alloc)
        refs = self._refs
        claimed = sum(prefix.unit_blocks for node in path if node.refs + refs.get(node, 0) == 0)
        extra = target - held
        if extra + claimed + self._input_gap(req, alloc) > \
                self.free - self.kv.watermark_blocks - self._reserve_blocks(req, alloc):
            return False
        for node in path:
            refs[node] = refs.get(node, 0) + 1
        self.free -= claimed
        self._take(req, num_tokens, target, extra)
        self._admitted(req, num_tokens)
        return True

    # -- admission signals (sim/admission.py) ----------------------------------------------
    def _admitted(self, req: Request, num_tokens: int) -> None:
        self.admitted.append(req.id)
        if self.state.reserve is not None and num_tokens >= self.need(req):  # a whole prompt reserves its decodes
            self._admitted_future += self.state.reserve.future(req)
        if self.state.step_cap is not None:
            self._admitted_reqs.append(req)

    @property
    def reserved_tokens(self) -> float:
        """Decode reserve: tokens kept free for future decodes (0 when off)."""
        reserve = self.state.reserve
        return self._running_future * reserve.ratio + self._admitted_future if reserve is not None else 0.0

    def _input_gap(self, req: Request, alloc_tokens: int) -> int:
        """With kv.check_full_input: the blocks `req`'s whole input needs beyond this admission's
        `alloc_tokens`, which must be free too, though only the allocation is taken (vLLM 0.32's
        scheduler_reserve_full_isl: allocate_slots(full_sequence_must_fit=True) checks the blocks of
        min(num_tokens, max_model_len), prefix hits counted, against the free blocks, then allocates the
        chunk). 0 without it."""
        if not self.kv.check_full_input:
            return 0
        return self.kv.blocks_for(max(alloc_tokens, req.num_tokens)) - self.kv.blocks_for(alloc_tokens)

    def _reserve_blocks(self, req: Request, alloc_tokens: int) -> int:
        """Blocks an admission of `req` (allocating `alloc_tokens` tokens' blocks) must leave free for
        future decodes: the reserve, and `req`'s own whole input and min(outputs left, clip) beyond its
        allocation (SGLang add_one_req's total_tokens). A request alone on the cache always fits:
        its input and outputs fit (Replica.reject_reason). A request whose KV is here already (P/D:
        landed, its room reserved at the hand-off) needs none."""
        reserve = self.state.reserve
        if reserve is None or req.num_blocks:
            return 0
        blocks_for = self.kv.blocks_for
        own = blocks_for(max(alloc_tokens, req.num_tokens + reserve.future(req))) - blocks_for(alloc_tokens)
        return own + blocks_for(math.ceil(self.reserved_tokens))

    def _swap_order_allows(self, req: Request) -> bool:
        """vLLM V0 _schedule_default: prompts wait while any request is swapped out; swapped
        requests swap in only in a step that preempts nobody. A request holding KV (P/D landed) passes."""
        if req.num_swapped_blocks:
            return not self.preempted
        return req.num_blocks > 0 or self.kv.host_blocks == 0

    def _within_step_cap(self, req: Request, num_tokens: int) -> bool:
        """TPOT slack: admitting `req` keeps the step's predicted time within state.step_cap, or no
        running request is decoding (nobody's TPOT is at stake)."""
        running = self.state.running
        if not any(r.num_output_tokens and r.id not in self._out for r in running):
            return True
        prefill, decode, sampled = [], [], 0
        admitted = {r.id for r in self._admitted_reqs}
        for r in [*running, *self._admitted_reqs]:
            n = self.scheduled.get(r.id)
            if n is None:
                continue
            computed, need = (self.computed(r), self.need(r)) if r.id in admitted else (r.num_computed_tokens, r.need)
            if r.num_output_tokens and need == 1:
                decode.append(computed + 1)
            else:
                prefill.append((n, computed))
            sampled += n == need
        prefill.append((num_tokens, self.computed(req)))
        sampled += num_tokens == self.need(req)
        shape = StepShape(tuple(prefill), tuple(decode), 0, sampled, 0.0)
        return self.state.step_time(shape) <= self.state.step_cap

    # -- result --------------------------------------------------------------------------
    def build(self, hold_finished: bool = False, rejected: tuple[int, ...] = ()) -> StepPlan:
        encoder_tokens, seconds, loads = self._extras_cost()
        return StepPlan(
            encoder_tokens=encoder_tokens,
            extra_seconds=seconds,
            lora_loads=loads,
            scheduled=self.scheduled,
            admitted=tuple(self.admitted),
            preempted=tuple(self.preempted),
            padding=tuple(self.padding),
            hold_finished=hold_finished,
            epochs=self.epochs,
            blocks=self.blocks,
            rejected=rejected,
            decode_requests=tuple(self._lead_requests),
            decode_contexts=tuple(self._lead_contexts),
            decode_grows=tuple(self._lead_grows),
        )

    def _extras_cost(self) -> tuple[int, float, int]:
        """(encoder tokens, seconds of encoder and LoRA loads, adapters loaded) of the plan; the
        LoRA residency is updated here, so build only the plan the policy returns."""
        if self.extras is None:
            return 0, 0.0, 0
        tokens, seconds, loads = 0, 0.0, 0
        if self.encoder is not None:
            tokens, seconds = self.encoder.tokens, self.encoder.seconds
        residency = self.extras.residency
        if residency is not None and self.scheduled:
            scheduled = self.scheduled
            used: dict[str, None] = {}
            for req in (*self.state.running, *self._admitted_lora):
                if req.adapter is not None and req.id in scheduled:
                    used.setdefault(req.adapter, None)
            if used:
                loads, reads = residency.activate(list(used))
                seconds += residency.seconds(loads, reads)
        return tokens, seconds, loads

    # -- internals -----------------------------------------------------------------------
    def _take(self, req: Request, num_tokens: int, target_blocks: int, extra_blocks: int) -> None:
        if self.extras is not None:
            self._take_extras(req)
        self.scheduled[req.id] = num_tokens
        self.epochs[req.id] = req.epoch
        self.blocks[req.id] = target_blocks
        self.tokens_left -= num_tokens
        self.seqs_left -= 1
        self.free -= extra_blocks
        if req.num_output_tokens == 0 or req.need > 1:  # (a decode's verify row, 1 + k tokens, is no prefill)
            self.num_prefills += 1

    def _take_extras(self, req: Request) -> None:
        if self._encoder_pending[0] == req.id:
            self.encoder.take(self._encoder_pending[1])
            self._encoder_pending = (-1, 0)
        if self.loras is not None and req.status != Status.RUNNING:
            self.loras.take(req)
            self._admitted_lora.append(req)

    def _pick_victim(self, requester: Request, spare: Callable[[Request], bool] | None = None) -> Request | None:
        """The request to evict so that `requester` can grow, or None if it should be the requester
        itself. Candidates are running requests not yet scheduled in this step (and not spared)."""
        candidates = [r for r in self.state.running
                      if r is not requester and r.id not in self.scheduled and r.id not in self._out
                      and r.status == Status.RUNNING and not (spare and spare(r))]
        if not candidates:
            return None
        victim_rule = self.state.victim
        if victim_rule == "last_admitted":
            return max(candidates, key=lambda r: r.admit_seq)
        key = VICTIM_KEYS[victim_rule]
        victim = min(candidates + [requester], key=lambda r: (key(self, r), -r.admit_seq))
        return None if victim is requester else victim

    def recompute_tokens(self, req: Request) -> int:
        """Computed tokens of a running `req` that a recompute would prefill again: all of them,
        less those in prefix-cache units it holds (cached, they outlive its release)."""
        if self.prefix is None:
            return req.num_computed_tokens
        return req.num_computed_tokens - len(self.prefix.held(req)) * self.prefix.unit_tokens

    def _preempt(self, victim: Request) -> None:
        self._out.add(victim.id)
        if self.encoder is not None:
            self.encoder.release(victim)
        self.preempted.append(victim.id)
        if self.state.reserve is not None:  # its future decodes need no room now (SGLang preempt_to_schedule)
            self._running_future -= self.state.reserve.future(victim)
        if self.prefix is None:
            self.free += victim.num_blocks
            return
        path, refs, unit = self.prefix.held(victim), self._refs, self.prefix.unit_blocks
        self.free += victim.num_blocks - len(path) * unit  # its own blocks
        for node in path:  # and the cached ones nobody else holds (they become evictable)
            refs[node] = refs.get(node, 0) - 1
            if node.refs + refs[node] == 0:
                self.free += unit


# victim rules other than last_admitted: key(builder, request), smaller is evicted first
VICTIM_KEYS: dict[str, Callable[[BatchBuilder, Request], int]] = {
    "lowest_priority": lambda b, r: r.priority,
    "shortest_remaining": lambda b, r: r.output_len - r.num_output_tokens,
    "lowest_cache_value": lambda b, r: b.recompute_tokens(r),
}
