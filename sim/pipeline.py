"""Pipeline parallelism: a replica of P stages keeps up to P micro-batches in flight.

The model's layers are split over P stages (GPUs or TP groups). A micro-batch passes the stages in
order; each stage runs one micro-batch at a time, first come first served. The cost model's
`step_time(shape)` is the time ONE stage takes for the batch (its layers and the activation send to
the next stage; with unequal stages, the slowest one's), and `pipeline_stages` is P. A batch that
enters stage 1 at S leaves stage s at E_s = max(E_{s-1}, when stage s finishes the batch before)
+ step_time, and its tokens come out at E_P: P x step_time after S on an idle pipeline, while a new
batch can enter every step_time.

Scheduling follows vLLM V1 with PP (vllm-project/vllm 00080ee1, vllm/v1/engine/core.py
`step_with_batch_queue`, and vllm/v1/core/sched/scheduler.py `schedule()`, 00024d31 in the stored
index): the engine keeps a batch queue of size P (`max_concurrent_batches`). While fewer than P
batches are in flight it schedules another at once (a batch enters stage 1 when that stage is
free); when the queue is full, or nothing more can be scheduled, it blocks until the oldest batch's
output returns, applies it, and schedules again. Arrivals while the engine blocks wait for the
output it waits for.

A request in flight (the policy does not see it: it moves from the running list the policy reads to
`state.in_flight`) keeps its KV blocks and cannot be a preemption victim, with one exception, chunk
pipelining (ReplicaSettings.pp_chunk_pipelining, the YAML's cluster.pp_chunk_pipelining, default on):
a request whose batches in flight carry only prompt chunks that leave part of its prompt uncomputed stays visible,
and the policy sees it as if those chunks were done, so its next chunk goes into the next
micro-batch. vLLM V1 advances `num_computed_tokens` when it schedules (`_update_after_schedule`:
"allowing us to schedule the prefill request again immediately in the next scheduling step"; 00024d31
and b4622cf) and skips a running request only when nothing is left to schedule ("PP>1 and we have
already scheduled all prompt tokens but they are not finished yet"); SGLang's PP loop keeps the
chunked request scheduler-wide, so its next chunk joins the next micro-batch (scheduler_pp_mixin.py,
00ff98d3; docs "Pipeline Parallelism for Long Context": "different chunks of the same request can be
processed simultaneously by different nodes"). Off, every request in flight waits for its output, as
in early vLLM V1 (Feb-Mar 2025: `scheduled_req_ids`, PR #13064; chunk pipelining was PR #13637,
closed, then #15307). A decode is never scheduled before its token is out (vLLM without async
scheduling: nothing left to schedule; with async scheduling and PP, v0.16+, the V2 runner makes it
eligible P steps later, `next_decode_eligible_step`, the same cadence). A visible request with chunks
in flight can be a victim, as in vLLM; its chunks in flight are then discarded (their entries carry
the old epoch) and their tokens recomputed.

How chunk pipelining is kept exact: `num_computed_tokens` stays what the returned batches computed
(commit adds a batch's tokens when its output returns, as without PP); `ahead` counts, per request
and epoch, the tokens scheduled in batches still in flight. While the policy plans and the plan's
start is applied (one instant), a visible request's counter is raised by its `ahead` and put back
after, so the policy's budgets, KV blocks, chunk sizes and the batch's shape all see the prompt's
next chunk.

Recorded steps: one row per micro-batch, from when it enters the LAST stage to when its tokens
come out (its end). A replica's rows do not overlap, so busy time, utilisation, MFU and the
duration-weighted KV usage mean what they mean without PP; token times, TTFT and ITL are the
output times. A request's `first_scheduled` is the time its batch was scheduled.

Runs: where every running request is in a pure decode batch in flight and nothing waits, the batches'
outputs and relaunches are advanced without planning each (sim/pipeline_run.py), bit for bit as stepped.

Not modelled: unequal stage times per batch (every stage takes the slowest stage's time);
prompt runs (a micro-batch with a prompt chunk is stepped); vLLM's async scheduling with the V1 runner under PP,
which may put a decode in consecutive micro-batches and stall stage 1 on the broadcast token.
"""
from __future__ import annotations

