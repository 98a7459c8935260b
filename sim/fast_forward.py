"""Fast-forward over predictable steps: which steps a replica may skip, computed without touching it.

When a step is pure decode of every running request, nothing can change the plan until the next
outside event (an arrival, a P/D hand-off), the first completion, a client's deadline, or running
out of KV blocks: each following step is the same batch with every context one longer. `decode_run`
says how far such a run goes and when each of its steps ends, vectorised (cost.decode_run_times) or,
for a short run, in a plain loop of O(1) steps (cost.decode_step_time). Invariant: the result is
exactly (bit for bit) what stepping one by one would produce; tests/test_fast_path.py holds it.

A prompt run (`prompt_run`) skips over the chunks of one prompt in progress beside the running
decodes and on over the decode steps after it, for a policy whose plans are then predictable
(Policy.steady_chunks: Sarathi-style, every decode and then the prompt's next chunk under the token
budget): each step's shape is priced by the cost model as the step would be; a request that finishes
leaves at its step's end while the others go on. While requests wait, only steps whose chunk takes
the whole token budget run (nothing can be admitted beside it). The run stops before KV runs short
and at the horizon, as a decode run does.

Nothing here mutates the replica; sim/step_apply.py commit_run and commit_prompt_run apply a run.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from itertools import islice
from dataclasses import dataclass

import numpy as np

from .durations import CLOCK_LIMIT, check_run
from .request import Request
from .shape import StepShape

SCALAR_RUN = 64  # decode runs bounded by this many steps are fast-forwarded in plain Python, not numpy


def may_leap(replica, plan, shape, swap_bytes) -> bool:
    """Whether the step just begun is one a run may repeat: pure decode of every running request,
    with nothing that changes from step to step (noise, a decaying reserve, an eviction that could
    unblock a waiting request)."""
    running = replica.state.running
    waiting = replica.state.waiting
    return not (shape.prefill or plan.admitted or plan.preempted or plan.padding or swap_bytes
                or len(shape.decode) != len(running) or not running or not replica.settings.fast_forward
                or replica.noise is not None or (waiting and not replica.policy.steady_when_blocked)
                or (waiting and replica.state.reserve is not None)  # its ratio decays every step
                or replica.kv.evicted_in_step  # an eviction can unblock a waiting request (its hit is gone)
                or plan.extra_seconds  # work beside the decoder (an encoder, LoRA loads) is this step's alone
                or replica.kv.window is not None)  # a sliding window frees blocks as it moves: stepped one by one


def next_deadline(replica) -> float:
    """When the client of the earliest request on `replica` gives up (inf without a timeout)."""
    limit = replica.settings.client_timeout
    running, waiting = replica.state.running, replica.state.waiting
    if limit is None or not (running or waiting):
        return math.inf
    return min(r.arrival for r in (*running, *waiting)) + limit


def decode_run(replica, start: float, duration: float, where):
    """(end times, blocks held beyond the first step's) of 2+ identical decode steps from the one
    that starts at `start` and lasts `duration`, or None to step once. `where()`: where a bad step
    time came from, for its message (called only then).

    The run ends with the first completion, before KV runs out, and before the first step that
    would start at or after the next outside event (with runs_end_before_horizon: that would end
    after it). Cost models are monotone in context, so (horizon - start) / duration + 2 bounds the
    steps worth computing.
    """
    running = replica.state.running
    settings = replica.settings
    horizon = min(replica.horizon(), next_deadline(replica))
    steps = min(min(r.output_len - r.num_output_tokens for r in running),  # up to the first completion
                settings.max_fast_forward)
    if horizon != math.inf:
        steps = min(steps, int((horizon - start) / duration) + 2)
    if steps < 2:
        return None
    before = settings.runs_end_before_horizon
    if steps <= SCALAR_RUN:
        run = scalar_run(running, replica.kv, replica.cost, steps, start, duration, horizon, before, where)
    else:
        run = vector_run(running, replica.kv, replica.cost, steps, start, duration, horizon, before, where)
    return run if run is None else _before_stop(run, replica.stop_time)


def _before_stop(run, stop_time: float):
    """The steps of a decode run (ends, extra) that end before the simulation stops (max_time), or None
    to step once where that leaves fewer than two."""
    ends, extra = run
    if ends[-1] < stop_time:
        return run
    count = bisect_left(ends, stop_time) if isinstance(ends, list) else int(np.searchsorted(ends, stop_time, "left"))
    return (ends[:count], extra[:count]) if count >= 2 else None


def vector_run(running, kv, cost, steps, start, duration, horizon, before, where):
    """`decode_run` with numpy: blocks held per step and request as a matrix, times in one call."""
    contexts, held = held_blocks(running, kv.block_size, steps)
    extra = held.sum(axis=1)
    extra -= extra[0]
    steps = int(np.searchsorted(extra, kv.free_blocks, side="right"))
    if steps < 2:
        return None
    durations = cost.decode_run_times(contexts, steps)
    durations[0] = duration
    ends = np.cumsum(np.concatenate(([start], durations)))[1:]
    if not (ends[-1] < CLOCK_LIMIT and (ends[1:] > ends[:-1]).all()):  # the first step was checked
        check_run("cost_model", start, durations, where=where())
    if before:  # every step of the run ends before the next outside event
        runnable = int(np.searchsorted(ends, horizon, side="left"))
    else:  # step j >= 2 starts at ends[j-2]; it may run only if that is before the next outside event
        runnable = 1 + int(np.searchsorted(ends[: steps - 1], horizon, side="left"))
    return (ends[:runnable], extra[:runnable]) if runnable >= 2 else None


def scalar_run(running, kv, cost, steps, start, duration, horizon, before, where):
    """`decode_run` for a short run (at most SCALAR_RUN steps), in plain Python: the same
    (ends, extra) as lists, step by step, stopping at the horizon (a numpy set-up costs more
    than such a run). A request crosses into a new block at steps j0, j0 + block_size, ...; the run
    stops before the step whose crossings need more blocks than are free."""
    block_size = kv.block_size
    contexts = []
    crossings = []
    for req in running:
        context = req.num_computed_tokens + 1
        contexts.append(context)
        held = -(-context // block_size)
        if req.num_blocks > held:
            held = req.num_blocks
        j = held * block_size - context + 1  # the first step whose context outgrows the blocks held
        while j < steps:
            crossings.append(j)
            j += block_size
    free = kv.free_blocks
    if len(crossings) > free:
        crossings.sort()
        steps = crossings[free]  # the first step that would need one block more than are free
        if steps < 2:
            return None
    step_time = cost.decode_step_time
    ends = [start + duration]
    total = sum(contexts)
    n = len(contexts)
    end = ends[0]
    if before and not end < horizon:
        return None
    for j in range(1, steps):
        if not before and not end < horizon:  # step j starts at the previous end: not at or after the horizon
            break
        seconds = step_time(contexts, j, total + n * j)
        later = end + seconds
        if not end < later < CLOCK_LIMIT:
            check_run("cost_model", end, np.array([seconds]), where=where())
        if before and not later < horizon:
            break
        ends.append(later)
        end = later
    count = len(ends)
    if count < 2:
        return None
    extra = [0] * count  # blocks held after step j beyond the first step's: crossings up to j
    for j in crossings:
        if j < count:
            extra[j] += 1
    for j in range(1, count):
        extra[j] += extra[j - 1]
    return ends, extra


def held_blocks(running, block_size: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """(decode contexts of the running requests now, [j, i]: KV blocks running request i holds
    after step j + 1 of a decode run, j = 0 being this step)."""
    contexts = np.fromiter((r.num_computed_tokens + 1 for r in running), dtype=np.int64, count=len(running))
    reserved = np.fromiter((r.num_blocks for r in running), dtype=np.int64, count=len(running))
    growth = np.arange(steps, dtype=np.int64)
    needed = -(-(contexts[None, :] + growth[:, None]) // block_size)
    return contexts, np.maximum(needed, reserved[None, :])


def cut_run(ends, extra, at: float):
    """The part of a run whose steps start before `at` (closed loop: a request routed here arrives
    during the run); the first step always stays."""
    keep = 1 + int(np.searchsorted(ends[:-1], at, side="left"))
    return ends[:keep], extra[:keep]


ROW_COLUMNS = ("prefill_tokens", "decode_tokens", "num_seqs", "kv_blocks_used", "decode_context_tokens",
               "prefill_history_tokens", "prefill_attention_pairs")


@dataclass(frozen=True, slots=True)
class PromptRun:
    """Steps 0..k from the step begun (step 0): every running decode decodes, and `prompt` runs
    `chunks[j]` in step j (from history `history`) until it has caught up; from step len(chunks) on it is
    a decode row too. It samples its next token in step `sampled` (None: not in this run): its last
    chunk's, or, when that left one token (a recompute's), its first decode row's. A request whose last
    token comes in step j leaves at that step's end (`finish[req]` = j). `ends[j]`: when step j ends;
    `rows[j - 1]`: step j's values of ROW_COLUMNS in the step table."""

    prompt: Request
    history: int
    chunks: list[int]
    sampled: int | None
    ends: list[float]
    finish: dict
    rows: list[tuple]

    def columns(self) -> dict[str, list]:
        """The run's steps 1..k as step-table columns (ROW_COLUMNS)."""
        return {name: list(values) for name, values in zip(ROW_COLUMNS, zip(*self.rows))}


