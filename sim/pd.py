"""Prefill/decode disaggregation: a prefill pool and a decode pool of replicas joined by KV links.

Life of a request (DistServe, Mooncake, vLLM's disaggregated prefill):

1. Arrival: the router picks a prefill replica. It runs its own policy, which computes the prompt
   (chunked or whole) and samples the first token there. A request with output_len 1 ends there.
2. Hand-off: right after that step the prefill replica detaches the request. Its KV stays in the
   prefill replica's cache, counted as used blocks there, so the prefill policy sees less room:
   this is the backpressure.
3. Decode room: prefilled requests wait in one FIFO queue, with no overtaking, until a decode
   replica can reserve blocks for prompt_len + 1 tokens and still keep its watermark free. A
   replica that has a preempted request waiting takes no reservations, so a recompute is not
   starved by new arrivals. `decode_router` picks among the replicas with room (prefix_affinity:
   the one holding most of the prompt in its prefix cache, so the least KV crosses the link).
4. Transfer of prompt_len x KV bytes per token (the whole model's; less with prefix caching, below):
   p2p: one hop over the prefill replica's link. It is submitted at the reservation.
   pool: a first hop (prefill replica -> shared store) submitted right after the prefill. Its end
   frees the prefill side. The request then waits for decode room in the store, and a second hop
   (store -> decode replica, over that replica's link) is submitted at the reservation.
   Each link is FIFO with `lanes` lanes (sim/kv/link.py): a hop takes latency + bytes / bandwidth
   plus its wait for a lane.
5. Landing: at the end of the last hop, the prefill side is freed (p2p). The reserved room becomes
   the request's own blocks on the decode replica. The request joins the head of that replica's
   waiting queue (after earlier landed requests) as a decode: num_computed = prompt_len, one
   output token. With first_token_on: decode, the first token becomes visible
   (first_token_time) only at landing, so TTFT includes the transfer.

Where a request's KV is: on the prefill replica from its first chunk until the hop that leaves it
ends; in the store between the two hops of pool mode; on the decode replica from landing on. The
reserved room exists from the reservation on. So the KV is counted on both sides during a
transfer (from the reservation until the p2p hop ends, or during the second hop of pool mode):
the sender still holds it and the receiver has reserved its room. At every other moment it is in
exactly one place. Neither replica's policy can touch it while it moves: the request is in
neither replica's waiting or running set.

Prefill replicas reserve a prompt's whole KV when they admit it (kv reserve_full_prompt): a
prompt in progress can never run out of room because of KV held for hand-offs, so prefill
replicas never preempt. A decode replica can: when reservations for incoming transfers take the
room its lone running request needs, its plan only preempts, which costs no forward pass (see
sim/roles.py, evict_only).

Fast-forward: a decode replica advances a run of identical decode steps at once, and other replicas'
steps do not end it: only a placement or a landing touches a decode replica's cache or queue (and an
arrival, where the decode policy has an arrival gate: see `horizon`). Its run
waits out its steps with the very timeouts stepping one by one would create (Replica._stepped: events at
the same instant fall in stepping's order; each step start pulls the arrival feed, as stepping does), and
counts the steps that ended. `place` (when requests wait for room) and `_land` first call
Replica.settle_run on each decode replica amid a run: the run is cut to its step in progress (a landed
request is visible from the next step start; a reservation's blocks constrain the next plan), and that
step holds the blocks its start gave it when stepping (step_apply.grow_decodes, the rule commit_run
applies too), so the room the placement reads, and the least-loaded router's outstanding tokens (less the
steps that ended: RunProgress.tokens_passed), are what stepping shows at that instant. While requests
wait for decode room, a run instead ends before `PDCluster.horizon` (any other replica's step, a
request becoming visible, a hop end, an arrival): a preemption elsewhere calls no `place`, and the next
step start of any decode replica may then place one. Prefill replicas never run pure decode steps and
step one by one. tests/sim/test_pd.py and test_pd_prefix.py check that runs equal stepping, bit for
bit (hypothesis: 1-2 replicas a pool, p2p and pool, every decode router, prefix caching, tight decode
KV, cuts by max_time). benchmarks/speed_matrix.py pd_1p1d, 10,000 requests: the decode replica
plans 28,237 steps (69,782 when every other replica's step ended its runs), 297-322 us a request
(388-411 us before; 3 alternated rounds against c7708f2). What each request still pays for: the prefill
replica's 20,798 planned steps (one by one) and a SimPy timeout for each of 173,237 decode steps.

Prefix caching (kv_cache.prefix_caching: every replica of both pools keeps a radix tree, see
sim/kv/prefix.py; a pool's own prefix_caching overrides it), as in vLLM's disaggregated
prefill with a KV connector and Mooncake:
- Prefill side: an admission hits the replica's cache like a colocated one, so the prefill
  computes only prompt - hit tokens. The request holds its prompt's nodes (hit and published)
  until its KV leaves the replica (the end of the p2p hop, or of the hop into the pool); then its
  refcounts drop and its prompt units stay cached there, evictable.
- Decode side: at the reservation the chosen replica looks up the request's prompt in its own
  cache (every full unit, the last too: the KV arrives complete) and holds those nodes, so they
  cannot be evicted; only the missing prompt tokens cross the last hop (p2p, or pool -> decode),
  and the room reserved is the prompt's blocks + 1 minus the cached ones (plus the cached ones
  that were evictable, as in an admission). A pool mode's first hop carries the whole prompt:
  the decode replica is not known yet. At landing the request holds the cached nodes and its
  own blocks for the rest (prompt_len + 1 tokens in all) and its prompt units are cached there,
  so later requests with that prefix need less transfer. `HandOff.cached_on_decode` counts the
  tokens not transferred; they are no compute hit (`hit_tokens` counts the prefill admission).
- Decode room counts free + evictable blocks (an evictable block is taken by eviction).
A decode-side recompute re-admission hits that replica's cache (`readmit_hit_tokens`).
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Literal, Sequence

import simpy

from cbsim.sim.clock import UrgentTimeout, delay_to
from cbsim.sim.cost import CostModel
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.kv.link import KVLink, Transfer
from cbsim.sim.metrics.recorder import Recorder
from cbsim.sim.pipeline import make_replica
from cbsim.sim.replica import Replica, ReplicaSettings
from cbsim.sim.request import Request, Status
from cbsim.sim.roles import Decode, Prefill
from cbsim.sim.router import outstanding_tokens
from cbsim.sim.simulation import ArrivalFeed, run_cluster


@dataclass(frozen=True)
class PDSettings:
    """How the pools are joined (bandwidths in bytes/s, times in seconds)."""

    link_mode: Literal["p2p", "pool"] = "p2p"
    latency: float = 1e-4
    bandwidth: float = 25e9
    lanes: int = 1
    pool_bandwidth: float | None = None  # pool mode: the second hop's bandwidth (None: bandwidth)
    first_token_on: Literal["decode", "prefill"] = "decode"  # all tokens from decode, as vLLM's disagg proxy
    decode_router: Literal["round_robin", "least_loaded", "prefix_affinity"] = "least_loaded"
    bytes_per_token: float = 0.0  # KV bytes one token occupies, whole model


@dataclass(slots=True, eq=False)
class HandOff:
    """One request's trip from a prefill replica to a decode replica (times in seconds)."""

    req: Request
    src: Replica
    prefilled: float  # end of the step that sampled its first token
    prefill_blocks: int  # KV blocks it held on the prefill replica
    dst: Replica | None = None
    holder: Request | None = None  # stands in for the reserved room until the KV lands
    reserved: float = math.nan  # decode room reserved
    released_src: float = math.nan  # prefill-side KV freed
    in_pool: float = math.nan  # pool mode: first hop ended
    landed: float = math.nan  # KV on the decode replica
    cached_on_decode: int = 0  # prompt tokens the decode replica had cached at the reservation (not sent)
    decode_admitted: float = math.nan  # start of its first step on the decode replica
    hops: list[Transfer] = field(default_factory=list)


