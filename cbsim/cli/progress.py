"""The one progress style of `run`, `sweep`, `capacity` and `tune`: a rich bar on stderr naming what runs.

Each command opens a `Reporter` around the work and prints its results only after the `with` block
ends, so no progress is ever drawn after the summary. A bar reads `run quickstart ━━━━ 412/1000
simulated 31.2 s, 530 arrived 0:00:04`: what runs (the experiment, the sweep and its last point, the
capacity probe's rate and seed, the tune stage and candidate), how much is done, the latest status, the
wall time. In a terminal the bar is redrawn as the work goes; when stderr is not a terminal (a pipe, a CI
log) rich draws it once, as it ends. It is off with -q, --log-level warning or error (logs.progress_wanted).

Reporting never changes results: a run's bar is fed by the SimPy watcher of sim/outputs/progress.py,
which only reads the clock and the requests' status.
"""
from __future__ import annotations

import sys

from cbsim.cli.logs import progress_wanted
from cbsim.sim.outputs.progress import Progress


class Reporter:
    """The bars of one command; `with Reporter(quiet) as report:` around the work, results after it."""

    def __init__(self, quiet: bool = False):
        from rich.console import Console  # lazy: rich is only for the commands that run simulations
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bars
        from rich.table import Column

        # what runs is never cut; the status gives way first (120 columns when stderr is not a terminal)
        columns = (TextColumn("{task.description}", table_column=Column(no_wrap=True, min_width=20)),
                   BarColumn(bar_width=20, table_column=Column(min_width=10)),
                   MofNCompleteColumn(table_column=Column(no_wrap=True, min_width=7)),
                   TextColumn("{task.fields[status]}", table_column=Column(no_wrap=True, overflow="ellipsis",
                                                                           max_width=40)),
                   TimeElapsedColumn(table_column=Column(no_wrap=True, min_width=7)))
        # stdout is redirected through the bar only when it is a terminal too (then they share one screen);
        # a piped stdout keeps the results apart from the bar
        self.bars = Bars(*columns, console=Console(stderr=True, width=None if sys.stderr.isatty() else 120),
                         disable=not progress_wanted(quiet),
                         redirect_stdout=sys.stdout.isatty())

    def __enter__(self) -> "Reporter":
        self.bars.start()
        return self

    def __exit__(self, kind, error, trace) -> None:
        if kind is not None:  # a failed command prints its one error line alone: the bar is wiped
            self.bars.live.transient = True
        self.bars.stop()

    def task(self, name: str, total: int | None = None) -> int:
        """A new bar named `name` (what it runs), `total` steps (None: not known yet)."""
        return self.bars.add_task(name, total=total, status="")

    def update(self, task: int, done: int | None = None, total: int | None = None, status: str | None = None,
               name: str | None = None) -> None:
        """Move bar `task` to `done` of `total`, show `status`, rename it `name` (each when given)."""
        fields = {"status": status} if status is not None else {}
        self.bars.update(task, completed=done, total=total, description=name, **fields)

    def runs(self, name: str) -> "RunBar | None":
        """The watcher that draws simulation runs as bar `name` (run, capacity's probes); None when off, so
        that a quiet run has no watcher at all."""
        return None if self.bars.disable else RunBar(self, name)


class RunBar(Progress):
    """sim/outputs/progress.py's watcher drawing on a bar: requests finished of all, the simulated time;
    `restart(label)` names the next run (a capacity probe's rate and seed) after `name`."""

    def __init__(self, reporter: Reporter, name: str):
        self.reporter, self.name = reporter, name
        self.bar = reporter.task(name)
        super().__init__(every=0.2, after=0.0)

    def restart(self, label: str = "") -> None:
        super().restart(label)
        if hasattr(self, "bar"):
            self.reporter.update(self.bar, done=0, name=f"{self.name}: {label}" if label else self.name,
                                 status="")

    def say(self, text: str, force: bool = False) -> None:
        self.reporter.update(self.bar, status=text)

    def count(self, simulated: float, finished: int, total: int, arrived: int) -> None:
        self.reporter.update(self.bar, done=finished, total=total,
                             status=f"simulated {simulated:,.1f} s, {arrived:,} arrived")
