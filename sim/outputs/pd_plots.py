"""The pool side of the per-run plots: replica names with their pool, and the KV hand-off panel.

A P/D run's `pools` maps "prefill" and "decode" to replica indices (a colocated run has one
"cluster" pool, which names nothing). The hand-off panel has one row per replica, labelled with its
pool, prefill rows on top; each hand-off is a line from its prefill replica's row when its first
transfer hop started to its decode replica's row when the last hop ended (the `transfers` rows of
that request that are not host swaps), so a steep line is a quick transfer and a slanted one a slow
or queued one. Nothing is computed here beyond joining the two frames.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.collections import LineCollection

TRANSFER, BUSY = "tab:purple", "0.85"
HOST_KINDS = ("swap_out", "swap_in")


def pool_of(replica, pools: dict | None) -> str | None:
    """The pool of `replica` when the run has more than one pool, else None."""
    if not pools or len(pools) < 2:
        return None
    return next((name for name, members in pools.items() if replica in members), None)


def replica_name(replica, pools: dict | None) -> str:
    """'replica 2 (decode pool)' on a P/D run, 'replica 2' otherwise."""
    pool = pool_of(replica, pools)
    return f"replica {replica}" + (f" ({pool} pool)" if pool else "")


def hand_off_spans(transfers: pd.DataFrame | None, handoffs: pd.DataFrame) -> pd.DataFrame:
    """Per hand-off with a decode replica: prefill_replica, decode_replica, start, end (first hop
    start to last hop end), bytes; hand-offs without a transfer row (all cached) are left out."""
    if transfers is None or not len(transfers):
        return pd.DataFrame(columns=["prefill_replica", "decode_replica", "start", "end", "bytes"])
    hops = transfers[~transfers["kind"].isin(HOST_KINDS)]
    per_request = hops.groupby("request_id").agg(start=("start", "min"), end=("end", "max"), bytes=("bytes", "sum"))
    moved = handoffs[handoffs["decode_replica"] >= 0][["request_id", "prefill_replica", "decode_replica"]]
    return moved.merge(per_request.reset_index(), on="request_id", how="inner")


def draw_transfers(ax, steps: pd.DataFrame, pools: dict, transfers, handoffs, raw: bool) -> None:
    """Rows per replica (named with their pool), busy steps in gray when `raw`, one line per hand-off."""
    order = [r for name in ("prefill", "decode") for r in pools.get(name, [])]
    order += [r for r in sorted(steps["replica"].unique()) if r not in order]
    row = {r: i for i, r in enumerate(reversed(order))}  # prefill replicas on top
    if raw:
        for r, s in steps.groupby("replica"):
            spans = np.column_stack([s["start"], s["end"] - s["start"]])
            ax.broken_barh(spans, (row[r] - 0.3, 0.6), facecolors=BUSY, linewidth=0)
    spans = hand_off_spans(transfers, handoffs)
    if len(spans):
        ys = np.column_stack([spans["prefill_replica"].map(row), spans["decode_replica"].map(row)])
        xs = np.column_stack([spans["start"], spans["end"]])
        alpha = 0.7 if len(spans) <= 300 else 0.25
        ax.add_collection(LineCollection(np.stack([xs, ys], axis=2), colors=TRANSFER, linewidths=0.8,
                                         alpha=alpha, label="KV transfer (prefill row to decode row)"))
        ax.plot(spans["end"], ys[:, 1], "v", color=TRANSFER, markersize=3, alpha=alpha)
    ax.set_yticks(list(row.values()), [replica_name(r, pools) for r in row])
    ax.set_ylim(-0.6, len(order) - 0.4)
    ax.set_title(_title(spans, raw))


def _title(spans: pd.DataFrame, raw: bool) -> str:
    if not len(spans):
        return "KV hand-offs: none moved over a link"
    link = (spans["end"] - spans["start"]).median()
    busy = "; gray: steps" if raw else ""
    return (f"KV hand-offs: {len(spans)} transfers, {spans['bytes'].sum() / 1e9:.3g} GB, median "
            f"{link * 1e3:.3g} ms on the link (one line each{busy})")
