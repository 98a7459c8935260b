"""Progress of a long run, as plain lines on a text stream (the CLI's stderr).

Invariant: reporting never changes a run. The watcher is a SimPy process that only reads the clock,
the arrival feed and the requests' status; the event loop does not know it exists. It wakes at
simulated-time intervals that it adapts so that it looks at the wall clock about every `check`
seconds, and it stops as soon as nothing else is scheduled, so a run that would end (or fail) by
running out of events still does. Nothing is printed in the first `after` seconds of wall time, so
short runs stay silent; after that a line every `every` seconds.
"""
from __future__ import annotations

import math
import sys
import time
from typing import Callable, TextIO

from cbsim.sim.request import Status
from cbsim.sim.request_table import RequestTable

MIN_STEP, MAX_STEP = 1e-6, 60.0  # simulated seconds between wake-ups (the floor keeps SimPy's clock moving)


class Progress:
    """Reports one run (or one run after another: `restart`) on `stream`."""

    def __init__(self, stream: TextIO | None = None, every: float = 5.0, after: float = 2.0,
                 check: float = 0.1, clock: Callable[[], float] = time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        self.every, self.after, self.check, self.clock = every, after, check, clock
        self.restart()

    def restart(self, label: str = "") -> None:
        """Start the wall clock again, for a new run; `label` prefixes its lines (e.g. a probe's rate)."""
        self.label = label
        self.started = self.clock()
        self.next_line = self.started + self.after
        self.spoke = False

    def say(self, text: str, force: bool = False) -> None:
        """Print `text` if this run has already been reported on or has been running for `after`
        seconds (a phase of a long run: metrics, writing); `force` prints it anyway."""
        now = self.clock()
        if force or self.spoke or now >= self.started + self.after:
            prefix = f"{self.label}: " if self.label else ""
            print(f"[{now - self.started:6.1f} s] {prefix}{text}", file=self.stream, flush=True)
            self.spoke = True
            self.next_line = now + self.every

    def watch(self, env, feed):
        """The SimPy process: a line about `feed`'s requests whenever one is due."""
        requests, step, last = feed.requests, 1e-3, self.clock()
        while True:
            yield env.timeout(step)
            if env.peek() == math.inf:  # only this process is left: let the run end as it would
                return
            now = self.clock()
            step = min(max(step * min(4.0, max(0.25, self.check / max(now - last, 1e-9))), MIN_STEP), MAX_STEP)
            last = now
            if now >= self.next_line:
                self.count(env.now, _finished(requests), len(requests), feed.index)

    def finish(self, env, feed) -> None:
        """The run's last count, once its event loop has ended (drained, or cut at max_time)."""
        self.count(env.now, _finished(feed.requests), len(feed.requests), feed.index)

    def count(self, simulated: float, finished: int, total: int, arrived: int) -> None:
        """A line about the run so far (a reporter that draws a bar overrides this: cbsim/cli/progress.py)."""
        self.say(f"simulated {simulated:,.1f} s; {finished:,}/{total:,} requests done ({arrived:,} arrived)")


def _finished(requests) -> int:
    """How many of a run's requests are finished (or rejected: done)."""
    if isinstance(requests, RequestTable):
        return requests.done_count()
    return sum(1 for r in requests if r.status >= Status.FINISHED)
