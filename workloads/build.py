"""From a WorkloadConfig to the simulator's requests.

Invariant: `build_requests` returns Requests sorted by arrival (a stable sort, so ties keep their
generation order) with ids 0..n-1 in that order, integer lengths >= 1, and arrivals starting at 0
for synthetic sources (explicit lists keep their times; traces keep their window's offsets). The
result depends only on the config, the files it names and the state of `rng`.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from cbsim.errors import ConfigError
from cbsim.sim.request import Request

from .arrivals import sample_arrivals
from .config import WorkloadConfig
from .lengths import sample_lengths
from .prefixes import multi_turn, system_prompts
from .trace_source import load_trace


def build_requests(cfg: WorkloadConfig, rng: np.random.Generator, base_dir: Path | None = None,
                   path: str = "workload") -> list[Request]:
    """The requests the workload describes; `base_dir` is the experiment file's folder (for trace paths)."""
    return build_workload(cfg, rng, base_dir, path)[0]


def build_workload(cfg: WorkloadConfig, rng: np.random.Generator, base_dir: Path | None = None,
                   path: str = "workload") -> tuple[list[Request], dict[str, int] | None]:
    """The requests, and for a trace the rows its rules dropped ({rule: rows}, see trace_source.py);
    None for other sources."""
    if cfg.source == "requests":
        rows = cfg.requests
        return make_requests(np.array([r.arrival for r in rows], dtype=np.float64),
                             np.array([r.prompt_len for r in rows]), np.array([r.output_len for r in rows]),
                             priority=np.array([r.priority for r in rows])), None
    if cfg.source == "trace":
        *columns, dropped = _from_trace(cfg, rng, base_dir, path)
        return make_requests(*columns), dropped
    return make_requests(*_synthetic(cfg, rng, base_dir, path)), None


def make_requests(arrival: np.ndarray, prompt_len: np.ndarray, output_len: np.ndarray,
                  hashes: list[tuple[int, ...]] | None = None, priority: np.ndarray | None = None) -> list[Request]:
    """Requests from parallel arrays, stably sorted by arrival and numbered in that order."""
    order = np.argsort(arrival, kind="stable")
    return [
        Request(id=i, arrival=float(arrival[k]), prompt_len=int(prompt_len[k]), output_len=int(output_len[k]),
                prefix_hashes=None if hashes is None else hashes[k],
                priority=0 if priority is None else int(priority[k]))
        for i, k in enumerate(order)
    ]


def _synthetic(cfg: WorkloadConfig, rng: np.random.Generator, base_dir: Path | None, path: str):
    n = cfg.num_requests
    prefix = cfg.shared_prefix
    if prefix is not None and prefix.mode == "multi_turn":
        starts = sample_arrivals(cfg.arrival, math.ceil(n / prefix.turns), rng)
    else:
        arrival = sample_arrivals(cfg.arrival, n, rng)
    prompt = sample_lengths(cfg.prompt_len, n, rng, role="prompt", base_dir=base_dir, path=f"{path}.prompt_len")
    output = sample_lengths(cfg.output_len, n, rng, role="output", base_dir=base_dir, path=f"{path}.output_len")
    hashes = None
    if prefix is not None and prefix.mode == "multi_turn":
        arrival, prompt, hashes = multi_turn(prefix, starts, prompt, output, rng)
    elif prefix is not None:
        prompt, hashes = system_prompts(prefix, prompt, rng)
    return arrival, prompt, output, hashes


def _from_trace(cfg: WorkloadConfig, rng: np.random.Generator, base_dir: Path | None, path: str):
    trace = load_trace(cfg.trace, rng, base_dir, f"{path}.trace")
    if cfg.arrival is not None:
        arrival = sample_arrivals(cfg.arrival, len(trace), rng)
    elif trace.arrival is not None:
        arrival = trace.arrival
    else:
        raise ConfigError(f"{path}.arrival", "an arrival process (this trace file has no arrival times)",
                          has_got=False)
    prompt, hashes = trace.prompt_len, trace.prefix_hashes
    if cfg.shared_prefix is not None:
        prompt, hashes = system_prompts(cfg.shared_prefix, prompt, rng)
    return arrival, prompt, trace.output_len, hashes, dict(trace.dropped)
