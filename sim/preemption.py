"""Preemption recovery: what a replica does with a victim its policy evicts, one strategy per replica.

A victim always loses its place in the batch (its epoch moves on, so a step in flight cannot
complete it), closes its token run and goes back to the waiting queue. How it gets its KV back is
the strategy, chosen once when the replica is built (`make_recovery`, from preemption_mode):

- Recompute: free its blocks; it prefills every computed token again when readmitted.
- Swap: copy its blocks to host memory over the replica's host link (sim/kv/link.py) and back in
  when readmitted; a victim that does not fit in the host swap space (swap_space) recomputes, as
  vLLM V0 would abort.
- Auto: per victim, the faster of the two by this run's cost model.

Where it rejoins the queue is the strategy's `requeue`, also chosen once (swapped_queue): at the
head (latest victim first), or vLLM V0's order (swapped requests FIFO ahead of all others). On a
P/D decode replica it goes behind the landed requests (the role's `queue_head`).

Invariant: every preemption appends one row to `replica.preemption_log`: (time, replica, request,
mode, recomputed tokens, swapped bytes).
"""
from __future__ import annotations

import warnings

from cbsim.sim.request import Request, Status
from cbsim.sim.shape import StepShape

PCIE_PEAK_GB_S = 25.0  # PCIe 4 x16 host link, ~25 GB/s usable of 32: the link when the engine gives no swap figure


def swap_bandwidth(configured_gb_s: float | None, engine, mode: str) -> float:
    """Bytes/s a swap moves over the host link: preemption.swap_bandwidth_gb_s when given, else what the
    engine's swap achieves (its `swap_bandwidth_gb_s`: vLLM V0's per-block copies reach ~3.1 GB/s, vllm
    PR #11531), else the PCIe peak. A swap asked of an engine that never swaps (vLLM V1, SGLang: they
    recompute) is simulated, with a warning that names it."""
    terms = engine.terms if engine is not None else None
    if mode != "recompute" and terms is not None and not terms.swap_preemption:
        warnings.warn(f"preemption.mode {mode}: engine {engine.name} does not swap (it preempts by recompute "
                      "only); simulating a V0-style swap it lacks", stacklevel=2)
    if configured_gb_s is not None:
        return configured_gb_s * 1e9
    return (terms.swap_bandwidth_gb_s if terms is not None and terms.swap_bandwidth_gb_s > 0 else PCIE_PEAK_GB_S) * 1e9


