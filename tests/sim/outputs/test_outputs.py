"""What a run writes (parquet by default, CSV and the trace on request, the bytes reported) and the
progress lines of a long run (stderr only, never in an output file, silenced by --quiet)."""
import io
import json

import pandas as pd
import pytest
import yaml
from typer.testing import CliRunner

from cbsim.sim.metrics import densified
from cbsim.api import run_experiment
from cbsim.cli.app import app
from cbsim.core.atomic import MARKER
from cbsim.sim.outputs.progress import Progress

runner = CliRunner()

TINY = {
    "name": "tiny", "seed": 5, "cost_model": {"type": "linear", "base": 0.01, "per_token": 1e-4},
    "cluster": {"replicas": 2, "kv_cache": {"num_blocks": 120}},
    "policy": {"name": "sarathi", "token_budget": 128},
    "workload": {"num_requests": 60, "arrival": {"type": "poisson", "rate": 20.0},
                 "prompt_len": {"type": "uniform", "min": 10, "max": 400},
                 "output_len": {"type": "uniform", "min": 1, "max": 60}},
    "output": {"plots": False},
}
PD = {**TINY, "cluster": {"mode": "pd", "prefill": {"replicas": 1}, "decode": {"replicas": 1},
                          "kv_cache": {"num_blocks": 400}}}
CLOSED = {**TINY, "workload": {**TINY["workload"], "max_concurrency": 4, "think_time": 0.5, "timeout": 5.0}}


def chatty() -> Progress:
    """A progress reporter for which every run is 'long': it speaks at every wake-up."""
    return Progress(io.StringIO(), every=0, after=0)


def outputs(folder) -> dict[str, bytes]:
    """Every file of a results folder, summary.json without its wall-clock entry."""
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    summary = json.loads(files.pop("summary.json"))
    summary.pop("sim_wall_seconds")
    files["summary.json"] = json.dumps(summary).encode()
    return files


def write(tmp_path, data, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_default_run_writes_parquet_and_no_csv_or_trace(tmp_path):
    res = run_experiment(TINY, out_dir=tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"config.yaml", "requests.parquet", "steps.parquet", "summary.json"} <= names
    assert not any(name.endswith(".csv") for name in names) and "trace.json" not in names
    assert res.files == {p.name: p.stat().st_size for p in tmp_path.iterdir() if p.name != MARKER}
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "requests.parquet"), res.requests)
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "steps.parquet"), densified(res.steps))
    assert isinstance(res.steps["preemptions"].dtype, pd.SparseDtype)  # in memory: its non-zero rows only


def test_tables_written_a_row_group_at_a_time_are_the_file_to_parquet_writes(tmp_path, monkeypatch):
    """write_parquet converts ROW_GROUP rows at a time and cuts the groups pyarrow cuts: the same bytes
    (groups of 7 here; pyarrow's own default, checked below, for a run's tables)."""
    from cbsim.sim.outputs import parquet

    res = run_experiment(TINY)
    assert len(res.steps) > 3 * 7 and isinstance(res.steps["padding_tokens"].dtype, pd.SparseDtype)
    monkeypatch.setattr(parquet, "ROW_GROUP", 7)
    for name, frame in (("steps", res.steps), ("requests", res.requests)):
        parquet.write_parquet(frame, tmp_path / f"{name}.parquet")
        densified(frame).to_parquet(tmp_path / f"{name}_whole.parquet", index=False, compression="zstd",
                                    row_group_size=7)
        assert (tmp_path / f"{name}.parquet").read_bytes() == (tmp_path / f"{name}_whole.parquet").read_bytes()
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.undo()
    pq.write_table(pa.table({"x": pa.array(bytes(parquet.ROW_GROUP + 1), pa.int8())}), tmp_path / "default.parquet")
    meta = pq.ParquetFile(tmp_path / "default.parquet").metadata
    assert meta.num_row_groups == 2 and meta.row_group(0).num_rows == parquet.ROW_GROUP  # pyarrow's default


def test_csv_on_request_matches_parquet(tmp_path):
    run_experiment({**TINY, "output": {"plots": False, "formats": ["csv"]}}, out_dir=tmp_path)
    assert (tmp_path / "steps.csv").is_file() and not list(tmp_path.glob("*.parquet"))
    both = run_experiment({**TINY, "output": {"plots": False, "formats": ["csv", "parquet"]}}, out_dir=tmp_path / "b")
    steps = pd.read_csv(tmp_path / "b" / "steps.csv")
    assert len(steps) == len(both.steps) and (tmp_path / "b" / "steps.parquet").is_file()


