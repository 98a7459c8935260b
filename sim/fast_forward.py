"""Fast-forward over predictable steps: which steps a replica may skip, computed without touching it.

When a step is pure decode of every running request, nothing can change the plan until the next
outside event (an arrival, a P/D hand-off), the first completion, a client's deadline, or running
out of KV blocks: each following step is the same batch with every context one longer. `decode_run`
says how far such a run goes and when each of its steps ends, vectorised (cost.decode_run_times) or,
for a short run, in a plain loop of O(1) steps (cost.decode_step_time). Invariant: the result is
exactly (bit for bit) what stepping one by one would produce; tests/sim/test_fast_path.py holds it.

Prompt runs (a prompt in progress beside the decodes, and the arrivals a steady policy admits) are
sim/prompt_run.py. A run's steps all end before the simulation's end (sim.max_time, Replica.stop_time).

Nothing here mutates the replica; sim/step_apply.py commit_run applies a run.
"""
from __future__ import annotations

import math
from bisect import bisect_left

import numpy as np

from cbsim.sim.durations import CLOCK_LIMIT, check_run

SCALAR_RUN = 64  # decode runs bounded by this many steps are fast-forwarded in plain Python, not numpy


def replica_leaps(replica) -> bool:
    """What of may_leap holds for the replica's whole life, decided once (Replica.run, before its first
    step): fast-forward on, no noise (it changes every step), no sliding window (it frees blocks as it
    moves: stepped one by one)."""
    return replica.settings.fast_forward and replica.noise is None and replica.kv.window is None


def may_leap(replica, plan, shape, swap_bytes) -> bool:
    """Whether the step just begun, on a replica where replica_leaps holds, is one a run may repeat: pure
    decode of every running request, with nothing that changes from step to step (a decaying reserve, an
    eviction that could unblock a waiting request)."""
    running = replica.state.running
    waiting = replica.state.waiting
    return not (shape.prefill or plan.admitted or plan.preempted or plan.padding or swap_bytes
                or len(shape.decode) != len(running) or not running
                or (waiting and not replica.policy.steady_when_blocked)
                or (waiting and replica.state.reserve is not None)  # its ratio decays every step
                or replica.kv.evicted_in_step  # an eviction can unblock a waiting request (its hit is gone)
                or plan.extra_seconds)  # work beside the decoder (an encoder, LoRA loads) is this step's alone


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


def cut_run(ends, at: float) -> int:
    """How many of a run's steps start before `at` (a request routed here arrives during the run); the first
    always stays."""
    return 1 + int(np.searchsorted(ends[:-1], at, side="left"))
