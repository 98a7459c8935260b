"""Applying a StepPlan to a replica, in the two halves of one step (Replica binds these as methods).

`begin` (at the step's start): preemptions, policy rejections, admissions, KV blocks; it records
the step's row and returns the shape the cost model prices. `commit` (at its end): progress,
sampled tokens, first-token and completion times, the release of finished requests. `commit_run`
commits a fast-forwarded run of identical decode steps (sim/fast_forward.py) at once, with the
same result as committing its steps one by one.

Invariants: a plan entry whose request changed epoch since planning (preempted in between) is
ignored; a request's KV blocks never shrink while it runs, except with a sliding window
(kv.window): then `begin` sets every scheduled request's units to the plan's, in plan order, so
blocks that left the window are freed (sim/kv/cache.py KVCache.resize); every finished request
leaves the running set, its KV freed, at the end of the step that produced its last token (or,
with hold_finished, when the whole batch is done).
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from itertools import islice

import numpy as np

from cbsim.sim.request import Request, Status
from cbsim.sim.shape import StepShape


# -- begin: what the step holds while it runs ---------------------------------------------
def begin(replica, plan, now: float) -> tuple[StepShape, float]:
    """Apply preemptions, admissions and KV blocks; return the step's shape and swapped bytes."""
    swap_bytes = 0.0
    by_id = replica.by_id
    for rid in plan.preempted:
        swap_bytes += replica._preempt(by_id[rid])
    state = replica.state
    if plan.preempted:
        state.running = [r for r in state.running if r.status == Status.RUNNING]
    for rid in plan.rejected:
        reject_waiting(replica, by_id[rid])
    for rid in plan.admitted:
        swap_bytes += admit(replica, by_id[rid], now)
    blocks, kv = plan.blocks, replica.kv
    kv.evicted_in_step = False  # prefix caching: set by grow if it evicts cached blocks
    if kv.free_blocks < 0:  # admissions restored prefix units from a lower tier (sim/kv/tiers.py)
        kv.settle()
    if kv.window is not None:  # grow or shrink to the plan's units (the loop below then grows nothing)
        resize = kv.resize
        for rid in plan.scheduled:
            resize(by_id[rid], blocks[rid])
    grow = kv.grow
    # the plan's leading decodes come checked by the builder (StepPlan.decode_contexts): grow and count them
    lead = plan.decode_contexts
    for req, target in plan.decode_grows:
        grow(req, target)
    prefill, decode, verify = [], list(lead), []
    sampled = len(lead)
    add_decode, add_prefill = decode.append, prefill.append
    entries = plan.scheduled.items()
    for rid, n in (islice(entries, len(lead), None) if lead else entries):
        req = by_id[rid]
        target = blocks[rid]
        if target > req.num_blocks:
            grow(req, target)
        computed = req.num_computed_tokens
        outputs = req.num_output_tokens
        left = req.prompt_len + outputs - computed  # tokens not yet in the KV cache
        if left == 1 and outputs and n == 1:
            add_decode(computed + 1)
        elif n > left:  # a decode verifying n - 1 draft tokens (speculative decoding)
            verify.append((n, computed))
        else:
            add_prefill((n, computed))
        if n >= left:
            sampled += 1
    if kv.prefix is not None:  # cache the full blocks this step computes (prompt, and output: sim/kv/prefix.py)
        for rid, n in plan.scheduled.items():
            kv.publish(by_id[rid], by_id[rid].num_computed_tokens + n)
    num_padding = len(plan.padding)
    num_decode = len(decode)
    if num_padding:
        decode.extend(by_id[rid].num_computed_tokens for rid in plan.padding)
    if replica.spec is not None:  # the verify rows: c = 1 + k query tokens over h, priced as a chunk
        replica.spec.rows = [(n - 1, h) for n, h in verify]
    shape = StepShape(tuple(prefill) + tuple(verify), tuple(decode), num_padding, sampled, swap_bytes,
                      plan.encoder_tokens, plan.extra_seconds)
    if state.reserve is not None:
        state.reserve.after_step(bool(plan.preempted), num_decode > 0, state.running)
    history, pairs = _prefill_reads(prefill) if prefill else (0, 0)  # what attention read (step_efficiency.py)
    replica.step = replica.recorder.add_step(
        replica.index, now, math.nan, sum(c for c, _ in prefill), num_decode + sum(n for n, _ in verify), num_padding,
        len(prefill) + len(decode) + len(verify), kv.num_blocks - kv.free_blocks, len(plan.preempted), swap_bytes,
        sum(decode) + sum(n + h for n, h in verify), history, pairs)
    if replica.shapes is not None:
        replica.shapes.append(shape)
    return shape, swap_bytes


