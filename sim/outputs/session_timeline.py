"""session_timeline.png: one agentic session's turns on a timeline (one lane per agent).

The session drawn is the one with the most sub-agents, at most MAX_LANES - 1 of them so that the
lanes stay legible (then the longest makespan, then the lowest id): the one that shows the most of
a program. Each turn is a bar from its send to its end, split
as the request table splits it (queue: send to first scheduled; prefill: to the first token;
decode: to the end); after a turn, its tool calls as a hatched bar (the slowest call's duration,
labelled with the number of parallel calls) or, for a turn that spawned sub-agents, a dotted line
to the next send and an arrow to each child's lane. Above the later turns (one label per LABEL_GAP
of the axis, so none overlap): the history tokens its admission found cached out of those reusable
(session_metrics.py).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from cbsim.sim.outputs.figure import new_figure, save_png, styled

QUEUE, PREFILL, DECODE, TOOL = "0.75", "tab:blue", "tab:orange", "tab:green"
DPI = 110
MAX_LANES = 5
LABEL_GAP = 0.08  # share of the time axis between two history labels of one lane (closer ones are left out)


def chosen_session(turns: pd.DataFrame) -> int:
    """The session to draw among those complete (see the module docstring)."""
    per = turns[turns["complete"]].groupby("session").agg(agents=("agent", "nunique"), start=("sent", "min"), end=("end", "max"))
    per["makespan"] = per["end"] - per["start"]
    per["agents"] = per["agents"].where(per["agents"] <= MAX_LANES, 0)  # too many lanes: drawn last
    per = per.reset_index().sort_values(["agents", "makespan", "session"], ascending=[False, False, True])
    return int(per["session"].iloc[0])


def plot_session_timeline(turns: pd.DataFrame, requests: pd.DataFrame, path, session: int | None = None) -> Path:
    """Draw `session` (default: chosen_session) of the turn table into `path`."""
    session = chosen_session(turns) if session is None else session
    rows = turns[turns["session"] == session].merge(
        requests[["request_id", "first_scheduled", "first_token_time"]], on="request_id", how="left")
    agents = sorted(rows["agent"].unique(), key=lambda a: (a != rows["agent"].min(), a))
    lane = {a: i for i, a in enumerate(agents)}
    return save_png(_draw(rows, lane, session), path, DPI)


@styled
def _draw(rows: pd.DataFrame, lane: dict, session: int):
    tall = 1.6 + 0.7 * len(lane)
    fig = new_figure((11, tall))
    ax = fig.add_axes([0.1, 1.0 / tall, 0.87, 1 - 1.5 / tall])
    t0 = float(rows["sent"].min())
    span = float(rows["end"].max() - t0)
    height = 0.5
    labelled: dict[int, float] = {}  # lane -> where its last history label went
    for row in rows.sort_values(["agent", "turn"]).itertuples(index=False):
        y = lane[row.agent]
        spans = ((QUEUE, row.sent, row.first_scheduled), (PREFILL, row.first_scheduled, row.first_token_time),
                 (DECODE, row.first_token_time, row.end))
        for color, start, stop in spans:
            if not (math.isnan(start) or math.isnan(stop)) and stop > start:
                ax.barh(y, stop - start, left=start - t0, height=height, color=color, linewidth=0)
        x = (row.sent + row.end) / 2 - t0
        if row.turn > 0 and row.reusable_tokens and x - labelled.get(y, -span) >= LABEL_GAP * span:
            labelled[y] = x
            ax.text(x, y - 0.36, f"{row.cached_tokens / 1e3:.3g}k/"
                    f"{row.reusable_tokens / 1e3:.3g}k", ha="center", va="bottom", fontsize=6, color="0.3")
    _gaps(ax, rows, lane, t0, height)
    ax.set_yticks(list(lane.values()))
    ax.set_yticklabels([f"session {session}" if i == 0 else f"sub-agent {a}" for a, i in lane.items()])
    ax.set_ylim(len(lane) - 0.4, -0.6)
    ax.set_xlabel("time since the session's first send (s)")
    handles = [ax.barh(np.nan, 0, color=c, label=n) for c, n in ((QUEUE, "queue"), (PREFILL, "prefill"),
                                                                  (DECODE, "decode"))]
    handles.append(ax.barh(np.nan, 0, color="none", edgecolor=TOOL, hatch="///", label="tool calls (x parallel)"))
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=4, frameon=False, fontsize=8)
    ax.set_title(f"agentic session {session}: {len(rows)} turns, {len(lane) - 1} sub-agents, makespan {span:.3g} s; "
                 "cached/reusable history tokens above each later turn", fontsize=9)
    return fig


def _gaps(ax, rows: pd.DataFrame, lane: dict, t0: float, height: float) -> None:
    """What each turn's agent did before its next turn: tool calls, or waiting for its sub-agents."""
    following = rows[rows["turn"] > 0].sort_values(["agent", "turn"])
    for row in following.itertuples(index=False):
        prev = rows[(rows["agent"] == row.agent) & (rows["turn"] == row.turn - 1)].iloc[0]
        y = lane[row.agent]
        if row.tool_time_before > 0:
            ax.barh(y, row.tool_time_before, left=prev["end"] - t0, height=height * 0.6, color="none",
                    edgecolor=TOOL, hatch="///", linewidth=0.8)
            ax.text(prev["end"] + row.tool_time_before / 2 - t0, y + 0.42, f"x{int(prev['tool_calls_after'])}",
                    ha="center", va="center", fontsize=6, color=TOOL)
        if row.subagent_wait_before > 0:
            ax.plot([prev["end"] - t0, row.sent - t0], [y, y], linestyle=":", color="0.4", linewidth=1)
    children = rows[(rows["turn"] == 0) & (rows["parent_agent"] >= 0)]
    for child in children.itertuples(index=False):
        spawner = rows[(rows["agent"] == child.parent_agent) & (rows["sent"] < child.sent)]
        if len(spawner):  # the parent's last turn sent before the child: its reply started the child
            start = float(spawner.sort_values("sent")["end"].iloc[-1]) - t0
            ax.annotate("", xy=(child.sent - t0, lane[child.agent]), xytext=(start, lane[child.parent_agent]),
                        arrowprops=dict(arrowstyle="->", color="0.4", linewidth=0.8))
