"""Faults during a sweep (issue 26, defects 10 and 16): a worker process that dies ends the sweep with
one line saying so and that a rerun resumes (exit code 2, no BrokenProcessPool traceback), and the rerun
does resume; a damaged point file is run again, not a traceback."""
import os
import signal

import yaml

from factories import TINY_EXPERIMENT, cli

import cbsim.tools.sweep.sweep
from cbsim.core.atomic import is_complete
from cbsim.tools.sweep.sweep import run_point, run_sweep

SPEC = {"name": "faults", "base": TINY_EXPERIMENT, "grid": {"policy.token_budget": [64, 128, 256]}}


def dies_at_256(point):
    """run_point, except that the worker running token budget 256 is killed (as the OOM killer would)."""
    if point.params.get("policy.token_budget") == 256:
        os.kill(os.getpid(), signal.SIGKILL)
    return run_point(point)


def test_a_dead_worker_is_one_line_and_the_rerun_resumes(tmp_path, monkeypatch):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    out = tmp_path / "out"
    monkeypatch.setattr(cbsim.tools.sweep.sweep, "run_point", dies_at_256)
    result = cli("sweep", spec, "--out", out, "--workers", 2, "--no-plots")
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    last = result.output.strip().splitlines()[-1]  # after the progress bar: one line
    assert last.startswith("error: a worker process died") and "rerun the same command to resume" in last
    monkeypatch.undo()
    assert not is_complete(out)  # points only: no results table, no completion marker
    kept = len(list((out / "points").glob("*.json"))) if (out / "points").exists() else 0
    calls = []
    table = run_sweep(SPEC, out_dir=out, workers=1, on_point=lambda record, done, total: calls.append(done))
    assert list(table["status"]) == ["ok"] * 3 and len(calls) == 3 - kept
    assert is_complete(out) and (out / "results.parquet").is_file()


def test_a_damaged_point_file_is_run_again(tmp_path):
    out = tmp_path / "out"
    first = run_sweep(SPEC, out_dir=out, workers=1)
    files = sorted((out / "points").glob("*.json"))
    files[0].write_text('{"point_id": "x", "stat')  # cut short by hand
    files[1].write_text("[" * 5000)
    calls = []
    again = run_sweep(SPEC, out_dir=out, workers=1, on_point=lambda record, done, total: calls.append(record))
    assert len(calls) == 2
    cols = [c for c in first.columns if c not in ("wall_seconds", "sim_wall_seconds")]
    assert again[cols].equals(first[cols])


def test_a_second_sweep_into_a_folder_being_written_is_refused(tmp_path):
    import fcntl

    spec = tmp_path / "sweep.yaml"
    spec.write_text(yaml.safe_dump(SPEC))
    with open(tmp_path / ".out.lock", "a") as handle:  # the first sweep's lock, as flock sees it
        fcntl.flock(handle, fcntl.LOCK_EX)
        result = cli("sweep", spec, "--out", tmp_path / "out", "--workers", 1, "--no-plots")
    assert result.exit_code == 2 and "another cbsim process is writing this folder" in result.output
    assert not (tmp_path / "out").exists()
