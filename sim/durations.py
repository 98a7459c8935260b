"""The guard on every duration the event loop schedules: step times and KV transfer times.

Invariant: a step or transfer that is scheduled lasts >= 0 s and ends at a finite time below
CLOCK_LIMIT; a step that runs tokens ends strictly after it starts (the replica's steps stay in
order). A NaN time would stall the clock (a hang), and a zero, negative or unresolvable step breaks
the order of steps; either raises a DurationError naming the config key whose value produced it,
when the step or transfer is scheduled.

Why CLOCK_LIMIT = 2**32 s (136 years): the clock is a float64 of seconds, whose spacing at t is
t * 2**-52; at 2**32 s that is 2**-20 s, about one microsecond, the scale of the shortest steps.
Beyond it a step no longer moves the clock by what it lasts, so no run can mean anything there
(a transfer at cluster.link.bandwidth_gb_s = 1e-300 would end ~1e297 s later).

The check on the hot path is one chained float comparison per step (`start < end < CLOCK_LIMIT`),
two per transfer and one vectorised comparison per fast-forwarded run of steps; the functions
here are called only when it fails, to find the culprit and word the error.
"""
from __future__ import annotations

from cbsim.core.errors import ConfigError

CLOCK_LIMIT = 2.0 ** 32  # seconds; see the module docstring


class DurationError(ConfigError):
    """A step or transfer time that is NaN, infinite, negative, zero for real work, or beyond the clock.

    Raised inside a SimPy process, which re-raises a copy built as `type(err)(*err.args)` (as
    pickling does), so `args` holds the constructor's arguments and `str` gives the message."""

    def __init__(self, path: str, expected: str, got=None, file: str | None = None, has_got: bool = True):
        super().__init__(path, expected, got, file, has_got)
        self.args = (path, expected, got, file, has_got)

    def __str__(self) -> str:
        return self._message()


def check_step(key: str, start: float, duration: float, empty: bool, file: str | None = None,
               where: str = "") -> None:
    """Raise a DurationError unless a step of `duration` s from `start` is fine (see the module
    docstring); an empty step may take 0 s. `key`: the config key that sets the step times."""
    if start < start + duration < CLOCK_LIMIT or (empty and duration == 0.0):
        return
    raise DurationError(key, f"finite step times > 0 that end within the simulated clock's range "
                        f"({CLOCK_LIMIT:.3g} s; check the cost model's coefficients and profile){where}; "
                        f"this step starts at t = {start!r} s and lasts (seconds)", duration, file=file)


def check_run(key: str, start: float, durations, file: str | None = None, where: str = "") -> None:
    """`check_step` for each step of a vectorised run of `durations` (numpy) from `start`; each step
    starts where the one before ends, as the run's cumulative sum has it."""
    for duration in durations.tolist():
        check_step(key, start, duration, False, file, where)
        start = start + duration


def check_transfer(key: str, start: float, duration: float, nbytes: float, where: str = "") -> None:
    """Raise a DurationError unless a transfer of `duration` s from `start` is fine: >= 0 and ending
    below CLOCK_LIMIT (a transfer shorter than the clock resolves at `start` may end as it starts:
    it holds its lane for no time, which breaks no order). `key`: the config key of the link."""
    if 0.0 <= duration and start + duration < CLOCK_LIMIT:
        return
    raise DurationError(key, f"a bandwidth and latency under which transfers end within the simulated clock's "
                        f"range ({CLOCK_LIMIT:.3g} s){where}; a transfer of {nbytes:g} bytes from t = {start!r} s "
                        "would last (seconds)", duration)
