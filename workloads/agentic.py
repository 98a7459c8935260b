"""Agentic sessions as programs: turns that extend one context, tool calls between them, sub-agents.

An agent is a program of T turns (LLM calls). Turn k's prompt is the agent's whole history: the
system prompt, the task, then every earlier turn's prompt additions and output, the results of the
tool calls each turn made, and the final outputs of the sub-agents it spawned. So turn k+1's
prompt starts with turn k's prompt, and its block hash chain extends turn k's (workloads/prefixes.py).
Turn k's own output is turn k+1's prompt too: its `output_hashes` are the hashes turn k+1's chain gives
the full blocks turn k's prompt + output fill, so the prefix cache keeps them as vLLM keeps every full
block a request computes (sim/kv/prefix.py). The prefix cache, not this module, decides whether the history is still resident when turn k+1
arrives (a hit), was evicted during the gap (recomputed), or sits on another replica.

Between turn k and k+1 (the gap) an agent either
- calls N tools in parallel (N drawn from `tool_calls`), each with its own duration (`tool_time`,
  workloads/tool_times.py) and result length (`tool_result_len` tokens appended to the context);
  turn k+1 is sent when the slowest call returns; or
- with probability `subagent_probability` (top-level agents only) spawns M sub-agents: child
  programs with their own context (the shared system prompt + their own task) and their own turns
  and tool calls, started as turn k's reply arrives; turn k+1 is sent when the last of them has
  finished, with each child's final output appended to the context.

Invariants: every row's prompt is >= 1 token and its chain covers its full blocks; a turn's chain is
a prefix of its agent's next turn's chain; `waits[r]` holds (row, delay) pairs for every row but an
agent's first turn of a top-level session, and every row it names comes earlier in its session (the
sends form a DAG ordered by row). Everything is drawn before the run from the run's generator, so a
session is as deterministic as any closed-loop run; the clients (workloads/clients.py) decide the
send times as replies arrive: row r is sent at max over its waits of (that row's reply + delay).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cbsim.core.schema import option, require
from cbsim.workloads.lengths import FixedLength, LengthConfig, sample_lengths
from cbsim.workloads.prefixes import continuation, extend_chain
from cbsim.workloads.tool_times import ToolTimeConfig, sample_tool_times

AGENT_CONTENT = 4  # content-id kind of an agent's own blocks (prefixes.py: 1 system, 2 conversation, 3 dataset)


@dataclass
class AgenticConfig:
    """`workload.agentic`: sessions of agents that call tools and spawn sub-agents (see the module docstring)."""

    sessions: int = option(help="top-level agent sessions (>= 1); workload.arrival gives their start times, "
                                "workload.prompt_len each session's task, workload.output_len each turn's output")
    turns: LengthConfig | None = option(None, help="turns (LLM calls) per agent, a length distribution "
                                                   "{type: fixed | uniform | lognormal | zipf | empirical} (>= 1)")
    system_prompt_len: int = option(0, help="tokens of the system prompt (tool definitions) every agent starts "
                                            "with, shared across sessions (>= 0)")
    tool_calls: LengthConfig | None = option(None, help="parallel tool calls per gap (a length distribution; "
                                                        "default fixed 1); the next turn waits for all of them")
    tool_time: ToolTimeConfig | None = option(None, help="seconds one tool call takes, {type: fixed(value) | "
                                                         "exponential(mean) | lognormal(median, sigma, max) | "
                                                         "empirical(values)}")
    tool_result_len: LengthConfig | None = option(None, help="tokens one tool call's result appends to the context "
                                                             "(a length distribution)")
    subagent_probability: float = option(0.0, help="probability that a top-level agent's gap spawns sub-agents "
                                                   "instead of calling tools (0..1)")
    subagent_count: LengthConfig | None = option(None, help="sub-agents per spawn (default fixed 1)")
    subagent_turns: LengthConfig | None = option(None, help="turns per sub-agent (default: turns)")
    subagent_prompt_len: LengthConfig | None = option(None, help="tokens of a sub-agent's task (default: "
                                                                 "workload.prompt_len)")
    hash_block_size: int = option(16, help="tokens per hashed block (match the KV cache block size)")

    def validate(self):
        require(self.sessions >= 1, "sessions", "an integer >= 1", self.sessions)
        require(self.system_prompt_len >= 0, "system_prompt_len", "a length >= 0", self.system_prompt_len)
        require(0.0 <= self.subagent_probability <= 1.0, "subagent_probability", "a probability in [0, 1]",
                self.subagent_probability)
        require(self.hash_block_size >= 1, "hash_block_size", "an integer >= 1", self.hash_block_size)


TAGGED = ("turns", "tool_calls", "tool_result_len", "subagent_count", "subagent_turns", "subagent_prompt_len",
          "tool_time")  # distribution keys, parsed by their `type` (workloads/config.py)
REQUIRED = ("turns", "tool_time", "tool_result_len")


@dataclass
class AgenticProgram:
    """The rows (requests) of every session, in session-start order, and how they depend on each other."""

    arrival: np.ndarray  # per row: its session's planned start (the clients send the later rows)
    prompt_len: np.ndarray
    output_len: np.ndarray
    hashes: list[tuple[int, ...]]
    agent: np.ndarray  # per row: its agent (a top-level session or a sub-agent)
    turn: np.ndarray  # per row: its index among its agent's turns
    waits: list[tuple[tuple[int, float], ...]]  # per row: (row, delay): sent at max(reply of row + delay)
    tool_times: list[tuple[float, ...]]  # per row: durations of the tool calls made after it
    parent: list[int] = field(default_factory=list)  # per agent: the agent that spawned it (-1: top level)
    session: list[int] = field(default_factory=list)  # per agent: its top-level session
    spawn_row: list[int] = field(default_factory=list)  # per agent: the row whose reply started it (-1: top level)
    sessions: list[list[int]] = field(default_factory=list)  # rows of each top-level session (first: its start)
    # per row: the chain's continuation over the full blocks its output completes (its next turn's hashes)
    output_hashes: list[tuple[int, ...]] = field(default_factory=list)

    def renumbered(self, ids: np.ndarray) -> "AgenticProgram":
        """The same program with rows named by request id (`ids[row]`; make_requests sorts by arrival)."""
        order = np.argsort(ids)
        inv = lambda rows: [int(ids[r]) for r in rows]  # noqa: E731
        return AgenticProgram(
            self.arrival[order], self.prompt_len[order], self.output_len[order], [self.hashes[k] for k in order],
            self.agent[order], self.turn[order],
            [tuple((int(ids[r]), d) for r, d in self.waits[k]) for k in order], [self.tool_times[k] for k in order],
            list(self.parent), list(self.session), [int(ids[r]) if r >= 0 else -1 for r in self.spawn_row],
            [inv(rows) for rows in self.sessions], [self.output_hashes[k] for k in order])


class _Stream:
    """Lengths drawn from one distribution in batches (an empirical trace is read once per batch)."""

    batch = 4096

    def __init__(self, cfg: LengthConfig, rng, role: str, base_dir: Path | None, path: str):
        self.cfg, self.rng, self.role, self.base_dir, self.path = cfg, rng, role, base_dir, path
        self.values, self.at = np.zeros(0, dtype=np.int64), 0

    def take(self, n: int = 1) -> np.ndarray:
        while self.at + n > len(self.values):
            more = sample_lengths(self.cfg, self.batch, self.rng, role=self.role, base_dir=self.base_dir,
                                  path=self.path)
            self.values, self.at = np.concatenate([self.values[self.at:], more]), 0
        out = self.values[self.at:self.at + n]
        self.at += n
        return out


def build_program(cfg: AgenticConfig, starts: np.ndarray, prompt_len: LengthConfig, output_len: LengthConfig,
                  rng: np.random.Generator, base_dir: Path | None = None, path: str = "workload") -> AgenticProgram:
    """Every session's rows, drawn in session order from `rng` (`starts`: one start time per session)."""
    key = f"{path}.agentic"
    one = FixedLength(1)
    streams = {
        "task": _Stream(prompt_len, rng, "prompt", base_dir, f"{path}.prompt_len"),
        "output": _Stream(output_len, rng, "output", base_dir, f"{path}.output_len"),
        "turns": _Stream(cfg.turns, rng, "prompt", base_dir, f"{key}.turns"),
        "calls": _Stream(cfg.tool_calls or one, rng, "prompt", base_dir, f"{key}.tool_calls"),
        "result": _Stream(cfg.tool_result_len, rng, "prompt", base_dir, f"{key}.tool_result_len"),
        "children": _Stream(cfg.subagent_count or one, rng, "prompt", base_dir, f"{key}.subagent_count"),
        "sub_turns": _Stream(cfg.subagent_turns or cfg.turns, rng, "prompt", base_dir, f"{key}.subagent_turns"),
        "sub_task": _Stream(cfg.subagent_prompt_len or prompt_len, rng, "prompt", base_dir,
                            f"{key}.subagent_prompt_len"),
    }
    builder = _Builder(cfg, rng, streams)
    for start in starts:
        builder.session(float(start))
    return builder.program()