@dataclass
class PoolParts:
    """What it takes to build the replicas of one pool."""

    replicas: int
    make_policy: Callable[[], object]
    cost: CostModel
    make_kv: Callable[[], KVCache]
    settings: ReplicaSettings
    noise: Callable[[], float] | None = None


class PDCluster:
    """The hand-off between the pools: the port both pools' replicas call, and the links."""

    def __init__(self, env, prefill: Sequence[Replica], decode: Sequence[Replica], settings: PDSettings):
        self.env = env
        self.prefill = list(prefill)
        self.decode = list(decode)
        self.settings = settings
        bandwidth, latency, lanes = settings.bandwidth, settings.latency, settings.lanes
        self.out_links = {r.index: KVLink(f"prefill{r.index}", bandwidth, latency, lanes) for r in self.prefill}
        self.in_links = {}
        if settings.link_mode == "pool":
            bandwidth = settings.pool_bandwidth or bandwidth
            self.in_links = {r.index: KVLink(f"decode{r.index}", bandwidth, latency, lanes) for r in self.decode}
        self.pending: deque[HandOff] = deque()  # prefilled, waiting for decode room (FIFO)
        self.records: dict[int, HandOff] = {}
        self.held = Counter()  # replica index -> hand-offs whose KV (or reserved room) sits there
        self.reserved_tokens = Counter()  # decode replica index -> decode tokens of requests on their way
        self.next_decode = 0
        self._hop_ends: list[tuple] = []  # (end, booking order, its event) of hops; handled ones pruned lazily
        self._hop_seq = itertools.count()
        for replica in self.prefill:
            replica.role = Prefill(replica, self)
        for replica in self.decode:
            replica.role = Decode(replica, self)
        # admission.pd_backpressure: prefill replicas admit no prompt while this many wait for decode room
        self.max_pending = self.prefill[0].settings.pd_backpressure if self.prefill else None
        self.paused = False

    @property
    def links(self) -> list[KVLink]:
        return list(self.out_links.values()) + list(self.in_links.values())

    @property
    def is_idle(self) -> bool:
        """No request waits for decode room or is on its way."""
        return not self.pending and not any(self.held.values())

    # -- the port the replicas and their roles (sim/roles.py) call ---------------------
    def reject_reason(self, req: Request) -> str:
        """Why the decode pool could never take `req` (checked at arrival on the prefill side)."""
        if req.output_len <= 1:
            return ""  # it ends on the prefill replica
        replica = self.decode[0]  # the pool's replicas are alike
        total = req.prompt_len + req.output_len
        if not replica.kv.fits_ever(total):
            return (f"needs {replica.kv.blocks_for(total)} KV blocks on a decode replica, its cache has "
                    f"{replica.kv.num_blocks - replica.kv.watermark_blocks} usable")
        return replica.policy.reject_reason(req, replica.state)

    def horizon(self, replica: Replica, next_arrival: float) -> float:
        """The earliest time anything outside `replica` could touch its cache or queue without cutting its run
        where it touches it (a decode replica fast-forwards only through runs that end before it).
        Placements and landings cut a run themselves (Replica.settle_run, called by `place` and `_land`), so,
        while no request waits for decode room, nothing else bounds it: inf (the next arrival where the
        decode policy has an arrival gate, quotas or overload: `reject_reason` asks replica 0's). Otherwise (requests wait for
        room: a preemption elsewhere, which calls no `place`, lets the next step start of any decode replica
        place one; or closed-loop clients, roles.Decode.placements_cut_runs): another replica's step (or
        fast-forwarded run) ending or starting now (woken at this instant), a request becoming visible there
        (each may reserve room on any decode replica), a hop ending, an arrival."""
        hops = self._hop_ends
        while hops and hops[0][2].processed:  # this hop's end has been handled
            heapq.heappop(hops)
        if replica.role.placements_cut_runs and not self.pending:
            # an arrival reads decode replica 0's state only through an arrival gate (reject_reason)
            gated = replica is self.decode[0] and getattr(replica.policy, "gate", None) is not None
            return next_arrival if gated else math.inf
        times = [next_arrival, hops[0][0] if hops else math.inf]
        for other in self.prefill + self.decode:
            if other is not replica:
                if other.step_end is not None:
                    times.append(other.step_end)
                elif other.woken:  # its step starts now and may end before any run of ours
                    times.append(self.env.now)
                visible = other.next_visible()
                if visible is not None:
                    times.append(visible)
        return min(times)

    # -- the hand-off --------------------------------------------------------------------
    def prefilled(self, src: Replica, req: Request, time: float) -> None:
        """`req`'s prompt is done on `src` at `time` (its first token sampled): start its hand-off."""
        rec = HandOff(req, src, time, req.num_blocks)
        self.records[req.id] = rec
        self.held[src.index] += 1
        if self.settings.link_mode == "pool":
            self._send(self.out_links[src.index], rec, time, req.prompt_len, "to_pool", self._into_pool)
        else:
            self.pending.append(rec)
            self.place(time)
        self._backpressure()

    def _into_pool(self, rec: HandOff, time: float) -> None:
        self._release_src(rec, time)
        rec.in_pool = time
        self.pending.append(rec)
        self.place(time)
        self._backpressure()

    def _backpressure(self) -> None:
        """admission.pd_backpressure: pause the prefill replicas' admissions while `max_pending`
        prefilled requests or more wait for decode room (the transfer queue: the decode side's free
        slots), and wake them when it drains below. Prompts already
        admitted run on: they hold their whole reservation (reserve_full_prompt)."""
        if self.max_pending is None:
            return
        paused = len(self.pending) >= self.max_pending
        if paused != self.paused:
            self.paused = paused
            for replica in self.prefill:
                replica.state.admit_paused = paused
                if not paused:
                    replica.wake()

    def place(self, time: float) -> None:
        """Reserve decode room for pending requests, oldest first, and start their transfers."""
        pending = self.pending
        if pending:  # every decode replica's room shows what stepping one by one shows now
            for replica in self.decode:
                if replica.progress is not None:
                    replica.settle_run()
        while pending:
            rec = pending[0]
            dst = self._choose(rec.req)
            if dst is None:
                return
            pending.popleft()
            self._backpressure()
            self._reserve(rec, dst, time)
            missing = rec.req.prompt_len - rec.cached_on_decode
            if self.settings.link_mode == "pool":
                self._send(self.in_links[dst.index], rec, time, missing, "from_pool", self._land)
            else:
                self._send(self.out_links[rec.src.index], rec, time, missing, "p2p", self._land)

    def _blocks(self, req: Request) -> int:
        """Decode-side room a request needs: its prompt's KV and the block its first decode writes."""
        return self.decode[0].kv.blocks_for(req.prompt_len + 1)

    def _room_needed(self, replica: Replica, req: Request) -> tuple[list, int, int]:
        """(cached path, blocks to reserve, blocks the path takes from the evictable ones) of `req`
        on decode replica `replica`; the path is empty without prefix caching."""
        kv = replica.kv
        path = kv.cached_prompt(req)
        if not path:
            return path, self._blocks(req), 0
        prefix = kv.prefix
        return path, self._blocks(req) - len(path) * prefix.unit_blocks, prefix.claimable_blocks(path)

    def _has_room(self, replica: Replica, req: Request) -> bool:
        kv = replica.kv
        _, blocks, claimed = self._room_needed(replica, req)
        if kv.available_blocks - kv.watermark_blocks < blocks + claimed:
            return False
        return not any(r.status in (Status.PREEMPTED, Status.SWAPPED) for r in replica.waiting)

    def _choose(self, req: Request) -> Replica | None:
        pool = self.decode
        if self.settings.decode_router == "round_robin":
            for k in range(len(pool)):
                replica = pool[(self.next_decode + k) % len(pool)]
                if self._has_room(replica, req):
                    self.next_decode = (self.next_decode + k + 1) % len(pool)
                    return replica
            return None
        fits = [r for r in pool if self._has_room(r, req)]
        if self.settings.decode_router == "prefix_affinity":  # most of the prompt cached there, then least loaded
            return min(fits, key=lambda r: (-len(r.kv.cached_prompt(req)), self._load(r), r.index), default=None)
        return min(fits, key=lambda r: (self._load(r), r.index), default=None)

    def _load(self, replica: Replica) -> int:
        """Decode tokens `replica` still owes, those on their way to it included; amid a run, less what its
        steps that ended took off (sim/run_progress.py)."""
        load = outstanding_tokens(replica) + self.reserved_tokens[replica.index]
        return load - replica.progress.tokens_passed() if replica.progress is not None else load

    def _reserve(self, rec: HandOff, dst: Replica, time: float) -> None:
        req = rec.req
        path, blocks, _ = self._room_needed(dst, req)
        dst.kv.claim_cached(req, path)
        if path:
            rec.cached_on_decode = len(path) * dst.kv.prefix.unit_tokens
        holder = Request(-1 - req.id, time, req.prompt_len, 1)
        dst.kv.grow(holder, blocks)
        rec.dst, rec.holder, rec.reserved = dst, holder, time
        self.held[dst.index] += 1
        self.reserved_tokens[dst.index] += req.output_len - 1

    def _send(self, link: KVLink, rec: HandOff, time: float, tokens: int, kind: str,
              then: Callable[[HandOff, float], None]) -> None:
        """Submit one hop of `tokens` tokens' KV on `link` at `time`; `then(rec, end)` runs at its end
        (before steps starting then)."""
        transfer = link.submit(time, tokens * self.settings.bytes_per_token, rec.req.id, kind)
        rec.hops.append(transfer)
        event = UrgentTimeout(self.env, delay_to(self.env.now, transfer.end))
        event.callbacks.append(lambda _: then(rec, transfer.end))
        heapq.heappush(self._hop_ends, (transfer.end, next(self._hop_seq), event))

    def _release_src(self, rec: HandOff, time: float) -> None:
        src = rec.src
        src.kv.release(rec.req)
        rec.released_src = time
        self.held[src.index] -= 1
        src.wake()  # a prefill replica blocked on this KV can plan again

    def _land(self, rec: HandOff, time: float) -> None:
        if math.isnan(rec.released_src):
            self._release_src(rec, time)  # p2p: the hop that leaves the prefill replica just ended
        req, dst = rec.req, rec.dst
        if dst.progress is not None:  # amid a run: the landed request is visible from its next step on
            dst.settle_run()
        dst.kv.receive(req, rec.holder, self._blocks(req))
        rec.holder = None
        rec.landed = time
        self.held[dst.index] -= 1
        self.reserved_tokens[dst.index] -= req.output_len - 1
        if self.settings.first_token_on == "decode":
            req.first_token_time = time
        dst.role.land(req, time)


