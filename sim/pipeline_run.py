"""Decode runs of a pipelined replica (sim/pipeline.py): many micro-batches advanced without planning each.

Steady state: every running request is in one of the k <= P micro-batches in flight, each a pure decode
batch (one token a row, nothing else), nothing waits, nothing else is visible. Stepping then does the
same thing at every output: the oldest batch X returns at its end T, is committed (a token a row), the
policy plans exactly X's rows again (the only requests it sees: the others are in flight), X goes back
into the pipeline at T, and the loop blocks until the next oldest output. So the batches cycle in a
fixed order, batch X's j-th relaunch decodes its rows at contexts c + j (one pricing call of the context
sum, cost.decode_pricer), and the stages' free times follow the recurrence stepping applies (`_launch`):
E_1 = max(T, E_1) + t, E_s = max(E_{s-1}, E_s) + t, the row running from the last stage's start to E_P.
`pipeline_run` advances that recurrence in a plain loop of floats, one iteration per micro-batch, no SimPy
event and no plan, until the first output that is not steady: one at or after the next outside event
(an arrival routed or landed here, a client's deadline, the simulation's end), one whose commit
finishes a request (it leaves; the next plan differs), or one whose relaunch needs more KV blocks than
are free (the policy would preempt). Stepping takes over from there.

`commit_pipeline_run` applies the run with the result of stepping through it: the returned batches'
rows get their ends, the relaunched ones their rows (kept in flight, their ends unknown, for the last k),
every request its tokens and token runs (Recorder.token at each batch's first return, where a run may
continue from before; after that, with one batch every token extends the run, and with k >= 2 batches
every return closes the run of the batch's previous one, appended in bulk: Recorder.closed_runs), its KV
blocks, and the in-flight queue batches carrying their original (pure decode) plans, which commit as the
re-planned ones would (commit reads a decode plan's rows and epochs, the same in every relaunch; its
contexts and blocks, read only by `begin`, are stale, so a run reads the contexts from the requests).

Like sim/fast_forward.py's decode runs, a run relies on the policy's contract that a pure decode plan of
every request it sees, with nothing waiting, repeats (and that with nothing to see it plans nothing: the
empty plans stepping makes while fewer than P batches fly are skipped).
Eligibility for the replica's life (`replica_leaps`) mirrors sim/fast_forward.py's; runs are off under P/D
roles, prefix caching, KV tiers, speculative decoding, a decaying decode reserve, a sliding window,
noise, recorded shapes and routers or clients that read or feed the replica amid a run.
Invariant: the result is exactly (bit for bit) what stepping gives; tests/sim/test_pipeline_runs.py holds it.
"""
from __future__ import annotations

import math
from collections import deque

import numpy as np

from cbsim.sim import step_apply
from cbsim.sim.durations import CLOCK_LIMIT
from cbsim.sim.fast_forward import SCALAR_RUN, next_deadline, replica_leaps as plain_leaps
from cbsim.sim.micro_batch import MicroBatch
from cbsim.sim.request import Status
from cbsim.sim.roles import Colocated

MIN_EVENTS = 2  # a run of one micro-batch is stepped


def replica_leaps(replica) -> bool:
    """What of a pipeline run's eligibility holds for the replica's whole life (decided once, before its
    first step, after its wiring)."""
    return (plain_leaps(replica) and type(replica.role) is Colocated and replica.tiering is None
            and replica.kv.prefix is None and replica.spec is None and replica.state.reserve is None
            and replica.shapes is None and not replica.cut_by_arrivals and replica.on_leave is None
            and not replica.settings.runs_end_before_horizon)


def _pure_decode(plan) -> bool:
    """A plan of leading one-token decodes only, with nothing beside them."""
    return (len(plan.decode_requests) == len(plan.scheduled) and not plan.padding and not plan.admitted
            and not plan.preempted and not plan.rejected and not plan.extra_seconds and not plan.encoder_tokens)


def steady(replica) -> bool:
    """Every running request is a current row of exactly one pure decode batch in flight, and nothing waits."""
    state = replica.state
    if state.waiting or replica.landed or replica.evicted or not replica.in_flight:
        return False
    rows = 0
    for batch in replica.in_flight:
        plan = batch.plan
        if not _pure_decode(plan):
            return False
        epochs = plan.epochs
        for req in plan.decode_requests:
            if req.epoch != epochs[req.id] or req.status != Status.RUNNING or replica.busy[req.id] != 1:
                return False
        rows += len(plan.scheduled)
    return rows == len(state.running)


