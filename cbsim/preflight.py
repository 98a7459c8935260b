"""What `cbsim validate` checks beyond the config itself: everything `cbsim run` can reject before
simulating. It opens every file the experiment reads (trace rows, profiles) and builds what a run
builds first (the workload, whose arrivals must fit the simulated clock; every replica's cost model,
KV cache size and cost noise), so `validate` says ok only where `run` gets as far as simulating. It also probes the step
and transfer times a run will schedule at their extremes (sim/durations.py), so a profile or
bandwidth that `run` would reject at its first step is rejected here. `check_writable` does the
same for an output folder: a run must not simulate for minutes and then fail to write.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from cbsim.build import build_replica_parts, step_noise
from cbsim.config import ExperimentConfig
from cbsim.core.errors import ConfigError
from cbsim.pools import pool_config
from cbsim.replica_gpus import kv_bytes_per_gpu
from cbsim.sim.durations import check_step, check_transfer
from cbsim.sim.shape import StepShape
from cbsim.workloads import build_workload, parse_workload


def preflight(cfg: ExperimentConfig) -> dict[str, int] | None:
    """Raise the ConfigError `run` would raise before simulating; return the trace rows the
    workload's rules drop ({rule: rows}) when it replays a trace, else None."""
    rng = np.random.default_rng(cfg.seed)
    try:
        workload = parse_workload(cfg.workload, "workload")
        base_dir = Path(cfg.source).parent if cfg.source else None
        _, dropped = build_workload(workload, rng, base_dir)  # synthetic too: its arrivals must fit the clock
        for pool in ("prefill", "decode") if cfg.cluster.mode == "pd" else ("cluster",):
            config = pool_config(cfg, pool) if pool != "cluster" else cfg
            model, cost, _, settings = build_replica_parts(cfg, pool)
            step_noise(config, cost, rng)
            probe_step_times(cost, settings.max_model_len)
            longest = settings.max_model_len * kv_bytes_per_gpu(config, model, cost)
            probe_transfer("preemption.swap_bandwidth_gb_s", settings.swap_bandwidth, 0.0, longest)
            if cfg.cluster.mode == "pd":
                link, whole = cfg.cluster.link, settings.max_model_len * float(model.kv_bytes_per_token(1))
                for key, gb_s in (("bandwidth_gb_s", link.bandwidth_gb_s), ("pool_bandwidth_gb_s", link.pool_bandwidth_gb_s)):
                    if gb_s is not None:
                        probe_transfer(f"cluster.link.{key}", gb_s * 1e9, link.latency_s, whole)
    except ConfigError as err:
        raise err.in_file(cfg.source)
    return dropped


def probe_step_times(cost, max_model_len: int) -> None:
    """DurationError (at `cost_model`) unless the cost model times a one-token decode step and a step
    that uses every term at `max_model_len` (a prefill chunk over cached history beside a decode row
    of full context) as finite, > 0 and within the simulated clock's range (sim/durations.py): a
    bad coefficient or bandwidth is caught here, not at the first step of a run."""
    chunk = max(1, max_model_len // 2)
    for shape in (StepShape(decode=(1,), tokens_sampled=1),
                  StepShape(prefill=((chunk, max_model_len - chunk),), decode=(max_model_len,), tokens_sampled=2)):
        check_step("cost_model", 0.0, cost.step_time(shape), False, where=f" (probed with a step of {shape.num_tokens} "
                   "tokens)")


def probe_transfer(key: str, bandwidth: float, latency: float, nbytes: float) -> None:
    """DurationError at `key` unless moving `nbytes` (one request's whole KV) over a link of
    `bandwidth` bytes/s and `latency` s ends within the simulated clock's range."""
    check_transfer(key, 0.0, latency + nbytes / bandwidth, nbytes, " (probed with one request's whole KV)")


def check_writable(folder: str | Path, key: str) -> None:
    """ConfigError naming `key` unless `folder` is, or can be created as, a writable folder (creates nothing)."""
    target = Path(folder).expanduser().absolute()
    probe = target
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        why = "is not a folder" if not probe.is_dir() else "is not writable"
        raise ConfigError(key, f"a folder that can be created and written ({probe} {why})", str(folder))
