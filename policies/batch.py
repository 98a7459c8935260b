"""BatchBuilder: one step's plan, accumulated under the budgets without touching the state.

Invariants kept while building: tokens scheduled <= token budget, sequences (padding included)
<= max_num_seqs, KV blocks granted <= free blocks (+ blocks of victims preempted in this plan),
and a new admission leaves the watermark free. A running request short of blocks preempts
victims (last admitted, or lowest priority) among the running requests not yet scheduled in this
step, and finally itself (`stalled`: KV is exhausted; policies that run prefills before decodes
then admit nobody, or two prompts could take turns preempting each other forever).

Prefix caching (state.kv.prefix): `free` counts available blocks (free + evictable). A waiting
request that can hit the cache is admitted past its cached prefix (`hit`, the same path the replica
acquires at admission: the cache does not change between plan and admission); the hit's nodes that
nobody references yet stop being evictable, once per plan (`_refs` holds the plan's own reference
changes). A victim gives back its own blocks and the nodes only it references.
"""
from __future__ import annotations

from typing import Callable

from cbsim.sim.plan import StepPlan
from cbsim.sim.request import Request, Status
from cbsim.sim.state import SchedulerState


class BatchBuilder:
    def __init__(self, state: SchedulerState, token_budget: int | None, max_num_seqs: int):
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
        self.num_prefills = 0  # prefill rows (chunks or whole prompts) scheduled so far
        self.stalled = False  # a running request could not get KV and preempted itself: admit nobody
        self.prefix = state.kv.prefix  # None unless prefix caching is on
        if self.prefix is not None:
            self.free += self.prefix.evictable_blocks
        self._hits: dict[int, list] = {}  # request id -> cached path it would hit (memo)
        self._refs: dict = {}  # prefix node -> references this plan adds (+) or drops (-)

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

    # -- running requests ----------------------------------------------------------------
    def schedule_running(self, req: Request, num_tokens: int, preempt: bool = True,
                         spare: Callable[[Request], bool] | None = None) -> bool:
        """Schedule `num_tokens` of a running request, preempting others (not those `spare` holds
        back) if KV is short.

        Returns False (nothing scheduled) if the request itself had to be preempted or, with
        preempt=False, if its blocks do not fit.
        """
        target = self.kv.blocks_for(req.num_computed_tokens + num_tokens)
        extra = target - req.num_blocks
        while extra > self.free:
            if not preempt:
                return False
            victim = self._pick_victim(req, spare)
            self._preempt(victim or req)
            if victim is None:
                self.stalled = True
                return False
        self._take(req, num_tokens, target, max(extra, 0))
        return True

    def schedule_decodes(self, running) -> list[Request]:
        """One token for every running decode, in order, while budgets allow. Returns the requests
        of `running` it did not take as decodes, in order (all of `running` if the budgets stopped
        the scan), so a policy can continue prefills without scanning the decodes again.

        The hot path of every step, kept tight: a decode needs a new block only at a block
        boundary, and only a shortage takes the general (preempting) path.
        """
        block_size = self.kv.block_size
        scheduled, epochs, blocks, out = self.scheduled, self.epochs, self.blocks, self._out
        room = min(self.seqs_left, self.tokens_left)
        taken = 0
        others = []
        for req in running:
            if taken >= room:
                self._commit_taken(taken)
                return list(running)
            outputs = req.num_output_tokens
            computed = req.num_computed_tokens
            rid = req.id
            if not outputs or req.prompt_len + outputs - computed != 1 or rid in scheduled or rid in out:
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
                    continue
                self.free -= extra
            scheduled[rid] = 1
            epochs[rid] = req.epoch
            blocks[rid] = target
            taken += 1
        self._commit_taken(taken)
        return others

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
        whole known input with reserve_full_prompt; the watermark must stay free.
        """
        if self.seqs_left <= 0 or num_tokens > self.tokens_left or num_tokens <= 0:
            return False
        if self.prefix is not None:
            return self._admit_with_prefix(req, num_tokens, reserve_tokens)
        tokens = req.num_computed_tokens + num_tokens
        if self.kv.reserve_full_prompt:
            tokens = max(tokens, req.num_tokens)
        target = self.kv.blocks_for(max(tokens, reserve_tokens))
        extra = target - req.num_blocks
        if extra > self.free - self.kv.watermark_blocks:
            return False
        self._take(req, num_tokens, target, extra)
        self.admitted.append(req.id)
        return True

    def _admit_with_prefix(self, req: Request, num_tokens: int, reserve_tokens: int) -> bool:
        path = self.cached_path(req)
        prefix = self.prefix
        held = req.num_blocks + len(path) * prefix.unit_blocks  # a hit request holds no blocks yet
        num_tokens = min(num_tokens, self.need(req))
        tokens = self.computed(req) + num_tokens
        if self.kv.reserve_full_prompt:
            tokens = max(tokens, req.num_tokens)
        target = self.kv.blocks_for(max(tokens, reserve_tokens))
        refs = self._refs
        claimed = sum(prefix.unit_blocks for node in path if node.refs + refs.get(node, 0) == 0)
        extra = target - held
        if extra + claimed > self.free - self.kv.watermark_blocks:
            return False
        for node in path:
            refs[node] = refs.get(node, 0) + 1
        self.free -= claimed
        self._take(req, num_tokens, target, extra)
        self.admitted.append(req.id)
        return True

    # -- result --------------------------------------------------------------------------
    def build(self, hold_finished: bool = False, rejected: tuple[int, ...] = ()) -> StepPlan:
        return StepPlan(
            scheduled=self.scheduled,
            admitted=tuple(self.admitted),
            preempted=tuple(self.preempted),
            padding=tuple(self.padding),
            hold_finished=hold_finished,
            epochs=self.epochs,
            blocks=self.blocks,
            rejected=rejected,
        )

    # -- internals -----------------------------------------------------------------------
    def _take(self, req: Request, num_tokens: int, target_blocks: int, extra_blocks: int) -> None:
        self.scheduled[req.id] = num_tokens
        self.epochs[req.id] = req.epoch
        self.blocks[req.id] = target_blocks
        self.tokens_left -= num_tokens
        self.seqs_left -= 1
        self.free -= extra_blocks
        if num_tokens > 1 or req.num_output_tokens == 0 or req.need > 1:
            self.num_prefills += 1

    def _pick_victim(self, requester: Request, spare: Callable[[Request], bool] | None = None) -> Request | None:
        """The request to evict so that `requester` can grow, or None if it should be the requester
        itself. Candidates are running requests not yet scheduled in this step (and not spared)."""
        candidates = [r for r in self.state.running
                      if r is not requester and r.id not in self.scheduled and r.id not in self._out
                      and r.status == Status.RUNNING and not (spare and spare(r))]
        if not candidates:
            return None
        if self.state.victim == "lowest_priority":
            victim = min(candidates + [requester], key=lambda r: (r.priority, -r.admit_seq))
            return None if victim is requester else victim
        return max(candidates, key=lambda r: r.admit_seq)

    def _preempt(self, victim: Request) -> None:
        self._out.add(victim.id)
        self.preempted.append(victim.id)
        if self.prefix is None:
            self.free += victim.num_blocks
            return
        path, refs, unit = self.prefix.held(victim), self._refs, self.prefix.unit_blocks
        self.free += victim.num_blocks - len(path) * unit  # its own blocks
        for node in path:  # and the cached ones nobody else holds (they become evictable)
            refs[node] = refs.get(node, 0) - 1
            if node.refs + refs[node] == 0:
                self.free += unit