def build_pd(env, recorder: Recorder, feed, prefill: PoolParts, decode: PoolParts, settings: PDSettings
             ) -> tuple[list[Replica], PDCluster]:
    """The replicas of both pools, numbered prefill first (0 .. P-1) then decode (P .. P+D-1), and
    the cluster joining them; nothing runs until the environment does."""
    replicas: list[Replica] = []
    for parts, role in ((prefill, "prefill"), (decode, "decode")):
        # prefill replicas never run pure decode steps; decode replicas fast-forward between hand-off events
        pool_settings = replace(parts.settings, fast_forward=parts.settings.fast_forward and role == "decode",
                                runs_end_before_horizon=True)
        for _ in range(parts.replicas):
            kv = parts.make_kv()
            kv.reserve_full_prompt |= role == "prefill"  # a prompt never waits for room held by hand-offs
            replicas.append(make_replica(env, len(replicas), parts.make_policy(), parts.cost, kv, recorder,
                                         pool_settings, lambda: feed.next_time, noise=parts.noise,
                                         pull=feed.deliver_until))
    cluster = PDCluster(env, replicas[:prefill.replicas], replicas[prefill.replicas:], settings)
    for replica in replicas:
        replica.horizon = partial(lambda r: cluster.horizon(r, feed.next_time), replica)
    return replicas, cluster


def simulate_pd(requests: Sequence[Request], prefill: PoolParts, decode: PoolParts, settings: PDSettings,
                router: str = "round_robin", max_time: float | None = None, progress=None
                ) -> tuple[Recorder, list[Replica], PDCluster]:
    """Run the requests (sorted by arrival) through a P/D cluster; arrivals are routed over the
    prefill pool. Returns the recorder, every replica (see build_pd) and the cluster. `progress`:
    as simulation.simulate."""
    env = simpy.Environment()
    recorder = Recorder()
    feed = ArrivalFeed(env, requests)
    replicas, cluster = build_pd(env, recorder, feed, prefill, decode, settings)
    run_cluster(env, feed, replicas, cluster.prefill, router, max_time, busy=lambda: not cluster.is_idle,
                progress=progress)
    return recorder, replicas, cluster
