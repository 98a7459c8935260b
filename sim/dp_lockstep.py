"""Data-parallel attention ranks step in lockstep, as the engines run them.

Invariant: the ranks of one MoE deployment with data-parallel attention (roofline `data_parallel`
D > 1: vLLM --data-parallel-size with --enable-expert-parallel, SGLang --enable-dp-attention) start
every step together and end it together. A step lasts as long as its slowest rank's forward; a rank
with nothing to run while another rank has work runs a dummy batch of one decode token, and that
dummy forward counts in the max too. A rank that gets work while a group step runs starts at the
step's end; when every rank is idle the wave runs on in dummy steps to vLLM's next all-reduce, then the
group sleeps, and the first rank to get work starts a step at once (the others join it with dummies).

Why: every MoE layer's dispatch and combine is a collective over all D ranks, so no rank can run
its next layer before the slowest rank reaches it.
- vLLM: vllm/v1/engine/core.py @00080ee1 (`DPEngineCoreProc.run_busy_loop`): a rank whose step ran
  no requests calls `execute_dummy_batch()` while the wave runs (`engines_running`);
  vllm/v1/worker/gpu_worker.py `execute_dummy_batch` runs `_dummy_run(1, uniform_decode=True)`, one
  decode token. `_has_global_unfinished_reqs` all-reduces only every 32 steps, so when every rank has
  run out of work the wave runs on in dummy steps until its step counter is a multiple of 32: a rank
  that gets work then starts at the next dummy step's end (LockstepGroup._wave_boundary).
- SGLang: python/sglang/srt/managers/scheduler_dp_attn_mixin.py `prepare_mlp_sync_batch_raw` (commit
  not pinned) all-gathers every rank's token count before each forward; a rank with nothing to run
  runs `get_idle_batch()`.
prefill_schedule_interval (vLLM PR #44558; the rule: LockstepReplica._defers_prefills) is in
docs/validation/moe.md with its sources.

The routed experts receive every rank's tokens: a rank priced alone assumes D x its own
(sim/costmodels/moe_gemms.py); at a step's close the group re-prices each rank's forward with the
experts at the ranks' sum, where the cost model can (roofline `step_time_among`; LockstepGroup._seconds).
"""
from __future__ import annotations

import math
from collections import deque

from cbsim.core.schema import require

from cbsim.sim import step_apply
from cbsim.sim.clock import delay_to
from cbsim.sim.replica import Replica
from cbsim.sim.shape import StepShape

WAVE_SYNC_STEPS = 32  # vLLM _has_global_unfinished_reqs: "only perform finish-sync all-reduce every 32 steps"
DUMMY_BATCH = StepShape.from_batch(decode=(1,))  # vLLM execute_dummy_batch: _dummy_run(1, uniform_decode=True)


