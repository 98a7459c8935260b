"""The Python entry points: run_experiment(config) -> Results, load_cost_model(mapping).

A run is a function: build -> simulate -> measure -> write. It builds everything from the config
(parsed once when loaded) and one seeded numpy Generator (the composition root: build.py),
simulates, computes metrics with pandas, and writes its own output folder only when asked.
The CLI, notebooks, sweeps and CI all call run_experiment.
"""
from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import yaml

from cbsim.core.atomic import results_folder
from cbsim.sim.costmodels import load_cost_model as load
from cbsim.sim.costmodels.domain import warn_run_outside
from cbsim.sim.metrics.knee import load_summary
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.costmodels.catalog.specs import DEFAULT_MODEL
from cbsim.sim import metrics
from cbsim.sim.admission import REASON_PREFIX
from cbsim.band import band_plan, band_summary
from cbsim.bench_result import bench_result
from cbsim.build import client_frontend, simulate_run
from cbsim.sim.metrics.client_view import client_view
from cbsim.replica_gpus import hardware_of
from cbsim.sim.metrics.step_table import StepTable
from cbsim.sim.metrics.summary import usage_summary
from cbsim.sim.outputs.parquet import write_csv, write_parquet
from cbsim.sim.outputs.side_by_side import run_side_by_side
from cbsim.sim.outputs.trace_export import write_chrome_trace
from cbsim.workloads import build_run

from cbsim.config import ExperimentConfig, load_config, parsed_sections
from cbsim.core.errors import ConfigError
from cbsim.replica_gpus import num_gpus


