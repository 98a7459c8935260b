"""KV links: FIFO transfer channels with a fixed number of lanes (P/D hand-off, pool hops, host swap).

A transfer of b bytes occupies one lane for `latency + b / bandwidth` seconds. Transfers are
served in submission order (FIFO), each on the lane that frees first; a lane carries one transfer
at a time, so at most `lanes` transfers overlap on a link (with one lane, none overlap). Nothing
can overtake a submitted transfer, so its start and end are fixed when it is submitted: the link
books the lane and returns the Transfer, and the caller schedules what happens at its end. The
link needs no process of its own.

Invariant: on every lane, booked transfers are disjoint in time and in submission order, and a
transfer never starts before it was submitted. Callers submit in non-decreasing time (they submit
at simulation events). Every transfer lasts >= 0 s and ends below durations.CLOCK_LIMIT, else a
DurationError names the link's config key.
"""
from __future__ import annotations

from dataclasses import dataclass

from cbsim.sim.durations import CLOCK_LIMIT, check_transfer


@dataclass(slots=True)
class Transfer:
    """One booked transfer: when it was asked for, when it holds its lane, and what it moves."""

    link: str
    request_id: int
    nbytes: float
    submitted: float
    start: float
    end: float
    lane: int
    kind: str = ""

    @property
    def queued(self) -> float:
        """Seconds the transfer waited for a lane."""
        return self.start - self.submitted


class KVLink:
    """A link of `lanes` lanes, each `bandwidth` bytes/s after a fixed `latency` per transfer."""

    def __init__(self, name: str, bandwidth: float, latency: float = 0.0, lanes: int = 1, key: str = "cluster.link"):
        if bandwidth <= 0 or latency < 0 or lanes < 1:
            raise ValueError("a link needs bandwidth > 0, latency >= 0 and lanes >= 1")
        self.name = name
        self.key = key  # the config key of its bandwidth and latency, for a DurationError
        self.bandwidth = bandwidth
        self.latency = latency
        self.lane_free = [0.0] * lanes  # when each lane finishes its last booked transfer
        self.log: list[Transfer] = []

    @property
    def lanes(self) -> int:
        return len(self.lane_free)

    def duration(self, nbytes: float) -> float:
        """Seconds one transfer of `nbytes` holds a lane."""
        return self.latency + nbytes / self.bandwidth

    def backlog(self, now: float) -> float:
        """Seconds a transfer submitted at `now` would wait for a lane."""
        return max(0.0, min(self.lane_free) - now)

    def submit(self, now: float, nbytes: float, request_id: int = -1, kind: str = "") -> Transfer:
        """Book a transfer of `nbytes` submitted at `now` on the lane that frees first."""
        lane = min(range(len(self.lane_free)), key=self.lane_free.__getitem__)
        start = max(now, self.lane_free[lane])
        seconds = self.duration(nbytes)
        if not (0.0 <= seconds and start + seconds < CLOCK_LIMIT):  # NaN, negative or beyond the clock
            check_transfer(self.key, start, seconds, nbytes, f" (link {self.name}: {self.bandwidth:g} bytes/s, "
                           f"latency {self.latency:g} s)")
        end = start + seconds
        self.lane_free[lane] = end
        transfer = Transfer(self.name, request_id, float(nbytes), now, start, end, lane, kind)
        self.log.append(transfer)
        return transfer

    def busy_seconds(self) -> float:
        """Lane-seconds booked so far (a lane's utilisation is this over the run's span and lanes)."""
        return sum(t.end - t.start for t in self.log)
