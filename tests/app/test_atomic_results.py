"""Results that are never half-written or mixed (issue 26, defects 1-4 and 11): a results folder appears
whole, with its completion marker, or not at all; a rerun replaces cbsim's own folder as a whole; a folder
of other files, the current folder and a symlink are refused; a second writer is refused while the first
writes; a kill or a full disk while writing leaves the old folder as it was (cbsim/core/atomic.py)."""
import errno
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from factories import TINY_EXPERIMENT, assert_user_error, cli, write_experiment

from cbsim.core.atomic import MARKER, OutputError, is_complete, require_complete, write_file_atomic

TINY = {**TINY_EXPERIMENT, "output": {"plots": False, "trace": True, "formats": ["parquet", "csv"]}}


def experiment(tmp_path, **changes):
    return write_experiment(tmp_path, {**TINY, **changes})


def listing(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_a_rerun_replaces_the_folder_as_a_whole(tmp_path):
    out = tmp_path / "out"
    assert cli("run", experiment(tmp_path), "--out", out, "-q").exit_code == 0
    assert {"requests.csv", "trace.json", MARKER} <= listing(out)
    result = cli("run", experiment(tmp_path, output={"plots": False, "trace": False, "formats": ["parquet"]}),
                 "--out", out, "-q")
    assert result.exit_code == 0, result.output
    assert listing(out) == {"config.yaml", "requests.parquet", "steps.parquet", "summary.json", "bench.json", MARKER}
    assert "5 files" in result.output  # what it says is what is there (besides the marker)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize("value", ["", ".", "./"])
def test_the_current_folder_is_refused(tmp_path, value, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exp = experiment(tmp_path)
    assert_user_error(cli("run", exp, "--out", value), "--out", "current")
    assert listing(tmp_path) == {"exp.yaml"}


def test_a_folder_holding_the_current_one_is_refused(tmp_path, monkeypatch):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    assert_user_error(cli("run", experiment(tmp_path), "--out", tmp_path), "--out", "current folder")


def test_a_folder_of_other_files_needs_overwrite(tmp_path):
    exp = experiment(tmp_path)
    assert_user_error(cli("run", exp, "--out", tmp_path), "--out", "--overwrite")
    assert listing(tmp_path) == {"exp.yaml"}
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert cli("run", exp, "--out", other, "--overwrite", "-q").exit_code == 0
    assert "notes.txt" not in listing(other) and is_complete(other)


def test_a_symlinked_folder_or_file_is_never_written_through(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    assert_user_error(cli("run", experiment(tmp_path), "--out", tmp_path / "link"), "symlink")
    assert listing(real) == set()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (tmp_path / "f.json").symlink_to(victim)
    with pytest.raises(OutputError, match="symlink"):
        write_file_atomic(tmp_path / "f.json", lambda tmp: tmp.write_text("{}"))
    assert victim.read_text() == "keep"


def test_a_second_writer_is_refused_while_the_first_holds_the_lock(tmp_path):
    out = tmp_path / "out"
    with open(tmp_path / ".out.lock", "a") as handle:  # another process's lock, as flock sees it
        fcntl.flock(handle, fcntl.LOCK_EX)
        assert_user_error(cli("run", experiment(tmp_path), "--out", out), "another cbsim process")
    assert not out.exists()
    assert cli("run", experiment(tmp_path), "--out", out, "-q").exit_code == 0


def test_an_error_while_writing_leaves_the_old_folder_whole(tmp_path, monkeypatch):
    out = tmp_path / "out"
    assert cli("run", experiment(tmp_path), "--out", out, "-q").exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("cbsim.api.bench_result", full)  # after the tables: a disk that fills mid-way
    result = cli("run", experiment(tmp_path, seed=4), "--out", out)
    assert_user_error(result, str(out), "No space left on device", "nothing was written")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert listing(tmp_path) == {"exp.yaml", "out", ".out.lock"}


def test_a_full_disk_writing_a_single_file_leaves_nothing(tmp_path):
    def half(tmp: Path):
        tmp.write_text("a,b\n1,")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OutputError, match="No space left"):
        write_file_atomic(tmp_path / "t.csv", half)
    assert listing(tmp_path) == set()


def test_a_reader_refuses_an_incomplete_folder(tmp_path):
    with pytest.raises(OutputError, match="does not exist"):
        require_complete(tmp_path / "none")
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "summary.json").write_text("{}")
    with pytest.raises(OutputError, match="cut short"):
        require_complete(tmp_path / "cut")


KILL_RUN = {**TINY, "workload": {"num_requests": 20000, "arrival": {"type": "poisson", "rate": 200.0},
                                 "prompt_len": {"type": "uniform", "min": 10, "max": 300},
                                 "output_len": {"type": "uniform", "min": 1, "max": 40}},
            "cluster": {"kv_cache": {"num_blocks": 20000}}, "output": {"plots": False, "formats": ["csv"]}}


def test_a_kill_while_writing_leaves_no_folder_then_a_rerun_writes_it(tmp_path):
    out = tmp_path / "out"
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(KILL_RUN))
    proc = subprocess.Popen([sys.executable, "-m", "cbsim.cli", "run", str(exp), "--out", str(out), "-q"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.tmp-*/steps.csv")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed while writing"
    assert not out.exists()  # never a folder with a table cut short under its final name
    assert cli("run", exp, "--out", out, "-q").exit_code == 0
    assert is_complete(out) and not list(tmp_path.glob(".out.tmp-*"))


def test_a_second_run_into_the_folder_of_a_running_one_is_refused_at_once(tmp_path):
    """Two real runs: the second exits 2 before simulating while the first holds the folder's lock; the
    first then writes its folder whole (issue 26, defect 3: both exited 0 and left a mixture)."""
    out = tmp_path / "out"
    exp = tmp_path / "exp.yaml"
    exp.write_text(yaml.safe_dump(KILL_RUN))
    first = subprocess.Popen([sys.executable, "-m", "cbsim.cli", "run", str(exp), "--out", str(out), "-q"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=tmp_path)
    lock = tmp_path / ".out.lock"
    deadline = time.monotonic() + 60
    while first.poll() is None and time.monotonic() < deadline:
        if lock.exists():
            with open(lock, "a") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    fcntl.flock(handle, fcntl.LOCK_UN)
                except OSError:
                    break  # the first run holds it
        time.sleep(0.01)
    assert first.poll() is None, "the first run ended before the second could start"
    second = cli("run", experiment(tmp_path, seed=9), "--out", out, "-q")
    assert_user_error(second, "another cbsim process is writing this folder")
    assert first.wait(timeout=300) == 0, first.stderr.read()
    assert is_complete(out) and yaml.safe_load((out / "config.yaml").read_text())["seed"] == KILL_RUN["seed"]


def test_an_earlier_runs_folder_without_the_marker_is_replaced(tmp_path):
    """Results written before the marker existed (only a run's own files) are cbsim's: replaced without
    --overwrite; one file of the user's among them makes the folder theirs."""
    out = tmp_path / "out"
    assert cli("run", experiment(tmp_path), "--out", out, "-q").exit_code == 0
    (out / MARKER).unlink()
    assert cli("run", experiment(tmp_path, seed=4), "--out", out, "-q").exit_code == 0
    assert is_complete(out)
    (out / MARKER).unlink()
    (out / "notes.txt").write_text("mine")
    assert_user_error(cli("run", experiment(tmp_path), "--out", out), "--overwrite")
