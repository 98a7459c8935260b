"""One serving replica: a SimPy process that schedules, runs and commits steps.

The loop is: plan = policy.schedule(state); begin(plan) (admissions, preemptions, KV blocks);
yield a timeout of cost.step_time(shape); commit(plan) (progress, sampled tokens, completions).
An idle replica waits on an event that an arrival triggers; there is no polling.

Fast-forward: when a step is pure decode of every running request, nothing can change the plan
until the next arrival, the first completion, or running out of KV blocks: each following step is
the same batch with every context one longer. The replica then advances up to that horizon in one
vectorised computation (cost.decode_run_times), or for a short run in a plain loop of O(1) steps
(cost.decode_step_time), with results identical to stepping one by one.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Literal

import numpy as np

from .admission import DecodeReserve, TTFTPredictor, prefill_tokens_ahead, queue_full_reason
from .clock import delay_to
from .cost import CostModel
from .durations import CLOCK_LIMIT, check_run, check_step
from .kv_cache import KVCache
from .kv_link import KVLink
from .plan import StepPlan
from .metrics.recorder import Recorder
from .request import Request, Status
from .shape import StepShape
from .state import SchedulerState


SCALAR_RUN = 64  # decode runs bounded by this many steps are fast-forwarded in plain Python, not numpy


class SchedulerStuck(RuntimeError):
    """A policy returned an empty plan while work was pending: a policy bug, never a user error."""


@dataclass(frozen=True)
class ReplicaSettings:
    preemption_mode: Literal["recompute", "swap", "auto"] = "recompute"  # auto: per victim, the cheaper
    victim: str = "last_admitted"
    swap_bandwidth: float = 25e9  # bytes/s over the host link
    max_model_len: int = 8192
    fast_forward: bool = True
    max_fast_forward: int = 4096
    # P/D decode side: an outside event (a reservation for a transfer) can take KV blocks mid-step,
    # so a fast-forwarded run must end before the horizon, not merely start before it
    runs_end_before_horizon: bool = False
    record_shapes: bool = False  # keep every step's shape (held-out batches for the profiler)
    role: Literal["colocated", "prefill", "decode"] = "colocated"  # a replica of a P/D pool: sim/pd.py
    max_predicted_ttft: float | None = None  # early admission control (sim/admission.py); None: admit all
    admission_window: int = 32
    admission_probe_tokens: int = 512
    client_timeout: float | None = None  # abort a request this long after its arrival (workloads/clients.py)
    swap_space: float | None = None  # host swap space in bytes (per GPU, vLLM V0 --swap-space); None: unbounded
    swapped_queue: Literal["head", "vllm_v0"] = "head"  # policies/batch.py, _requeue
    decode_reserve: bool = False  # SGLang's new_token_ratio reserve (sim/admission.py DecodeReserve)
    schedule_conservativeness: float = 1.0
    clip_max_new_tokens: int = 4096
    step_cap: float | None = None  # TPOT slack: seconds a step may take while requests decode
    pd_backpressure: int | None = None  # P/D prefill side: pause admissions at this many awaiting decode room
    max_queued_requests: int | None = None  # overload: reject an arrival when this many wait (sim/admission.py)


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
        self.state.chunk_cost = lambda c, h: cost.step_time(StepShape(prefill=((c, h),)))  # dynamic chunking
        self._init_admission_signals(settings, cost)
        self.by_id: dict[int, Request] = {}
        self.prev_step = -1
        self.admissions = 0
        self.on_idle = on_idle  # told whenever the replica runs out of work
        self.pull = pull  # delivers every arrival due by a given time (the arrival feed)
        self.incoming: deque[Request] = deque()  # routed here, not yet visible (arrival after the clock)
        self.noise = noise  # multiplies each step's time (cost_noise); disables fast-forward
        self.shapes: list[StepShape] | None = [] if settings.record_shapes else None
        self.host_link = KVLink(f"host{index}", settings.swap_bandwidth,  # swaps, in and out
                                key="preemption.swap_bandwidth_gb_s")
        self.admission = None if settings.max_predicted_ttft is None else TTFTPredictor(
            settings.max_predicted_ttft, cost, settings.admission_window, settings.admission_probe_tokens)
        self.handoff = None  # P/D: the cluster's hand-off port (sim/pd.py), set when the pools are wired
        self.on_leave = None  # closed-loop clients: told (request, time) when a request finishes or fails here
        self.landed: deque[tuple[float, Request]] = deque()  # P/D decode side: KV arrived, not yet visible
        self.preemption_log: list[tuple] = []  # (time, replica, request, mode, recomputed tokens, swapped bytes)
        self._step_start = 0.0
        self.step_end: float | None = None  # end of the step (or fast-forwarded run) in progress, if any
        self._swap_out_booked = 0.0  # bytes this step's victims swap out (already on the host link)
        self._wake = None
        self._cut = None  # closed loop: triggered by an arrival routed here during a fast-forwarded run
        self._resume_at = None
        self.process = env.process(self.run())

    def _init_admission_signals(self, settings: ReplicaSettings, cost: CostModel) -> None:
        """Swap capacity, swapped-queue order, decode reserve and step cap (all off by default)."""
        state = self.state
        state.swapped_first = settings.swapped_queue == "vllm_v0"
        if settings.decode_reserve:
            state.reserve = DecodeReserve(settings.schedule_conservativeness, settings.clip_max_new_tokens)
        if settings.step_cap is not None:
            state.step_cap, state.step_time = settings.step_cap, cost.step_time
        block_bytes = self.kv.block_bytes
        # host blocks that fit in the swap space (vLLM V0: num_cpu_blocks = swap_space_bytes // block bytes)
        self.swap_capacity_blocks = (None if settings.swap_space is None or block_bytes <= 0
                                     else int(settings.swap_space // block_bytes))
        self.swap_full_recomputes = 0  # victims recomputed because the swap space was full

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
        """Why `req`, arriving now, is rejected: it could never run here, or admission control says no."""
        total = req.prompt_len + req.output_len
        if total > self.settings.max_model_len:
            return f"prompt_len + output_len = {total} exceeds max_model_len = {self.settings.max_model_len}"
        held = req.prompt_len if self.settings.role == "prefill" else total  # a prefill replica keeps the prompt
        if not self.kv.fits_ever(held):
            return (f"needs {self.kv.blocks_for(held)} KV blocks, the cache has "
                    f"{self.kv.num_blocks - self.kv.watermark_blocks} usable")
        # a prefill replica runs the prompt only (and samples one token): its policy judges that much
        judged = replace(req, output_len=1) if self.settings.role == "prefill" else req
        reason = self.policy.reject_reason(judged, self.state)
        if not reason and self.handoff is not None:
            reason = self.handoff.reject_reason(req)
        if not reason and self.admission is not None:
            ahead = prefill_tokens_ahead((self.incoming, self.waiting, self.running))
            reason = self.admission.reject_reason(ahead, req.prompt_len)
        if not reason and self.settings.max_queued_requests is not None:
            reason = queue_full_reason(len(self.incoming) + len(self.waiting), self.settings.max_queued_requests)
        return reason

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
        if self.on_leave is not None and self._wake is not None and not self._wake.triggered:
            self._resume_at = req.arrival  # closed loop: start at the exact arrival, not SimPy's rounded clock
        self.wake()
        if self._cut is not None and not self._cut.triggered and req.arrival < self.step_end:
            self._cut.succeed(req.arrival)

    def wake(self) -> None:
        """Resume the loop if it sleeps (a new request, a landed one, or KV a hand-off released)."""
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    @property
    def woken(self) -> bool:
        """Woken from its sleep but not resumed yet: it plans at this instant."""
        return self._wake is not None and self._wake.triggered

    def _sleep(self):
        self._wake = self.env.event()
        yield self._wake
        self._wake = None

    def next_visible(self) -> float | None:
        """When the earliest request routed or landed here, but not yet visible, becomes visible."""
        times = [self.incoming[0].arrival] if self.incoming else []
        if self.landed:
            times.append(self.landed[0][0])
        return min(times) if times else None

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
            if self.landed:
                self._take_landed(start)
            if not self.waiting and not self.running:
                later = self.next_visible()
                if later is not None:  # routed or landed, but a hair later than this clock
                    yield env.timeout(delay_to(env.now, later))
                    continue
                self.on_idle()
                yield from self._sleep()
                continue
            self.state.now = start
            plan = self.policy.schedule(self.state)
            if plan.is_empty:
                if self.handoff is None or not self.handoff.holds_kv(self):
                    raise SchedulerStuck(self._stuck_message())
                # P/D: KV held for a transfer leaves no room; its release (or a new request) wakes us
                later = self.next_visible()
                if later is None:
                    yield from self._sleep()
                else:
                    yield env.timeout(delay_to(env.now, later))
                continue
            self._step_start = start
            self._swap_out_booked = 0.0
            if self.handoff is not None and not (plan.scheduled or plan.padding or plan.rejected):
                yield from self._evict_only(plan, start)  # P/D: room reserved for a transfer forced it
                continue
            shape, swap_bytes = self.begin(plan, start)
            duration = self.cost.step_time(shape)
            if self.noise is not None:
                duration *= self.noise()
            if swap_bytes:  # the step waits for its swaps: the host link is idle at every step's start
                self._book_swap_ins(start, swap_bytes)
                duration += swap_bytes / self.settings.swap_bandwidth
            if not start < start + duration < CLOCK_LIMIT:  # NaN, inf, <= 0 or beyond the clock (durations.py)
                self._check_step(start, duration, shape)
            if self.admission is not None and shape.prefill:
                self.admission.observe(sum(c for c, _ in shape.prefill), duration)
            if self.handoff is not None:
                self.handoff.began(self, plan, start)
            run = self._fast_forward(plan, shape, start, duration, swap_bytes)
            if run is None:
                end = self.step_end = start + duration
                yield env.timeout(delay_to(env.now, end))
                self.commit(plan, end)
            else:
                ends, extra = run
                end = self.step_end = float(ends[-1])
                if self.on_leave is None:
                    yield env.timeout(delay_to(env.now, end))
                else:  # closed loop: a request sent here mid-run cuts the run short
                    ends, extra = yield from self._cuttable_run(ends, extra)
                    end = float(ends[-1])
                if len(ends) == 1:
                    self.commit(plan, end)
                else:
                    self._commit_run(ends, extra, plan.hold_finished)
            self.step_end = None
            if self.handoff is not None:  # after a run too: its last step's room counts, as after one step
                self.handoff.committed(self, plan, end)
            self._resume_at = end  # the exact sum, whatever SimPy's clock rounded to
            if self.settings.client_timeout is not None:  # clients that gave up by now leave at this boundary
                self._expire(end)
            if self.on_leave is not None:  # closed loop: every request leaving at this instant leaves first
                yield env.timeout(0)

    def _check_step(self, start: float, duration: float, shape: StepShape) -> None:
        """DurationError unless the step is an empty one of 0 s (called only when the hot path's
        comparison fails)."""
        check_step("cost_model", start, duration, shape.is_empty, where=self._step_context(shape))

    def _step_context(self, shape: StepShape | None = None) -> str:
        """Where a bad step time came from, for its error message."""
        parts = [f"replica {self.index} ({self.settings.role})"]
        if shape is not None:
            parts.append(f"a step of {shape.num_tokens} tokens")
        profile = self.cost.describe().get("profile")
        if profile:
            parts.append(f"profile {profile}")
        if self.noise is not None:
            parts.append("times sim.cost_noise")
        return "; " + ", ".join(parts)

    # -- begin: what the step holds while it runs ---------------------------------------
    def begin(self, plan: StepPlan, now: float) -> tuple[StepShape, float]:
        """Apply preemptions, admissions and KV blocks; return the step's shape and swapped bytes."""
        swap_bytes = 0.0
        for rid in plan.preempted:
            swap_bytes += self._preempt(self.by_id[rid])
        if plan.preempted:
            self.state.running = [r for r in self.running if r.status == Status.RUNNING]
        for rid in plan.rejected:
            self._reject_waiting(self.by_id[rid])
        for rid in plan.admitted:
            swap_bytes += self._admit(self.by_id[rid], now)
        prefill, decode = [], []
        sampled = 0
        by_id, blocks, kv = self.by_id, plan.blocks, self.kv
        kv.evicted_in_step = False  # prefix caching: set by grow if it evicts cached blocks
        add_decode, add_prefill, grow = decode.append, prefill.append, kv.grow
        for rid, n in plan.scheduled.items():
            req = by_id[rid]
            target = blocks[rid]
            if target > req.num_blocks:
                grow(req, target)
            computed = req.num_computed_tokens
            outputs = req.num_output_tokens
            left = req.prompt_len + outputs - computed  # tokens not yet in the KV cache
            if left == 1 and outputs:
                add_decode(computed + 1)
            else:
                add_prefill((n, computed))
            if n == left:
                sampled += 1
        if kv.prefix is not None:  # cache the full prompt blocks this step computes
            for rid, n in plan.scheduled.items():
                kv.publish(by_id[rid], by_id[rid].num_computed_tokens + n)
        num_padding = len(plan.padding)
        num_decode = len(decode)
        if num_padding:
            decode.extend(by_id[rid].num_computed_tokens for rid in plan.padding)
        shape = StepShape(tuple(prefill), tuple(decode), num_padding, sampled, swap_bytes)
        if self.state.reserve is not None:
            self.state.reserve.after_step(bool(plan.preempted), num_decode > 0, self.running)
        history, pairs = _prefill_reads(prefill) if prefill else (0, 0)  # what attention read (step_efficiency.py)
        self.step = self.recorder.add_step(
            self.index, now, math.nan, sum(c for c, _ in prefill), num_decode, num_padding,
            len(prefill) + len(decode), kv.num_blocks - kv.free_blocks, len(plan.preempted), swap_bytes,
            sum(decode), history, pairs)
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
        if self.kv.prefix is not None:
            self.kv.acquire_prefix(req)  # a prefix-cache hit: the counter jumps over cached blocks
        return 0.0

    def _reject_waiting(self, req: Request) -> None:
        """A waiting request the plan gives up on (plan.rejected); it holds no KV."""
        self.waiting.remove(req)
        del self.by_id[req.id]
        req.status = Status.REJECTED
        req.reject_reason = (f"rejected while waiting by policy {self.policy.name}: it could no longer meet "
                             "its deadline")
        if self.on_leave is not None:
            self.on_leave(req, self._step_start)

    def _preempt(self, req: Request) -> float:
        """Evict `req` before the step runs; returns the bytes it swaps out (0 for recompute)."""
        req.epoch += 1
        req.num_preemptions += 1
        self.recorder.close_run(req)
        self._requeue(req)
        tokens = req.num_computed_tokens
        if self._recovers_by_swap(req):
            req.status = Status.SWAPPED
            moved = self.kv.swap_out(req)
            self.host_link.submit(self._step_start, moved, req.id, "swap_out")
            self._swap_out_booked += moved
            self.preemption_log.append((self._step_start, self.index, req.id, "swap", 0, moved))
            return moved
        req.status = Status.PREEMPTED
        self.kv.release(req)
        req.num_computed_tokens = 0
        self.preemption_log.append((self._step_start, self.index, req.id, "recompute", tokens, 0.0))
        return 0.0

    def _recovers_by_swap(self, req: Request) -> bool:
        """Swap or recompute? `auto` takes the faster recovery by this run's cost model:
        T_swap = out and back in over the host link + the link's queue (victims already swapping out
        in this step); T_recompute = one prefill of every token whose KV would be dropped. Ties recompute."""
        mode = self.settings.preemption_mode
        if mode == "recompute":
            return False
        capacity = self.swap_capacity_blocks
        if capacity is not None and self.kv.host_blocks + req.num_blocks > capacity:
            self.swap_full_recomputes += 1
            return False  # the host swap space is full: recompute (vLLM V0 aborts the engine here)
        if mode == "swap":
            return True
        tokens = req.num_computed_tokens
        if tokens == 0:
            return False
        link = self.host_link
        t_swap = 2 * link.duration(req.num_blocks * self.kv.block_bytes) + link.backlog(self._step_start)
        t_recompute = self.cost.step_time(StepShape(prefill=((tokens, 0),), tokens_sampled=1))
        return t_swap < t_recompute

    def _requeue(self, req: Request) -> None:
        """A preempted request goes back to the head of the waiting queue (on a P/D decode replica,
        behind the landed requests there: they hold their KV already, and waiting behind a recompute
        that cannot fit could deadlock). With swapped_queue vllm_v0 the swapped requests lead the
        queue in preemption order and every victim goes behind them: a swapped one joins the end of
        that FIFO, a recompute one the head of the rest. vLLM V0 keeps swapped requests in their own
        queue (`self.swapped.extend(swapped_out)`, swapped in from its head) served before the waiting
        queue, where recompute victims go first (`self.waiting.extendleft(preempted)`)
        (vllm-project/vllm 0dce2b29, vllm/core/scheduler.py _schedule_default, _schedule_chunked_prefill)."""
        head = self._landed_prefix() if self.settings.role == "decode" else 0
        if self.settings.swapped_queue == "vllm_v0":
            waiting = self.waiting
            while head < len(waiting) and waiting[head].num_swapped_blocks:
                head += 1
        if head:
            self.waiting.insert(head, req)
        else:
            self.waiting.appendleft(req)

    def _evict_only(self, plan: StepPlan, start: float):
        """A plan that only preempts (P/D: KV reserved for transfers left a lone request no room to
        grow) runs no forward pass and records no step; the replica waits only for swap-outs."""
        swapped = sum(self._preempt(self.by_id[rid]) for rid in plan.preempted)
        self.state.running = [r for r in self.running if r.status == Status.RUNNING]
        if swapped:
            self._resume_at = self.step_end = start + swapped / self.settings.swap_bandwidth
            yield self.env.timeout(delay_to(self.env.now, self._resume_at))
            self.step_end = None

    def _book_swap_ins(self, start: float, swap_bytes: float) -> None:
        """Put the step's swap-ins on the host link (its swap-outs were booked as they were decided)."""
        swap_in = swap_bytes - self._swap_out_booked
        if swap_in > 0:
            self.host_link.submit(start, swap_in, -1, "swap_in")

    # -- P/D hand-off (sim/pd.py drives these) ------------------------------------------
    def detach(self, reqs: list[Request]) -> None:
        """Prefill side: take requests whose prompt is done off this replica; their KV stays
        allocated here until the hand-off releases it."""
        gone = {req.id for req in reqs}
        self.state.running = [r for r in self.running if r.id not in gone]
        for req in reqs:
            del self.by_id[req.id]
            self.recorder.close_run(req)

    def land(self, req: Request, time: float) -> None:
        """Decode side: `req`'s KV arrived at `time` (its blocks are already granted here)."""
        req.replica = self.index
        req.status = Status.WAITING
        self.landed.append((time, req))
        self.wake()

    def _take_landed(self, now: float) -> None:
        """Landed requests become visible at the head of the waiting queue, in landing order."""
        landed = self.landed
        while landed and landed[0][0] <= now:
            _, req = landed.popleft()
            self.by_id[req.id] = req
            self.waiting.insert(self._landed_prefix(), req)

    def _landed_prefix(self) -> int:
        """How many landed requests (waiting, holding KV blocks) lead the waiting queue."""
        count = 0
        for req in self.waiting:
            if req.status != Status.WAITING or not req.num_blocks:
                break
            count += 1
        return count

    # -- commit: what the step produced --------------------------------------------------
    def commit(self, plan: StepPlan, end: float) -> None:
        """Apply the step's progress at its end; stale entries (older epoch) are ignored."""
        step = self.step
        self.recorder.set_end(step, end)
        finished = False
        by_id, epochs, previous, running = self.by_id, plan.epochs, self.prev_step, Status.RUNNING
        close_run = self.recorder.close_run
        for rid, n in plan.scheduled.items():
            req = by_id[rid]
            if req.epoch != epochs[rid] or req.status != running:
                continue
            computed = req.num_computed_tokens + n
            req.num_computed_tokens = computed
            outputs = req.num_output_tokens
            if computed == req.prompt_len + outputs:
                outputs += 1
                req.num_output_tokens = outputs
                # Recorder.token, inlined on the hottest loop: extend the open run or start one
                if req.run_tokens and req.last_token_step == previous:
                    req.run_tokens += 1
                else:
                    close_run(req)
                    req.run_start_step = step
                    req.run_tokens = 1
                req.last_token_step = step
                if outputs == 1:
                    req.first_token_time = end
                    req.first_token_step = step
                if outputs >= req.output_len:
                    finished = True
        self.prev_step = step
        if finished:
            self._release_finished(plan.hold_finished, end)

    def _release_finished(self, hold: bool, end: float) -> None:
        if hold and not all(r.is_done for r in self.running):
            return
        keep = []
        limit = self.settings.client_timeout
        for req in self.running:
            if req.is_done:
                if limit is not None and end > req.arrival + limit:  # its client had given up
                    self._time_out(req, limit)
                else:
                    req.status = Status.FINISHED
                    req.completion_time = end
                self.kv.release(req)
                self.recorder.close_run(req)
                del self.by_id[req.id]
                if self.on_leave is not None:
                    self.on_leave(req, end)
            else:
                keep.append(req)
        self.state.running = keep

    # -- client timeouts ------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        """Abort every request whose client gave up by `now` (client_timeout after its arrival), at the
        end of a step, as vLLM aborts a disconnected request between steps: it leaves the queue or the
        batch and its KV blocks (and any host copy) are freed. (Only a step's end can pass a deadline:
        a replica without work has no request to expire, and one that wakes has only fresh ones.)"""
        limit = self.settings.client_timeout
        late = [r for r in self.running if r.arrival + limit <= now] + [r for r in self.waiting
                                                                         if r.arrival + limit <= now]
        for req in late:
            if req.status == Status.RUNNING:
                self.recorder.close_run(req)
            else:
                self.waiting.remove(req)
                if req.num_swapped_blocks:
                    self.kv.drop_host_copy(req)
            if req.num_blocks:
                self.kv.release(req)
            del self.by_id[req.id]
            self._time_out(req, limit)
            if self.on_leave is not None:
                self.on_leave(req, now)
        if late:
            self.state.running = [r for r in self.running if r.status == Status.RUNNING]

    @staticmethod
    def _time_out(req: Request, limit: float) -> None:
        req.status = Status.REJECTED
        req.reject_reason = f"timeout: not finished {limit:g} s after arrival"

    def _cuttable_run(self, ends, extra):
        """Closed loop: wait out a fast-forwarded run, unless a request routed here arrives during it
        (a reply elsewhere sent it); then only the run's steps that start before that arrival run,
        exactly what stepping one by one would do. Returns the (ends, extra) that ran."""
        env = self.env
        self._cut = env.event()
        done = env.timeout(delay_to(env.now, float(ends[-1])))
        yield done | self._cut
        if self._cut.triggered:
            keep = 1 + int(np.searchsorted(ends[:-1], self._cut.value, side="left"))  # steps starting before it
            if keep < len(ends):
                ends, extra = ends[:keep], extra[:keep]
                self.step_end = float(ends[-1])
                yield env.timeout(delay_to(env.now, self.step_end))
            elif not done.processed:  # (a Timeout counts as triggered from its creation)
                yield done
        self._cut = None
        return ends, extra

    def _next_deadline(self) -> float:
        """When the client of the earliest request here gives up (inf without a timeout)."""
        limit = self.settings.client_timeout
        if limit is None or not (self.running or self.waiting):
            return math.inf
        return min(r.arrival for r in (*self.running, *self.waiting)) + limit

    # -- fast-forward over identical decode steps ----------------------------------------
    def _fast_forward(self, plan, shape, start, duration, swap_bytes):
        """(end times, blocks held beyond the first step's) of 2+ identical decode steps from this
        one, or None to step once.

        The run ends with the first completion, before KV runs out, and before the first step
        that would start at or after the next outside event (an arrival). Cost models are monotone
        in context, so (horizon - start) / duration + 1 bounds the steps worth computing.
        """
        running = self.running
        if (shape.prefill or plan.admitted or plan.preempted or plan.padding or swap_bytes
                or len(shape.decode) != len(running) or not running or not self.settings.fast_forward
                or self.noise is not None or (self.waiting and not self.policy.steady_when_blocked)
                or (self.waiting and self.state.reserve is not None)  # its ratio decays every step
                or self.kv.evicted_in_step):  # an eviction can unblock a waiting request (its hit is gone)
            return None
        horizon = min(self.horizon(), self._next_deadline())
        steps = min(min(r.output_len - r.num_output_tokens for r in running),  # up to the first completion
                    self.settings.max_fast_forward)
        if horizon != math.inf:
            steps = min(steps, int((horizon - start) / duration) + 2)
        if steps < 2:
            return None
        if steps <= SCALAR_RUN:
            return self._scalar_run(steps, start, duration, horizon)
        contexts, held = self._held_blocks(steps)
        extra = held.sum(axis=1)
        extra -= extra[0]
        steps = int(np.searchsorted(extra, self.kv.free_blocks, side="right"))
        if steps < 2:
            return None
        durations = self.cost.decode_run_times(contexts, steps)
        durations[0] = duration
        ends = np.cumsum(np.concatenate(([start], durations)))[1:]
        if not (ends[-1] < CLOCK_LIMIT and (ends[1:] > ends[:-1]).all()):  # the first step was checked
            check_run("cost_model", start, durations, where=self._step_context())
        if self.settings.runs_end_before_horizon:  # every step of the run ends before the next outside event
            runnable = int(np.searchsorted(ends, horizon, side="left"))
        else:  # step j >= 2 starts at ends[j-2]; it may run only if that is before the next outside event
            runnable = 1 + int(np.searchsorted(ends[: steps - 1], horizon, side="left"))
        return (ends[:runnable], extra[:runnable]) if runnable >= 2 else None

    def _scalar_run(self, steps: int, start: float, duration: float, horizon: float):
        """`_fast_forward` for a short run (at most SCALAR_RUN steps), in plain Python: the same
        (ends, extra) as lists, step by step, stopping at the horizon (a numpy set-up costs more
        than such a run). A request crosses into a new block at steps j0, j0 + block_size, ...; the run
        stops before the step whose crossings need more blocks than are free."""
        block_size = self.kv.block_size
        contexts = []
        crossings = []
        for req in self.running:
            context = req.num_computed_tokens + 1
            contexts.append(context)
            held = -(-context // block_size)
            if req.num_blocks > held:
                held = req.num_blocks
            j = held * block_size - context + 1  # the first step whose context outgrows the blocks held
            while j < steps:
                crossings.append(j)
                j += block_size
        free = self.kv.free_blocks
        if len(crossings) > free:
            crossings.sort()
            steps = crossings[free]  # the first step that would need one block more than are free
            if steps < 2:
                return None
        step_time = self.cost.decode_step_time
        ends = [start + duration]
        total = sum(contexts)
        n = len(contexts)
        end = ends[0]
        before = self.settings.runs_end_before_horizon
        if before and not end < horizon:
            return None
        for j in range(1, steps):
            if not before and not end < horizon:  # step j starts at the previous end: not at or after the horizon
                break
            seconds = step_time(contexts, j, total + n * j)
            later = end + seconds
            if not end < later < CLOCK_LIMIT:
                check_run("cost_model", end, np.array([seconds]), where=self._step_context())
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

    def _held_blocks(self, steps: int) -> tuple[np.ndarray, np.ndarray]:
        """(decode contexts of the running requests now, [j, i]: KV blocks running request i holds
        after step j + 1 of a decode run, j = 0 being this step)."""
        running = self.running
        contexts = np.fromiter((r.num_computed_tokens + 1 for r in running), dtype=np.int64, count=len(running))
        reserved = np.fromiter((r.num_blocks for r in running), dtype=np.int64, count=len(running))
        growth = np.arange(steps, dtype=np.int64)
        needed = -(-(contexts[None, :] + growth[:, None]) // self.kv.block_size)
        return contexts, np.maximum(needed, reserved[None, :])

    def _commit_run(self, ends, extra, hold_finished: bool) -> None:
        """Commit a run of identical decode steps: rows in bulk, every request +len(ends) tokens and
        the blocks its last step's context needs; `extra[j]`: blocks held after step j beyond those
        held in the first."""
        count = len(ends)
        running = self.running
        n = len(running)
        used = self.kv.used_blocks
        recorder = self.recorder
        recorder.set_end(self.step, float(ends[0]))
        last = recorder.num_steps + count - 2  # the run's last step (rows are appended below)
        # per request: Recorder.token at this step then tokens_bulk over the rest, inlined (one pass)
        close_run, grow, previous = recorder.close_run, self.kv.grow, self.prev_step
        contexts = n  # the first step's decode contexts, summed
        finished = False
        block_size = self.kv.block_size
        for req in running:
            computed = req.num_computed_tokens
            contexts += computed
            if req.run_tokens and req.last_token_step == previous:
                req.run_tokens += count
            else:
                close_run(req)
                req.run_start_step = self.step
                req.run_tokens = count
            req.last_token_step = last
            outputs = req.num_output_tokens + count
            req.num_output_tokens = outputs
            req.num_computed_tokens = computed + count
            blocks = -(-(computed + count) // block_size)  # for its last step's context, computed + count
            if blocks > req.num_blocks:
                grow(req, blocks)
            if outputs >= req.output_len:
                finished = True
        if isinstance(ends, list):  # a short run (_scalar_run): plain lists, appended as they are
            used = [used + e for e in extra[1:]]
            decode_contexts = [contexts + n * j for j in range(1, count)]
        else:
            used = used + extra[1:]
            decode_contexts = contexts + n * np.arange(1, count, dtype=np.int64)
        recorder.add_steps(
            replica=self.index, start=ends[:-1], end=ends[1:], prefill_tokens=0,
            decode_tokens=n, padding_tokens=0, num_seqs=n, kv_blocks_used=used,
            preemptions=0, swap_bytes=0.0, decode_context_tokens=decode_contexts)
        self.prev_step = last
        if self.state.reserve is not None:
            self.state.reserve.decay_steps(count - 1)
        if finished:
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


def _prefill_reads(prefill: list) -> tuple[int, int]:
    """(sum of h, sum of causal query-key pairs c * h + c * (c + 1) / 2) over prefill rows (c, h)."""
    history = pairs = 0
    for c, h in prefill:
        history += h
        pairs += c * h + c * (c + 1) // 2
    return history, pairs