def test_pd_tables_follow_the_formats(tmp_path):
    run_experiment(PD, out_dir=tmp_path / "p")
    assert (tmp_path / "p" / "transfers.parquet").is_file() and not (tmp_path / "p" / "transfers.csv").exists()
    run_experiment({**PD, "output": {"plots": False, "formats": ["csv"]}}, out_dir=tmp_path / "c")
    assert (tmp_path / "c" / "transfers.csv").is_file() and not (tmp_path / "c" / "transfers.parquet").exists()


def test_trace_is_opt_in_and_sized(tmp_path):
    res = run_experiment({**TINY, "output": {"plots": False, "trace": True}, "metrics": {"trace_max_steps": 10}},
                         out_dir=tmp_path)
    trace = json.loads((tmp_path / "trace.json").read_text())
    assert trace["otherData"]["steps_written"] == 10 and trace["otherData"]["steps_total"] == len(res.steps)
    assert res.files["trace.json"] == (tmp_path / "trace.json").stat().st_size


@pytest.mark.parametrize("config", [TINY, PD, CLOSED], ids=["colocated", "pd", "closed_loop"])
def test_progress_speaks_on_its_stream_and_changes_no_output(tmp_path, config):
    progress = chatty()
    run_experiment({**config, "output": {"plots": False, "trace": True, "formats": ["csv", "parquet"]}},
                   out_dir=tmp_path / "with", progress=progress)
    run_experiment({**config, "output": {"plots": False, "trace": True, "formats": ["csv", "parquet"]}},
                   out_dir=tmp_path / "without")
    lines = progress.stream.getvalue().splitlines()
    assert any("requests done" in line for line in lines) and any("writing" in line for line in lines)
    assert outputs(tmp_path / "with") == outputs(tmp_path / "without")


def test_short_runs_are_silent():
    progress = Progress(io.StringIO())  # the CLI's: nothing before 2 s of wall time
    run_experiment(TINY, progress=progress)
    assert progress.stream.getvalue() == ""


def test_the_watcher_never_keeps_a_run_alive():
    """Alone in the event queue, the watcher stops: a run that would end (or fail) for lack of events
    still does; with max_time the run ends there as before."""
    import simpy

    from cbsim.sim.simulation import ArrivalFeed

    env = simpy.Environment()
    env.process(chatty().watch(env, ArrivalFeed(env, [])))
    env.run()  # returns: nothing else was scheduled
    progress = chatty()
    res = run_experiment({**TINY, "sim": {"max_time": 1.0}}, progress=progress)
    assert res.summary["num_requests"] == 60 and "requests done" in progress.stream.getvalue()


def test_cli_reports_progress_on_stderr_bytes_on_stdout_and_quiet_silences(tmp_path):
    exp = write(tmp_path, TINY)  # the CLI's bar: cbsim/cli/progress.py (tests/cli/test_progress.py)
    loud = runner.invoke(app, ["run", str(exp), "--out", str(tmp_path / "loud")])
    assert loud.exit_code == 0, loud.output
    assert "60/60" in loud.stderr and "60/60" not in loud.stdout
    assert "results: " in loud.stdout and "steps.parquet" in loud.stdout and " kB" in loud.stdout
    quiet = runner.invoke(app, ["run", str(exp), "--quiet", "--out", str(tmp_path / "quiet")])
    assert quiet.exit_code == 0, quiet.output
    assert quiet.stderr == ""
    assert outputs(tmp_path / "loud") == outputs(tmp_path / "quiet")


def test_capacity_reports_each_probe_run_under_its_rate():
    from cbsim.tools.sweep.capacity import find_capacity

    progress = chatty()
    find_capacity(TINY, {"ttft_p99": 100.0}, hi=40.0, rel_tol=1.0, progress=progress)
    text = progress.stream.getvalue()
    assert "rate 20, seed 0: simulated" in text and "rate 40, seed 0: simulated" in text


def test_capacity_cli_progress_and_quiet(tmp_path):
    args = ["capacity", str(write(tmp_path, TINY)), "--slo", "ttft_p99=100s", "--hi", "40", "--tol", "1"]
    loud, quiet = runner.invoke(app, args), runner.invoke(app, args + ["--quiet"])
    assert loud.exit_code == quiet.exit_code == 0, loud.output + quiet.output
    assert "rate 40, seed 0" in loud.stderr and loud.stdout == quiet.stdout
    assert [line for line in quiet.stderr.splitlines() if not line.startswith("warning: ")] == []  # no progress


