"""From a WorkloadConfig to the simulator's requests.

Invariant: `build_requests` returns Requests sorted by arrival (a stable sort, so ties keep their
generation order) with ids 0..n-1 in that order, integer lengths >= 1, and arrivals starting at 0
for synthetic sources (explicit lists keep their times; traces keep their window's offsets). The
result depends only on the config, the files it names and the state of `rng`.

`build_run` adds what the run needs beyond the requests: the trace rows its rules dropped, notes
for the summary (how a text dataset's lengths were counted) and the clients' plan (timeouts,
closed loop: sessions and think times, drawn last so open-loop workloads draw exactly as before).
Closed-loop requests carry their *planned* send times until the run decides the real ones. An
agentic workload (workloads/agentic.py) adds its program: every request's session, turn and waits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cbsim.core.errors import ConfigError
from cbsim.sim.durations import CLOCK_LIMIT
from cbsim.sim.request import Request
from cbsim.sim.request_table import RequestTable

from cbsim.workloads.agentic import AgenticProgram, build_program
from cbsim.workloads.arrivals import StagesArrival, sample_arrivals
from cbsim.workloads.clients import ClientPlan
from cbsim.workloads.config import MAX_REQUESTS, WorkloadConfig
from cbsim.workloads.lengths import sample_lengths
from cbsim.workloads.multimodal import add_images
from cbsim.workloads.prefixes import multi_turn, system_prompts
from cbsim.workloads.trace_source import load_trace


def build_requests(cfg: WorkloadConfig, rng: np.random.Generator, base_dir: Path | None = None,
                   path: str = "workload") -> list[Request]:
    """The requests the workload describes; `base_dir` is the experiment file's folder (for trace paths)."""
    return build_workload(cfg, rng, base_dir, path)[0]


def build_workload(cfg: WorkloadConfig, rng: np.random.Generator, base_dir: Path | None = None,
                   path: str = "workload") -> tuple[list[Request], dict[str, int] | None]:
    """The requests, and for a trace the rows its rules dropped ({rule: rows}, see trace_source.py);
    None for other sources."""
    run = build_run(cfg, rng, base_dir, path)
    return run.requests, run.dropped


@dataclass
class Workload:
    """Everything a run takes from its workload section."""

    requests: list[Request] | RequestTable
    dropped: dict[str, int] | None = None  # trace rows dropped, by rule (None: not a trace)
    notes: dict[str, object] = field(default_factory=dict)  # summary entries (token_lengths, ...)
    clients: ClientPlan | None = None  # None: open loop without timeouts
    agentic: AgenticProgram | None = None  # agentic sessions, rows named by request id (None: none)


def build_run(cfg: WorkloadConfig, rng: np.random.Generator, base_dir: Path | None = None,
              path: str = "workload", as_table: bool = False) -> Workload:
    """The requests and what the run needs with them (see the module docstring). With `as_table`, plain
    requests (text only, no prefixes, tenants or adapters, open loop without timeouts) come as a
    RequestTable (sim/request_table.py: the same requests, as columns) instead of a list."""
    plain = as_table and not (cfg.source == "requests" or cfg.tenants or cfg.multimodal or cfg.adapters
                              or cfg.closed_loop or cfg.timeout is not None or cfg.agentic is not None)
    make = make_table_or_requests if plain else make_requests
    notes, sessions, dropped = {}, None, None
    if cfg.agentic is not None:
        return _from_agentic(cfg, rng, base_dir, path)
    if cfg.source == "requests":
        rows = cfg.requests
        requests = make_requests(np.array([r.arrival for r in rows], dtype=np.float64),
                                 np.array([r.prompt_len for r in rows]), np.array([r.output_len for r in rows]),
                                 priority=np.array([r.priority for r in rows]),
                                 tenants=[r.tenant for r in rows], adapters=[r.adapter for r in rows],
                                 mm_inputs=[None if r.mm_inputs is None else tuple(map(tuple, r.mm_inputs))
                                            for r in rows])
    elif cfg.source == "trace":
        *columns, groups, dropped, lengths, labels = _from_trace(cfg, rng, base_dir, path)
        requests, sessions = make(*columns, **labels), _renumber(groups, columns[0])
        if lengths != "file":
            notes["token_lengths"] = lengths
    else:
        *columns, groups, outputs = _synthetic(cfg, rng, base_dir, path)
        requests, sessions = make(*columns), _renumber(groups, columns[0])
        if outputs is not None:  # multi_turn: each turn's output blocks, the next turn's prompt
            for req, k in zip(requests, np.argsort(columns[0], kind="stable").tolist()):
                req.output_hashes = outputs[k] or None
    if cfg.source != "requests":
        _check_clock(columns[0], f"{path}.trace" if cfg.source == "trace" else f"{path}.arrival")
    clients = _clients(cfg, requests, sessions, rng)
    if cfg.tenants:
        _draw_tenants(cfg.tenants, requests, rng)
    if cfg.multimodal is not None:  # drawn after the rest: every other draw is as without images
        add_images(cfg.multimodal, requests, rng)
    if cfg.adapters:
        _draw_adapters(cfg.adapters, requests, rng)
    return Workload(requests, dropped, notes, clients)