def may_leap_prompt(replica, plan, shape, swap_bytes) -> bool:
    """Whether the step just begun may start a prompt run: one prompt in progress beside decodes of every
    other running request, and nothing that changes from step to step or must see each
    step (noise, recorded shapes, prefix caching, a sliding window, the decode reserve and step cap, TTFT
    admission, a closed loop or client timeouts, a P/D role, side work)."""
    state = replica.state
    return (len(shape.prefill) == 1 and len(shape.decode) + 1 == len(state.running) == len(plan.scheduled)
            and replica.settings.fast_forward and replica.settings.client_timeout is None
            and not (plan.preempted or plan.padding or plan.rejected or swap_bytes or plan.extra_seconds
                     or plan.hold_finished or state.reserve is not None
                     or state.step_cap is not None)
            and replica.noise is None and replica.shapes is None and replica.kv.prefix is None
            and replica.kv.window is None and replica.admission is None and replica.on_leave is None and replica.role.leaps_prompts)


def prompt_run(replica, plan, shape, start: float, duration: float, where) -> PromptRun | None:
    """The prompt run from the step that starts at `start` and lasts `duration` (plan `plan`, shape
    `shape`), or None to step once. While the prompt has tokens left, step j decodes every running decode
    once more and runs the chunk min(tokens left, budget - decodes, cap) at the prompt's history; from
    the step after the one that samples its next token it is one more decode. A request that finishes
    leaves at the end of its step. A step runs only if its blocks fit in the free ones (block crossings,
    the prompt's growth), if it leaves no token budget while requests wait, and, as in a decode run, if
    it starts before the next outside event (with runs_end_before_horizon: ends before it)."""
    steady = getattr(replica.policy, "steady_chunks", None)  # a policy without it (a test's wrapper) is stepped
    rule = steady(replica.state) if steady is not None else None
    if rule is None or not start + duration < min(replica.horizon(), next_deadline(replica)):
        return None  # not steady, or an outside event comes before its second step (before any O(rows) work)
    prompt, decodes = _prompt_and_decodes(replica, plan, shape)
    if prompt is None or prompt.mm_inputs or shape.prefill[0][1] != prompt.num_computed_tokens:
        return None
    return _SteadySteps(replica, prompt, decodes, shape, rule, start + duration).price(where)


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


