"""Writing a run's output files side by side: the figures (matplotlib, most of the writing time) are
drawn in forked child processes while this process writes the tables and the trace.

Invariant: every file is exactly what its job writes when run in this process; a child changes only
when it is written (a test compares the two byte for byte). A child is a fork, so it reads the
results already in memory, nothing is pickled; it reports the paths it wrote, or its traceback,
through a pipe, and ends with os._exit (no atexit handlers, no second flush of this process's
buffers). Forking is used only where it is safe and pays: Linux (macOS's system libraries are not
fork-safe; Windows has no fork), no other thread running (a fork copies only the calling thread, so
a lock another thread held would stay held in the child), and a CPU to spare (more than one, and a
load average at least one below their count: on a saturated machine the children only take turns,
and each costs a little CPU of its own); anywhere else the jobs run here, one after another.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from pathlib import Path
from typing import Callable

Job = Callable[[], list]  # writes files, returns their paths


def can_fork() -> bool:
    """Whether jobs may run in forked children here (see the module docstring)."""
    cpus = os.cpu_count() or 1
    return (sys.platform.startswith("linux") and hasattr(os, "fork") and threading.active_count() == 1
            and cpus > 1 and os.getloadavg()[0] <= cpus - 1)


def run_side_by_side(here: Job, jobs: list[Job], parallel: bool | None = None) -> list[Path]:
    """Run `here` in this process and each of `jobs` in a forked child at the same time (all here, one
    after another, when `parallel` is False, or by default when can_fork() says no). Returns the paths
    written: `here`'s, then each job's in order. A failed job raises here, with the child's traceback."""
    if not jobs or not (can_fork() if parallel is None else parallel):
        return [Path(p) for job in (here, *jobs) for p in job()]
    sys.stdout.flush()
    sys.stderr.flush()
    children = [_fork(job) for job in jobs]
    try:
        paths = [Path(p) for p in here()]
    finally:
        reports = [_join(pid, pipe) for pid, pipe in children]
    for report in reports:
        if report.get("os_error"):
            raise OSError(*report["os_error"])
        if not report["ok"]:
            raise RuntimeError("writing an output file failed in a worker process:\n" + report["error"])
    return paths + [Path(p) for report in reports for p in report["paths"]]


def _fork(job: Job) -> tuple[int, int]:
    """(pid, read end of its pipe) of a child running `job`."""
    read, write = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write)
        return pid, read
    try:  # the child: never returns
        os.close(read)
        try:
            report = {"ok": True, "paths": [str(p) for p in job()]}
        except OSError as err:  # the disk, not the code (full, read-only): the parent raises it as such
            report = {"ok": False, "error": traceback.format_exc(), "os_error": [err.errno, err.strerror, err.filename]}
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            report = {"ok": False, "error": traceback.format_exc()}
        data = json.dumps(report).encode()
        while data:
            data = data[os.write(write, data):]
    finally:
        os._exit(0)


def _join(pid: int, read: int) -> dict:
    """The report of child `pid`, once it has ended."""
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if not chunks:
        return {"ok": False, "error": f"process {pid} ended without a report (wait status {status})"}
    return json.loads(b"".join(chunks))
