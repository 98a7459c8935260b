"""Fast-forward over predictable steps: which steps a replica may skip, computed without touching it.

When a step is pure decode of every running request, nothing can change the plan until the next
outside event (an arrival, a P/D hand-off), the first completion, a client's deadline, or running
out of KV blocks: each following step is the same batch with every context one longer. `decode_run`
says how far such a run goes and when each of its steps ends, vectorised (cost.decode_run_times) or,
for a short run, in a plain loop of O(1) steps (cost.decode_step_time). Invariant: the result is
exactly (bit for bit) what stepping one by one would produce; tests/test_fast_path.py holds it.

A prompt run (`prompt_run`) skips over the chunks of one prompt in progress beside the same running
decodes, for a policy whose plans are then predictable (Policy.steady_chunks: Sarathi-style, every
decode and then the prompt's next chunk under the token budget) while nothing waits: each step's
shape is priced by the cost model as the step would be, and the run stops at the step that samples
the prompt's next token, at a decode's completion, before KV runs short and at the horizon, as a
decode run does.

Nothing here mutates the replica; sim/step_apply.py commit_run and commit_prompt_run apply a run.
"""
from __future__ import annotations

import math
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
        return scalar_run(running, replica.kv, replica.cost, steps, start, duration, horizon, before, where)
    return vector_run(running, replica.kv, replica.cost, steps, start, duration, horizon, before, where)


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


@dataclass(frozen=True, slots=True)
class PromptRun:
    """Steps 0..k from the step begun (step 0): each decodes the same running requests and runs the next
    chunk of `prompt` (`chunks[j]`, history `history + chunks[0] + ... + chunks[j - 1]`) until the chunk
    that samples its next token; every step after that decodes the prompt too. `ends[j]`, `used[j]`:
    when step j ends and the KV blocks in use while it runs."""

    prompt: Request
    history: int
    chunks: list[int]
    ends: list[float]
    used: list[int]


def may_leap_prompt(replica, plan, shape, swap_bytes) -> bool:
    """Whether the step just begun may start a prompt run: one prompt in progress beside decodes of every
    other running request, nothing waiting, and nothing that changes from step to step or must see each
    step (noise, recorded shapes, prefix caching, the decode reserve and step cap, TTFT admission, a
    closed loop, a P/D role, side work)."""
    state = replica.state
    return (len(shape.prefill) == 1 and len(shape.decode) + 1 == len(state.running) == len(plan.scheduled)
            and replica.settings.fast_forward
            and not (plan.preempted or plan.padding or plan.rejected or swap_bytes or plan.extra_seconds
                     or state.waiting or state.reserve is not None or state.step_cap is not None)
            and replica.noise is None and replica.shapes is None and replica.kv.prefix is None
            and replica.admission is None and replica.on_leave is None and replica.role.leaps_prompts)


def prompt_run(replica, shape, start: float, duration: float, where) -> PromptRun | None:
    """The prompt run from the step that starts at `start` and lasts `duration` (shape `shape`), or None
    to step once. While the prompt has tokens left, step j decodes every decode once more (contexts + j)
    and runs the chunk min(tokens left, budget - decodes, cap) at the prompt's history; from the step
    after the one that samples its next token it is one more decode. A step runs only if its blocks fit
    in the free ones (block crossings, the prompt's growth) and, as in a decode run, if it starts before
    the next outside event (with runs_end_before_horizon: ends before it); the run ends with the first
    completion."""
    state = replica.state
    rule = replica.policy.steady_chunks(state)
    prompts = [r for r in state.running if r.in_prefill]
    if rule is None or len(prompts) != 1 or prompts[0].mm_inputs:
        return None
    prompt = prompts[0]
    budget, cap = rule
    per_step = budget - len(shape.decode) if cap is None else min(budget - len(shape.decode), cap)
    chunk, history = shape.prefill[0]
    if per_step <= 0 or history != prompt.num_computed_tokens:
        return None
    left = prompt.prompt_len + prompt.num_output_tokens - history - chunk  # after step 0
    sample_step = -(-left // per_step)  # the step whose chunk samples the prompt's next token
    steps = min(replica.settings.max_fast_forward, sample_step + prompt.output_len - prompt.num_output_tokens,
                min((r.output_len - r.num_output_tokens for r in state.running if r is not prompt),
                    default=math.inf))
    if steps < 2:
        return None
    crossings = _decode_crossings(state.running, prompt, replica.kv.block_size, steps)
    return _prompt_steps(replica, prompt, shape, crossings, start + duration, left, per_step, where)


def _decode_crossings(running, prompt, block_size: int, steps: int) -> list[int]:
    """[j]: how many decodes (the prompt aside) cross into a new block at step j (< steps) of a run."""
    crossings = [0] * steps
    for req in running:
        if req is prompt:
            continue
        context = req.num_computed_tokens + 1
        held = max(req.num_blocks, -(-context // block_size))
        j = held * block_size - context + 1
        while j < steps:
            crossings[j] += 1
            j += block_size
    return crossings


def _prompt_steps(replica, prompt, shape, crossings, end: float, left: int, per_step: int, where):
    """Price the run's steps 1.. one by one (see prompt_run); None when fewer than two steps run."""
    settings, kv, cost = replica.settings, replica.kv, replica.cost
    horizon = min(replica.horizon(), next_deadline(replica))
    before = settings.runs_end_before_horizon
    if before and not end < horizon:
        return None
    chunk, history = shape.prefill[0]
    free, block_size, held = kv.free_blocks, kv.block_size, prompt.num_blocks
    chunks, ends, used = [chunk], [end], [kv.num_blocks - free]
    base, decodes = shape.decode, len(shape.decode)
    computed = history + chunk  # the prompt's tokens in the cache after the last step priced
    contexts = total = None  # from the step after the prompt samples: every decode row, offset by the step
    for j in range(1, len(crossings)):
        if not before and not end < horizon:
            break
        if left:
            chunk = min(left, per_step)
            target = -(-(computed + chunk) // block_size)
            seconds = cost.step_time(StepShape(((chunk, computed),), tuple(c + j for c in base), 0,
                                               decodes + (chunk == left)))
        else:
            if contexts is None:
                contexts, total = _with_prompt(replica.state.running, prompt, base, computed + 1 - j)
            target = -(-(computed + 1) // block_size)
            seconds = cost.decode_step_time(contexts, j, total + len(contexts) * j)
        grow = crossings[j] + (target - held if target > held else 0)
        later = end + seconds
        if grow > free:  # the policy would preempt: step by step from here
            break
        if not end < later < CLOCK_LIMIT:
            check_run("cost_model", end, np.array([seconds]), where=where())
        if before and not later < horizon:
            break
        free -= grow
        held = max(held, target)
        ends.append(later)
        used.append(kv.num_blocks - free)
        if left:
            chunks.append(chunk)
            computed, left = computed + chunk, left - chunk
        else:
            computed += 1
        end = later
    return PromptRun(prompt, history, chunks, ends, used) if len(ends) >= 2 else None


def _with_prompt(running, prompt, base, prompt_context: int) -> tuple[list[int], int]:
    """(every running request's decode context at step 0 of the run, in running order, the prompt's as
    `prompt_context`; their sum): the rows of a decode step j are these + j."""
    rows = iter(base)
    contexts = [prompt_context if req is prompt else next(rows) for req in running]
    return contexts, sum(contexts)