def first_crossing(held: int, context: int, after: int, block_size: int) -> int:
    """The first step after `after` in which a row reading context + step (its step-0 `context`) outgrows
    the `held` blocks; later crossings follow every block_size steps."""
    first = held * block_size - context + 1
    if first <= after:
        first += (after - first) // block_size * block_size + block_size
    return first


class _SteadySteps:
    """The state of a prompt run while its steps are priced one by one (see prompt_run). O(1) work a
    decode step: the decode rows' step-0 contexts (a row of step j reads its context + j) and their sum
    change only when a request joins or leaves; a row's block crossings recur every block_size steps, so
    rows are kept by the phase of their first crossing; leaving requests are kept by their last step."""

    def __init__(self, replica, prompt, decodes, shape, rule, end: float):
        self.replica, self.prompt, self.kv = replica, prompt, replica.kv
        self.budget, self.cap = rule
        chunk, history = shape.prefill[0]
        self.history, self.computed, self.chunks = history, history + chunk, [chunk]
        self.left = prompt.prompt_len + prompt.num_output_tokens - self.computed  # after step 0
        self.prompt_blocks = prompt.num_blocks  # while it runs chunks
        self.base: dict = {}  # decode row -> its step-0 context (step j reads it + j), in the batch's order
        self.held: dict = {}  # decode row -> blocks held when it became one
        self.phases: dict[int, list] = {}  # step % block_size -> (first crossing, last step) of rows
        self.leaving: dict[int, list] = {}  # step -> requests whose last token comes in it
        self._add_decodes(decodes, shape.decode)
        self.finish: dict = {}
        self.free = self.kv.free_blocks
        self.ends = [end]
        self.sampled: int | None = None
        self.rows: list[tuple] = []  # steps 1..: ROW_COLUMNS
        self.contexts = list(shape.decode)
        self.total = sum(self.contexts)
        self._caught_up(0)

    def _add_decodes(self, decodes, contexts) -> None:
        """The step's decodes as rows from step 1 (the run's one O(rows) part: locals, one call a row)."""
        base, held, leaving, phases = self.base, self.held, self.leaving, self.phases
        block_size = self.kv.block_size
        for req, context in zip(decodes, contexts):
            blocks = req.num_blocks
            last = req.output_len - req.num_output_tokens - 1
            base[req] = context
            held[req] = blocks
            leaving.setdefault(last, []).append(req)
            first = first_crossing(blocks, context, 0, block_size)
            if first <= last:
                phases.setdefault(first % block_size, []).append((first, last))

    def _add_row(self, req, context: int, held: int, last: int, after: int) -> None:
        """`req` is a decode row from step after + 1 to step `last` (step-0 context `context`, `held` blocks)."""
        self.base[req] = context
        self.held[req] = held
        self.leaving.setdefault(last, []).append(req)
        block_size = self.kv.block_size
        first = first_crossing(held, context, after, block_size)
        if first <= last:
            self.phases.setdefault(first % block_size, []).append((first, last))

    def _rebuild(self) -> None:
        """The rows in running order (the batch's order), their contexts and sum."""
        order = [r for r in self.replica.state.running if r in self.base]
        self.base = {r: self.base[r] for r in order}
        self.contexts = list(self.base.values())
        self.total = sum(self.contexts)

    def price(self, where) -> PromptRun | None:
        replica = self.replica
        horizon = min(replica.horizon(), next_deadline(replica))
        before = replica.settings.runs_end_before_horizon
        if before and not self.ends[0] < horizon:
            return None
        self._leave(0)
        stop = replica.settings.max_fast_forward
        j = self._chunk_steps(stop, horizon, before, where)
        if j is not None and not replica.state.waiting:  # while requests wait, a step must fill the budget
            self._decode_steps(j, stop, horizon, before, where)
        if len(self.ends) < 2:
            return None
        return PromptRun(self.prompt, self.history, self.chunks, self.sampled, self.ends, self.finish, self.rows)

    def _chunk_steps(self, stop: int, horizon: float, before: bool, where) -> int | None:
        """Steps 1.. while the prompt has tokens left, each priced by its shape; returns the first step
        after them, or None where the run ends among them."""
        block_size, cost = self.kv.block_size, self.replica.cost
        waiting = bool(self.replica.state.waiting)  # then only steps that leave no token budget for them run
        end, j = self.ends[-1], 1
        while self.left:
            if j >= stop or not (before or end < horizon):
                return None
            chunk = self.next_chunk()
            target = -(-(self.computed + chunk) // block_size)
            grow = self._crossings(j) + max(0, target - self.prompt_blocks)
            if chunk <= 0 or grow > self.free or (waiting and chunk != self.budget - len(self.contexts)):
                return None  # the policy would not run it so (or could admit a waiting request): step by step
            seconds = cost.step_time(StepShape(((chunk, self.computed),), tuple(c + j for c in self.contexts), 0,
                                               len(self.contexts) + (chunk == self.left)))
            later = end + seconds
            if not end < later < CLOCK_LIMIT:
                check_run("cost_model", end, np.array([seconds]), where=where())
            if (before and not later < horizon) or not later < self.replica.stop_time:
                return None
            self._take(j, grow, chunk, target)
            self.ends.append(later)
            end = later
            if j in self.leaving:
                self._leave(j)
            j += 1
        return j

    def _decode_steps(self, j: int, stop: int, horizon: float, before: bool, where) -> None:
        """Steps j.. once the prompt has caught up: decode-only, O(1) each (the row count, the contexts'
        sum and the free blocks are locals between leaves)."""
        step_time, num_blocks = self.replica.cost.decode_step_time, self.kv.num_blocks
        rows, ends, leaving = self.rows, self.ends, self.leaving
        contexts, total, free = self.contexts, self.total, self.free
        n, end, stop_time = len(contexts), ends[-1], self.replica.stop_time
        while j < stop and n and (before or end < horizon):
            grow = self._crossings(j)
            if grow > free:
                break
            summed = total + n * j
            seconds = step_time(contexts, j, summed)
            later = end + seconds
            if not end < later < CLOCK_LIMIT:
                check_run("cost_model", end, np.array([seconds]), where=where())
            if (before and not later < horizon) or not later < stop_time:
                break
            free -= grow
            rows.append((0, n, n, num_blocks - free, summed, 0, 0))
            ends.append(later)
            end = later
            if j in leaving:
                self.free = free
                self._leave(j)
                contexts, total, free = self.contexts, self.total, self.free
                n = len(contexts)
            j += 1
        self.free = free

    def _crossings(self, j: int) -> int:
        """Decode rows that cross into a new KV block in step j."""
        count = 0
        for first, last in self.phases.get(j % self.kv.block_size, ()):
            if first <= j <= last:
                count += 1
        return count

    def next_chunk(self) -> int:
        """The prompt's chunk in the next step: min(tokens left, budget - decodes, cap)."""
        room = self.budget - len(self.contexts)
        if self.cap is not None:
            room = min(room, self.cap)
        return min(self.left, room)

    def _take(self, j: int, grow: int, chunk: int, target: int) -> None:
        """Apply step j: blocks, the prompt's chunk (`target` blocks; and its joining the decodes), the
        step's row."""
        self.free -= grow
        decodes = len(self.contexts)
        contexts = self.total + decodes * j
        history = pairs = 0
        if chunk:
            history = self.computed
            pairs = chunk * history + chunk * (chunk + 1) // 2
            self.prompt_blocks = max(self.prompt_blocks, target)
            self.chunks.append(chunk)
            self.computed += chunk
            self.left -= chunk
            self._caught_up(j)
        self.rows.append((chunk, decodes, decodes + (chunk > 0), self.kv.num_blocks - self.free, contexts, history,
                          pairs))

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
        self._add_row(prompt, self.computed - j, self.prompt_blocks, last, j)  # step j + 1 reads computed + 1
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