def test_the_trace_has_a_lane_per_request(tmp_path):
    """Perfetto lanes (sim/outputs/request_lanes.py): queue, prefill, decode back to back on each request's
    track, KV hops of a P/D hand-off on it too, capped by metrics.trace_max_requests."""
    import json

    from cbsim.sim.outputs.request_lanes import REQUESTS_PID

    results = run_experiment("experiments/pd_vs_colocated.yaml", overrides=[
        "workload.num_requests=12", "output.trace=true", "output.plots=false", "metrics.trace_max_requests=10"],
        out_dir=tmp_path)
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    lanes = [e for e in events if e.get("pid") == REQUESTS_PID and e["ph"] == "X"]
    by_request: dict = {}
    for e in lanes:
        by_request.setdefault(e["tid"], {})[e["name"]] = e
    first = results.requests.sort_values(["arrival", "request_id"]).head(10)["request_id"]
    assert sorted(by_request) == sorted(first)  # the first ten by arrival, no more
    for spans in by_request.values():
        queue, prefill, decode = spans["queue"], spans["prefill"], spans["decode"]
        assert queue["ts"] + queue["dur"] == pytest.approx(prefill["ts"], abs=0.01)  # microseconds, rounded
        assert prefill["ts"] + prefill["dur"] == pytest.approx(decode["ts"], abs=0.01)
        assert "transfer p2p" in spans
    run_experiment("experiments/pd_vs_colocated.yaml", overrides=[
        "workload.num_requests=12", "output.trace=true", "output.plots=false", "metrics.trace_max_requests=0"],
        out_dir=tmp_path / "none")
    events = json.loads((tmp_path / "none" / "trace.json").read_text())["traceEvents"]
    assert not any(e.get("pid") == REQUESTS_PID for e in events)


def test_figures_drawn_side_by_side_are_the_files_drawn_here(tmp_path):
    """Results.write draws the figures in forked processes where it can (sim/outputs/side_by_side.py);
    every file, PNGs included, is byte for byte what drawing them here writes, and listed in the same order."""
    res = run_experiment({**TINY, "output": {"plots": True, "trace": True}})
    res.write(tmp_path / "here", parallel=False)
    here = dict(res.files)
    res.write(tmp_path / "forked", parallel=True)
    assert list(res.files) == list(here) and any(name.endswith(".png") for name in here)
    for name in here:
        assert (tmp_path / "forked" / name).read_bytes() == (tmp_path / "here" / name).read_bytes(), name


def test_a_figure_that_fails_in_a_worker_raises_with_its_traceback(tmp_path, monkeypatch):
    import cbsim.sim.outputs.plots as plots

    def broken(*args, **kwargs):
        raise ValueError("no such panel")

    monkeypatch.setattr(plots, "plot_latency_cdf", broken)
    res = run_experiment({**TINY, "output": {"plots": True}})
    for parallel in (True, False):
        with pytest.raises((RuntimeError, ValueError), match="no such panel"):
            res.write(tmp_path / str(parallel), parallel=parallel)


def test_a_run_without_plots_never_imports_matplotlib(tmp_path):
    """No work for outputs nobody asked for: matplotlib (~0.5 s to import) loads only for a run that plots."""
    import subprocess
    import sys

    exp = write(tmp_path, TINY)  # output.plots: false
    code = ("import sys; from cbsim.cli.app import app; from typer.testing import CliRunner; "
            f"r = CliRunner().invoke(app, ['run', {str(exp)!r}, '--quiet', '--out', {str(tmp_path / 'out')!r}]); "
            "assert r.exit_code == 0, r.output; print(sorted(m for m in sys.modules if m.startswith('matplotlib'))[:3])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_a_full_disk_while_a_worker_draws_is_an_os_error_and_no_folder(tmp_path, monkeypatch):
    """A figure that cannot be written (ENOSPC) in a forked worker raises the OSError itself in the parent,
    which the CLI reports in one line (issue 26, defect 11); the results folder is not written at all."""
    import errno

    import cbsim.sim.outputs.plots as plots

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "latency_cdf.png")

    monkeypatch.setattr(plots, "plot_latency_cdf", full)
    res = run_experiment({**TINY, "output": {"plots": True}})
    for parallel in (True, False):
        with pytest.raises(Exception, match="No space left on device") as err:
            res.write(tmp_path / str(parallel), parallel=parallel)
        assert err.type.__name__ == "OutputError" and not (tmp_path / str(parallel)).exists()


def test_capacity_warns_when_probes_are_short(tmp_path):
    from cbsim.tools.sweep.capacity import MIN_STEADY_SECONDS, short_probe_warning

    assert short_probe_warning(MIN_STEADY_SECONDS) is None and short_probe_warning(None) is None
    assert "simulated only 5.0 s" in short_probe_warning(5.0, "sarathi")
    args = ["capacity", str(write(tmp_path, TINY)), "--slo", "ttft_p99=10s", "--hi", "40", "--tol", "1", "-q"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "warning: sarathi: a capacity probe simulated only" in result.stderr