@dataclass
class Results:
    """What a run produced: per-request and per-step tables, the summary, and the raw record.

    `steps` (the step table as one pandas frame) is built when first read and then kept; the run's own
    metrics and files read `step_table` (sim/metrics/step_table.py: a column or a block of rows at a
    time), so `cbsim run` never holds the whole frame (830 MB of columns at a million requests)."""

    config: ExperimentConfig
    requests: pd.DataFrame
    step_table: StepTable
    summary: dict
    itl: object  # cbsim.sim.metrics.ITLDistribution
    recorder: object  # cbsim.sim.metrics.recorder.Recorder
    shapes: list | None = None  # sampled step shapes (output.shapes > 0)
    out_dir: Path | None = None
    pools: dict | None = None  # pool name -> replica indices ({"cluster": [...]}, or prefill and decode)
    preemptions: pd.DataFrame | None = None  # one row per preemption (metrics.preemption_frame)
    transfers: pd.DataFrame | None = None  # every booked transfer: host swaps, P/D hops (metrics.transfer_frame)
    handoffs: pd.DataFrame | None = None  # P/D: one row per hand-off (metrics.handoff_frame)
    turns: pd.DataFrame | None = None  # agentic sessions: one row per turn (metrics.turn_frame)
    sessions: pd.DataFrame | None = None  # agentic sessions: one row per agent (metrics.session_frame)
    kv_tiers: pd.DataFrame | None = None  # lower KV tiers' occupancy over time (metrics.tier_occupancy)
    kv_blocks: dict | None = None  # replica index -> KV blocks of its cache
    kv_unit_tokens: float | None = None  # tokens one of those blocks holds (a sliding window's units: fewer)
    files: dict | None = None  # what write() wrote: file name -> bytes

    @cached_property
    def steps(self) -> pd.DataFrame:
        """One row per step (metrics.step_frame with the efficiency columns), made when first read."""
        return self.step_table.frame()

    def token_times(self, request_id: int) -> np.ndarray:
        """Every output-token time of one request (expanded from the compact token runs)."""
        return metrics.token_times(self.recorder, request_id)

    def write(self, out_dir: str | Path, progress=None, parallel: bool | None = None, overwrite: bool = False,
              also: Callable[[Path], list[Path]] | None = None) -> Path:
        """Write config, tables (output.formats), summary, plots, dashboards and trace into `out_dir`;
        `files` then maps each file written to its size in bytes. `progress` (sim/outputs/progress.py) names
        each phase of a long run's writing. The figures are drawn in forked processes while the tables
        and the trace are written (sim/outputs/side_by_side.py: where forking is safe; `parallel`
        False draws them here first); every file is the same either way. The folder appears whole or
        not at all, replacing cbsim's previous results there as a whole, or a folder of other files only
        with `overwrite` (cbsim/core/atomic.py); `also(folder)` writes more files into it first."""
        out = Path(out_dir)
        say = progress.say if progress is not None else lambda text: None
        figures = [self._write_plots, self._write_dashboards] if self.config.output.plots else []
        if figures:  # imported once here, not once per forked process
            import cbsim.sim.outputs.dashboard  # noqa: F401 - lazy: matplotlib (~0.5 s), only for a run that plots
            import cbsim.sim.outputs.plots  # noqa: F401
        with results_folder(out, overwrite=overwrite) as staging:
            written = run_side_by_side(lambda: self._write_files(staging, say, out),
                                       [lambda job=job: job(staging) for job in figures], parallel)
            written += also(staging) if also is not None else []
            files = {file.name: file.stat().st_size for file in _in_order(written)}
        self.out_dir = out
        self.files = files
        return out

    def _write_files(self, out: Path, say, shown: Path) -> list[Path]:
        """Config, tables, summary, bench.json, trace and shapes: the files that are not figures (`shown`:
        the folder's name in the progress line; `out` is where they are written until complete)."""
        cfg = self.config
        written: list[Path] = []

        def path(name: str) -> Path:  # a file this call writes
            written.append(out / name)
            return written[-1]

        say(f"writing tables to {shown}" + (" (and plotting)" if cfg.output.plots else ""))
        path("config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        tables = (("requests", self.requests), ("steps", self.step_table), ("preemptions", self.preemptions),
                  ("transfers", self.transfers), ("sessions", self.sessions), ("session_turns", self.turns),
                  ("kv_tiers", self.kv_tiers))
        for name, frame in tables:
            if frame is None or (name in ("preemptions", "transfers") and not len(frame)):
                continue
            if "parquet" in cfg.output.formats:
                write_parquet(frame, path(f"{name}.parquet"))  # a row group at a time: the same file
            if "csv" in cfg.output.formats:
                write_csv(frame, path(f"{name}.csv"))  # a block of rows at a time: the same file
        path("summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")
        bench = bench_result(self, cfg.metrics.percentiles, details=cfg.output.bench_details)
        path("bench.json").write_text(json.dumps(bench, indent=2) + "\n")
        if cfg.output.trace:
            say("writing trace.json")
            write_chrome_trace(self.step_table, path("trace.json"), cfg.metrics.trace_max_steps, self.requests,
                               self.transfers, cfg.metrics.trace_max_requests)
        if self.shapes:
            with open(path("shapes.jsonl"), "w") as handle:
                for shape in self.shapes:
                    handle.write(json.dumps({"prefill": [list(p) for p in shape.prefill],
                                             "decode": list(shape.decode)}) + "\n")
        return written

    def _write_plots(self, out: Path) -> list[Path]:
        """latency_cdf.png, step_timeline.png, kv_usage.png (sim/outputs/plots.py)."""
        from cbsim.sim.outputs.plots import plot_run  # lazy: matplotlib, as in write

        cfg = self.config
        written = plot_run(self.requests, self.steps, self.itl.values, self.itl.weights, out,
                           stalls=metrics.stall_events(self.itl, cfg.metrics.stall_factor),
                           cdf_max_points=cfg.metrics.cdf_max_points, pools=self.pools, kv_blocks=self.kv_blocks,
                           transfers=self.transfers, handoffs=self.handoffs, kv_tiers=self.kv_tiers)
        if self.turns is not None and self.turns["complete"].any():  # agentic: one session's turns on a timeline
            from cbsim.sim.outputs.session_timeline import plot_session_timeline

            written.append(plot_session_timeline(self.turns, self.requests, out / "session_timeline.png"))
        return written

    def _write_dashboards(self, out: Path) -> list[Path]:
        """dashboard.png (and per pool of a P/D run: sim/outputs/dashboard.py)."""
        from cbsim.sim.outputs.dashboard import write_dashboards  # lazy: matplotlib, as above

        return write_dashboards(self, out)