class PipelineRun:
    """What a run did: `drained[i]`, when output i returned; `batch[i]`, which of the batches in flight at the
    run's start it was (they cycle); `starts`, `used`, `sums`: the row of its relaunch (start in the last
    stage, KV blocks used, decode context sum); `ends`: when each relaunch's output returns; `commits[b]`:
    how many times batch b returned; `stage_free`: the stages' free times after it."""

    __slots__ = ("batches", "drained", "batch", "starts", "used", "sums", "ends", "commits", "stage_free")

    def __init__(self, batches, k):
        self.batches = batches
        self.drained, self.batch, self.starts, self.used, self.sums, self.ends = [], [], [], [], [], []
        self.commits = [0] * k
        self.stage_free = None


def pipeline_run(replica) -> PipelineRun | None:
    """The run from the replica's state as it blocks for its oldest output (`steady` holds), or None to step."""
    batches = list(replica.in_flight)
    k = len(batches)
    kv, cost = replica.kv, replica.cost
    block_size = kv.block_size
    limit = min(replica.horizon(), next_deadline(replica), replica.stop_time)
    visible = replica.next_visible()
    if visible is not None:
        limit = min(limit, visible)
    if not batches[0].end < limit or (k > 1 and not batches[1].end < limit):
        return None  # fewer than MIN_EVENTS outputs before the next outside event
    # returns before one of a batch's rows finishes (its commit frees it and the next plan differs)
    lasts = [min(req.output_len - req.num_output_tokens for req in batch.plan.decode_requests) - 1
             for batch in batches]
    if lasts[0] < 1 or (k > 1 and lasts[1] < 1):
        return None
    events = replica.settings.max_fast_forward
    stages = len(replica.stage_free)
    counts, sums, pricers, allowed, grows = [], [], [], [], []
    for batch, last in zip(batches, lasts):
        plan = batch.plan
        contexts = [req.num_computed_tokens + 1 for req in plan.decode_requests]  # (the plan's may be a run old)
        price, cycles = _relaunch_pricer(cost, contexts, min(last, events // k + 2), limit - batch.end, stages)
        counts.append(len(contexts))
        sums.append(sum(contexts))
        pricers.append(price)
        allowed.append(cycles)
        grows.append(_crossings(plan, block_size, cycles))
    run = PipelineRun(batches, k)
    ends = deque(batch.end for batch in batches)
    which = deque(range(k))
    free = list(replica.stage_free)
    kv_free = kv.free_blocks
    used = kv.num_blocks - kv_free
    commits = run.commits
    while len(run.drained) < events:
        now, b = ends[0], which[0]
        if not now < limit:
            break
        j = commits[b] + 1
        if j > allowed[b] or grows[b][j] > kv_free:
            break
        context_sum = sums[b] + counts[b]
        seconds = pricers[b](context_sum)
        if not now < now + seconds < CLOCK_LIMIT:  # stepping raises the error
            break
        commits[b], sums[b] = j, context_sum
        kv_free -= grows[b][j]
        used += grows[b][j]
        ends.popleft()
        which.popleft()
        start = max(now, free[0])  # as PipelinedReplica._launch
        t = free[0] = start + seconds
        for s in range(1, stages):
            start = max(t, free[s])
            t = free[s] = start + seconds
        ends.append(t)
        which.append(b)
        run.drained.append(now)
        run.batch.append(b)
        run.starts.append(start)
        run.used.append(used)
        run.sums.append(context_sum)
        run.ends.append(t)
    if len(run.drained) < MIN_EVENTS:
        return None
    run.stage_free = free
    return run


def _relaunch_pricer(cost, contexts: list[int], cycles: int, span: float, stages: int):
    """(context sum -> one stage's seconds of the batch's relaunch at that sum, how many relaunches are worth
    pricing): the relaunches j = 1.. (contexts + j) that can return within `span` seconds of its first return
    (each takes `stages` stage times at least, and cost models are monotone in context, as sim/fast_forward.py
    has it), at most `cycles`. Priced as the run reaches them (cost.decode_pricer) for a few, all at once in
    one vectorised call (cost.decode_run_times) for more."""
    n, total = len(contexts), sum(contexts)
    price = cost.decode_pricer(contexts)
    if cycles <= SCALAR_RUN:
        return price, cycles
    first = price(total + n)
    if span != math.inf and first > 0:
        cycles = min(cycles, int(span / (stages * first)) + 2)
        if cycles <= SCALAR_RUN:
            return price, cycles
    seconds = cost.decode_run_times(np.array(contexts, dtype=np.int64) + 1, cycles).tolist()
    return (lambda context_sum: seconds[(context_sum - total) // n - 1]), cycles


def _crossings(plan, block_size: int, cycles: int) -> list[int]:
    """[j]: how many of the plan's rows need a new block at its j-th relaunch (contexts + j), j <= cycles."""
    grows = [0] * (cycles + 1)
    for req in plan.decode_requests:
        j = req.num_blocks * block_size - req.num_computed_tokens  # the first relaunch outgrowing its blocks
        while j <= cycles:
            grows[j] += 1
            j += block_size
    return grows


def commit_pipeline_run(replica, run: PipelineRun) -> None:
    """Apply `run` to the replica as stepping through its outputs would have (see the module docstring)."""
    batches, m, k = run.batches, len(run.drained), len(run.batches)
    recorder = replica.recorder
    first = recorder.num_steps  # the row of the first relaunch
    drained_rows = [batch.step for batch in batches[:min(k, m)]] + list(range(first, first + m - k))
    for i in range(min(k, m)):
        recorder.set_end(batches[i].step, run.drained[i])
    ends = [run.drained[i + k] if i + k < m else math.nan for i in range(m)]
    counts = [len(batches[b].plan.scheduled) for b in run.batch]
    recorder.add_steps(replica=replica.index, start=np.array(run.starts), end=np.array(ends), prefill_tokens=0,
                       decode_tokens=counts, padding_tokens=0, num_seqs=counts, kv_blocks_used=run.used,
                       preemptions=0, swap_bytes=0.0, decode_context_tokens=run.sums)
    _tokens(replica, run, drained_rows)
    for batch in batches:  # the blocks of each row's last relaunch's context
        step_apply.grow_decodes(replica, 0, batch.plan.decode_requests)
    replica.kv.evicted_in_step = False
    in_flight = deque(batches[m:])  # (only where the run returned fewer outputs than batches flew)
    for i in range(max(0, m - k), m):
        batch = batches[run.batch[i]]
        in_flight.append(MicroBatch(batch.plan, first + i, run.ends[i], batch.members))
    replica.in_flight = in_flight
    replica.stage_free = run.stage_free
    replica.step = first + m - 1
    replica.prev_step = drained_rows[-1]
    replica.step_start = run.drained[-1]
    replica.recovery.swap_out_booked = 0.0


def _tokens(replica, run: PipelineRun, drained_rows: list[int]) -> None:
    """Every request's tokens and token runs, as each output's commit (step_apply.commit) records them: at a
    batch's first return a run from before may go on (Recorder.token); after that, with one batch every
    return extends the run, and with k >= 2 every return closes the run of the batch's previous one."""
    batches, m, k = run.batches, len(run.drained), len(run.batches)
    recorder = replica.recorder
    previous = replica.prev_step
    for i in range(min(m, k)):
        row = drained_rows[i]
        for req in batches[i].plan.decode_requests:
            recorder.token(req, row, previous)
        previous = row
    if m > k and k == 1:
        for req in batches[0].plan.decode_requests:
            req.run_tokens += m - 1
            req.last_token_step = drained_rows[-1]
    elif m > k:
        _closed_runs(recorder, run, drained_rows)
        for b, batch in enumerate(batches):
            if run.commits[b] > 1:
                last = _last_row(run, drained_rows, b)
                for req in batch.plan.decode_requests:
                    req.run_start_step = req.last_token_step = last
                    req.run_tokens = 1
    for batch, commits in zip(batches, run.commits):
        for req in batch.plan.decode_requests:
            req.num_computed_tokens += commits
            req.num_output_tokens += commits


def _closed_runs(recorder, run: PipelineRun, drained_rows: list[int]) -> None:
    """The runs closed by returns k.. of a run of k >= 2 batches, in order: at a batch's second return, each
    row's run as its first return left it; at a later one, the one-token run of its previous return."""
    batches, m, k = run.batches, len(run.drained), len(run.batches)
    second = [batches[b].plan.decode_requests for b in run.batch[k:min(m, 2 * k)]]
    ids, first, last, tokens = (np.array([getattr(req, name) for reqs in second for req in reqs], np.int64)
                                for name in ("id", "run_start_step", "last_token_step", "run_tokens"))
    if m > 2 * k:
        later = run.batch[2 * k:]
        members = [np.fromiter((r.id for r in b.plan.decode_requests), np.int64) for b in batches]
        rows = np.repeat(drained_rows[k:m - k], [len(members[b]) for b in later])
        ids = np.concatenate([ids, *(members[b] for b in later)])
        first = np.concatenate([first, rows])
        last = np.concatenate([last, rows])
        tokens = np.concatenate([tokens, np.ones(len(rows), np.int64)])
    recorder.closed_runs(ids, first, last, tokens)


def _last_row(run: PipelineRun, drained_rows: list[int], b: int) -> int:
    """The row of batch b's last return in the run."""
    for i in range(len(run.drained) - 1, -1, -1):
        if run.batch[i] == b:
            return drained_rows[i]
    return -1
