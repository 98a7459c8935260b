"""A replica's role in its cluster: the hooks its loop calls, so the loop itself knows no roles.

A colocated replica (`Colocated`, every replica outside a P/D cluster) runs whole requests and its
hooks do nothing. P/D wiring (sim/pd.py PDCluster) gives each replica of its pools a `Prefill` or
`Decode` role bound to the cluster's hand-off. The loop calls, per step:

- `holds_kv()` when the policy planned nothing: True if KV held for a hand-off (or paused admissions)
  explains it, and the replica waits for a release instead of reporting a stuck policy;
- `evict_only(plan, start)` (a generator) for a plan that only preempts, when `runs_eviction_steps`
  is False (P/D: room reserved for a transfer forced it; no forward pass runs);
- `began(plan, start)` after the step's start half, `committed(plan, end)` after its end half;
- `take_landed(now)` while requests whose KV landed here wait to become visible.

At arrival `reject_reason(req)` says whether the request could ever run here (KV and policy), and a
preemption asks `queue_head()` where the head of the waiting queue is for a victim.
"""
from __future__ import annotations

import math
from dataclasses import replace

from cbsim.sim.clock import delay_to
from cbsim.sim.request import Request, Status


class Colocated:
    """A replica that runs whole requests (prefill and decode); no hand-off."""

    name = "colocated"
    runs_eviction_steps = True  # a plan that only preempts runs as a (possibly empty) step of its own
    placements_cut_runs = False  # P/D decode: a decode run goes on until a placement touches it (sim/pd.py)
    leaps_prompts = True  # a prompt's chunks may be fast-forwarded (its hooks see only the run's first step)

    def __init__(self, replica):
        self.replica = replica

    def reject_reason(self, req: Request) -> str:
        """Why `req` could never run here: the KV it holds at its peak, then the policy's own limits."""
        return self._kv_reason(req, req.prompt_len + req.output_len) or self.replica.policy.reject_reason(
            req, self.replica.state)

    def _kv_reason(self, req: Request, held: int) -> str:
        kv = self.replica.kv
        if kv.fits_ever(held):
            return ""
        return f"needs {kv.blocks_for(held)} KV blocks, the cache has {kv.num_blocks - kv.watermark_blocks} usable"

    def holds_kv(self) -> bool:
        return False

    def evict_only(self, plan, start: float):
        raise NotImplementedError("a colocated replica runs eviction-only plans as steps")

    def began(self, plan, start: float) -> None:
        pass

    def committed(self, plan, end: float) -> None:
        pass

    def queue_head(self) -> int:
        return 0

    def take_landed(self, now: float) -> None:
        pass


class _PDRole(Colocated):
    """Either pool of a P/D cluster: the cluster's hand-off holds KV here at times."""

    runs_eviction_steps = False
    leaps_prompts = False  # its hooks act on the step that finishes a prompt (hand-off) or lands KV

    def __init__(self, replica, cluster):
        super().__init__(replica)
        self.cluster = cluster

    def reject_reason(self, req: Request) -> str:
        return super().reject_reason(req) or self.cluster.reject_reason(req)

    def holds_kv(self) -> bool:
        return self.cluster.held[self.replica.index] > 0

    def evict_only(self, plan, start: float):
        """A plan that only preempts (KV reserved for transfers left a lone request no room to grow)
        runs no forward pass and records no step; the replica waits only for swap-outs."""
        replica = self.replica
        swapped = sum(replica._preempt(replica.by_id[rid]) for rid in plan.preempted)
        replica.state.running = [r for r in replica.state.running if r.status == Status.RUNNING]
        if swapped:
            replica._resume_at = replica.step_end = start + swapped / replica.settings.swap_bandwidth
            yield replica.env.timeout(delay_to(replica.env.now, replica._resume_at))
            replica.step_end = None


class Prefill(_PDRole):
    """Runs prompts (and samples their first token), then hands them to the decode pool."""

    name = "prefill"

    def reject_reason(self, req: Request) -> str:
        # it keeps the prompt's KV only and runs the prompt (and samples one token): its policy judges that much
        return (self._kv_reason(req, req.prompt_len)
                or self.replica.policy.reject_reason(replace(req, output_len=1), self.replica.state)
                or self.cluster.reject_reason(req))

    def holds_kv(self) -> bool:
        return super().holds_kv() or self.cluster.paused

    def committed(self, plan, end: float) -> None:
        """Hand off prompts that are done: they leave the replica; their KV stays until the hand-off frees it."""
        by_id = self.replica.by_id
        done = [by_id[rid] for rid in plan.scheduled
                if rid in by_id and by_id[rid].num_output_tokens and by_id[rid].status == Status.RUNNING]
        if done:
            self.detach(done)
            for req in done:
                self.cluster.prefilled(self.replica, req, end)

    def detach(self, reqs: list[Request]) -> None:
        """Take requests whose prompt is done off this replica; their KV stays allocated here until the
        hand-off releases it."""
        replica = self.replica
        gone = {req.id for req in reqs}
        replica.state.running = [r for r in replica.state.running if r.id not in gone]
        for req in reqs:
            del replica.by_id[req.id]
            replica.recorder.close_run(req)


class Decode(_PDRole):
    """Receives prefilled requests (their KV lands here) and decodes them."""

    name = "decode"

    @property
    def placements_cut_runs(self) -> bool:
        """A decode run goes on past other replicas' steps and is cut only where a placement reads or reserves
        this replica's room (Replica.settle_run); closed-loop clients (who may send requests at any step end)
        keep runs within the horizon of every other replica's steps (sim/pd.py PDCluster.horizon)."""
        return self.replica.on_leave is None

    def began(self, plan, start: float) -> None:
        """Note first decode admissions; room may have changed."""
        cluster = self.cluster
        for rid in plan.admitted:
            rec = cluster.records.get(rid)
            if rec is not None and math.isnan(rec.decode_admitted):
                rec.decode_admitted = start
        if cluster.pending:
            cluster.place(start)

    def committed(self, plan, end: float) -> None:
        """Decode room may have grown (after a run too: its last step's room counts, as after one step)."""
        if self.cluster.pending:
            self.cluster.place(end)

    def land(self, req: Request, time: float) -> None:
        """`req`'s KV arrived at `time` (its blocks are already granted here)."""
        replica = self.replica
        req.replica = replica.index
        req.status = Status.WAITING
        replica.landed.append((time, req))
        replica.wake()

    def take_landed(self, now: float) -> None:
        """Landed requests become visible at the head of the waiting queue, in landing order."""
        replica = self.replica
        landed = replica.landed
        while landed and landed[0][0] <= now:
            _, req = landed.popleft()
            replica.by_id[req.id] = req
            replica.state.waiting.insert(self.queue_head(), req)

    def queue_head(self) -> int:
        """How many landed requests (waiting, holding KV blocks) lead the waiting queue."""
        count = 0
        for req in self.replica.state.waiting:
            if req.status != Status.WAITING or not req.num_blocks:
                break
            count += 1
        return count
