"""The Python entry points: run_experiment(config) -> Results, load_cost_model(mapping).

A run is a function: it builds everything from the config and one seeded numpy Generator,
simulates, computes metrics with pandas, and writes its own output folder only when asked.
The CLI, notebooks, sweeps and CI all call run_experiment.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from cbsim.policies import make_policy
from cbsim.profiler.costmodels import load_cost_model as load
from cbsim.profiler.costmodels.registry import engine_of
from cbsim.profiler.kv_window import cache_window
from cbsim.profiler.specs import DEFAULT_MODEL, model_spec
from cbsim.sim import metrics
from cbsim.sim.admission import REASON_PREFIX
from cbsim.sim.kv_cache import KVCache
from cbsim.sim.metrics.bench_result import bench_result
from cbsim.sim.metrics.client_view import client_view, frontend_delays, shift_arrivals
from cbsim.sim.metrics.step_efficiency import hardware_of, with_efficiency
from cbsim.sim.metrics.summary import usage_summary
from cbsim.sim.outputs.parquet import write_parquet
from cbsim.sim.outputs.side_by_side import run_side_by_side
from cbsim.sim.outputs.trace_export import write_chrome_trace
from cbsim.sim.pd import PDSettings, PoolParts, simulate_pd
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request_table import RequestTable
from cbsim.sim.simulation import simulate
from cbsim.workloads import build_run, parse_workload

from .config import ExperimentConfig, load_config
from .errors import ConfigError
from .pools import pool_config
from .replica_gpus import kv_bytes_per_gpu, num_gpus, replica_kv_blocks


@dataclass
class Results:
    """What a run produced: per-request and per-step tables, the summary, and the raw record."""

    config: ExperimentConfig
    requests: pd.DataFrame
    steps: pd.DataFrame
    summary: dict
    itl: object  # cbsim.sim.metrics.ITLDistribution
    recorder: object  # cbsim.sim.metrics.recorder.Recorder
    shapes: list | None = None  # sampled step shapes (output.shapes > 0)
    out_dir: Path | None = None
    pools: dict | None = None  # pool name -> replica indices ({"cluster": [...]}, or prefill and decode)
    preemptions: pd.DataFrame | None = None  # one row per preemption (metrics.preemption_frame)
    transfers: pd.DataFrame | None = None  # every booked transfer: host swaps, P/D hops (metrics.transfer_frame)
    handoffs: pd.DataFrame | None = None  # P/D: one row per hand-off (metrics.handoff_frame)
    kv_blocks: dict | None = None  # replica index -> KV blocks of its cache
    kv_unit_tokens: float | None = None  # tokens one of those blocks holds (a sliding window's units: fewer)
    files: dict | None = None  # what write() wrote: file name -> bytes

    def token_times(self, request_id: int) -> np.ndarray:
        """Every output-token time of one request (expanded from the compact token runs)."""
        return metrics.token_times(self.recorder, request_id)

    def write(self, out_dir: str | Path, progress=None, parallel: bool | None = None) -> Path:
        """Write config, tables (output.formats), summary, plots, dashboards and trace into `out_dir`;
        `files` then maps each file written to its size in bytes. `progress` (sim/outputs/progress.py) names
        each phase of a long run's writing. The figures are drawn in forked processes while the tables
        and the trace are written (sim/outputs/side_by_side.py: where forking is safe; `parallel`
        False draws them here first); every file is the same either way."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        say = progress.say if progress is not None else lambda text: None
        figures = [self._write_plots, self._write_dashboards] if self.config.output.plots else []
        if figures:  # imported once here, not once per forked process
            import cbsim.sim.outputs.dashboard  # noqa: F401 - lazy: matplotlib (~0.5 s), only for a run that plots
            import cbsim.sim.outputs.plots  # noqa: F401
        written = run_side_by_side(lambda: self._write_files(out, say), [lambda job=job: job(out) for job in figures],
                                   parallel)
        self.out_dir = out
        self.files = {file.name: file.stat().st_size for file in _in_order(written)}
        return out

    def _write_files(self, out: Path, say) -> list[Path]:
        """Config, tables, summary, bench.json, trace and shapes: the files that are not figures."""
        cfg = self.config
        written: list[Path] = []

        def path(name: str) -> Path:  # a file this call writes
            written.append(out / name)
            return written[-1]

        say(f"writing tables to {out}" + (" (and plotting)" if cfg.output.plots else ""))
        path("config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        tables = (("requests", self.requests), ("steps", self.steps), ("preemptions", self.preemptions),
                  ("transfers", self.transfers))
        for name, frame in tables:
            if frame is None or (name in ("preemptions", "transfers") and not len(frame)):
                continue
            if "parquet" in cfg.output.formats:
                write_parquet(frame, path(f"{name}.parquet"))  # a row group at a time: the same file
            if "csv" in cfg.output.formats:
                frame.to_csv(path(f"{name}.csv"), index=False)
        path("summary.json").write_text(json.dumps(self.summary, indent=2) + "\n")
        bench = bench_result(self, cfg.metrics.percentiles, details=cfg.output.bench_details)
        path("bench.json").write_text(json.dumps(bench, indent=2) + "\n")
        if cfg.output.trace:
            say("writing trace.json")
            write_chrome_trace(self.steps, path("trace.json"), cfg.metrics.trace_max_steps, self.requests,
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
        return plot_run(self.requests, self.steps, self.itl.values, self.itl.weights, out,
                        stalls=metrics.stall_events(self.itl, cfg.metrics.stall_factor),
                        cdf_max_points=cfg.metrics.cdf_max_points, pools=self.pools, kv_blocks=self.kv_blocks,
                        transfers=self.transfers, handoffs=self.handoffs)

    def _write_dashboards(self, out: Path) -> list[Path]:
        """dashboard.png (and per pool of a P/D run: sim/outputs/dashboard.py)."""
        from cbsim.sim.outputs.dashboard import write_dashboards  # lazy: matplotlib, as above

        return write_dashboards(self, out)


def _in_order(paths: list[Path]) -> list[Path]:
    """The files in the order a run has always listed them: tables and summaries, figures, then the
    trace and shapes (the figures are written beside the others now, and reported after them)."""
    late = [p for p in paths if p.name in ("trace.json", "shapes.jsonl")]
    return [p for p in paths if p not in late] + late


def _extra_summary(cfg, summary, table, steps, pools, preemptions, transfers, host, handoffs) -> dict:
    """Recovery, admission, per-pool and per-GPU entries of the summary."""
    out = metrics.recovery_summary(preemptions, transfers[host])
    out["num_rejected_admission"] = int(table["reject_reason"].str.startswith(REASON_PREFIX).sum())
    out.update(metrics.pool_summary(steps, table, pools, handoffs, transfers[~host] if handoffs is not None else None))
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


def build_replica_parts(cfg: ExperimentConfig):
    """Model spec, cost model, KV-cache factory and replica settings for a config."""
    model = model_spec(cfg.model, "model")
    cost = load(cfg.cost_model, model)
    cluster = cfg.cluster
    kv_cfg = cluster.kv_cache
    num_blocks = replica_kv_blocks(cfg, model, cost)  # the replica's layout: tp, pp stages, DP ranks
    bytes_per_token = kv_bytes_per_gpu(cfg, model, cost)  # what a swap moves per GPU
    settings = ReplicaSettings(
        preemption_mode=cfg.preemption.mode, victim=cfg.preemption.victim,
        swap_bandwidth=cfg.preemption.swap_bandwidth_gb_s * 1e9,
        max_model_len=cluster.max_model_len or model.max_model_len, fast_forward=cfg.sim.fast_forward,
        record_shapes=cfg.output.shapes > 0, max_predicted_ttft=cfg.admission.max_predicted_ttft,
        admission_window=cfg.admission.window_steps, admission_probe_tokens=cfg.admission.probe_tokens,
        pp_chunk_pipelining=cluster.pp_chunk_pipelining, **preemption_admission_settings(cfg))

    hash_block = None
    if kv_cfg.prefix_caching:
        hash_block = kv_cfg.hash_block_size or parse_workload(cfg.workload, "workload").hash_block_size

    window = cache_window(model, kv_cfg.block_size, kv_cfg.hybrid_kv_cache_manager, kv_cfg.prefix_caching,
                          cluster.mode == "pd")
    units = num_blocks * (window.units_per_block if window is not None else 1)  # a window counts g layer-pages

    def make_kv():
        return KVCache(units, kv_cfg.block_size, int(math.floor(kv_cfg.watermark * units)),
                       kv_cfg.reserve_full_prompt, bytes_per_token,
                       prefix_caching=kv_cfg.prefix_caching, hash_block_size=hash_block, window=window,
                       check_full_input=kv_cfg.check_full_input)

    return model, cost, make_kv, settings


def preemption_admission_settings(cfg: ExperimentConfig) -> dict:
    """ReplicaSettings fields of preemption.swap_space_gib/swapped_queue and the per-step admission signals."""
    pre, adm = cfg.preemption, cfg.admission
    if pre.swapped_queue == "vllm_v0" and cfg.policy.get("name") == "sglang":
        # its adder stops at the first request it cannot add: a reordered queue would block on a new prompt
        raise ConfigError("preemption.swapped_queue", "head with policy sglang (SGLang has no swapped queue: it "
                          "retracts by recompute; vllm_v0 is vLLM V0's)", "vllm_v0")
    step_cap = None
    if adm.tpot_slack is not None:
        tpot = cfg.metrics.slo.tpot if hasattr(cfg.metrics, "slo") else None
        if tpot is None:
            raise ConfigError("admission.tpot_slack", "metrics.slo.tpot set (the cap is tpot_slack x slo.tpot)",
                              adm.tpot_slack)
        step_cap = adm.tpot_slack * tpot
    return dict(swap_space=None if pre.swap_space_gib is None else pre.swap_space_gib * 2**30,
                swapped_queue=pre.swapped_queue, decode_reserve=adm.decode_reserve,
                schedule_conservativeness=adm.schedule_conservativeness,
                clip_max_new_tokens=adm.clip_max_new_tokens, step_cap=step_cap, pd_backpressure=adm.pd_backpressure,
                max_queued_requests=adm.max_queued_requests)


def step_noise(cfg: ExperimentConfig, cost, rng: np.random.Generator):
    """The per-step time factor for `sim.cost_noise`, drawn from its own child generator."""
    if not cfg.sim.cost_noise:
        return None
    if not hasattr(cost, "sample_factor"):
        raise ConfigError("sim.cost_noise", "a cost model with fitted residuals (type: fitted)",
                          cfg.cost_model.get("type"))
    noise_rng = rng.spawn(1)[0]
    return lambda: cost.sample_factor(noise_rng)


def sample_shapes(pool, count: int, rng: np.random.Generator) -> list | None:
    """`count` step shapes drawn uniformly (seeded, in step order) from every replica's log."""
    if count <= 0:
        return None
    shapes = [shape for replica in pool for shape in replica.shapes if not shape.is_empty]
    if len(shapes) <= count:
        return shapes
    return [shapes[i] for i in np.sort(rng.choice(len(shapes), size=count, replace=False))]


def pool_parts(cfg: ExperimentConfig, pool: str, rng: np.random.Generator):
    """(model, PoolParts) of P/D pool `pool`; only the prefill pool, where requests arrive, applies
    admission control."""
    pool_cfg = pool_config(cfg, pool)
    model, cost, make_kv, settings = build_replica_parts(pool_cfg)
    if pool == "decode":
        settings = replace(settings, max_predicted_ttft=None)
    policy = pool_cfg.policy
    return model, PoolParts(getattr(cfg.cluster, pool).replicas, lambda: make_policy(policy), cost, make_kv,
                            settings, step_noise(pool_cfg, cost, rng))


def pd_settings(cfg: ExperimentConfig, model):
    """The links and hand-off rules of a P/D cluster (bandwidths in bytes/s)."""
    link, cluster = cfg.cluster.link, cfg.cluster
    return PDSettings(link_mode=link.mode, latency=link.latency_s, bandwidth=link.bandwidth_gb_s * 1e9,
                      lanes=link.lanes, pool_bandwidth=(link.pool_bandwidth_gb_s or link.bandwidth_gb_s) * 1e9,
                      first_token_on=cluster.first_token_on, decode_router=cluster.decode_router,
                      bytes_per_token=float(model.kv_bytes_per_token(1)))


def _simulate(cfg: ExperimentConfig, requests, rng: np.random.Generator, progress=None, clients=None):
    """(recorder, replicas, pools, P/D cluster or None) of one run of `requests` under `cfg`;
    `clients`: the workload's timeouts and closed-loop clients (workloads/clients.py), colocated only."""
    try:
        if cfg.cluster.mode == "pd":
            model, prefill = pool_parts(cfg, "prefill", rng)
            _, decode = pool_parts(cfg, "decode", rng)
            links = pd_settings(cfg, model)
        else:
            _, cost, make_kv, settings = build_replica_parts(cfg)
            noise = step_noise(cfg, cost, rng)
    except ConfigError as err:
        raise err.in_file(cfg.source)
    try:  # a step or transfer time the guard refuses (sim/durations.py) names the experiment file too
        if cfg.cluster.mode == "pd":
            if clients is not None:
                raise ConfigError("workload.max_concurrency" if clients.closed_loop else "workload.timeout",
                                  "null with cluster.mode pd (clients and timeouts run on colocated clusters)",
                                  clients.max_concurrency if clients.closed_loop else clients.timeout, file=cfg.source)
            recorder, replicas, cluster = simulate_pd(requests, prefill, decode, links, router=cfg.cluster.router,
                                                      max_time=cfg.sim.max_time, progress=progress)
            pools = {"prefill": list(range(prefill.replicas)),
                     "decode": list(range(prefill.replicas, prefill.replicas + decode.replicas))}
            return recorder, replicas, pools, cluster
        recorder, replicas = simulate(requests, lambda: make_policy(cfg.policy), cost, make_kv, settings,
                                      replicas=cfg.cluster.replicas, router=cfg.cluster.router,
                                      max_time=cfg.sim.max_time, noise=noise, progress=progress, clients=clients)
        return recorder, replicas, {"cluster": list(range(cfg.cluster.replicas))}, None
    except ConfigError as err:
        raise err.in_file(cfg.source)


def client_frontend(cfg: ExperimentConfig, requests):
    """(engine, client arrivals or None, requests in scheduler-arrival order): with an engine front
    end, each request reaches the scheduler later than the client sent it (sim/metrics/client_view.py)."""
    try:
        engine = engine_of(cfg.cost_model)
    except ConfigError as err:
        raise err.in_file(cfg.source)
    if not engine.has_frontend:
        return engine, None, requests
    if isinstance(requests, RequestTable):  # its rows stay in id order; it delivers them by the new times
        return engine, requests.shift_arrivals(frontend_delays(requests.column("prompt_len"), engine.terms)), requests
    client = shift_arrivals(requests, engine.terms)
    return engine, client, sorted(requests, key=lambda r: r.arrival)


def run_experiment(config, out_dir: str | Path | None = None, overrides: list[str] | None = None,
                   progress=None) -> Results:
    """Run one experiment (YAML path, mapping or ExperimentConfig) and return its Results.

    Writes the output folder only when `out_dir` is given (the CLI passes output.dir or results/<name>
    explicitly): running a shipped experiment from Python or a test never overwrites its results.
    `progress`: a cbsim.sim.outputs.progress.Progress that reports a long run as it goes (the CLI passes one
    writing to stderr); None, the default, is silent. It never changes the results.
    """
    cfg = load_config(config, overrides)
    try:
        rng = np.random.default_rng(cfg.seed)
        base_dir = Path(cfg.source).parent if cfg.source else None
        workload = build_run(parse_workload(cfg.workload, "workload"), rng, base_dir, as_table=True)
        requests, dropped = workload.requests, workload.dropped
    except ConfigError as err:
        raise err.in_file(cfg.source)
    frontend, client_arrival, in_order = client_frontend(cfg, requests)
    if workload.clients is not None:  # closed loop: the clients' send times, decided by the run
        workload.clients.client_arrival = client_arrival
    started = time.perf_counter()
    recorder, pool, pools, cluster = _simulate(cfg, in_order, rng, progress, workload.clients)
    wall = time.perf_counter() - started
    if progress is not None:
        progress.say(f"simulated {len(requests):,} requests in {wall:.1f} s; computing metrics")
    steps = with_efficiency(metrics.step_frame(recorder), hardware_of(cfg, pool, pools))  # MFU, HBM, collectives
    # KV usage and MFU for sweeps, computed here so that its scratch is freed before the request frame and the
    # ITL exist (a lower peak); added to the summary in its place below
    usage = usage_summary(steps, {r.index: r.kv.num_blocks for r in pool})
    table = metrics.request_frame(requests, recorder, steps, cfg.metrics)
    if client_arrival is not None:
        table = client_view(table, steps, requests, client_arrival, frontend.terms, cfg.metrics)
    itl = metrics.itl_distribution(recorder, requests, steps)
    summary = metrics.summarize(table, steps, recorder, cfg.metrics, itl=itl)
    preemptions = metrics.preemption_frame(pool)
    links = [replica.host_link for replica in pool] + (cluster.links if cluster is not None else [])
    transfers = metrics.transfer_frame(links)
    host = transfers["kind"].isin(["swap_out", "swap_in"])
    handoffs = metrics.handoff_frame(cluster.records.values()) if cluster is not None else None
    if handoffs is not None:
        table = table.merge(handoffs.drop(columns=["prefill_blocks"]), on="request_id", how="left")
    summary.update(_extra_summary(cfg, summary, table, steps, pools, preemptions, transfers, host, handoffs))
    kvs = [replica.kv for replica in pool]
    summary.update(usage)  # KV usage, MFU for sweeps
    if any(kv.prefix is not None for kv in kvs):  # prefix caching on: hit columns and summary keys
        table["cached_tokens"] = metrics.cached_token_column(table["request_id"].to_numpy(), kvs)
        table["readmit_cached_tokens"] = metrics.readmit_hit_column(table["request_id"].to_numpy(), kvs)
        summary.update(metrics.prefix_summary(table, kvs))
    summary["sim_wall_seconds"] = wall
    if dropped is not None:  # trace rows its rules removed, by rule (workloads/trace_source.py)
        summary["dropped_rows"] = dropped
    summary.update(workload.notes)  # token_lengths: how a text dataset was counted (approximation flagged)
    if workload.clients is not None and workload.clients.timeout is not None:
        summary["num_timed_out"] = int(table["reject_reason"].str.startswith("timeout").sum())
    shapes = sample_shapes(pool, cfg.output.shapes, np.random.default_rng([cfg.seed, 1]))
    results = Results(cfg, table, steps, summary, itl, recorder, shapes, pools=pools, preemptions=preemptions,
                      transfers=transfers, handoffs=handoffs, kv_blocks={r.index: r.kv.num_blocks for r in pool},
                      kv_unit_tokens=pool[0].kv.unit_tokens)
    if out_dir is not None:
        results.write(out_dir, progress)
    return results