def _in_order(paths: list[Path]) -> list[Path]:
    """The files in the order a run has always listed them: tables and summaries, figures, then the
    trace and shapes (the figures are written beside the others now, and reported after them)."""
    late = [p for p in paths if p.name in ("trace.json", "shapes.jsonl")]
    return [p for p in paths if p not in late] + late


def _extra_summary(cfg, summary, table, steps, pools, preemptions, transfers, host, handoffs, busy) -> dict:
    """Recovery, admission, per-pool and per-GPU entries of the summary."""
    out = metrics.recovery_summary(preemptions, transfers[host])
    out["num_rejected_admission"] = int(table["reject_reason"].str.startswith(REASON_PREFIX).sum())
    out.update(metrics.pool_summary(steps, table, pools, handoffs, transfers[~host] if handoffs is not None else None,
                                    busy=busy))
    out["num_gpus"] = gpus = num_gpus(cfg)
    goodput = summary.get("goodput_requests_per_s")
    out["goodput_per_gpu"] = None if goodput is None else goodput / gpus
    return out


def load_cost_model(mapping: dict, model=DEFAULT_MODEL):
    """The cost model a YAML `cost_model:` mapping describes, for asking step times in a notebook:

    >>> cost = load_cost_model({"type": "roofline", "gpu": "h100", "tp": 1})
    >>> cost.step_time(StepShape.from_batch(prefill=[(512, 0)], decode=[1000] * 8))
    """
    return load(mapping, model_spec(model, "model"))


def sample_shapes(pool, count: int, rng: np.random.Generator) -> list | None:
    """`count` step shapes drawn uniformly (seeded, in step order) from every replica's log."""
    if count <= 0:
        return None
    shapes = [shape for replica in pool for shape in replica.shapes if not shape.is_empty]
    if len(shapes) <= count:
        return shapes
    return [shapes[i] for i in np.sort(rng.choice(len(shapes), size=count, replace=False))]


