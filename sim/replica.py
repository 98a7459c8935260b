"""One serving replica: a SimPy process that schedules, runs and commits steps.

The loop is: plan = policy.schedule(state); begin(plan) (admissions, preemptions, KV blocks);
yield a timeout of cost.step_time(shape); commit(plan) (progress, sampled tokens, completions).
An idle replica waits on an event that an arrival triggers; there is no polling.

The replica keeps the loop and its arrivals; each other concern is a unit of its own, chosen or
bound once when the replica is built:
- sim/step_apply.py: begin and commit, the two halves of applying a plan (bound as methods);
- sim/preemption.py: the preemption recovery strategy (recompute, swap or auto; the queue order);
- sim/roles.py: the replica's role (colocated, or a P/D pool's prefill or decode) and its hooks;
- sim/fast_forward.py: how far a run of identical decode steps may be skipped, computed without
  touching the replica (results identical to stepping one by one); sim/prompt_run.py the same for a
  steady chunked-prefill schedule (a prompt's chunks, the decodes after it, the arrivals it admits).
A replica of P > 1 pipeline stages runs a loop of its own (sim/pipeline.py PipelinedReplica: up to P
micro-batches in flight); sim/pipeline.py make_replica picks the loop from the cost model.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Literal

from cbsim.sim import native_core, step_apply  # native_core: prompt runs, compiled where a user built them
from cbsim.sim.admission import DecodeReserve, TTFTPredictor, prefill_tokens_ahead, queue_full_reason
from cbsim.sim.clock import delay_to
from cbsim.sim.cost import CostModel
from cbsim.sim.durations import CLOCK_LIMIT, check_step
from cbsim.sim.fast_forward import cut_run, decode_run, may_leap, replica_leaps
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.kv.link import KVLink
from cbsim.sim.kv.tier_traffic import TierTraffic
from cbsim.sim.metrics.recorder import Recorder
from cbsim.sim.plan import StepPlan
from cbsim.sim.preemption import make_recovery
from cbsim.sim.request import Request, Status
from cbsim.sim.roles import Colocated
from cbsim.sim.run_progress import RunProgress
from cbsim.sim.shape import StepShape
from cbsim.sim.state import SchedulerState, Victim


class SchedulerStuck(RuntimeError):
    """A policy returned an empty plan while work was pending: a policy bug, never a user error."""


@dataclass(frozen=True)
class ReplicaSettings:
    preemption_mode: Literal["recompute", "swap", "auto"] = "recompute"  # auto: per victim, the cheaper
    victim: Victim = "last_admitted"
    swap_bandwidth: float = 25e9  # bytes/s over the host link
    max_model_len: int = 8192
    fast_forward: bool = True
    max_fast_forward: int = 4096
    # P/D decode side: an outside event (a reservation for a transfer) can take KV blocks mid-step,
    # so a fast-forwarded run must end before the horizon, not merely start before it; likewise when a
    # router reads the replicas' KV caches at each arrival (several replicas, kv_aware or prefix_affinity)
    runs_end_before_horizon: bool = False
    record_shapes: bool = False  # keep every step's shape (held-out batches for the profiler)
    max_predicted_ttft: float | None = None  # early admission control (sim/admission.py); None: admit all
    admission_window: int = 32
    admission_probe_tokens: int = 512
    client_timeout: float | None = None  # abort a request this long after its arrival (workloads/clients.py)
    swap_space: float | None = None  # host swap space in bytes (per GPU, vLLM V0 --swap-space); None: unbounded
    swapped_queue: Literal["head", "vllm_v0"] = "head"  # where a victim waits (sim/preemption.py)
    decode_reserve: bool = False  # SGLang's new_token_ratio reserve (sim/admission.py DecodeReserve)
    schedule_conservativeness: float = 1.0
    clip_max_new_tokens: int = 4096
    step_cap: float | None = None  # TPOT slack: seconds a step may take while requests decode
    pd_backpressure: int | None = None  # P/D prefill side: pause admissions at this many awaiting decode room
    max_queued_requests: int | None = None  # overload: reject an arrival when this many wait (sim/admission.py)
    speculative: object = None  # sim/speculative.py Speculation: each replica makes its Speculator; None: off
    pp_chunk_pipelining: bool = True  # pipeline stages: a prompt's next chunk joins the next micro-batch (sim/pipeline.py)
    dp_lockstep: bool = True  # data-parallel attention: the D ranks of a deployment step together (sim/dp_lockstep.py)
    prefill_schedule_interval: int = 1  # vLLM: with lockstep ranks, prompts run on every Nth step of the wave


class Replica:
    # the two halves of applying a plan (sim/step_apply.py)
    begin = step_apply.begin
    commit = step_apply.commit

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
        self.spec = self.state.spec = settings.speculative.make(cost) if settings.speculative is not None else None
        self.state.chunk_cost = lambda c, h: cost.step_time(StepShape(prefill=((c, h),)))  # dynamic chunking
        self._init_admission_signals(settings, cost)
        self.by_id: dict[int, Request] = {}
        self.prev_step = -1
        self.step = -1  # the recorder's row of the step in progress (or last begun)
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
        self.role = Colocated(self)  # P/D wiring (sim/pd.py) gives the replicas of its pools their roles
        self.on_leave = None  # closed-loop clients: told (request, time) when a request finishes or fails here
        self.landed: deque[tuple[float, Request]] = deque()  # P/D decode side: KV arrived, not yet visible
        self.preemption_log: list[tuple] = []  # (time, replica, request, mode, recomputed tokens, swapped bytes)
        tiers = kv.prefix.tiers if kv.prefix is not None else None
        self.tiering = TierTraffic(tiers, self.host_link, index) if tiers is not None else None  # sim/kv/tiers.py
        self.recovery = make_recovery(self, settings)  # one preemption strategy (sim/preemption.py)
        self._preempt = self.recovery.preempt
        self.step_start = 0.0
        self.step_end: float | None = None  # end of the step (or fast-forwarded run) in progress, if any
        self._wake = None
        self._cut = None  # triggered by an arrival routed here during a run that it cuts (cut_by_arrivals)
        self.cut_by_arrivals = False  # a request routed here cuts a run in flight (a router that sees runs)
        self.progress = None  # the run in flight, where a router reads it (sim/run_progress.py), else None
        self._resume_at = None
        # the simulation's end (max_time): every step of a fast-forwarded run ends before it, since a run is
        # committed at its end and SimPy stops there; stepping commits each step that ended by then
        self.stop_time = math.inf
        # open loop, where the arrivals this replica will receive are known ahead: the feed (it alone receives
        # them) or its RoutedArrivals (round_robin, sim/simulation.py); a prompt run looks ahead in it
        self.arrivals = None
        self.takes_arrivals_until = -math.inf  # amid a prompt run: its end (it pulls each arrival by then)
        self._judged: dict[int, str] = {}  # request id -> reject_reason, judged before it arrived (judge_ahead)
        self.process = env.process(self.run())

    def _init_admission_signals(self, settings: ReplicaSettings, cost: CostModel) -> None:
        """Swapped-queue order, decode reserve and step cap (all off by default)."""
        state = self.state
        state.swapped_first = settings.swapped_queue == "vllm_v0"
        if settings.decode_reserve:
            state.reserve = DecodeReserve(settings.schedule_conservativeness, settings.clip_max_new_tokens)
        if settings.step_cap is not None:
            state.step_cap, state.step_time = settings.step_cap, cost.step_time

    @property
    def swap_capacity_blocks(self) -> int | None:
        """Host blocks that fit in the swap space (None: unbounded)."""
        return self.recovery.swap_capacity_blocks

    @property
    def swap_full_recomputes(self) -> int:
        """Victims recomputed because the swap space was full."""
        return self.recovery.swap_full_recomputes

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
        reason = self.role.reject_reason(req)  # the KV it holds here and the policy (P/D: and the other pool)
        if not reason and self.admission is not None:
            ahead = prefill_tokens_ahead((self.incoming, self.waiting, self.running))
            reason = self.admission.reject_reason(ahead, req.prompt_len)
        if not reason and self.settings.max_queued_requests is not None:
            reason = queue_full_reason(len(self.incoming) + len(self.waiting), self.settings.max_queued_requests)
        return reason

    def judge_ahead(self, req: Request) -> str:
        """reject_reason of a request not arrived yet, kept for its arrival. Only where the reason cannot
        change before then (a prompt run looks ahead where it is pure: sim/prompt_run.py)."""
        reason = self._judged[req.id] = self.reject_reason(req)
        return reason

    def enqueue(self, req: Request) -> None:
        """Called by the router at the request's arrival."""
        req.replica = self.index
        judged = self._judged.pop(req.id, None) if self._judged else None
        reason = self.reject_reason(req) if judged is None else judged
        if reason:
            req.status = Status.REJECTED
            req.reject_reason = reason
            return
        req.status = Status.WAITING
        self.incoming.append(req)
        if self._wake is not None and not self._wake.triggered:
            self._resume_at = req.arrival  # start at the exact arrival, not SimPy's rounded clock
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
        waiting = self.state.waiting
        while incoming and incoming[0].arrival <= now:
            req = incoming.popleft()
            waiting.append(req)
            self.by_id[req.id] = req

    def _wait_for_visible(self):
        """Sleep until a request becomes visible here (routed or landed a hair later than this clock),
        or until something wakes the replica."""
        later = self.next_visible()
        if later is None:
            yield from self._sleep()
        else:
            yield self.env.timeout(delay_to(self.env.now, later))

    def _idle_until(self, time: float):
        """Sleep until `time` (a plan's idle_until), or until a request becomes visible or something
        wakes the replica, whichever comes first; then plan again."""
        later = self.next_visible()
        if later is not None and later < time:
            time = later
        self._wake = self.env.event()
        self.step_end = time  # P/D: when this replica plans next at the latest
        yield self.env.timeout(delay_to(self.env.now, time)) | self._wake
        if not self._wake.triggered:
            self._resume_at = time
        self._wake = None
        self.step_end = None

    # -- the loop ------------------------------------------------------------------------
    def run(self):
        env = self.env
        state = self.state
        core = native_core.core
        # what of the runs' eligibility holds for the replica's whole life, decided once, after its wiring
        # (a P/D role, closed-loop clients) and before its first step
        leaps, leaps_prompts = replica_leaps(self), core.replica_leaps_prompts(self)
        cuttable = self.cut_by_arrivals or self.on_leave is not None  # closed loop: a reply sends requests here
        if self.tiering is not None:  # a step may restore (and must book its tier traffic): none is skipped
            leaps = leaps_prompts = False
        while True:
            start = env.now if self._resume_at is None else self._resume_at
            self._resume_at = None
            self._take_arrivals(start)
            if self.landed:
                self.role.take_landed(start)
            if not state.waiting and not state.running:
                if self.next_visible() is None:
                    self.on_idle()
                yield from self._wait_for_visible()
                continue
            state.now = start
            plan = self.policy.schedule(state)
            if not self._steps(plan):
                yield from self._not_stepping(plan, start)
                continue
            self.step_start = start
            self.recovery.swap_out_booked = 0.0
            shape, swap_bytes = self.begin(plan, start)
            _, duration = self._priced(plan, shape, swap_bytes, start)
            run = decode_run(self, start, duration, self._step_context) if leaps and may_leap(
                self, plan, shape, swap_bytes) else None
            prompt = core.prompt_run(self, plan, shape, start, duration, self._step_context) if run is None and \
                leaps_prompts and core.may_leap_prompt(self, plan, shape, swap_bytes) else None
            if prompt is not None:
                end = self.step_end = self.takes_arrivals_until = prompt.ends[-1]
                if not cuttable:
                    yield env.timeout(delay_to(env.now, end))
                else:  # a request routed here mid-run cuts the run short
                    self.progress = RunProgress.of_steps(prompt.ends, core.tokens_by_step(prompt, shape))
                    prompt = core.cut_prompt_run(prompt, (yield from self._cuttable(prompt.ends)))
                    end = prompt.ends[-1]
                step_apply.commit_prompt_run(self, prompt)
                self.takes_arrivals_until = -math.inf
            elif run is None:
                end = self.step_end = start + duration
                yield env.timeout(delay_to(env.now, end))
                self.commit(plan, end)
            else:
                ends, extra = run
                end = self.step_end = float(ends[-1])
                used = self.kv.used_blocks  # in the run's first step (a P/D reservation may add to it later)
                if self.role.placements_cut_runs:  # P/D decode: a placement may cut the run (settle_run)
                    self.progress = RunProgress.of_decodes(ends, state.running)
                    count = yield from self._stepped(ends)
                    ends, extra = ends[:count], extra[:count]
                    end = float(ends[-1])
                elif not cuttable:
                    yield env.timeout(delay_to(env.now, end))
                else:  # a request routed here mid-run cuts the run short
                    if self.cut_by_arrivals:
                        self.progress = RunProgress.of_decodes(ends, state.running)
                    count = yield from self._cuttable(ends)
                    ends, extra = ends[:count], extra[:count]
                    end = float(ends[-1])
                if len(ends) == 1:
                    self.commit(plan, end)
                else:
                    step_apply.commit_run(self, ends, extra, plan.hold_finished, used)
            self.progress = None
            self.step_end = None
            self.role.committed(plan, end)
            self._resume_at = end  # the exact sum, whatever SimPy's clock rounded to
            if self.settings.client_timeout is not None:  # clients that gave up by now leave at this boundary
                step_apply.expire(self, end)
            if self.on_leave is not None:  # closed loop: every request leaving at this instant leaves first
                yield env.timeout(0)

    def _steps(self, plan) -> bool:
        """Whether `plan` runs a forward pass (anything scheduled, padded or rejected, or a role whose
        evictions take a step of their own)."""
        return not plan.is_empty and bool(plan.scheduled or plan.padding or plan.rejected
                                          or self.role.runs_eviction_steps)

    def _not_stepping(self, plan, start: float):
        """A plan that runs no forward: wait for a time (a token bucket refills), for work (P/D: KV held for a
        hand-off; its release wakes us), or evict without a step (sim/roles.py evict_only)."""
        if plan.is_empty:
            if plan.idle_until is not None:
                yield from self._idle_until(plan.idle_until)
            elif not self.role.holds_kv():
                raise SchedulerStuck(self._stuck_message())
            else:
                yield from self._wait_for_visible()
        else:
            self.step_start = start
            self.recovery.swap_out_booked = 0.0
            yield from self.role.evict_only(plan, start)

    def _cuttable(self, ends):
        """Wait out a run whose steps end at `ends`, unless a request routed here arrives during it; then only
        the run's steps that start before that arrival run, exactly what stepping one by one would do.
        Returns how many of its steps ran (the first always does)."""
        env = self.env
        self._cut = env.event()
        done = env.timeout(delay_to(env.now, float(ends[-1])))
        yield done | self._cut
        count = len(ends)
        if self._cut.triggered:
            kept = cut_run(ends, self._cut.value)
            if kept < count:
                count = kept
                self.step_end = float(ends[count - 1])
                yield env.timeout(delay_to(env.now, self.step_end))
            elif not done.processed:  # (a Timeout counts as triggered from its creation)
                yield done
        self._cut = None
        return count

    def _stepped(self, ends):
        """Wait out a decode run one step end at a time, with the very timeouts stepping one by one would
        create (so events at the same instant fall in stepping's order), counting the steps that ended
        (`progress.passed`); a P/D placement may cut the run meanwhile (settle_run). Returns how many of its
        steps ran."""
        env, progress, pull = self.env, self.progress, self.pull
        while progress.passed < progress.kept:
            end = float(ends[progress.passed])
            yield env.timeout(delay_to(env.now, end))
            progress.passed += 1
            if progress.passed < progress.kept:
                pull(end)  # each step's start delivers the arrivals due, as `_take_arrivals` does stepping
        return progress.kept

    def settle_run(self) -> None:
        """Called by a P/D placement about to read or reserve this replica's room now, or a landing here,
        while a decode run of it is in flight: the run is cut to its step in progress, and that step holds the blocks its start
        would have given it (step_apply.grow_decodes, as its commit does), so the cache shows exactly what
        stepping one by one shows now. Completions come only at a run's last step: none yet."""
        progress = self.progress
        if progress is None or progress.kept == progress.passed:
            return
        progress.kept = progress.passed + 1
        self.step_end = float(progress.ends[progress.passed])
        step_apply.grow_decodes(self, progress.passed)

    def _priced(self, plan: StepPlan, shape: StepShape, swap_bytes: float, start: float) -> tuple[float, float]:
        """(the forward's seconds as the cost model prices them, noise included; the step's whole time:
        plus the plan's side work (an encoder, LoRA loads, priced by the policy) and the swap-ins it
        waits for). Checks the whole time against the clock, shows it to the admission signals and
        tells the role the step began. A pipelined replica charges the extras to its first stage."""
        seconds = self.cost.step_time(shape)
        if self.noise is not None:
            seconds *= self.noise()
        whole = seconds + plan.extra_seconds if plan.extra_seconds else seconds
        if self.spec is not None:  # the drafter's forward passes for this step's verify rows
            whole += self.spec.draft_seconds()
        if swap_bytes:
            whole += self.recovery.book_swap_ins(start, swap_bytes)
        if self.tiering is not None:  # restores from (and stores to) the lower KV tiers
            whole = self.tiering.step_time(start, whole, self.kv.block_bytes)
        if not start < start + whole < CLOCK_LIMIT:  # NaN, inf, <= 0 or beyond the clock (durations.py)
            self._check_step(start, whole, shape)
        if self.admission is not None and shape.prefill:
            self.admission.observe(sum(c for c, _ in shape.prefill), whole)
        self.role.began(plan, start)
        return seconds, whole

    def _check_step(self, start: float, duration: float, shape: StepShape) -> None:
        """DurationError unless the step is an empty one of 0 s (called only when the hot path's
        comparison fails)."""
        check_step("cost_model", start, duration, shape.is_empty, where=self._step_context(shape))

    def _step_context(self, shape: StepShape | None = None) -> str:
        """Where a bad step time came from, for its error message."""
        parts = [f"replica {self.index} ({self.role.name})"]
        if shape is not None:
            parts.append(f"a step of {shape.num_tokens} tokens")
        profile = self.cost.describe().get("profile")
        if profile:
            parts.append(f"profile {profile}")
        if self.noise is not None:
            parts.append("times sim.cost_noise")
        return "; " + ", ".join(parts)

    def _stuck_message(self) -> str:
        head = self.waiting[0] if self.waiting else None
        return (f"replica {self.index}: policy {self.policy.name} scheduled nothing with {len(self.waiting)} waiting "
                f"and {len(self.running)} running at t={self.env.now}; free KV blocks {self.kv.free_blocks}; "
                f"head of queue: {head}")
