"""What a run in flight has done by a given time, for a router that reads the replicas' outstanding tokens at
an arrival during it (sim/router.py LeastLoaded): stepping one by one would have committed, by then, the run's
steps that ended before the arrival, so those are taken off what the replica's requests still show (the run
is committed at its end, or where a request routed here cuts it: sim/replica.py). A P/D decode run counts its
steps as they end instead (`passed`, Replica._stepped), and a placement cuts it to the step in progress
(`kept`, Replica.settle_run; sim/pd.py reads `tokens_passed`)."""
from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate
from typing import Callable


class RunProgress:
    """`ends[j]`: when step j of the run ends; `done(c)`: the outstanding tokens committing its first c steps
    takes off (c >= 1)."""

    __slots__ = ("ends", "done", "passed", "kept")

    def __init__(self, ends, done: Callable[[int], int]):
        self.ends = ends
        self.done = done
        self.passed = 0  # P/D decode run: its steps that have ended (sim/replica.py _stepped)
        self.kept = len(ends)  # ... its steps that run (fewer once a placement cut it: Replica.settle_run)

    def tokens_passed(self) -> int:
        """Outstanding tokens the steps that have ended (`passed`) took off."""
        return self.done(self.passed) if self.passed else 0

    def tokens_done(self, at: float) -> int:
        """Outstanding tokens the steps that ended before `at` took off."""
        count = bisect_left(self.ends, at)
        return self.done(count) if count else 0

    @classmethod
    def of_decodes(cls, ends, running) -> RunProgress:
        """A run of identical decode steps of `running` (sim/fast_forward.py): a token a row a step, and one
        more for each row whose last token comes in the last step (it leaves then)."""
        rows, count = len(running), len(ends)
        leaving = sum(1 for req in running if req.output_len - req.num_output_tokens == count)
        return cls(ends, lambda c: rows * c + (leaving if c == count else 0))

    @classmethod
    def of_steps(cls, ends, done_by_step: list[int]) -> RunProgress:
        """A run whose step j takes done_by_step[j] off (sim/prompt_run.py tokens_by_step)."""
        done = list(accumulate(done_by_step))
        return cls(ends, lambda c: done[c - 1])