def _from_agentic(cfg: WorkloadConfig, rng: np.random.Generator, base_dir: Path | None, path: str) -> Workload:
    """Agentic sessions: their program's rows as requests (each labelled with its agent, the session
    the router keeps together), the clients that send each row when its waits are over, then the
    tenants and adapters as for any source."""
    starts = sample_arrivals(cfg.arrival, cfg.agentic.sessions, rng)
    _check_clock(starts, f"{path}.arrival")
    program = build_program(cfg.agentic, starts, cfg.prompt_len, cfg.output_len, rng, base_dir, path)
    requests = make_requests(program.arrival, program.prompt_len, program.output_len, program.hashes)
    ids = np.empty(len(requests), dtype=np.int64)
    ids[np.argsort(program.arrival, kind="stable")] = np.arange(len(requests))
    program = program.renumbered(ids)
    for req, agent, output in zip(requests, program.agent.tolist(), program.output_hashes):
        req.session = agent
        req.output_hashes = output or None
    clients = ClientPlan(cfg.timeout, cfg.max_concurrency, None, program.sessions, waits=program.waits)
    if cfg.tenants:
        _draw_tenants(cfg.tenants, requests, rng)
    if cfg.adapters:
        _draw_adapters(cfg.adapters, requests, rng)
    return Workload(requests, None, {}, clients, program)


def _draw_tenants(mix: dict, requests: list[Request], rng: np.random.Generator) -> None:
    """Each request's tenant, drawn with probability weight / sum in id order (drawn last, so a
    workload draws everything else exactly as without a mix)."""
    names = list(mix)
    weights = np.array([float(mix[n]) for n in names])
    for req, k in zip(requests, rng.choice(len(names), size=len(requests), p=weights / weights.sum())):
        req.tenant = str(names[k])


def _check_clock(arrivals: np.ndarray, key: str) -> None:
    """ConfigError at `key` unless every arrival is within the simulated clock's range (sim/durations.py):
    a rate or time scale of 1e-300, or a trace row in year 9999, would otherwise pass and fail at the first
    step, blamed on the cost model."""
    last = float(np.max(arrivals)) if len(arrivals) else 0.0
    if not last < CLOCK_LIMIT:
        raise ConfigError(key, f"arrivals within the simulated clock's range ({CLOCK_LIMIT:.3g} s, 136 years; "
                          "check the rate, time scale or timestamps)", f"an arrival at {last:.3g} s")


def _draw_adapters(mix: dict, requests: list[Request], rng: np.random.Generator) -> None:
    """Each request's LoRA adapter, drawn like the tenants (last); the key 'base' means none."""
    names = list(mix)
    weights = np.array([float(mix[n]) for n in names])
    for req, k in zip(requests, rng.choice(len(names), size=len(requests), p=weights / weights.sum())):
        req.adapter = None if names[k] == "base" else str(names[k])


def _clients(cfg: WorkloadConfig, requests: list[Request], sessions, rng: np.random.Generator) -> ClientPlan | None:
    if not cfg.closed_loop:
        return None if cfg.timeout is None else ClientPlan(timeout=cfg.timeout)
    think = rng.exponential(cfg.think_time, len(requests)) if cfg.think_time > 0 else None
    return ClientPlan(cfg.timeout, cfg.max_concurrency, think, sessions)


def _renumber(groups: list[list[int]] | None, arrival: np.ndarray) -> list[list[int]] | None:
    """Sessions as request ids: make_requests numbers rows in (stable) arrival order."""
    if groups is None:
        return None
    ids = np.empty(len(arrival), dtype=np.int64)
    ids[np.argsort(arrival, kind="stable")] = np.arange(len(arrival))
    return [[int(ids[k]) for k in group] for group in groups]


def make_requests(arrival: np.ndarray, prompt_len: np.ndarray, output_len: np.ndarray,
                  hashes: list[tuple[int, ...]] | None = None, priority: np.ndarray | None = None,
                  tenants: list | None = None, adapters: list | None = None,
                  mm_inputs: list | None = None) -> list[Request]:
    """Requests from parallel arrays, stably sorted by arrival and numbered in that order
    (`tenants`, `adapters`: a string or None per row; `mm_inputs`: (offset, length) pairs or None per row)."""
    order = np.argsort(arrival, kind="stable")
    return [
        Request(id=i, arrival=float(arrival[k]), prompt_len=int(prompt_len[k]), output_len=int(output_len[k]),
                prefix_hashes=None if hashes is None else hashes[k],
                priority=0 if priority is None else int(priority[k]),
                tenant=None if tenants is None else tenants[k], adapter=None if adapters is None else adapters[k],
                mm_inputs=None if mm_inputs is None else mm_inputs[k])
        for i, k in enumerate(order)
    ]


