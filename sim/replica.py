"""One serving replica: a SimPy process that schedules, runs and commits steps.

The loop is: plan = policy.schedule(state); begin(plan) (admissions, preemptions, KV blocks);
yield a timeout of cost.step_time(shape); commit(plan) (progress, sampled tokens, completions).
An idle replica waits on an event that an arrival triggers; there is no polling.

Fast-forward: when a step is pure decode of every running request, nothing can change the plan
until the next arrival, the first completion, or running out of KV blocks: each following step is
the same batch with every context one longer. The replica then advances up to that horizon in one
vectorised computation (cost.decode_run_times) with results identical to stepping one by one.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .clock import delay_to
from .cost import CostModel
from .kv_cache import KVCache
from .plan import StepPlan
from .recorder import Recorder
from .request import Request, Status
from .shape import StepShape
from .state import SchedulerState


class SchedulerStuck(RuntimeError):
    """A policy returned an empty plan while work was pending: a policy bug, never a user error."""


@dataclass(frozen=True)
class ReplicaSettings:
    preemption_mode: str = "recompute"  # recompute | swap
    victim: str = "last_admitted"
    swap_bandwidth: float = 25e9  # bytes/s over the host link
    max_model_len: int = 8192
    fast_forward: bool = True
    max_fast_forward: int = 4096
    record_shapes: bool = False  # keep every step's shape (held-out batches for the profiler)


class Replica:
    def __init__(self, env, index: int, policy, cost: CostModel, kv: KVCache, recorder: Recorder,
                 settings: ReplicaSettings, horizon: Callable[[], float], on_idle: Callable[[], None] = lambda: None,
                 noise: Callable[[], float] | None = None, pull: Callable[[float], None] = lambda t: None):
        self.env = env
        self.index = index
        self.policy = policy
        self.cost = cost
        self.kv = kv
        self.recorder = recorder
        self.settings = settings
        self.horizon = horizon  # time of the next event outside this replica that could change its plan
        self.state = SchedulerState(kv=kv, max_model_len=settings.max_model_len, victim=settings.victim)
        self.by_id: dict[int, Request] = {}
        self.prev_step = -1
        self.admissions = 0
        self.on_idle = on_idle  # told whenever the replica runs out of work
        self.pull = pull  # delivers every arrival due by a given time (the arrival feed)
        self.incoming: deque[Request] = deque()  # routed here, not yet visible (arrival after the clock)
        self.noise = noise  # multiplies each step's time (cost_noise); disables fast-forward
        self.shapes: list[StepShape] | None = [] if settings.record_shapes else None
        self._wake = None
        self._resume_at = None
        self.process = env.process(self.run())

    @property
    def is_idle(self) -> bool:
        return not self.state.waiting and not self.state.running and not self.incoming

    @property
    def waiting(self) -> deque:
        return self.state.waiting

    @property
    def running(self) -> list:
        return self.state.running

    # -- arrivals ------------------------------------------------------------------------
    def reject_reason(self, req: Request) -> str:
        total = req.prompt_len + req.output_len
        if total > self.settings.max_model_len:
            return f"prompt_len + output_len = {total} exceeds max_model_len = {self.settings.max_model_len}"
        if not self.kv.fits_ever(total):
            return (f"needs {self.kv.blocks_for(total)} KV blocks, the cache has "
                    f"{self.kv.num_blocks - self.kv.watermark_blocks} usable")
        return self.policy.reject_reason(req, self.state)

    def enqueue(self, req: Request) -> None:
        """Called by the router at the request's arrival."""
        req.replica = self.index
        reason = self.reject_reason(req)
        if reason:
            req.status = Status.REJECTED
            req.reject_reason = reason
            return
        req.status = Status.WAITING
        self.incoming.append(req)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _take_arrivals(self, now: float) -> None:
        """Make visible every request that arrived by `now` (exact clock), in arrival order."""
        self.pull(now)
        incoming = self.incoming
        while incoming and incoming[0].arrival <= now:
            req = incoming.popleft()
            self.waiting.append(req)
            self.by_id[req.id] = req

    # -- the loop ------------------------------------------------------------------------
    def run(self):
        env = self.env
        while True:
            start = env.now if self._resume_at is None else self._resume_at
            self._resume_at = None
            self._take_arrivals(start)
            if not self.waiting and not self.running:
                if self.incoming:  # routed, but arriving a hair later than this clock
                    yield env.timeout(delay_to(env.now, self.incoming[0].arrival))
                    continue
                self.on_idle()
                self._wake = env.event()
                yield self._wake
                self._wake = None
                continue
            self.state.now = start
            plan = self.policy.schedule(self.state)
            if plan.is_empty:
                raise SchedulerStuck(self._stuck_message())
            shape, swap_bytes = self.begin(plan, start)
            duration = self.cost.step_time(shape)
            if self.noise is not None:
                duration *= self.noise()
            duration += swap_bytes / self.settings.swap_bandwidth
            run = self._fast_forward(plan, shape, start, duration, swap_bytes)
            if run is None:
                end = start + duration
                yield env.timeout(delay_to(env.now, end))
                self.commit(plan, end)
                self._resume_at = end  # the exact sum, whatever SimPy's clock rounded to
            else:
                ends, held = run
                yield env.timeout(delay_to(env.now, float(ends[-1])))
                self._commit_run(ends, held, plan.hold_finished)
                self._resume_at = float(ends[-1])  # the exact sum, whatever SimPy's clock rounded to

    # -- begin: what the step holds while it runs ---------------------------------------
    def begin(self, plan: StepPlan, now: float) -> tuple[StepShape, float]:
        """Apply preemptions, admissions and KV blocks; return the step's shape and swapped bytes."""
        swap_bytes = 0.0
        for rid in plan.preempted:
            swap_bytes += self._preempt(self.by_id[rid])
        if plan.preempted:
            self.state.running = [r for r in self.running if r.status == Status.RUNNING]
        for rid in plan.admitted:
            swap_bytes += self._admit(self.by_id[rid], now)
        prefill, decode = [], []
        sampled = 0
        by_id, blocks, kv = self.by_id, plan.blocks, self.kv
        for rid, n in plan.scheduled.items():
            req = by_id[rid]
            if blocks[rid] > req.num_blocks:
                kv.grow(req, blocks[rid])
            computed = req.num_computed_tokens
            total = req.prompt_len + req.num_output_tokens
            if req.num_output_tokens and total - computed == 1:
                decode.append(computed + 1)
            else:
                prefill.append((n, computed))
            sampled += computed + n == total
        num_padding = len(plan.padding)
        num_decode = len(decode)
        if num_padding:
            decode.extend(by_id[rid].num_computed_tokens for rid in plan.padding)
        shape = StepShape(tuple(prefill), tuple(decode), num_padding, sampled, swap_bytes)
        self.step = self.recorder.add_step(
            self.index, now, math.nan, sum(c for c, _ in prefill), num_decode, num_padding,
            len(prefill) + len(decode), kv.num_blocks - kv.free_blocks, len(plan.preempted), swap_bytes)
        if self.shapes is not None:
            self.shapes.append(shape)
        return shape, swap_bytes

    def _admit(self, req: Request, now: float) -> float:
        if self.waiting and self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        req.status = Status.RUNNING
        req.admit_seq = self.admissions
        self.admissions += 1
        self.running.append(req)
        if req.first_scheduled_step < 0:
            req.first_scheduled = now
            req.first_scheduled_step = self.recorder.num_steps
        if req.num_swapped_blocks:
            moved = self.kv.swap_in_bytes(req)
            self.kv.drop_host_copy(req)
            return moved
        return 0.0

    def _preempt(self, req: Request) -> float:
        req.epoch += 1
        req.num_preemptions += 1
        self.recorder.close_run(req)
        self.waiting.appendleft(req)
        if self.settings.preemption_mode == "swap":
            req.status = Status.SWAPPED
            return self.kv.swap_out(req)
        req.status = Status.PREEMPTED
        self.kv.release(req)
        req.num_computed_tokens = 0
        return 0.0

    # -- commit: what the step produced --------------------------------------------------
    def commit(self, plan: StepPlan, end: float) -> None:
        """Apply the step's progress at its end; stale entries (older epoch) are ignored."""
        step = self.step
        self.recorder.set_end(step, end)
        finished = False
        by_id, epochs, token, previous = self.by_id, plan.epochs, self.recorder.token, self.prev_step
        for rid, n in plan.scheduled.items():
            req = by_id[rid]
            if req.epoch != epochs[rid] or req.status != Status.RUNNING:
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.prompt_len + req.num_output_tokens:
                req.num_output_tokens += 1
                token(req, step, previous)
                if req.num_output_tokens == 1:
                    req.first_token_time = end
                    req.first_token_step = step
                finished |= req.num_output_tokens >= req.output_len
        self.prev_step = step
        if finished:
            self._release_finished(plan.hold_finished, end)

    def _release_finished(self, hold: bool, end: float) -> None:
        if hold and not all(r.is_done for r in self.running):
            return
        keep = []
        for req in self.running:
            if req.is_done:
                req.status = Status.FINISHED
                req.completion_time = end
                self.kv.release(req)
                self.recorder.close_run(req)
                del self.by_id[req.id]
            else:
                keep.append(req)
        self.state.running = keep

    # -- fast-forward over identical decode steps ----------------------------------------
    def _fast_forward(self, plan, shape, start, duration, swap_bytes):
        """(end times, KV blocks held) of 2+ identical decode steps from this one, or None to step once.

        The run ends with the first completion, before KV runs out, and before the first step
        that would start at or after the next outside event (an arrival). Cost models are monotone
        in context, so (horizon - start) / duration + 1 bounds the steps worth computing.
        """
        running = self.running
        if (shape.prefill or plan.admitted or plan.preempted or plan.padding or swap_bytes
                or len(shape.decode) != len(running) or not running or not self.settings.fast_forward
                or self.noise is not None or (self.waiting and not self.policy.steady_when_blocked)):
            return None
        horizon = self.horizon()
        steps = min(min(r.output_len - r.num_output_tokens for r in running),  # up to the first completion
                    self.settings.max_fast_forward)
        if horizon != math.inf:
            steps = min(steps, int((horizon - start) / duration) + 2)
        if steps < 2:
            return None
        held = self._held_blocks(steps)
        extra = held.sum(axis=1) - held[0].sum()
        steps = int(np.searchsorted(extra, self.kv.free_blocks, side="right"))
        if steps < 2:
            return None
        contexts = np.fromiter(shape.decode, dtype=np.int64, count=len(shape.decode))
        durations = self.cost.decode_run_times(contexts, steps)
        durations[0] = duration
        ends = np.cumsum(np.concatenate(([start], durations)))[1:]
        # step j >= 2 starts at ends[j-2]; it may run only if that is before the next outside event
        runnable = 1 + int(np.searchsorted(ends[: steps - 1], horizon, side="left"))
        return (ends[:runnable], held[:runnable]) if runnable >= 2 else None

    def _held_blocks(self, steps: int) -> np.ndarray:
        """[j, i]: KV blocks running request i holds after step j + 1 of a decode run (j = 0 is now)."""
        running = self.running
        contexts = np.fromiter((r.num_computed_tokens + 1 for r in running), dtype=np.int64, count=len(running))
        reserved = np.fromiter((r.num_blocks for r in running), dtype=np.int64, count=len(running))
        growth = np.arange(steps, dtype=np.int64)
        needed = -(-(contexts[None, :] + growth[:, None]) // self.kv.block_size)
        return np.maximum(needed, reserved[None, :])

    def _commit_run(self, ends: np.ndarray, held: np.ndarray, hold_finished: bool) -> None:
        """Commit a run of identical decode steps: rows in bulk, every request +len(ends) tokens."""
        count = len(ends)
        running = self.running
        used = self.kv.used_blocks + held.sum(axis=1) - held[0].sum()
        self.recorder.set_end(self.step, float(ends[0]))
        first = self.recorder.add_steps(
            replica=self.index, start=ends[:-1], end=ends[1:], prefill_tokens=0,
            decode_tokens=len(running), padding_tokens=0, num_seqs=len(running), kv_blocks_used=used[1:],
            preemptions=0, swap_bytes=0.0)
        last = first + count - 2
        token, grow, step, previous = self.recorder.token, self.kv.grow, self.step, self.prev_step
        for req, blocks in zip(running, held[-1].tolist()):
            token(req, step, previous)
            req.num_output_tokens += count
            req.num_computed_tokens += count
            if blocks > req.num_blocks:
                grow(req, blocks)
        self.recorder.tokens_bulk(running, first, last)
        self.prev_step = last
        if any(r.num_output_tokens >= r.output_len for r in running):
            self._release_finished(hold_finished, float(ends[-1]))
        if self.shapes is not None:
            base = self.shapes[-1].decode
            self.shapes.extend(StepShape(decode=tuple(c + j for c in base), tokens_sampled=len(base))
                               for j in range(1, count))

    def _stuck_message(self) -> str:
        head = self.waiting[0] if self.waiting else None
        return (f"replica {self.index}: policy {self.policy.name} scheduled nothing with {len(self.waiting)} waiting "
                f"and {len(self.running)} running at t={self.env.now}; free KV blocks {self.kv.free_blocks}; "
                f"head of queue: {head}")