def run_experiment(config, out_dir: str | Path | None = None, overrides: list[str] | None = None,
                   progress=None, overwrite: bool = False) -> Results:
    """Run one experiment (YAML path, mapping or ExperimentConfig) and return its Results.

    Writes the output folder only when `out_dir` is given (the CLI passes output.dir or results/<name>
    explicitly): running a shipped experiment from Python or a test never overwrites its results.
    `progress`: a cbsim.sim.outputs.progress.Progress that reports a long run as it goes (the CLI passes one
    writing to stderr); None, the default, is silent. It never changes the results. `overwrite`: replace
    a folder of other files at `out_dir` (Results.write).
    """
    cfg = load_config(config, overrides)
    try:
        rng = np.random.default_rng(cfg.seed)
        base_dir = Path(cfg.source).parent if cfg.source else None
        workload = build_run(parsed_sections(cfg).workload, rng, base_dir, as_table=True)
        requests, dropped = workload.requests, workload.dropped
        band = band_plan(cfg, parsed_sections(cfg).cost_models)  # a bad band is refused before simulating
    except ConfigError as err:
        raise err.in_file(cfg.source)
    frontend, client_arrival, in_order = client_frontend(cfg, requests)
    if workload.clients is not None:  # closed loop: the clients' send times, decided by the run
        workload.clients.client_arrival = client_arrival
    started = time.perf_counter()
    recorder, pool, pools, cluster = simulate_run(cfg, in_order, rng, progress, workload.clients)
    wall = time.perf_counter() - started
    if progress is not None:
        progress.say(f"simulated {len(requests):,} requests in {wall:.1f} s; computing metrics")
    steps = StepTable(recorder, hardware_of(cfg, pool, pools))  # columns made as read; MFU, HBM, collectives
    # KV usage and MFU for sweeps, computed here so that its scratch is freed before the request frame and the
    # ITL exist (a lower peak); added to the summary in its place below
    usage = usage_summary(steps, {r.index: r.kv.num_blocks for r in pool})
    busy = metrics.busy_time(steps)  # (likewise: its group sum's scratch freed before the frames exist)
    table = metrics.request_frame(requests, recorder, steps, cfg.metrics)
    if client_arrival is not None:
        table = client_view(table, steps, requests, client_arrival, frontend.terms, cfg.metrics)
    itl = metrics.itl_distribution(recorder, requests, steps)
    summary = metrics.summarize(table, steps, recorder, cfg.metrics, itl=itl)
    summary.update(metrics.rejection_summary(table))  # why requests were rejected, by reason
    summary.update(metrics.mark_cut(table, cfg.sim.max_time))  # what max_time cut (not_arrived relabelled)
    preemptions = metrics.preemption_frame(pool)
    links = [replica.host_link for replica in pool] + (cluster.links if cluster is not None else [])
    links += [link for replica in pool if replica.tiering is not None for link in replica.tiering.links]
    transfers = metrics.transfer_frame(links)
    host = transfers["kind"].isin(["swap_out", "swap_in"])
    handoffs = metrics.handoff_frame(cluster.records.values()) if cluster is not None else None
    if handoffs is not None:
        table = table.merge(handoffs.drop(columns=["prefill_blocks"]), on="request_id", how="left")
    summary.update(_extra_summary(cfg, summary, table, steps, pools, preemptions, transfers, host, handoffs, busy))
    summary.update(load_summary(pool, table, cfg.cluster.mode))  # offered load against capacity (the knee)
    kvs = [replica.kv for replica in pool]
    summary.update(usage)  # KV usage, MFU for sweeps
    if any(kv.prefix is not None for kv in kvs):  # prefix caching on: hit columns and summary keys
        table["cached_tokens"] = metrics.cached_token_column(table["request_id"].to_numpy(), kvs)
        table["readmit_cached_tokens"] = metrics.readmit_hit_column(table["request_id"].to_numpy(), kvs)
        summary.update(metrics.prefix_summary(table, kvs))
        if any(replica.tiering is not None for replica in pool):  # lower KV tiers (cluster.kv_cache.tiers)
            table["restore_wait"] = metrics.restore_wait_column(table["request_id"].to_numpy(), pool)
            summary.update(metrics.tier_summary(table, pool))
    turns = sessions = None
    if workload.agentic is not None:  # agentic sessions: per-turn and per-agent tables, summary keys
        prefix = kvs[0].prefix
        unit = prefix.unit_tokens if prefix is not None else parsed_sections(cfg).workload.hash_block_size
        turns = metrics.turn_frame(table, workload.agentic, unit)
        sessions = metrics.session_frame(turns)
        summary.update(metrics.session_summary(turns, sessions, prefix is not None))
    summary["sim_wall_seconds"] = wall
    if dropped is not None:  # trace rows its rules removed, by rule (workloads/trace_source.py)
        summary["dropped_rows"] = dropped
    summary.update(workload.notes)  # token_lengths: how a text dataset was counted (approximation flagged)
    if workload.clients is not None and workload.clients.timeout is not None:
        summary["num_timed_out"] = int(table["reject_reason"].str.startswith("timeout").sum())
    if band is not None:  # the run again at the step-time bounds (cbsim/band.py)
        summary.update(band_summary(band, run_experiment))
    shapes = sample_shapes(pool, cfg.output.shapes, np.random.default_rng([cfg.seed, 1]))
    warn_run_outside([replica.cost for replica in pool], steps, table)  # a calibrated engine's domain
    results = Results(cfg, table, steps, summary, itl, recorder, shapes, pools=pools, preemptions=preemptions,
                      transfers=transfers, handoffs=handoffs, kv_blocks={r.index: r.kv.num_blocks for r in pool},
                      kv_tiers=metrics.tier_occupancy(pool) if any(r.tiering is not None for r in pool) else None,
                      kv_unit_tokens=pool[0].kv.unit_tokens, turns=turns, sessions=sessions)
    if out_dir is not None:
        # the run's objects (replicas, caches, the request columns the table was made from) are not written:
        # freed first, so that the writing's scratch takes their place (a lower peak at a million requests)
        del workload, requests, in_order, pool, cluster, kvs, links
        gc.collect()  # (the replicas and the event loop hold each other)
        results.write(out_dir, progress, overwrite=overwrite)
    return results