class LockstepGroup:
    """The clock the D ranks of one deployment share: one open boundary at a time.

    At the boundary `at`, each rank in `members` reports once: `join` with its step's seconds, or
    `skip` (nothing to run). When the last member has reported, the step closes: it ends at
    `at + max(joined seconds, the dummy batch's if a rank did not join)`, its joiners are the members
    of the next boundary (at that end), and every joiner resumes at that end."""

    def __init__(self, env, size: int, cost, prefill_schedule_interval: int = 1):
        self.env = env
        self.size = size  # D ranks
        self.cost = cost
        # the experts' share of the ranks' tokens: cost.step_time_among(shape, share), where the cost
        # model prices the routed experts apart (roofline); else each rank's own price stands
        self.among = getattr(cost, "step_time_among", None)
        self.prefill_schedule_interval = prefill_schedule_interval
        self.step_counter = 0  # steps of the wave so far (vLLM's step_counter, the same on every rank)
        self.tail: tuple[float, int, int] | None = None  # all ranks idle: (from, step_counter, dummy steps left)
        self.at = -math.inf  # the open boundary (or the end of the last step, when idle)
        self.members: set[int] = set()  # ranks that report at `at`
        self.joined: dict[int, tuple] = {}  # rank -> join's (whole, forward, own, shape), reported at `at`
        self.skipped: set[int] = set()
        self.closed = env.event()  # succeeds with the step's end when the boundary at `at` closes

    def align(self, rank: int, start: float):
        """Where `rank`, with work visible at `start`, plans: the open boundary, which it joins. When
        the group is idle it opens one at `start`; while a step it is not part of runs, it waits for the
        step's end (its dummy batch is in that step)."""
        opens = not self.members
        if opens:
            self.at = self._wave_boundary(start)
        self.members.add(rank)
        self.skipped.discard(rank)  # skipped at this instant, then woken by an arrival: it reports again
        if opens and self.at == start:  # ranks woken at this same instant join this step (the wave starts)
            yield self.env.timeout(0)
        elif self.at > start:
            yield self.env.timeout(delay_to(self.env.now, self.at))
        return self.at

    @property
    def throttles_prefills(self) -> bool:
        """vLLM DPEngineCoreProc._should_throttle_prefills: prefills wait for every Nth step of the wave."""
        interval = self.prefill_schedule_interval
        return interval > 1 and self.step_counter % interval != 0

    def join(self, rank: int, whole: float, forward: float, own: float, shape: StepShape):
        """`rank` runs `shape` at the boundary: `whole` seconds as the replica priced it, of which
        `forward` the cost model's forward (noise included), `own` the same without noise. Returns
        (yields for) the step's end."""
        self.joined[rank] = (whole, forward, own, shape)
        closed = self.closed
        if not self._close_if_complete():
            return (yield closed)
        return closed.value

    def skip(self, rank: int) -> None:
        """`rank` has nothing to run at the boundary (it sleeps until work arrives)."""
        if rank in self.members:
            self.skipped.add(rank)
            self._close_if_complete()

    def _close_if_complete(self) -> bool:
        if len(self.joined) + len(self.skipped) < len(self.members):
            return False
        closed, joined = self.closed, self.joined
        seconds = self._seconds(list(joined.values()))
        end = self.at + max(seconds) if seconds else self.at
        if seconds:
            self.step_counter += 1
        else:  # every rank idle: dummy steps until vLLM's every-32-steps all-reduce ends the wave
            left = -self.step_counter % WAVE_SYNC_STEPS
            self.tail = (self.at, self.step_counter, left) if left else None
            self.step_counter = self.step_counter if left else 0
        self.at, self.members = end, set(joined)
        self.joined, self.skipped, self.closed = {}, set(), self.env.event()
        closed.succeed(end)
        return True

    def _wave_boundary(self, start: float) -> float:
        """The first step boundary at or after `start` for a rank that finds every rank idle: `start`
        itself once the wave has ended, else the end of the tail's dummy step in progress (the step
        counter advanced by the dummy steps run)."""
        if self.tail is None:
            self.step_counter = 0
            return start
        since, counter, left = self.tail
        self.tail = None
        dummy = self.cost.step_time(DUMMY_BATCH)  # every rank runs it: the experts see D x one token
        ran = max(0, math.ceil((start - since) / dummy)) if dummy > 0 else left
        if ran >= left:  # the all-reduce after the last dummy step found no work: a new wave starts now
            self.step_counter = 0
            return start
        self.step_counter = counter + ran
        return since + ran * dummy

    def _seconds(self, steps: list[tuple]) -> list[float]:
        """Each joined rank's step time, and an idle rank's dummy batch's where a rank sat out. The
        routed experts receive every rank's tokens (a dummy batch's one included): where the cost model
        prices them apart, each rank's forward is re-priced with the experts at the ranks' sum instead
        of D x its own (the roofline's assumption for a rank priced alone); the rest of its step (host
        work, swap-ins, noise) is kept."""
        if not steps:
            return []
        idle = self.size - len(steps)
        if self.among is None:
            dummy = [self.cost.step_time(DUMMY_BATCH)] if idle else []
            return [whole for whole, _, _, _ in steps] + dummy
        total = sum(shape.num_tokens for _, _, _, shape in steps) + idle * DUMMY_BATCH.num_tokens
        out = []
        for whole, forward, own, shape in steps:
            scale = self.among(shape, total / shape.num_tokens) / own if own > 0 and shape.num_tokens else 1.0
            out.append(whole + forward * (scale - 1.0))
        if idle:
            out.append(self.among(DUMMY_BATCH, total / DUMMY_BATCH.num_tokens))
        return out


