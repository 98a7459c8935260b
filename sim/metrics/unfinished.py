"""What a run did not finish, said in its summary instead of silently: rejections by reason, and the
requests `sim.max_time` cut off.

A rejected request's reason names its numbers ("needs 20 KV blocks, the cache has 2 usable"), so reasons
are grouped by their wording with the numbers masked: `rejected_reasons` maps the first reason of each
group to the group's count (largest first), so a run in which every request is rejected still says why.

A run cut at `max_time` leaves requests unfinished: those that arrived (waiting, running, preempted or
swapped when the clock stopped) and those whose arrival is after the cut, which never reached the
scheduler. The latter are labelled `not_arrived` in the requests table (they were `waiting` before,
indistinguishable from a request that waited), and `cut_at_max_time` counts both.
"""
from __future__ import annotations

import re

import pandas as pd

NUMBER = re.compile(r"[-+]?\d[\d,._]*(?:[eE][-+]?\d+)?")
MAX_REASONS = 10  # groups kept in the summary; a run's reasons come in a handful of wordings


def rejection_summary(table: pd.DataFrame) -> dict:
    """{"rejected_reasons": {reason: count}} where some request was rejected, else {}."""
    reasons = table.loc[table["status"] == "rejected", "reject_reason"].astype(str)
    if not len(reasons):
        return {}
    groups = reasons.map(lambda text: NUMBER.sub("#", text))
    counts = groups.value_counts(sort=False)
    first = reasons.groupby(groups, sort=False).first()
    order = sorted(counts.index, key=lambda g: (-counts[g], list(counts.index).index(g)))[:MAX_REASONS]
    return {"rejected_reasons": {first[g]: int(counts[g]) for g in order}}


def mark_cut(table: pd.DataFrame, max_time: float | None) -> dict:
    """Relabel the requests that arrive after `max_time` as `not_arrived` (in place) and return
    {"cut_at_max_time": {"max_time", "unfinished", "not_arrived"}} when the cut left any unfinished."""
    if max_time is None:
        return {}
    open_ = ~table["status"].isin(["finished", "rejected"])
    if not open_.any():
        return {}
    late = open_ & (table["status"] == "waiting") & (table["arrival"] >= max_time)
    table.loc[late, "status"] = "not_arrived"
    return {"cut_at_max_time": {"max_time": float(max_time), "unfinished": int(open_.sum() - late.sum()),
                                "not_arrived": int(late.sum())}}


def cut_warning(summary: dict) -> str | None:
    """The warning line a cut run prints, or None."""
    cut = summary.get("cut_at_max_time")
    if not cut:
        return None
    return (f"warning: sim.max_time = {cut['max_time']:g} s stopped the run with {cut['unfinished']} request(s) "
            f"unfinished and {cut['not_arrived']} not yet arrived; their latencies are not in the summary")