class _Builder:
    """Lays agents out row by row (one instance per workload)."""

    def __init__(self, cfg: AgenticConfig, rng, streams):
        self.cfg, self.rng, self.streams = cfg, rng, streams
        self.rows: dict[str, list] = {k: [] for k in ("arrival", "prompt", "output", "hashes", "agent", "turn",
                                                      "waits", "tools", "output_hashes")}
        self.parent, self.session_of, self.spawn_row, self.sessions = [], [], [], []

    def session(self, start: float) -> None:
        first = len(self.rows["prompt"])
        self._agent(start, -1, -1, len(self.sessions), int(self.streams["turns"].take()[0]),
                    int(self.streams["task"].take()[0]))
        self.sessions.append(list(range(first, len(self.rows["prompt"]))))

    def _agent(self, start: float, parent: int, spawned_by: int, session: int, turns: int, task: int) -> int:
        """Lay out one agent's rows (and its sub-agents'); returns its last row."""
        cfg, streams, rows = self.cfg, self.streams, self.rows
        agent = len(self.parent)
        self.parent.append(parent)
        self.session_of.append(session)
        self.spawn_row.append(spawned_by)
        sys_len, block = cfg.system_prompt_len, cfg.hash_block_size
        system = 0 if sys_len else None
        context, chain = sys_len + task, []
        waits: tuple = () if spawned_by < 0 else ((spawned_by, 0.0),)
        for k in range(turns):
            row = len(rows["prompt"])
            extend_chain(chain, context // block, block, sys_len, system, agent, AGENT_CONTENT)
            output = int(streams["output"].take()[0])
            rows["output_hashes"].append(continuation(chain, context + output, block, sys_len, system, agent, AGENT_CONTENT))
            for name, value in (("arrival", start), ("prompt", context), ("output", output),
                                ("hashes", tuple(chain)), ("agent", agent), ("turn", k), ("waits", waits)):
                rows[name].append(value)
            rows["tools"].append(())
            context += output
            if k == turns - 1:
                break
            if parent < 0 and cfg.subagent_probability and self.rng.random() < cfg.subagent_probability:
                lasts = [self._agent(start, agent, row, session, int(streams["sub_turns"].take()[0]),
                                     int(streams["sub_task"].take()[0]))
                         for _ in range(int(streams["children"].take()[0]))]
                context += sum(rows["output"][last] for last in lasts)
                waits = ((row, 0.0),) + tuple((last, 0.0) for last in lasts)
            else:
                calls = int(streams["calls"].take()[0])
                times = sample_tool_times(cfg.tool_time, calls, self.rng)
                rows["tools"][row] = tuple(float(t) for t in times)
                context += int(streams["result"].take(calls).sum())
                waits = ((row, float(times.max())),)
        return len(rows["prompt"]) - 1

    def program(self) -> AgenticProgram:
        r = self.rows
        return AgenticProgram(np.asarray(r["arrival"], dtype=np.float64), np.asarray(r["prompt"], dtype=np.int64),
                              np.asarray(r["output"], dtype=np.int64), r["hashes"],
                              np.asarray(r["agent"], dtype=np.int64), np.asarray(r["turn"], dtype=np.int64),
                              r["waits"], r["tools"], self.parent, self.session_of, self.spawn_row, self.sessions,
                              r["output_hashes"])


def check_agentic(cfg: AgenticConfig, key: str) -> None:
    """The distributions a program needs are there (ConfigError naming the missing key)."""
    from cbsim.core.errors import missing

    for name in REQUIRED:
        if getattr(cfg, name) is None:
            raise missing(f"{key}.{name}", "a mapping with a 'type' key")