def admit(replica, req: Request, now: float) -> float:
    """A waiting request joins the running set; returns the bytes it swaps back in."""
    waiting = replica.state.waiting
    if waiting and waiting[0] is req:
        waiting.popleft()
    else:
        waiting.remove(req)
    req.status = Status.RUNNING
    req.admit_seq = replica.admissions
    replica.admissions += 1
    replica.state.running.append(req)
    if req.first_scheduled_step < 0:
        req.first_scheduled = now
        req.first_scheduled_step = replica.recorder.num_steps
    kv = replica.kv
    if req.num_swapped_blocks:
        moved = kv.swap_in_bytes(req)
        kv.drop_host_copy(req)
        return moved
    if kv.prefix is not None:
        kv.acquire_prefix(req)  # a prefix-cache hit: the counter jumps over cached blocks
    return 0.0


def reject_waiting(replica, req: Request) -> None:
    """A waiting request the plan gives up on (plan.rejected); it holds no KV."""
    replica.state.waiting.remove(req)
    del replica.by_id[req.id]
    req.status = Status.REJECTED
    req.reject_reason = (f"rejected while waiting by policy {replica.policy.name}: it could no longer meet "
                         "its deadline")
    if replica.on_leave is not None:
        replica.on_leave(req, replica.step_start)


def _prefill_reads(prefill: list) -> tuple[int, int]:
    """(sum of h, sum of causal query-key pairs c * h + c * (c + 1) / 2) over prefill rows (c, h)."""
    history = pairs = 0
    for c, h in prefill:
        history += h
        pairs += c * h + c * (c + 1) // 2
    return history, pairs


# -- commit: what the step produced --------------------------------------------------------
def commit(replica, plan, end: float) -> None:
    """Apply the step's progress at its end; stale entries (older epoch) are ignored."""
    step = replica.step
    recorder = replica.recorder
    recorder.set_end(step, end)
    finished = False
    by_id, epochs, previous, running = replica.by_id, plan.epochs, replica.prev_step, Status.RUNNING
    close_run = recorder.close_run
    lead = plan.decode_requests  # the plan's leading one-token decodes: each still current samples a token
    for req in lead:
        if req.epoch != epochs[req.id] or req.status != running:
            continue
        req.num_computed_tokens += 1
        outputs = req.num_output_tokens + 1
        req.num_output_tokens = outputs
        if req.run_tokens and req.last_token_step == previous:  # Recorder.token, inlined
            req.run_tokens += 1
        else:
            close_run(req)
            req.run_start_step = step
            req.run_tokens = 1
        req.last_token_step = step
        if outputs >= req.output_len:
            finished = True
    entries = plan.scheduled.items()
    for rid, n in (islice(entries, len(lead), None) if lead else entries):
        req = by_id[rid]
        if req.epoch != epochs[rid] or req.status != running:
            continue
        computed = req.num_computed_tokens + n
        req.num_computed_tokens = computed
        outputs = req.num_output_tokens
        if computed >= req.prompt_len + outputs:
            outputs += 1 if computed == req.prompt_len + outputs else verified(replica, req, n - 1)
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
    replica.prev_step = step
    if finished:
        release_finished(replica, plan.hold_finished, end)


