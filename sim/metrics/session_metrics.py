"""Agentic-session metrics: one row per turn, one row per agent, and the run's session summary.

A turn is one request of an agentic workload (workloads/agentic.py); its program (`agent`, `turn`,
`waits`, `tool_times`, `parent`, `session`, `spawn_row`, by request id) is read by attribute, so this
module imports nothing of the workloads. Times come from the request table: a turn is *sent* at its
`arrival` (the client's send time in a run whose sends follow replies) and *ends* at its completion
(a failed turn at its last token, or when it reached the scheduler if it had none: its client went
on as if the reply had come, workloads/clients.py).

An agent's makespan (first send to last end) splits exactly into
- serving: each turn's send to its end;
- tool time: the gap before a turn that waited for tool calls (the slowest call's duration, less
  the front end's stream lag of the turn before, which the client does not wait for);
- sub-agent wait: the gap before a turn that waited for its sub-agents (their last end minus the
  spawning turn's end).

KV between turns. Turn k+1's prompt starts with turn k's prompt and output (its `history_tokens`),
so what turn k put in the prefix cache
(its full cache units: `unit_tokens`, the cache's granule, of the prompt + output - 1 tokens it computed:
its output's blocks are cached too, as vLLM V1 caches them, sim/kv/prefix.py; at most what turn k+1's
admission may hit, all its prompt but the last token) is *reusable* by turn k+1. What its admission found cached of that
is *resident*; the rest is *recomputed*: evicted during the gap, or on another replica (`moved`: the
two turns ran on different replicas). A failed previous turn leaves nothing reusable, and a turn never admitted reuses nothing.

A run cut by `sim.max_time` may leave sessions open (a turn unfinished, or never sent: a turn not
sent yet keeps its session's start as its arrival). Their turns and agents are marked `complete`
False and carry no times; the makespan keys and shares are over the complete sessions only.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from cbsim.sim.metrics.summary import column_percentiles, json_number

TIMES = ("sent", "end", "serving_time", "gap_before", "tool_time_before", "subagent_wait_before")  # per turn, in s


def turn_frame(requests: pd.DataFrame, program, unit_tokens: int) -> pd.DataFrame:
    """One row per turn, in request-id order (columns: see docs/concepts/agentic-sessions.md)."""
    ids = requests["request_id"].to_numpy()
    sent = requests["arrival"].to_numpy(dtype=np.float64)
    end = _ends(requests)
    prompt = requests["prompt_len"].to_numpy()
    replica = requests["replica"].to_numpy()
    finished = (requests["status"] == "finished").to_numpy()
    cached = requests["cached_tokens"].to_numpy() if "cached_tokens" in requests else np.zeros(len(ids), np.int64)
    agent = np.asarray(program.agent)[ids]
    turn = np.asarray(program.turn)[ids]
    before = np.array([_previous(program, int(r)) for r in ids], dtype=np.int64)  # same agent's turn before
    has = before >= 0
    prev = np.where(has, before, 0)
    admitted = ~np.isnan(requests["first_scheduled"].to_numpy(dtype=np.float64))
    output = requests["output_len"].to_numpy()
    left = np.minimum(prompt[prev] + output[prev] - 1, prompt - 1) // unit_tokens * unit_tokens
    reusable = np.where(has & admitted & finished[prev], left, 0)
    resident = np.minimum(cached, reusable)
    gap = np.where(has, sent - end[prev], 0.0)
    spawned = np.array([_spawned(program, int(r)) for r in ids], dtype=bool)  # waited for sub-agents
    session = np.asarray(program.session)[agent]
    done = np.isin(requests["status"].to_numpy(), ["finished", "rejected"])
    complete = pd.Series(done).groupby(session).transform("all").to_numpy()  # a session a cut left open: no times
    frame = pd.DataFrame({
        "request_id": ids, "session": session, "agent": agent, "complete": complete,
        "parent_agent": np.asarray(program.parent)[agent], "turn": turn, "status": requests["status"].to_numpy(),
        "replica": replica, "sent": sent, "ttft": requests["ttft"].to_numpy(), "end": end,
        "serving_time": end - sent, "gap_before": gap,
        "tool_time_before": np.where(has & ~spawned, gap, 0.0),
        "subagent_wait_before": np.where(spawned, gap, 0.0),
        "tool_calls_after": np.array([len(program.tool_times[int(r)]) for r in ids], dtype=np.int64),
        "prompt_len": prompt, "output_len": requests["output_len"].to_numpy(),
        "history_tokens": np.where(has, prompt[prev] + requests["output_len"].to_numpy()[prev], 0),
        "reusable_tokens": reusable, "cached_tokens": cached, "resident_tokens": resident,
        "recomputed_tokens": reusable - resident,
        "moved": has & (replica != replica[prev]),
    })
    frame.loc[~complete, list(TIMES)] = np.nan
    return frame


def session_frame(turns: pd.DataFrame) -> pd.DataFrame:
    """One row per agent (top-level sessions and sub-agents), in agent order."""
    g = turns.groupby("agent", sort=True)
    out = pd.DataFrame({
        "session": g["session"].first(), "parent_agent": g["parent_agent"].first(), "complete": g["complete"].all(),
        "turns": g["turn"].count(),
        "failed_turns": g["status"].agg(lambda s: int((s != "finished").sum())),
        "start": g["sent"].min(), "end": g["end"].max(),
    })
    out["makespan"] = out["end"] - out["start"]
    for name in ("serving_time", "tool_time_before", "subagent_wait_before", "tool_calls_after", "reusable_tokens",
                 "resident_tokens", "recomputed_tokens"):
        out[name.replace("_before", "").replace("_after", "")] = g[name].sum(min_count=1)
    out["recomputed_moved_tokens"] = turns["recomputed_tokens"].where(turns["moved"], 0).groupby(turns["agent"]).sum()
    out["final_context"] = g["prompt_len"].last() + g["output_len"].last()
    return out.reset_index()


def session_summary(turns: pd.DataFrame, sessions: pd.DataFrame, prefix_caching: bool) -> dict:
    """Summary keys of an agentic run (units: sim/metrics/summary_units.py)."""
    top = sessions[sessions["parent_agent"] < 0]
    out = {"num_sessions": len(top), "num_subagents": int((sessions["parent_agent"] >= 0).sum()),
           "num_sessions_incomplete": int((~top["complete"]).sum())}
    top = top[top["complete"]]
    span = float(top["makespan"].sum())
    for q, v in zip((50, 90, 99), column_percentiles(top["makespan"])):
        out[f"session_makespan_p{q}"] = v
    for name, column in (("serving", "serving_time"), ("tool", "tool_time"), ("subagent", "subagent_wait")):
        out[f"session_{name}_share"] = json_number(top[column].sum() / span) if span > 0 else None
    ok = turns[turns["status"] != "rejected"]
    for name, rows in (("first_turn_ttft", ok[ok["turn"] == 0]), ("followup_ttft", ok[ok["turn"] > 0])):
        for q, v in zip((50, 99), column_percentiles(rows["ttft"], (50, 99))):
            out[f"{name}_p{q}"] = v
    reusable = int(turns["reusable_tokens"].sum())
    out["session_reusable_tokens"] = reusable
    out["session_recomputed_tokens"] = int(turns["recomputed_tokens"].sum())
    out["session_recomputed_moved_tokens"] = int(turns["recomputed_tokens"][turns["moved"]].sum())
    resident = int(turns["resident_tokens"].sum())
    out["session_kv_resident_fraction"] = json_number(resident / reusable) if reusable and prefix_caching else (
        0.0 if reusable else None)
    return out


def _ends(requests: pd.DataFrame) -> np.ndarray:
    """When each turn ended: its completion, else its last token, else its arrival at the scheduler."""
    end = requests["completion_time"].to_numpy(dtype=np.float64)
    reached = requests["arrival"].to_numpy(dtype=np.float64)
    if "frontend_delay" in requests:
        reached = reached + requests["frontend_delay"].to_numpy(dtype=np.float64)
    for fallback in (requests["last_token_time"].to_numpy(dtype=np.float64), reached):
        end = np.where(np.isnan(end), fallback, end)
    return end


def _previous(program, rid: int) -> int:
    """The same agent's turn before `rid` (-1: its first turn)."""
    agent = program.agent[rid]
    for pred, _ in program.waits[rid]:
        if program.agent[pred] == agent:
            return int(pred)
    return -1


def _spawned(program, rid: int) -> bool:
    """`rid` waited for sub-agents (a wait on another agent's turn, not its spawner's first send)."""
    agent = program.agent[rid]
    return any(program.agent[pred] != agent for pred, _ in program.waits[rid]) and _previous(program, rid) >= 0