def make_table_or_requests(arrival: np.ndarray, prompt_len: np.ndarray, output_len: np.ndarray,
                           hashes: list | None = None, priority: np.ndarray | None = None, tenants: list | None = None,
                           adapters: list | None = None, mm_inputs: list | None = None) -> RequestTable | list[Request]:
    """make_requests' requests as a RequestTable (same ids, same arrival order), or as make_requests
    makes them where some request carries a prefix, tenant, adapter or image (a table holds none)."""
    labelled = any(v is not None for values in (tenants, adapters, mm_inputs) if values is not None for v in values)
    if hashes is not None or labelled:
        return make_requests(arrival, prompt_len, output_len, hashes, priority, tenants, adapters, mm_inputs)
    order = np.argsort(arrival, kind="stable")
    return RequestTable(np.asarray(arrival, dtype=np.float64)[order], np.asarray(prompt_len)[order],
                        np.asarray(output_len)[order], priority=None if priority is None else np.asarray(priority)[order])


def _synthetic(cfg: WorkloadConfig, rng: np.random.Generator, base_dir: Path | None, path: str):
    """(arrival, prompt, output, hashes, sessions: rows of each conversation or None, output hashes: a
    multi_turn request's output blocks (prefixes.multi_turn) or None)."""
    n = cfg.num_requests
    prefix = cfg.shared_prefix
    if prefix is not None and prefix.mode == "multi_turn":
        starts = sample_arrivals(cfg.arrival, math.ceil((n or MAX_REQUESTS) / prefix.turns), rng)
        n = n or len(starts) * prefix.turns  # load stages without num_requests: their conversations
    else:
        arrival = sample_arrivals(cfg.arrival, n or MAX_REQUESTS, rng)
        n = len(arrival)
    prompt = sample_lengths(cfg.prompt_len, n, rng, role="prompt", base_dir=base_dir, path=f"{path}.prompt_len")
    output = sample_lengths(cfg.output_len, n, rng, role="output", base_dir=base_dir, path=f"{path}.output_len")
    hashes = sessions = outputs = None
    if prefix is not None and prefix.mode == "multi_turn":
        arrival, prompt, hashes, outputs = multi_turn(prefix, starts, prompt, output, rng)
        sessions = [list(range(c, min(c + prefix.turns, n))) for c in range(0, n, prefix.turns)]
    elif prefix is not None:
        prompt, hashes = system_prompts(prefix, prompt, rng)
    return arrival, prompt, output, hashes, sessions, outputs


def _from_trace(cfg: WorkloadConfig, rng: np.random.Generator, base_dir: Path | None, path: str):
    trace = load_trace(cfg.trace, rng, base_dir, f"{path}.trace")
    if cfg.arrival is not None:
        arrival = sample_arrivals(cfg.arrival, len(trace), rng)
        if isinstance(cfg.arrival, StagesArrival) and len(arrival) < len(trace):
            trace = trace.take(np.arange(len(arrival)), "after the last stage")
    elif trace.arrival is not None:
        arrival = trace.arrival
    else:
        raise ConfigError(f"{path}.arrival", "an arrival process (this trace file has no arrival times)",
                          has_got=False)
    prompt, hashes, images = trace.prompt_len, trace.prefix_hashes, trace.mm_inputs
    if cfg.shared_prefix is not None:
        prompt, hashes = system_prompts(cfg.shared_prefix, prompt, rng)
        if images is not None:  # the system prompt goes in front: the images move back by its length
            shift = cfg.shared_prefix.prefix_len
            images = [None if m is None else tuple((o + shift, n) for o, n in m) for m in images]
    labels = {"tenants": trace.tenants, "adapters": trace.adapters, "mm_inputs": images}
    return (arrival, prompt, trace.output_len, hashes, _trace_sessions(trace), dict(trace.dropped), trace.token_lengths,
            labels)


def _trace_sessions(trace) -> list[list[int]] | None:
    """Rows of each session of a trace with session ids (in row order), a row without one alone."""
    if trace.sessions is None:
        return None
    groups: dict[int, list[int]] = {}
    lone = []
    for row, code in enumerate(trace.sessions.tolist()):
        if code < 0:
            lone.append([row])
        else:
            groups.setdefault(code, []).append(row)
    return sorted([*groups.values(), *lone])
