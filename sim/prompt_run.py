"""Prompt runs: fast-forward over the steps of a steady chunked-prefill schedule, computed without
touching the replica (sim/step_apply.py commit_prompt_run applies one).

A policy that states its plans (Policy.steady_chunks: Sarathi-style, every decode and then the prompt's
next chunk, min(tokens left, budget - decodes, cap)) lets the replica skip over the chunks of the one
prompt in progress and on over the decode steps after it: each step's shape is priced by the cost model
as the step would be; a request that finishes leaves at its step's end while the others go on. While
requests wait, only steps whose chunk takes the whole token budget run (nothing can be admitted beside
it). The run stops before KV runs short, before the simulation's end, and at the next outside event.

Arrivals inside a run. Where the replica knows ahead which arrivals it will receive (open loop: one
replica, Replica.arrivals is the feed; several under round_robin, the replica's own RoutedArrivals, and the
other replicas' arrivals are no outside event) and the policy states its admission (Policy.steady_admission: the head
of the waiting queue, fresh, admitted as admit_prefills does), an arrival is not an outside event. The
run looks ahead in the feed (ArrivalFeed.peek; the feed still routes each request at its time, and the
replica's reject_reason says which it will turn away); a request waits from the first step that starts
at or after its arrival. In a step whose running requests all decode, or whose prompt runs its last
chunk with token budget left (not a long chunk), the run admits the head of the queue if a sequence, a
token (a policy of whole prompts: its whole prompt) and the KV blocks its admission takes beside the
watermark are free (KVCache.admission_tokens: its first chunk's, its whole prompt's with
reserve_full_prompt, or what the policy reserves up front: Orca's prompt + max output), and if the
requests behind it, if any, find no token or sequence left; the new prompt then runs its chunks as the
first one did.
A policy whose prefill steps run alone (SteadyAdmission.prefill_only: vLLM V0's prefill-first, SGLang's
prefill batches) runs each admitted prompt whole in a step of its own, and a run may start at such a
step: the decode rows wait it out (a pause, PromptRun.pauses: their later steps, block crossings and last
steps come one step later), and only while they all fit max_num_seqs.
With a prefix cache, a run takes only requests the cache cannot share (no prefix or output hashes: no hit, nothing
published, a leave frees its blocks), and only one waiting at a time (so no cache-aware order can
differ from the queue's); a request it could share ends the run.
Anything else (a request that holds progress at the head, a chunk that leaves budget while requests
wait, a second admission into one step, an admission that does not fit) ends the run before that
step, which the policy then plans.

Per step O(1) work: the decode rows' step-0 contexts (a row of step j reads its context + j) and their
sum change only when a request joins or leaves; a row's block crossings recur every block_size steps
up to its last step, all known when it becomes a row, so they are counted by step then (a list indexed
by step, as long as a run may be); leaving requests are kept by their last step.
Invariant: the result is exactly (bit for bit) what stepping one by one gives; tests/sim/test_fast_path.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import islice
from typing import NamedTuple

import numpy as np

from cbsim.sim.durations import CLOCK_LIMIT, check_run
from cbsim.sim.fast_forward import next_deadline
from cbsim.sim.request import Request, Status
from cbsim.sim.run_rows import RunRows

_LEAVE, _BOUND = "leave", "bound"  # why a segment of decode-only steps ended (_SteadySteps._decode_segment)


class PromptSegment(NamedTuple):  # (a tuple: made once per prompt a run admits, in C)
    """One prompt's part of a run: it runs `chunks[k]` in step first + k (from history `history`) until it
    has caught up, then is a decode row. `first`: 0 for the prompt in progress at the run's start, else
    the step that admits it. It samples its next token in step `sampled` (None: not in this run): its
    last chunk's, or, when that left one token (a recompute's), its first decode row's. It holds at least
    `blocks` KV blocks after its chunks (an admission's reservation may exceed its context)."""

    prompt: Request
    first: int
    history: int
    chunks: list[int]
    sampled: int | None
    blocks: int


@dataclass(frozen=True, slots=True)
class PromptRun:
    """Steps 0..k from the step begun (step 0): every running decode decodes each step, and the prompts
    run their chunks one after another (`prompts`, in the order they run). A request whose last token
    comes in step j leaves at that step's end (`finish[req]` = j). `ends[j]`: when step j ends;
    `columns`: steps 1..k in the step table (sim/run_rows.py COLUMNS, numpy). `pauses`: the steps, ascending,
    that run a prompt alone (SteadyAdmission.prefill_only): every decode row waits them out."""

    prompts: tuple[PromptSegment, ...]
    ends: list[float]
    finish: dict
    columns: dict
    pauses: tuple[int, ...] = ()


def cut_prompt_run(run: PromptRun, count: int) -> PromptRun:
    """Steps 0..count-1 of `run` (a request routed here arrives during it: sim/replica.py), exactly the run
    those steps alone make. Only a run that admits nobody is cut (a replica that cannot know its arrivals
    ahead takes none inside a run): its one prompt keeps the chunks of the kept steps and holds the blocks
    of its context, which the commit grows it to."""
    if count == len(run.ends):
        return run
    (segment,) = run.prompts
    kept = segment.chunks[:count]
    sampled = segment.sampled if segment.sampled is not None and segment.sampled < count else None
    return PromptRun((segment._replace(chunks=kept, sampled=sampled, blocks=0),), run.ends[:count],
                     {req: j for req, j in run.finish.items() if j < count},
                     {name: column[:count - 1] for name, column in run.columns.items()},
                     tuple(j for j in run.pauses if j < count))


def tokens_by_step(run: PromptRun, shape) -> list[int]:
    """Per step of `run`, what committing it takes off its requests' outstanding tokens (sim/router.py): the
    tokens it computes (its chunks, one a decode row), and one more per request that leaves at its end (the
    token it sampled last, which it never computes)."""
    done = [sum(c for c, _ in shape.prefill) + len(shape.decode)]
    done += (run.columns["prefill_tokens"] + run.columns["decode_tokens"]).tolist()
    for j in run.finish.values():
        done[j] += 1
    return done


def replica_leaps_prompts(replica) -> bool:
    """What of may_leap_prompt holds for the replica's whole life, decided once (Replica.run, before its
    first step): nothing that changes from step to step or must see each step (noise, recorded shapes,
    a sliding window, the decode reserve and step cap, TTFT admission, a closed loop or
    client timeouts, a P/D role)."""
    state = replica.state
    return (replica.settings.fast_forward and replica.settings.client_timeout is None
            and state.reserve is None and state.step_cap is None
            and replica.noise is None and replica.shapes is None
            and replica.kv.window is None and replica.admission is None and replica.on_leave is None
            and replica.role.leaps_prompts)


def may_leap_prompt(replica, plan, shape, swap_bytes) -> bool:
    """Whether the step just begun, on a replica where replica_leaps_prompts holds, may start a prompt run:
    one prompt in progress beside decodes of every other running request, and no preemption, padding,
    rejection, swap, side work or held finish in the step."""
    state = replica.state
    return (len(shape.prefill) == 1 and len(shape.decode) + 1 == len(plan.scheduled)
            and (len(state.running) == len(plan.scheduled) or not shape.decode)  # (or a prompt alone: prompt_run)
            and not (plan.preempted or plan.padding or plan.rejected or swap_bytes or plan.extra_seconds
                     or plan.hold_finished))


def prompt_run(replica, plan, shape, start: float, duration: float, where) -> PromptRun | None:
    """The prompt run from the step that starts at `start` and lasts `duration` (plan `plan`, shape
    `shape`), or None to step once. While a prompt has tokens left, step j decodes every running decode
    once more and runs the chunk min(tokens left, budget - decodes, cap) at the prompt's history; from
    the step after the one that samples its next token it is one more decode. A request that finishes
    leaves at the end of its step. A step runs only if its blocks fit in the free ones (block crossings,
    the prompt's growth), if it leaves no token budget while requests wait, if it ends before the
    simulation does, and, as in a decode run, if it starts before the next outside event (with
    runs_end_before_horizon: ends before it). Arrivals: see the module docstring."""
    steady = getattr(replica.policy, "steady_chunks", None)  # a policy without it (a test's wrapper) is stepped
    rule = steady(replica.state) if steady is not None else None
    admission = _stated_admission(replica) if rule is not None else None
    horizon = next_deadline(replica) if admission is not None else min(replica.horizon(), next_deadline(replica))
    if rule is None or not start + duration < horizon:
        return None  # not steady, or an outside event comes before its second step (before any O(rows) work)
    alone = len(replica.state.running) > 1 and not shape.decode  # the decodes pause for the prompt
    if alone and not (admission is not None and admission.prefill_only
                      and len(replica.state.running) <= admission.max_num_seqs):
        return None  # (with more running than seats, a decode step leaves some out)
    prompt, decodes = _alone(replica, plan) if alone else _prompt_and_decodes(replica, plan, shape)
    if prompt is None or prompt.mm_inputs or shape.prefill[0][1] != prompt.num_computed_tokens:
        return None
    if replica.kv.prefix is not None and any(r.prefix_hashes or r.output_hashes for r in replica.state.running):
        return None  # a request the prefix cache could share: step by step (module docstring)
    if alone and shape.prefill[0][0] + 1 < prompt.need:
        return None  # a prompt alone that goes on in later steps (a chunked one): step by step
    steps = _SteadySteps(replica, prompt, decodes, shape, rule, admission, start + duration, alone)
    return steps.price(horizon, where)


def _stated_admission(replica):
    """The policy's stated admission (Policy.steady_admission) where a run may admit arrivals itself (see
    the module docstring), else None."""
    admits = getattr(replica.policy, "steady_admission", None)
    if not (replica.arrivals is not None and admits is not None) or replica.state.swapped_first \
            or replica.settings.max_queued_requests is not None:
        return None
    return admits(replica.state)


def _prompt_and_decodes(replica, plan, shape) -> tuple:
    """(the one running request in prefill, the others in the batch's order), or (None, ()) unless
    exactly one is in prefill. When the plan's leading decodes are every decode row of the step
    (StepPlan.decode_requests), the prompt is the plan's one other entry, found without a scan."""
    lead = plan.decode_requests
    if len(lead) == len(shape.decode):
        return replica.by_id[next(islice(plan.scheduled, len(lead), None))], lead
    running = replica.state.running
    prompts = [r for r in running if r.in_prefill]
    if len(prompts) != 1:
        return None, ()
    return prompts[0], [r for r in running if r is not prompts[0]]


def _alone(replica, plan) -> tuple:
    """(the prompt a step runs alone, the running requests that pause for it), or (None, ()) unless
    every other running request is a decode."""
    prompt = replica.by_id[next(iter(plan.scheduled))]
    decodes = [r for r in replica.state.running if r is not prompt]
    return (prompt, decodes) if not any(r.in_prefill for r in decodes) else (None, ())


def first_crossing(held: int, context: int, after: int, block_size: int) -> int:
    """The first step after `after` in which a row reading context + step (its step-0 `context`) outgrows
    the `held` blocks; later crossings follow every block_size steps."""
    first = held * block_size - context + 1
    if first <= after:
        first += (after - first) // block_size * block_size + block_size
    return first


class _SteadySteps:
    """The state of a prompt run while its steps are priced one by one (see the module docstring)."""

    def __init__(self, replica, prompt, decodes, shape, rule, admission, end: float, alone: bool = False):
        self.replica, self.kv = replica, replica.kv
        self.budget, self.cap = rule
        self.admission = admission  # the policy's (Policy.steady_admission); None: arrivals end the run
        self.segments: list[PromptSegment] = []  # prompts done with (a later one was admitted)
        chunk, history = shape.prefill[0]
        self._start_prompt(prompt, 0, history, prompt.num_blocks)
        self.base: dict = {}  # decode row -> its step-0 context (step j reads it + j), in the batch's order
        self.held: dict = {}  # decode row -> blocks held when it became one
        self.stop = replica.settings.max_fast_forward  # no step of the run reaches it
        self.crossings = [0] * (self.stop + 1)  # step -> decode rows that cross into a new KV block in it
        self.leaving: dict[int, list] = {}  # step -> requests whose last token comes in it
        self.pauses: list[int] = []  # steps that run a prompt alone (the decode rows wait)
        # the policy runs an admitted prompt alone (SteadyAdmission.prefill_only: the decodes pause for it)
        self.alone = admission is not None and admission.prefill_only
        contexts = [r.num_computed_tokens + 1 for r in decodes] if alone else shape.decode
        self._add_decodes(decodes, contexts, -1 if alone else 0)
        self.admitted: list[Request] = []  # joined the batch in this run, in order
        self.waiting = len(replica.state.waiting)  # of the requests waiting at the start, those not admitted
        self.arriving = list(replica.incoming)  # routed here, not visible at the start; then those peeked at
        self.peeked = 0  # requests of the feed looked at (not routed yet)
        self.seen = 0  # of self.arriving, those visible by the current step
        self.routed = 0  # of those, the ones admitted (the first ones)
        self.upcoming = self._next_arrival() if admission is not None else math.inf  # of the next to be seen
        self.finish: dict = {}
        self.free = self.kv.free_blocks
        self.ends = [end]
        self.rows = RunRows()  # steps 1..
        self.contexts = list(contexts)
        self.total = sum(self.contexts)
        if alone:  # step 0 runs the prompt alone
            self._pause(0)
        self.chunks.append(chunk)
        self.computed += chunk
        self.left -= chunk
        self._caught_up(0)

    def _start_prompt(self, prompt, first: int, history: int, blocks: int, reserved: int = 0) -> None:
        """`prompt` runs its chunks from step `first` (history `history`, `blocks` held; its first chunk
        takes at least `reserved`, an admission's reservation)."""
        self.prompt, self.first, self.history = prompt, first, history
        self.chunks: list = []
        self.sampled: int | None = None
        self.computed, self.prompt_blocks, self.reserved = history, blocks, reserved
        self.left = prompt.prompt_len + prompt.num_output_tokens - history

    def _segment(self) -> PromptSegment:
        return PromptSegment(self.prompt, self.first, self.history, self.chunks, self.sampled, self.prompt_blocks)

    def _add_decodes(self, decodes, contexts, after: int) -> None:
        """The step's decodes as rows from step 1 (the run's one O(rows) part: locals, two calls a row);
        their blocks cover their contexts after step `after` (0, or -1 where step 0 does not decode them)."""
        base, held, leaving, block_size = self.base, self.held, self.leaving, self.kv.block_size
        for req, context in zip(decodes, contexts):
            blocks = req.num_blocks
            last = req.output_len - req.num_output_tokens - 1
            base[req] = context
            held[req] = blocks
            leaving.setdefault(last, []).append(req)
            self._count_crossings(first_crossing(blocks, context, after, block_size), last)

    def _add_row(self, req, context: int, held: int, last: int, after: int) -> None:
        """`req` is a decode row from step after + 1 to step `last` (step-0 context `context`, `held` blocks)."""
        self.base[req] = context
        self.held[req] = held
        self.leaving.setdefault(last, []).append(req)
        self._count_crossings(first_crossing(held, context, after, self.kv.block_size), last)

    def _count_crossings(self, first: int, last: int) -> None:
        """A row crosses into a new block in step `first` and every block_size steps after, up to `last`
        (a plain loop of adds: Counter.update's Mapping check cost more)."""
        crossings = self.crossings
        for step in range(first, min(last, self.stop) + 1, self.kv.block_size):
            crossings[step] += 1

    def _pause(self, j: int) -> None:
        """Step j runs a prompt alone: every decode row's later steps come one step later (its step-0 context
        one less, its block crossings and its last step one step on)."""
        self.pauses.append(j)
        self.crossings.insert(j, 0)
        self.crossings.pop()  # (the last entry: a step no run reaches)
        self.leaving = {k + (k >= j): reqs for k, reqs in self.leaving.items()}
        for req in self.base:
            self.base[req] -= 1
        self.contexts = list(self.base.values())
        self.total -= len(self.contexts)

    def _rebuild(self) -> None:
        """The rows in the batch's order (the running requests', then those admitted in this run), their
        contexts and sum."""
        order = [r for r in (*self.replica.state.running, *self.admitted) if r in self.base]
        self.base = {r: self.base[r] for r in order}
        self.contexts = list(self.base.values())
        self.total = sum(self.contexts)

    # -- the steps -----------------------------------------------------------------------
    def price(self, horizon: float, where) -> PromptRun | None:
        before = self.replica.settings.runs_end_before_horizon
        if before and not self.ends[0] < horizon:
            return None
        self._leave(0)
        stop = self.stop
        j = 1
        while True:
            k = self._chunk_steps(j, stop, horizon, before, where)
            if k is not None:
                k = self._decode_steps(k, stop, horizon, before, where)
            if k is None or not self._admit(k):
                break
            j = k
        if len(self.ends) < 2:
            return None
        prompts = [*self.segments, self._segment()]
        if prompts[-1].first and not prompts[-1].chunks:  # admitted for a step the run did not take
            prompts.pop()
        return PromptRun(tuple(prompts), self.ends, self.finish,
                         self.rows.columns(len(self.ends) - 1, self.crossings), tuple(self.pauses))

    def _arrivals(self, start: float) -> int:
        """Requests waiting at a step that starts at `start`: those waiting when the run began and not
        admitted since, and, where the run takes arrivals, those that arrived here by then."""
        while self.upcoming <= start:
            self.seen += 1
            self.upcoming = self._next_arrival()
        return self.waiting + self.seen - self.routed

    def _next_arrival(self) -> float:
        """When the next request that will be visible here arrives (inf: none). The feed is looked at,
        not advanced: it routes each request at its time, and the replica's `reject_reason` (pure here,
        see _stated_admission; judged once, kept for the arrival) says which it will turn away."""
        arriving, feed = self.arriving, self.replica.arrivals
        while self.seen == len(arriving):
            req = feed.peek(self.peeked)
            if req is None:
                return math.inf
            self.peeked += 1
            if not self.replica.judge_ahead(req):
                arriving.append(req)
        return arriving[self.seen].arrival

    def _bounds(self, horizon: float, before: bool) -> tuple[float, float]:
        """(the time a step must start before, the time it must end before): the next outside event
        bounds a step's start, or, with runs_end_before_horizon (`before`), its end; the simulation's end
        and the clock's range bound its end."""
        if before:
            return math.inf, min(CLOCK_LIMIT, self.replica.stop_time, horizon)
        return horizon, min(CLOCK_LIMIT, self.replica.stop_time)

    def _chunk_steps(self, j: int, stop: int, horizon: float, before: bool, where) -> int | None:
        """Steps j.. while the prompt has tokens left, each priced by its shape; returns the first step
        after them, or None where the run ends among them."""
        block_size, price = self.kv.block_size, self.replica.cost.mixed_step_time
        opens, limit = self._bounds(horizon, before)
        end = self.ends[-1]
        while self.left:
            if j >= stop or not end < opens:
                return None
            n = 0 if self.alone else len(self.contexts)  # (a prompt alone: the decodes wait)
            room = self.budget - n
            chunk = min(self.left, room if self.cap is None else min(room, self.cap))
            waiting = self._arrivals(end) if chunk != room else 0  # a chunk short of the budget runs only
            # if nobody waits, or beside the one it admits (a full chunk leaves them nothing)
            target = max(-(-(self.computed + chunk) // block_size), self.reserved)
            grow = (0 if self.alone else self.crossings[j]) + max(0, target - self.prompt_blocks)
            if chunk <= 0 or grow > self.free:
                return None  # the policy would not run it so: step by step
            beside = None  # (the waiting request admitted beside the prompt's last chunk, its first chunk)
            if waiting:
                if self.alone or chunk != self.left or self._long(chunk):
                    return None  # the policy could admit a waiting request as this run cannot: step by step
                beside = self._first_chunk(room - chunk, n + 1, self.free - grow, waiting)
                if beside is None:
                    return None
            prefill: tuple = ((chunk, self.computed),)
            sampled = n + (chunk == self.left)
            if beside is not None:
                prefill, sampled = self._beside(prefill, sampled, beside)
            seconds = price(prefill, (), 0, 0, sampled) if self.alone else \
                price(prefill, self.contexts, j, self.total + n * j, sampled)
            later = end + seconds
            if not end < later < limit:
                if not end < later < CLOCK_LIMIT:
                    check_run("cost_model", end, np.array([seconds]), where=where())
                return None
            self._take(j, grow, chunk, target, beside)
            self.ends.append(later)
            end = later
            if j in self.leaving:
                self._leave(j)
            j += 1
        return j

    def _decode_steps(self, j: int, stop: int, horizon: float, before: bool, where) -> int | None:
        """Steps j.. once the prompt has caught up: decode-only, O(1) each, in segments between leaves
        (_decode_segment). Returns the step at whose start a request waits (the run may admit it), or None
        where the run ends."""
        if self._arrivals(self.ends[-1]):
            return j if self.admission is not None else None
        opens, limit = self._bounds(horizon, before)
        bound = min(self.upcoming, opens)  # a step starts before the next arrival is visible, too
        while self.contexts:
            j, reason = self._decode_segment(j, stop, bound, limit, where)
            if reason is _LEAVE:
                self._leave(j - 1)
                continue
            if reason is _BOUND and j < stop and self.ends[-1] < opens:
                return j  # the next arrival is visible at step j's start
            break
        return None

    def _decode_segment(self, j: int, stop: int, bound: float, limit: float, where) -> tuple[int, object]:
        """Decode-only steps j.. of the rows as they are (nobody joins or leaves among them) while a step
        starts before `bound`, ends before `limit` and its blocks fit; the step-table rows are added at
        the end, in one go. Returns (the next step, _LEAVE: a request's last token came in the step
        before it; _BOUND: the next step would start at or after `bound`; None: the run ends)."""
        contexts, total, free, first = self.contexts, self.total, self.free, j
        n, price = len(contexts), self.replica.cost.decode_pricer(contexts)
        ends, leaving, crossings = self.ends, self.leaving, self.crossings
        end = ends[-1]
        reason: str | None = _BOUND
        while j < stop and end < bound:
            grow = crossings[j]
            if grow > free:
                reason = None
                break
            seconds = price(total + n * j)
            later = end + seconds
            if not end < later < limit:
                if not end < later < CLOCK_LIMIT:
                    check_run("cost_model", end, np.array([seconds]), where=where())
                reason = None
                break
            free -= grow
            ends.append(later)
            end = later
            j += 1
            if j - 1 in leaving:
                reason = _LEAVE
                break
        self.rows.decodes(first, j, n, total, self.kv.num_blocks - self.free)
        self.free = free
        return j, reason

    def _admit(self, j: int) -> bool:
        """Admit the head of the requests waiting at step j, whose running requests all decode, as its next
        prompt where the policy would (see the module docstring); False: the run ends before step j."""
        waiting = self._arrivals(self.ends[-1])
        if self.admission is None or not waiting:
            return False
        if self.alone and (len(self.contexts) >= self.admission.max_num_seqs
                           or self.sampled is not None and self.sampled >= j):
            return False  # the decode steps after would leave some out, or a recompute samples in step j: step by step
        decodes = 0 if self.alone else len(self.contexts)  # (a prompt alone: the decodes wait)
        free = self.free if self.alone else self.free - self.crossings[j]
        first = self._first_chunk(self.budget - decodes, decodes, free, waiting)
        if first is None:
            return False
        self._join(first[0], j)
        return True

    def _long(self, chunk: int) -> bool:
        """Whether a prompt's last chunk counts as long for the policy (then nothing is admitted beside it)."""
        threshold = self.admission.long_threshold if self.admission is not None else None
        return threshold is not None and chunk > threshold

    def _first_chunk(self, room: int, taken: int, free: int, waiting: int) -> tuple[Request, int] | None:
        """(the head of the `waiting` requests, its first chunk) where the policy admits it, and it alone,
        into a step with `room` tokens left, `taken` sequences and `free` KV blocks (the watermark must stay
        free): the others, if any, find no token or no sequence left after it. Else None."""
        admission = self.admission
        if admission is None or room <= 0 or taken >= admission.max_num_seqs:
            return None
        req = self._queued_request()
        if req.status != Status.WAITING or req.num_output_tokens or req.mm_inputs:
            return None  # a request that holds progress (a preempted one) is the policy's to plan
        if self.kv.prefix is not None and (req.prefix_hashes or req.output_hashes or waiting > 1):
            return None  # the cache could share its prompt, or order the queue by what it holds: step by step
        chunk = min(req.prompt_len, room)
        if self.cap is not None:
            chunk = min(chunk, self.cap)
        if admission.whole_prompts and chunk < req.prompt_len:
            return None  # the prompt does not fit whole: the policy admits nobody
        if taken and chunk < min(admission.min_chunk, req.prompt_len):
            return None  # too small a first piece beside other rows: the policy admits nobody
        if waiting > 1 and chunk < room and taken + 1 < admission.max_num_seqs:
            return None  # the policy would go on to the next waiting request
        return (req, chunk) if self._first_blocks(req, chunk) <= free - self.kv.watermark_blocks else None

    def _first_blocks(self, req: Request, chunk: int) -> int:
        """KV blocks a fresh request holds once admitted with its first chunk (KVCache.admission_tokens)."""
        reserve = self.admission.reserve if self.admission is not None else None
        return self.kv.blocks_for(self.kv.admission_tokens(req, chunk, 0 if reserve is None else reserve(req)))

    def _join(self, req: Request, j: int) -> None:
        """`req`, the head of the waiting requests, is admitted in step j: it is the prompt from then on."""
        self.segments.append(self._segment())
        if self.waiting:
            self.waiting -= 1
        else:
            self.routed += 1
        self.admitted.append(req)
        self._start_prompt(req, j, 0, 0, self._first_blocks(req, 0))

    def _queued_request(self) -> Request:
        """The head of the waiting requests (of the replica's queue, or the next arrived here)."""
        queue = self.replica.state.waiting
        if self.waiting:
            return queue[len(queue) - self.waiting]
        return self.arriving[self.routed]

    def _beside(self, prefill: tuple, sampled: int, beside) -> tuple[tuple, int]:
        """A step's prefill rows and the tokens it samples with a new prompt's first chunk beside the
        prompt's last (`beside`: the request and its chunk)."""
        req, first = beside
        return prefill + ((first, 0),), sampled + (first == req.prompt_len)

    def _take(self, j: int, grow: int, chunk: int, target: int, beside) -> None:
        """Apply step j: blocks, the prompt's chunk (`target` blocks; and its joining the decodes), the
        prompt admitted beside it (`beside`: it is the prompt from step j on), the step's row."""
        self.free -= grow
        if self.alone:
            self._pause(j)
        decodes = 0 if self.alone else len(self.contexts)
        contexts = 0 if self.alone else self.total + decodes * j
        history = self.computed
        pairs = chunk * history + chunk * (chunk + 1) // 2
        self._advance(j, chunk, target)
        tokens = chunk
        if beside is not None:
            req, first = beside
            blocks = self._first_blocks(req, first)
            self.free -= blocks
            self._join(req, j)
            self._advance(j, first, blocks)
            tokens += first
            pairs += first * (first + 1) // 2
        self.rows.chunk((j, tokens, decodes, decodes + 1 + (beside is not None), self.kv.num_blocks - self.free,
                         contexts, history, pairs))

    def _advance(self, j: int, chunk: int, target: int) -> None:
        """The prompt runs `chunk` tokens in step j, holding `target` blocks; it may catch up."""
        self.prompt_blocks = max(self.prompt_blocks, target)
        self.chunks.append(chunk)
        self.computed += chunk
        self.left -= chunk
        if self.left <= 1:
            self._caught_up(j)

    def _caught_up(self, j: int) -> None:
        """After step j's chunk: a prompt with nothing left sampled in step j; one with one token left and
        outputs already (a recompute) is a decode row from step j + 1 and samples there. Either way it
        decodes, in its place in the batch, from step j + 1."""
        prompt = self.prompt
        if not self.left:
            self.sampled = j
        elif self.left == 1 and prompt.num_output_tokens:
            self.sampled, self.left = j + 1, 0
        else:
            return
        last = self.sampled + prompt.output_len - prompt.num_output_tokens - 1
        context = self.computed - j  # step j + 1 reads computed + 1
        self._add_row(prompt, context, self.prompt_blocks, last, j)
        if self.admitted and self.admitted[-1] is prompt:  # the batch's last row: appended in its place
            self.contexts.append(context)
            self.total += context
        else:
            self._rebuild()

    def _leave(self, j: int) -> None:
        """Requests whose last token came in step j leave at its end (their blocks are free after it)."""
        done = self.leaving.pop(j, None)
        if not done:
            return
        block_size = self.kv.block_size
        for req in done:
            self.finish[req] = j
            self.free += max(self.held.pop(req), -(-(self.base.pop(req) + j) // block_size))
        self.contexts = list(self.base.values())  # (a leave keeps the others' order)
        self.total = sum(self.contexts)