class LockstepReplica(Replica):
    """One data-parallel attention rank: Replica's loop, each step aligned by the group's clock.
    No step is fast-forwarded (a run of identical steps assumes the rank steps alone)."""

    def __init__(self, *args, group: LockstepGroup, **kwargs):
        self.group = group
        self.prefill_capacity_bound = False  # vLLM Scheduler: the last admitting step left prompts waiting
        super().__init__(*args, **kwargs)

    def run(self):
        env, state, group = self.env, self.state, self.group
        while True:
            start = env.now if self._resume_at is None else self._resume_at
            self._resume_at = None
            self._take_arrivals(start)
            if not state.waiting and not state.running:
                group.skip(self.index)
                if self.next_visible() is None:
                    self.on_idle()
                yield from self._wait_for_visible()
                continue
            start = yield from group.align(self.index, start)
            self._take_arrivals(start)
            deferred = self._defers_prefills()
            plan = self._plan(start, deferred)
            if not self._steps(plan):
                group.skip(self.index)
                yield from self._not_stepping(plan, start)
                continue
            self.step_start = start
            self.recovery.swap_out_booked = 0.0
            shape, swap_bytes = self.begin(plan, start)
            if not deferred and not plan.preempted:  # vLLM updates the latch in its waiting pass only
                self.prefill_capacity_bound = bool(state.waiting)
            forward, duration = self._priced(plan, shape, swap_bytes, start)
            own = forward if self.noise is None else self.cost.step_time(shape)
            end = yield from group.join(self.index, duration, forward, own, shape)
            self.step_end = end
            yield env.timeout(delay_to(env.now, end))
            self.commit(plan, end)
            self.step_end = None
            self.role.committed(plan, end)
            self._resume_at = end
            if self.settings.client_timeout is not None:
                step_apply.expire(self, end)
            if self.on_leave is not None:
                yield env.timeout(0)

    def _defers_prefills(self) -> bool:
        """vLLM Scheduler.schedule's `defer_prefills`: on a throttled step, unless the last admitting
        step was capacity-bound, no prefill work runs while a running request can decode instead."""
        return (self.group.throttles_prefills and not self.prefill_capacity_bound
                and any(not r.in_prefill for r in self.state.running))

    def _plan(self, start: float, deferred: bool):
        """The policy's plan at `start`. Deferred: the policy sees no waiting prompt and the running
        prompts in progress as not schedulable this step (held as `in_flight`: their KV stays, they
        get no tokens), as vLLM skips `is_prefill_chunk` requests and admits no new prompt."""
        state = self.state
        state.now = start
        if not deferred:
            return self.policy.schedule(state)
        running, waiting, in_flight = state.running, state.waiting, state.in_flight
        state.running = [r for r in running if not r.in_prefill]
        state.in_flight = (*in_flight, *(r for r in running if r.in_prefill))
        state.waiting = deque()
        try:
            return self.policy.schedule(state)
        finally:
            state.running, state.waiting, state.in_flight = running, waiting, in_flight


def lockstep_groups(env, cost, settings, replicas: int) -> list[LockstepGroup | None]:
    """Each replica's group: replicas i*D .. i*D + D-1 are the D ranks of one deployment (a last group
    with fewer replicas than D has its missing ranks idle: they run dummies). None for every replica
    where the ranks step alone: no data-parallel attention (D = 1), `dp_lockstep` off, or pipeline
    stages (sim/pipeline.py runs its own loop)."""
    size = int(getattr(cost, "data_parallel", 1))
    if size <= 1 or not settings.dp_lockstep or int(getattr(cost, "pipeline_stages", 1)) > 1:
        require(settings.prefill_schedule_interval == 1, "cluster.prefill_schedule_interval", "1 unless the "
                "ranks of data-parallel attention step together (cost_model.data_parallel > 1, cluster.dp_lockstep "
                "true, no pipeline stages): vLLM applies it in DPEngineCoreProc only",
                settings.prefill_schedule_interval)
        return [None] * replicas
    groups = [LockstepGroup(env, size, cost, settings.prefill_schedule_interval)
              for _ in range(-(-replicas // size))]
    return [groups[i // size] for i in range(replicas)]