from collections import Counter, deque

from cbsim.core.errors import ConfigError

from cbsim.sim import pipeline_run, step_apply
from cbsim.sim.clock import delay_to
from cbsim.sim.micro_batch import MicroBatch
from cbsim.sim.replica import Replica, SchedulerStuck
from cbsim.sim.request import Status


class PipelinedReplica(Replica):
    """A replica whose loop keeps up to `stages` micro-batches in flight (see the module docstring)."""

    def __init__(self, *args, stages: int, chunk_pipelining: bool | None = None, **kwargs):
        self.stages = stages
        self.stage_free = [0.0] * stages  # when each stage finishes the last batch it was given
        self.in_flight: deque[MicroBatch] = deque()  # oldest first: outputs return in this order
        # request id -> its batches in flight (one, unless a policy preempts a request in flight and
        # readmits it before that batch is back: its stale entry is ignored at commit, by epoch)
        self.busy: Counter[int] = Counter()
        # request id -> (epoch, tokens scheduled for it in batches still in flight at that epoch)
        self.ahead: dict[int, tuple[int, int]] = {}
        self.pipelined: frozenset[int] = frozenset()  # requests in flight raised by their chunks in flight
        self.shown: frozenset[int] = frozenset()  # requests in flight the policy sees (pipelined, or stale)
        self.evicted = 0  # preemptions of plans that ran no batch, not yet counted in a step row
        super().__init__(*args, **kwargs)
        if chunk_pipelining is None:
            chunk_pipelining = self.settings.pp_chunk_pipelining
        self.chunk_pipelining = chunk_pipelining

    @property
    def is_idle(self) -> bool:
        return not self.in_flight and super().is_idle

    def run(self):
        env, state = self.env, self.state
        leaps = pipeline_run.replica_leaps(self)  # decided once, after the replica's wiring
        while True:
            now = env.now if self._resume_at is None else self._resume_at
            self._resume_at = None
            if self.in_flight and self.in_flight[0].end <= now:
                self._drain(now)
                if self.on_leave is not None:  # closed loop: every request leaving at this instant leaves first
                    self._resume_at = now
                    yield env.timeout(0)
                    continue
            self._take_arrivals(now)
            if self.landed:
                self.role.take_landed(now)
            if not state.waiting and not state.running and not self.in_flight:
                if self.next_visible() is None:
                    self.on_idle()
                yield from self._wait_for_visible()
                continue
            if len(self.in_flight) < self.stages:
                plan, applied = self._plan(now)
                if applied:
                    self._resume_at = now  # the queue is not full (or nothing ran): schedule again at once
                    continue
                # left: an empty plan, or only evictions while batches are in flight. Then the room is held
                # by requests the policy cannot pick (vLLM's victim may be in flight): wait for the oldest
                # output instead of evicting a visible request for it, which can thrash (two requests
                # preempting themselves in turn, each while the other is in flight). A plan that evicts
                # and also runs a batch is applied (discarding it would undo the policy's plan-time side
                # effects: token-bucket debits, LoRA residency): splitfuse, which admits in a step that
                # preempts, can still thrash that way under recompute pressure (tests/sim/test_pipeline_chunks.py,
                # the xfail case)
                idle_until = plan.idle_until  # the policy waits for a time (a token bucket refills)
                if plan.is_empty and idle_until is not None and (not self.in_flight
                                                                 or idle_until < self.in_flight[0].end):
                    yield from self._idle_until(idle_until)
                    continue
                if not self.in_flight:
                    if not self.role.holds_kv():
                        raise SchedulerStuck(self._stuck_message())
                    yield from self._wait_for_visible()  # P/D: KV held for a hand-off; its release wakes us
                    continue
            # the queue is full, or nothing more can be scheduled: block until the oldest output returns
            run = pipeline_run.pipeline_run(self) if leaps and pipeline_run.steady(self) else None
            if run is not None:  # steady decode batches: advance through their outputs without planning each
                end = self.step_end = run.drained[-1]
                yield env.timeout(delay_to(env.now, end))
                self.step_end = None
                pipeline_run.commit_pipeline_run(self, run)
                self._resume_at = end
                continue
            end = self.step_end = self.in_flight[0].end
            yield env.timeout(delay_to(env.now, end))
            self.step_end = None
            self._resume_at = end

    def _plan(self, now: float):
        """The policy's plan at `now`, applied at once when it runs a batch (launched) or only evicts
        with nothing in flight; returns (plan, applied). Chunk pipelining's look-ahead holds meanwhile."""
        raised = self._look_ahead()
        try:
            plan = self._schedule(now)
            if not plan.is_empty and (plan.scheduled or plan.padding):
                self.step_start = now
                self.recovery.swap_out_booked = 0.0
                self._launch(plan, now)
                return plan, True
            if not plan.is_empty and not (plan.preempted and self.in_flight):
                self.step_start = now  # no forward pass: nothing enters the pipeline
                self.recovery.swap_out_booked = 0.0
                self._evict(plan)
                return plan, True
            return plan, False
        finally:
            self._settle(raised)

    def _look_ahead(self) -> list[tuple]:
        """Raise the counter of every request in flight whose batches leave part of its prompt to
        compute by the tokens they carry (chunk pipelining), and show it to the policy; show too a
        request preempted in flight and readmitted, while only batches of its old epoch fly. Returns
        (request, epoch, tokens) for each raised, for `_settle`."""
        if not self.chunk_pipelining or not self.ahead:
            return []
        raised, shown, busy, by_id = [], [], self.busy, self.by_id
        for rid, (epoch, tokens) in self.ahead.items():
            req = by_id.get(rid)
            if req is None or req.status != Status.RUNNING or rid not in busy:
                continue
            if epoch != req.epoch:
                shown.append(rid)  # its batches in flight are stale: they complete nothing
            elif req.num_computed_tokens + tokens < req.prompt_len + req.num_output_tokens:
                req.num_computed_tokens += tokens
                raised.append((req, epoch, tokens))
                shown.append(rid)
        self.pipelined = frozenset(req.id for req, _, _ in raised)
        self.shown = frozenset(shown)
        return raised

    def _settle(self, raised: list[tuple]) -> None:
        """Put back what `_look_ahead` added: a request preempted meanwhile keeps no look-ahead (its
        chunks in flight are discarded: recompute reset its counter, a swap kept the raised one)."""
        for req, epoch, tokens in raised:
            if req.epoch == epoch or req.status == Status.SWAPPED:
                req.num_computed_tokens -= tokens
        self.pipelined = self.shown = frozenset()

    def _schedule(self, now: float):
        """The policy's plan at `now` over the requests not in flight (and those `_look_ahead` shows)."""
        state = self.state
        state.now = now
        busy = self.busy
        if not busy:
            return self.policy.schedule(state)
        shown = self.shown
        everyone = state.running
        state.running = [r for r in everyone if r.id not in busy or r.id in shown]
        state.in_flight = tuple(r for r in everyone if r.id in busy and r.id not in shown)
        try:
            return self.policy.schedule(state)
        finally:
            state.running, state.in_flight = everyone, ()

    def _evict(self, plan) -> None:
        """A plan that only preempts (or gives up on waiting requests): applied at once, no batch sent;
        its preemptions count in the row of the next batch (planned at this instant, unless nothing
        can run now); swap-outs go on the host link without holding the replica (a one-stage P/D
        replica waits for them: roles.evict_only). (A request in flight the policy does not see cannot be
        a victim, so a visible one can find no room but its own, where a one-stage replica would
        preempt the latest admitted request instead.)"""
        self.evicted += len(plan.preempted)
        by_id = self.by_id
        for rid in plan.preempted:
            self._preempt(by_id[rid])
        self.state.running = [r for r in self.state.running if r.status == Status.RUNNING]
        for rid in plan.rejected:
            step_apply.reject_waiting(self, by_id[rid])

    def _launch(self, plan, now: float) -> None:
        """Apply the plan's start half and send the batch down the pipeline."""
        shape, swap_bytes = self.begin(plan, now)
        if self.evicted:
            self.recorder.set_preemptions(self.step, len(plan.preempted) + self.evicted)
            self.evicted = 0
        # one stage's seconds; the first stage also pays the side work and waits for the swap-ins
        seconds, first = self._priced(plan, shape, swap_bytes, now)
        free = self.stage_free
        last_start = max(now, free[0])  # enters the first stage
        t = free[0] = last_start + first
        for s in range(1, self.stages):
            last_start = max(t, free[s])
            t = last_start + seconds
            free[s] = t
        self.recorder.set_start(self.step, last_start)  # the row: its pass through the last stage
        members = (*plan.scheduled, *plan.padding)
        self.busy.update(members)  # (Counter.update adds one per member)
        self._track(plan)
        self.in_flight.append(MicroBatch(plan, self.step, t, members))

    def _track(self, plan) -> None:
        """Count the batch's tokens in flight per request and epoch (`ahead`)."""
        ahead, epochs = self.ahead, plan.epochs
        for rid, n in plan.scheduled.items():
            epoch = epochs[rid]
            entry = ahead.get(rid)
            ahead[rid] = (epoch, n + entry[1]) if entry is not None and entry[0] == epoch else (epoch, n)

    def _untrack(self, plan) -> None:
        """A batch is back: its tokens are no longer ahead (an entry of another epoch stays)."""
        ahead, epochs = self.ahead, plan.epochs
        for rid, n in plan.scheduled.items():
            entry = ahead.get(rid)
            if entry is None or entry[0] != epochs[rid]:
                continue
            if entry[1] > n:
                ahead[rid] = (entry[0], entry[1] - n)
            else:
                del ahead[rid]

    def _drain(self, now: float) -> None:
        """Apply, oldest first, every batch whose output is out by `now`, each at its own end."""
        in_flight, busy = self.in_flight, self.busy
        while in_flight and in_flight[0].end <= now:
            batch = in_flight.popleft()
            busy.subtract(batch.members)
            for rid in batch.members:
                if busy[rid] <= 0:
                    del busy[rid]
            self._untrack(batch.plan)
            self.step = batch.step
            self.commit(batch.plan, batch.end)
            self.role.committed(batch.plan, batch.end)
            if self.settings.client_timeout is not None:
                self._expire(batch.end)

    def _expire(self, now: float) -> None:
        """Client timeouts at a batch's end; a request in flight leaves when its batch is back."""
        state = self.state
        if not self.busy:
            step_apply.expire(self, now)
            return
        everyone = state.running
        state.running = [r for r in everyone if r.id not in self.busy]
        step_apply.expire(self, now)
        state.running = [r for r in everyone if r.status == Status.RUNNING]