class Recompute:
    """Drop the victim's KV; it prefills again. The base of every strategy: `swaps` says no."""

    def __init__(self, replica, swapped_queue: str = "head", swap_space: float | None = None):
        self.replica = replica
        self.requeue = self._requeue_vllm_v0 if swapped_queue == "vllm_v0" else self._requeue_head
        block_bytes = replica.kv.block_bytes
        # host blocks that fit in the swap space (vLLM V0: num_cpu_blocks = swap_space_bytes // block bytes)
        self.swap_capacity_blocks = (None if swap_space is None or block_bytes <= 0
                                     else int(swap_space // block_bytes))
        tiers = replica.kv.prefix.tiers if replica.kv.prefix is not None else None
        if tiers is not None:  # swap shares the cpu tier (sim/kv/tiers.py): its capacity is the host space
            self.swap_capacity_blocks = tiers.tiers[0].capacity_blocks
        self.swap_full_recomputes = 0  # victims recomputed because the swap space was full
        self.swap_out_booked = 0.0  # bytes this step's victims swap out (already on the host link)

    def preempt(self, req: Request) -> float:
        """Evict `req` before the step runs; returns the bytes it swaps out (0 for recompute)."""
        replica = self.replica
        req.epoch += 1
        req.num_preemptions += 1
        replica.recorder.close_run(req)
        self.requeue(req)
        if self.swaps(req):
            return self._swap_out(req)
        req.status = Status.PREEMPTED
        tokens = req.num_computed_tokens
        replica.kv.release(req)
        req.num_computed_tokens = 0
        replica.preemption_log.append((replica.step_start, replica.index, req.id, "recompute", tokens, 0.0))
        return 0.0

    def swaps(self, req: Request) -> bool:
        return False

    def _swap_out(self, req: Request) -> float:
        replica = self.replica
        req.status = Status.SWAPPED
        moved = replica.kv.swap_out(req)
        replica.host_link.submit(replica.step_start, moved, req.id, "swap_out")
        self.swap_out_booked += moved
        replica.preemption_log.append((replica.step_start, replica.index, req.id, "swap", 0, moved))
        return moved

    def book_swap_ins(self, start: float, swap_bytes: float) -> float:
        """Put the step's swap-ins on the host link (its swap-outs were booked as they were decided);
        returns the seconds the step waits for all its swaps (the link is idle at every step's start)."""
        swap_in = swap_bytes - self.swap_out_booked
        if swap_in > 0:
            self.replica.host_link.submit(start, swap_in, -1, "swap_in")
        return swap_bytes / self.replica.settings.swap_bandwidth

    # -- where the victim waits ------------------------------------------------------------
    def _requeue_head(self, req: Request) -> None:
        """Back to the head of the waiting queue (on a P/D decode replica, behind the landed requests
        there: they hold their KV already, and waiting behind a recompute that cannot fit could
        deadlock)."""
        replica = self.replica
        head = replica.role.queue_head()
        if head:
            replica.state.waiting.insert(head, req)
        else:
            replica.state.waiting.appendleft(req)

    def _requeue_vllm_v0(self, req: Request) -> None:
        """The swapped requests lead the queue in preemption order and every victim goes behind them:
        a swapped one joins the end of that FIFO, a recompute one the head of the rest. vLLM V0 keeps
        swapped requests in their own queue (`self.swapped.extend(swapped_out)`, swapped in from its
        head) served before the waiting queue, where recompute victims go first
        (`self.waiting.extendleft(preempted)`) (vllm-project/vllm 0dce2b29, vllm/core/scheduler.py
        _schedule_default, _schedule_chunked_prefill)."""
        replica = self.replica
        waiting = replica.state.waiting
        head = replica.role.queue_head()
        while head < len(waiting) and waiting[head].num_swapped_blocks:
            head += 1
        if head:
            waiting.insert(head, req)
        else:
            waiting.appendleft(req)


class Swap(Recompute):
    """Move the victim's KV to host memory; recompute only when the swap space is full."""

    def swaps(self, req: Request) -> bool:
        capacity = self.swap_capacity_blocks
        if capacity is not None and self.replica.kv.host_blocks + req.num_blocks > capacity:
            self.swap_full_recomputes += 1
            return False  # the host swap space is full: recompute (vLLM V0 aborts the engine here)
        return True


class Auto(Swap):
    """Per victim, the faster recovery by this run's cost model: T_swap = out and back in over the
    host link + the link's queue (victims already swapping out in this step); T_recompute = one
    prefill of every token whose KV would be dropped. Ties recompute."""

    def swaps(self, req: Request) -> bool:
        if not super().swaps(req):
            return False
        tokens = req.num_computed_tokens
        if tokens == 0:
            return False
        replica = self.replica
        link = replica.host_link
        t_swap = 2 * link.duration(req.num_blocks * replica.kv.block_bytes) + link.backlog(replica.step_start)
        t_recompute = replica.cost.step_time(StepShape(prefill=((tokens, 0),), tokens_sampled=1))
        return t_swap < t_recompute


def make_recovery(replica, settings) -> Recompute:
    """The replica's one recovery strategy, from preemption_mode, swapped_queue and swap_space."""
    kind = {"recompute": Recompute, "swap": Swap, "auto": Auto}[settings.preemption_mode]
    return kind(replica, settings.swapped_queue, settings.swap_space)