def verified(replica, req: Request, drafts: int) -> int:
    """Tokens a verify row of `drafts` draft tokens emits: 1 + the accepted ones (sim/speculative.py),
    at most what `req` still has to produce; its progress steps back over the rejected drafts and their
    lookahead blocks are freed."""
    accepted = replica.spec.accept(drafts)
    emitted = min(1 + accepted, req.output_len - req.num_output_tokens)
    req.spec_steps += 1
    req.spec_accepted += accepted
    req.spec_extra += emitted - 1
    req.num_computed_tokens += emitted - 1 - drafts  # computed = prompt + outputs - 1 after the step
    replica.kv.trim(req, replica.kv.blocks_for(req.num_computed_tokens))
    return emitted


def grow_decodes(replica, j: int, requests=None) -> None:
    """Give each running request of a decode run (or each of `requests`: a pipeline run's batch), not yet
    committed, the blocks its context in the run's step j needs (what that step's start gives it when
    stepping one by one; nothing once it holds them)."""
    kv = replica.kv
    block_size, grow = kv.block_size, kv.grow
    for req in replica.state.running if requests is None else requests:
        blocks = -(-(req.num_computed_tokens + 1 + j) // block_size)
        if blocks > req.num_blocks:
            grow(req, blocks)


def commit_run(replica, ends, extra, hold_finished: bool, used: int) -> None:
    """Commit a run of identical decode steps: rows in bulk, every request +len(ends) tokens and
    the blocks its last step's context needs; `used`: blocks in use in the run's first step, `extra[j]`:
    blocks held after step j beyond those."""
    count = len(ends)
    running = replica.state.running
    n = len(running)
    recorder = replica.recorder
    step = replica.step
    recorder.set_end(step, float(ends[0]))
    last = recorder.num_steps + count - 2  # the run's last step (rows are appended below)
    previous = replica.prev_step
    grow_decodes(replica, count - 1)
    contexts = n  # the first step's decode contexts, summed
    for req in running:
        contexts += req.num_computed_tokens
        _decode_tokens(recorder, req, count, step, last, previous)
    kv = replica.kv
    if kv.prefix is not None:  # the output blocks the run's steps complete (Request.output_hashes), held
        for req in running:  # by their request until it leaves, so caching them at the run's end is exact
            kv.publish(req, req.num_computed_tokens)
    finished = any(req.num_output_tokens >= req.output_len for req in running)
    if isinstance(ends, list):  # a short run (fast_forward.scalar_run): plain lists, appended as they are
        used = [used + e for e in extra[1:]]
        decode_contexts = [contexts + n * j for j in range(1, count)]
    else:
        used = used + extra[1:]
        decode_contexts = contexts + n * np.arange(1, count, dtype=np.int64)
    recorder.add_run(replica.index, ends, prefill_tokens=0, decode_tokens=n, padding_tokens=0, num_seqs=n,
                     kv_blocks_used=used, preemptions=0, swap_bytes=0.0, decode_context_tokens=decode_contexts)
    replica.prev_step = last
    if replica.state.reserve is not None:
        replica.state.reserve.decay_steps(count - 1)
    if finished:
        release_finished(replica, hold_finished, float(ends[-1]))
    if replica.shapes is not None:
        base = replica.shapes[-1].decode
        replica.shapes.extend(StepShape(decode=tuple(c + j for c in base), tokens_sampled=len(base))
                              for j in range(1, count))


def commit_prompt_run(replica, run) -> None:
    """Commit a prompt run (sim/prompt_run.py PromptRun) with the result of committing its steps one by
    one: rows in bulk; every decode a token a step until it finishes; each prompt joins (an admitted one
    in its step, as `admit` has it), runs its chunks, then samples a token in the step of its last chunk
    and in every step after it; finished requests leave, each at its own step's end, before the others'
    blocks grow."""
    ends, finish = run.ends, run.finish
    count = len(ends)
    recorder, step = replica.recorder, replica.step
    recorder.set_end(step, ends[0])
    first = recorder.num_steps  # the row of the run's step 1 (rows are appended below)

    def row(j: int) -> int:
        return step if j == 0 else first + j - 1

    previous, running, pauses = replica.prev_step, replica.state.running, run.pauses
    prompts = {segment.prompt for segment in run.prompts}
    breaks: list = []  # (step, *run record): token runs broken in that step (with pauses only), in batch order
    leaving = []  # the finished, in the batch's order
    for req in running:
        if req in finish:
            leaving.append(req)
        if req not in prompts:
            last = finish.get(req, count - 1)
            if not pauses:
                _decode_tokens(recorder, req, last + 1, step, row(last), previous)
            else:
                _span_tokens(req, decode_spans(0, last, pauses), row, previous, breaks)
    for segment in run.prompts:
        if segment.first:
            _join(replica, segment.prompt, ends[segment.first - 1], row(segment.first))
            if segment.prompt in finish:
                leaving.append(segment.prompt)
        _commit_prompt(recorder, segment, run, row, breaks)
    recorder.add_run(replica.index, ends, padding_tokens=0, preemptions=0, swap_bytes=0.0, **run.columns)
    replica.prev_step = row(count - 1)
    breaks.sort(key=_first)
    closed = 0  # of the breaks, those recorded: a step's breaks before its leaves, as stepping has them
    if leaving:  # each at its own step's end, in the order stepping one by one releases them (a stable sort)
        leaving.sort(key=finish.__getitem__)
        for req in leaving:
            closed = _record_breaks(recorder, breaks, closed, finish[req])
            leave_finished(replica, req, ends[finish[req]])
        replica.state.running = [req for req in running if req not in finish]
    _record_breaks(recorder, breaks, closed, count)
    kv = replica.kv
    for req in replica.state.running:  # the blocks of their last step's context
        blocks = -(-req.num_computed_tokens // kv.block_size)
        if blocks > req.num_blocks:
            kv.grow(req, blocks)
    for segment in run.prompts:  # a reservation beyond the context (reserve_full_prompt, Orca's max length)
        if segment.blocks > segment.prompt.num_blocks and segment.prompt not in finish:
            kv.grow(segment.prompt, segment.blocks)


def _join(replica, req: Request, start: float, row: int) -> None:
    """`req`, admitted by a prompt run in the step that starts at `start` (row `row` of the step table),
    joins the batch as in that step: what arrived by its start becomes visible, and `req`, the head of
    the queue, is admitted."""
    replica._take_arrivals(start)
    admit(replica, req, start)  # (a fresh request holds no KV: its blocks grow with the run's, below)
    req.first_scheduled_step = row


def _decode_tokens(recorder, req: Request, tokens: int, step: int, last: int, previous: int) -> None:
    """`req`, a decode at a run's first step (`step`), produced a token in each of its first `tokens`
    steps, the last of them `last`; its token run goes on if its last token was in `previous`."""
    if req.run_tokens and req.last_token_step == previous:
        req.run_tokens += tokens
    else:
        recorder.close_run(req)
        req.run_start_step = step
        req.run_tokens = tokens
    req.last_token_step = last
    req.num_output_tokens += tokens
    req.num_computed_tokens += tokens


def _first(item):
    return item[0]


def _record_breaks(recorder, breaks: list, closed: int, step: int) -> int:
    """Record the breaks from `closed` on up to those of step `step`; returns how many are recorded."""
    while closed < len(breaks) and breaks[closed][0] <= step:
        recorder.add_run_record(*breaks[closed][1:])
        closed += 1
    return closed


def _span_tokens(req: Request, spans, row, previous: int, breaks: list, after: int = -1) -> None:
    """`req` produced a token in each step of `spans` (a run's steps, from decode_spans); its open run goes on
    into the first span if that is step after + 1 and its last token was in row `previous`. A run that
    breaks is closed into `breaks` at the step it breaks in (recorded in step order with the leaves:
    commit_prompt_run)."""
    continues_from = previous if spans and spans[0][0] == after + 1 else None
    for a, b in spans:
        tokens = b - a + 1
        if req.run_tokens and req.last_token_step == continues_from:
            req.run_tokens += tokens
        else:
            if req.run_tokens:
                breaks.append((a, req.id, req.run_start_step, req.last_token_step, req.run_tokens))
            req.run_start_step = row(a)
            req.run_tokens = tokens
        req.last_token_step = row(b)
        req.num_output_tokens += tokens
        req.num_computed_tokens += tokens
        continues_from = None


def _commit_prompt(recorder, segment, run, row, breaks: list) -> None:
    """A prompt's chunks, then a token in step `segment.sampled` and in each step after it (each a decode
    row from the step after its last chunk on) until it finishes or the run ends."""
    prompt, ends, sampled, pauses = segment.prompt, run.ends, segment.sampled, run.pauses
    computed = segment.history + sum(segment.chunks)
    if sampled is not None and sampled < len(ends):  # (a recompute's decode row may fall after the run)
        last = run.finish.get(prompt, len(ends) - 1)
        rows = decode_spans(segment.first + len(segment.chunks), last, pauses)  # its decode rows
        computed += sum(b - a + 1 for a, b in rows)
        _prompt_token(recorder, prompt, row(sampled), ends[sampled])
        _span_tokens(prompt, decode_spans(sampled + 1, last, pauses), row, row(sampled), breaks, sampled)
    prompt.num_computed_tokens = computed


def decode_spans(first: int, last: int, pauses) -> list[tuple[int, int]]:
    """The steps first..last of a run that a decode row runs, as (from, to) spans: all but the `pauses`
    (ascending: steps that run a prompt alone)."""
    spans, start = [], first
    for pause in pauses[bisect_left(pauses, first):bisect_right(pauses, last)]:
        if pause > start:
            spans.append((start, pause - 1))
        start = pause + 1
    if start <= last:
        spans.append((start, last))
    return spans


def _prompt_token(recorder, req: Request, step: int, end: float) -> None:
    """`req` samples its next token in `step` (ending at `end`), after a step without one."""
    recorder.close_run(req)
    req.run_start_step = step
    req.run_tokens = 1
    req.last_token_step = step
    outputs = req.num_output_tokens + 1
    req.num_output_tokens = outputs
    if outputs == 1:
        req.first_token_time = end
        req.first_token_step = step


# -- leaving: finished, or the client gave up ----------------------------------------------
def release_finished(replica, hold: bool, end: float) -> None:
    """Finished requests leave the running set and free their KV (with `hold`: only once all are done)."""
    running = replica.state.running
    if hold and not all(r.is_done for r in running):
        return
    keep = []
    for req in running:
        if req.is_done:
            leave_finished(replica, req, end)
        else:
            keep.append(req)
    replica.state.running = keep


def leave_finished(replica, req: Request, end: float) -> None:
    """`req`, which produced its last token in a step ending at `end`, leaves: its KV is freed, its
    token run closed (or it timed out, if its client had given up by then)."""
    limit = replica.settings.client_timeout
    if limit is not None and end > req.arrival + limit:  # its client had given up
        time_out(req, limit)
    else:
        req.status = Status.FINISHED
        req.completion_time = end
    replica.kv.release(req)
    replica.recorder.close_run(req)
    del replica.by_id[req.id]
    if replica.on_leave is not None:
        replica.on_leave(req, end)


def expire(replica, now: float) -> None:
    """Abort every request whose client gave up by `now` (client_timeout after its arrival), at the
    end of a step, as vLLM aborts a disconnected request between steps: it leaves the queue or the
    batch and its KV blocks (and any host copy) are freed. (Only a step's end can pass a deadline:
    a replica without work has no request to expire, and one that wakes has only fresh ones.)"""
    limit = replica.settings.client_timeout
    state = replica.state
    late = [r for r in state.running if r.arrival + limit <= now] + [r for r in state.waiting
                                                                     if r.arrival + limit <= now]
    for req in late:
        if req.status == Status.RUNNING:
            replica.recorder.close_run(req)
        else:
            state.waiting.remove(req)
            if req.num_swapped_blocks:
                replica.kv.drop_host_copy(req)
        if req.num_blocks:
            replica.kv.release(req)
        del replica.by_id[req.id]
        time_out(req, limit)
        if replica.on_leave is not None:
            replica.on_leave(req, now)
    if late:
        state.running = [r for r in state.running if r.status == Status.RUNNING]


def time_out(req: Request, limit: float) -> None:
    req.status = Status.REJECTED
    req.reject_reason = f"timeout: not finished {limit:g} s after arrival"