def replica_class(stages: int) -> type:
    """The loop for a replica of `stages` pipeline stages: the plain one for a single stage."""
    return Replica if stages == 1 else PipelinedReplica


def pipeline_stages(cost) -> int:
    """P, from the cost model (`pipeline_stages`, default 1: no pipeline)."""
    stages = getattr(cost, "pipeline_stages", 1)
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ConfigError("cost_model.pp", "an integer >= 1 (pipeline stages)", stages)
    return stages


def make_replica(env, index: int, policy, cost, kv, recorder, settings, horizon, **kwargs) -> Replica:
    """A replica for `cost`: pipelined when the cost model prices one of P > 1 stages; a data-parallel
    attention rank stepping with its `group` when it has one (sim/dp_lockstep.py)."""
    group = kwargs.pop("group", None)
    if group is not None:
        from cbsim.sim.dp_lockstep import LockstepReplica  # (it imports sim/replica.py, as this module does)
        return LockstepReplica(env, index, policy, cost, kv, recorder, settings, horizon, group=group, **kwargs)
    stages = pipeline_stages(cost)
    kind = replica_class(stages)
    if kind is Replica:
        return Replica(env, index, policy, cost, kv, recorder, settings, horizon, **kwargs)
    return kind(env, index, policy, cost, kv, recorder, settings, horizon, stages=stages, **kwargs)
