"""What `cbsim validate` checks beyond the config itself: everything `cbsim run` can reject before
simulating. It opens every file the experiment reads (trace rows, profiles) and builds what a run
builds first (the workload when it reads a file, every replica's cost model, KV cache size and cost
noise), so `validate` says ok only where `run` gets as far as simulating. `check_writable` does the
same for an output folder: a run must not simulate for minutes and then fail to write.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .config import ExperimentConfig
from .errors import ConfigError


def preflight(cfg: ExperimentConfig) -> dict[str, int] | None:
    """Raise the ConfigError `run` would raise before simulating; return the trace rows the
    workload's rules drop ({rule: rows}) when it replays a trace, else None."""
    from cbsim.workloads import build_workload, parse_workload

    from .api import build_replica_parts, pool_config, step_noise

    rng = np.random.default_rng(cfg.seed)
    try:
        workload = parse_workload(cfg.workload, "workload")
        dropped = None
        if reads_file(workload):
            base_dir = Path(cfg.source).parent if cfg.source else None
            _, dropped = build_workload(workload, rng, base_dir)
        configs = [pool_config(cfg, pool) for pool in ("prefill", "decode")] if cfg.cluster.mode == "pd" else [cfg]
        for config in configs:
            _, cost, _, _ = build_replica_parts(config)
            step_noise(config, cost, rng)
    except ConfigError as err:
        raise err.in_file(cfg.source) if cfg.source else err
    return dropped


def reads_file(workload) -> bool:
    """Whether a parsed workload reads a trace file (as its source or for empirical lengths)."""
    lengths = (workload.prompt_len, workload.output_len)
    return workload.trace is not None or any(getattr(spec, "trace", None) is not None for spec in lengths)


def check_writable(folder: str | Path, key: str) -> None:
    """ConfigError naming `key` unless `folder` is, or can be created as, a writable folder (creates nothing)."""
    target = Path(folder).expanduser().absolute()
    probe = target
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        why = "is not a folder" if not probe.is_dir() else "is not writable"
        raise ConfigError(key, f"a folder that can be created and written ({probe} {why})", str(folder))
