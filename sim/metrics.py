"""Metrics computed after a run from the Recorder and the Request records (numpy + pandas).

Design: nothing here touches the simulation; everything is derived from two records.
- The step table gives every step's replica, start and end. A replica's *local order* is its steps
  sorted by global index; each replica's ends strictly increase along it (checked).
- A request's tokens are *runs* (recorder.py): a run covers consecutive local positions
  f..l of one replica, one token per step, token time = the step's end.

Invariants used (and checked, raising ValueError on a broken record): a run lies on one replica,
tokens == l - f + 1, and runs of one request do not overlap in time.

The ITL distribution is never expanded per token. Within runs, the gap of local position k
(end[k] - end[k-1]) is shared by every run with f < k <= l: its weight is a difference array over
local positions. Each break between two runs of a request adds one gap (first token of the later
run minus last token of the earlier). Memory is O(steps + runs + requests).

Percentiles (request columns and the weighted ITL alike) use the inverted-CDF definition
(numpy method="inverted_cdf"): the smallest value v with P(X <= v) >= q.
The summary is JSON-ready: plain int/float values, None where a metric is undefined.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from cbsim.schema import option, require

from .recorder import STEP_COLUMNS, Recorder
from .request import Request, Status


@dataclass
class SLOConfig:
    """Service-level objectives; a request meets the SLO set when it finished and meets every one set."""

    ttft: float | None = option(None, help="max time to first token, seconds (null: no TTFT objective)")
    tpot: float | None = option(None, help="max time per output token after the first, seconds (null: none)")
    itl_max: float | None = option(
        None, help="max gap between two consecutive tokens of a request, seconds (null: none)")

    def validate(self) -> None:
        for name in ("ttft", "tpot", "itl_max"):
            value = getattr(self, name)
            require(value is None or value > 0, name, "a positive number of seconds or null", value)


@dataclass
class MetricsConfig:
    """How the run's results are summarised."""

    long_prompt_threshold: int = option(2048, help="prompts of at least this many tokens are 'long' (dec@P, short_P)")
    slo: SLOConfig = option(default_factory=SLOConfig, help="objectives for goodput and SLO attainment")
    stall_factor: float = option(5.0, help="an ITL gap above stall_factor x the run's median ITL is a stall")
    cdf_max_points: int = option(2000, help="at most this many points per CDF curve in plots")
    trace_max_steps: int = option(200_000, help="the Perfetto trace holds at most this many steps (the first ones)")

    def validate(self) -> None:
        require(self.long_prompt_threshold >= 1, "long_prompt_threshold", "an integer >= 1", self.long_prompt_threshold)
        require(self.stall_factor > 0, "stall_factor", "a positive number", self.stall_factor)
        require(self.cdf_max_points >= 2, "cdf_max_points", "an integer >= 2", self.cdf_max_points)
        require(self.trace_max_steps >= 0, "trace_max_steps", "an integer >= 0", self.trace_max_steps)


# ---------------------------------------------------------------- steps in each replica's order


def step_frame(recorder: Recorder) -> pd.DataFrame:
    """One row per step: `step` (global index), every recorder column, and `duration` (end - start)."""
    table = recorder.step_table()  # views of the recorder's buffers: the frame does not copy them
    columns = {"step": np.arange(recorder.num_steps, dtype=np.int64), **{name: table[name] for name in STEP_COLUMNS}}
    columns["duration"] = table["end"] - table["start"]
    return pd.DataFrame(columns, copy=False)


@dataclass(frozen=True)
class LocalOrder:
    """Steps grouped by replica, in each replica's own order (global index ascending within it)."""

    order: np.ndarray  # global step index at each local slot
    position: np.ndarray  # position[g]: slot of global step g
    end: np.ndarray  # step end per slot
    replica: np.ndarray  # replica per slot
    gap: np.ndarray  # end[k] - end[k-1] within a replica; NaN at a replica's first step

    @classmethod
    def of(cls, steps: pd.DataFrame) -> "LocalOrder":
        """From a step_frame: row i must be global step i."""
        replica = steps["replica"].to_numpy()
        order = np.argsort(replica, kind="stable")
        position = np.empty(len(order), dtype=np.int64)
        position[order] = np.arange(len(order), dtype=np.int64)
        end = steps["end"].to_numpy(dtype=np.float64)[order]
        rep = replica[order]
        gap = np.full(len(order), np.nan)
        gap[1:] = end[1:] - end[:-1]
        gap[1:][rep[1:] != rep[:-1]] = np.nan
        if np.any(gap <= 0):
            raise ValueError("step ends of a replica must strictly increase in step order")
        return cls(order, position, end, rep, gap)


# ---------------------------------------------------------------- token runs


@dataclass(frozen=True)
class TokenRuns:
    """Every token run, sorted by (request, time), located in the local order."""

    request_id: np.ndarray
    first: np.ndarray  # local slot of the run's first token
    last: np.ndarray  # local slot of its last token
    tokens: np.ndarray
    t_first: np.ndarray
    t_last: np.ndarray
    break_gap: np.ndarray  # gap from the same request's previous run; NaN on a request's first run


def run_arrays(recorder: Recorder, requests=()) -> dict[str, np.ndarray]:
    """The recorder's closed runs plus the still-open run of each request (a run cut short)."""
    table = recorder.run_table()
    open_runs = [(r.id, r.run_start_step, r.last_token_step, r.run_tokens) for r in requests if r.run_tokens > 0]
    if not open_runs:
        return table
    extra = np.array(open_runs, dtype=np.int64).reshape(-1, 4)
    return {name: np.concatenate([table[name], extra[:, j]])
            for j, name in enumerate(("request_id", "first_step", "last_step", "tokens"))}


def token_runs(local: LocalOrder, runs: dict[str, np.ndarray]) -> TokenRuns:
    """Locate runs in the local order and check the run invariants."""
    first_step, last_step, tokens = runs["first_step"], runs["last_step"], runs["tokens"]
    num_steps = len(local.order)
    if len(tokens) and (first_step.min() < 0 or last_step.max() >= num_steps):
        raise ValueError("a token run refers to a step that is not in the step table")
    first, last = local.position[first_step], local.position[last_step]
    bad = (local.replica[first] != local.replica[last]) | (last - first + 1 != tokens)
    if np.any(bad):
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"token run {i} of request {runs['request_id'][i]} is not "
                         f"{tokens[i]} consecutive steps of one replica")
    t_first, t_last = local.end[first], local.end[last]
    sort = np.lexsort((t_first, runs["request_id"]))
    rid, t_first, t_last = runs["request_id"][sort], t_first[sort], t_last[sort]
    break_gap = np.full(len(rid), np.nan)
    same = rid[1:] == rid[:-1]
    break_gap[1:][same] = t_first[1:][same] - t_last[:-1][same]
    if np.any(break_gap <= 0):
        raise ValueError("two token runs of one request overlap in time")
    return TokenRuns(rid, first[sort], last[sort], tokens[sort], t_first, t_last, break_gap)


def _coverage(local: LocalOrder, runs: TokenRuns) -> np.ndarray:
    """Per local slot k: how many runs have a token at k that follows one at k-1 in the same run."""
    n = len(local.order)
    diff = np.bincount(runs.first + 1, minlength=n + 1) - np.bincount(runs.last + 1, minlength=n + 1)
    return np.cumsum(diff)[:n]


def _in_run_max(local: LocalOrder, runs: TokenRuns) -> np.ndarray:
    """Largest within-run gap of each run (NaN for a one-token run), without expanding tokens."""
    if len(runs.first) == 0:
        return np.zeros(0)
    gaps = np.append(np.nan_to_num(local.gap, nan=-np.inf), -np.inf)
    by_start = np.argsort(runs.first, kind="stable")  # keeps the unused in-between spans short
    bounds = np.empty(2 * len(by_start), dtype=np.int64)
    bounds[0::2] = runs.first[by_start] + 1
    bounds[1::2] = runs.last[by_start] + 1
    out = np.empty(len(by_start))
    out[by_start] = np.maximum.reduceat(gaps, bounds)[0::2]
    out[runs.last == runs.first] = np.nan
    return out


# ---------------------------------------------------------------- ITL distribution


@dataclass(frozen=True)
class ITLDistribution:
    """Every inter-token gap of the run, weighted: `weights[i]` gaps of length `values[i]` seconds.

    Sorted by value. `times` is when each gap ended (a step end, or the later run's first token)
    and `replica` where; together they locate stalls.
    """

    values: np.ndarray
    weights: np.ndarray
    times: np.ndarray
    replica: np.ndarray
    total_tokens: int

    @property
    def count(self) -> int:
        return int(self.weights.sum())

    def percentile(self, q):
        """Weighted inverted-CDF percentile(s), q in [0, 100]; NaN when there is no gap."""
        return weighted_percentile(self.values, self.weights, q)


def itl_distribution(recorder: Recorder, requests=(), steps: pd.DataFrame | None = None) -> ITLDistribution:
    """The ITL distribution of a run. Pass `requests` to include runs still open when the run was cut."""
    steps = step_frame(recorder) if steps is None else steps
    local = LocalOrder.of(steps)
    runs = token_runs(local, run_arrays(recorder, requests))
    cover = _coverage(local, runs)
    inside = cover > 0
    broken = ~np.isnan(runs.break_gap)
    values = np.concatenate([local.gap[inside], runs.break_gap[broken]])
    weights = np.concatenate([cover[inside], np.ones(int(broken.sum()), dtype=np.int64)])
    times = np.concatenate([local.end[inside], runs.t_first[broken]])
    replica = np.concatenate([local.replica[inside], local.replica[runs.first[broken]]])
    sort = np.argsort(values, kind="stable")
    return ITLDistribution(values[sort], weights[sort], times[sort], replica[sort], int(runs.tokens.sum()))


def weighted_percentile(values: np.ndarray, weights: np.ndarray, q):
    """Inverted-CDF percentile: the smallest v with (weight of values <= v) >= q/100 x total weight.

    Equals numpy.percentile(np.repeat(values, weights), q, method="inverted_cdf").
    """
    values = np.asarray(values, dtype=np.float64)
    weights = np.asarray(weights)
    keep = weights > 0
    values, weights = values[keep], weights[keep]
    scalar = np.ndim(q) == 0
    q = np.atleast_1d(np.asarray(q, dtype=np.float64))
    if np.any((q < 0) | (q > 100)):
        raise ValueError("percentiles must lie in [0, 100]")
    if len(values) == 0:
        out = np.full(len(q), np.nan)
    else:
        sort = np.argsort(values, kind="stable")
        cum = np.cumsum(weights[sort])
        index = np.searchsorted(cum, cum[-1] * (q / 100), side="left")
        out = values[sort][np.minimum(index, len(cum) - 1)]
    return float(out[0]) if scalar else out


def cdf_points(values: np.ndarray, weights: np.ndarray | None = None, max_points: int = 2000):
    """(x, F(x)) of the empirical CDF, thinned to at most `max_points` points (the last one kept)."""
    values = np.asarray(values, dtype=np.float64)
    weights = np.ones(len(values)) if weights is None else np.asarray(weights, dtype=np.float64)
    keep = ~np.isnan(values) & (weights > 0)
    values, weights = values[keep], weights[keep]
    if len(values) == 0:
        return np.zeros(0), np.zeros(0)
    sort = np.argsort(values, kind="stable")
    x, cum = values[sort], np.cumsum(weights[sort])
    y = cum / cum[-1]
    if len(x) > max_points:
        pick = np.unique(np.searchsorted(y, np.linspace(0, 1, max_points), side="left").clip(0, len(x) - 1))
        x, y = x[pick], y[pick]
    return x, y


def stall_events(dist: ITLDistribution, factor: float) -> pd.DataFrame:
    """Gaps longer than factor x the run's median ITL: time (gap end), length, count, replica."""
    threshold = factor * dist.percentile(50) if dist.count else math.inf
    mask = dist.values > threshold
    return pd.DataFrame({"time": dist.times[mask], "length": dist.values[mask],
                         "count": dist.weights[mask], "replica": dist.replica[mask]})


def token_times(recorder: Recorder, request_id: int) -> np.ndarray:
    """All token times of one request (closed runs), in order; for tests and notebooks."""
    local = LocalOrder.of(step_frame(recorder))
    table = recorder.run_table()
    mine = table["request_id"] == request_id
    runs = token_runs(local, {name: column[mine] for name, column in table.items()})
    slots = [np.arange(f, l + 1) for f, l in zip(runs.first, runs.last)]
    return local.end[np.concatenate(slots)] if slots else np.zeros(0)


# ---------------------------------------------------------------- per-request table


def _request_columns(requests: list[Request]) -> dict[str, np.ndarray]:
    def column(name, dtype):
        return np.fromiter((getattr(r, name) for r in requests), dtype=dtype, count=len(requests))

    cols = {"request_id": column("id", np.int64), "arrival": column("arrival", np.float64)}
    for name in ("prompt_len", "output_len", "priority", "replica", "num_preemptions",
                 "first_scheduled_step", "first_token_step"):
        cols[name] = column(name, np.int64)
    for name in ("first_scheduled", "first_token_time", "completion_time"):
        cols[name] = column(name, np.float64)
    cols["status_code"] = column("status", np.int64)
    return cols


def _per_request_runs(ids: np.ndarray, local: LocalOrder, runs: TokenRuns):
    """Tokens, last token time and largest gap per request (row order of `ids`)."""
    n = len(ids)
    tokens, last, itl_max = np.zeros(n, np.int64), np.full(n, np.nan), np.full(n, np.nan)
    if len(runs.tokens) == 0:
        return tokens, last, itl_max
    sorter = np.argsort(ids, kind="stable")
    pos = np.searchsorted(ids[sorter], runs.request_id).clip(0, max(n - 1, 0))
    if n == 0 or np.any(ids[sorter][pos] != runs.request_id):
        raise ValueError("a token run belongs to a request that is not in the request list")
    row = sorter[pos]
    starts = np.flatnonzero(np.r_[True, runs.request_id[1:] != runs.request_id[:-1]])
    gap = np.fmax(_in_run_max(local, runs), runs.break_gap)
    tokens[row[starts]] = np.add.reduceat(runs.tokens, starts)
    last[row[starts]] = np.maximum.reduceat(runs.t_last, starts)
    itl_max[row[starts]] = np.fmax.reduceat(gap, starts)
    return tokens, last, itl_max


def _dec_at_p(cols, steps: pd.DataFrame, long_mask: np.ndarray) -> np.ndarray:
    """Decode tokens of the first-scheduled replica's steps between first_scheduled_step and first_token_step."""
    out = np.full(len(long_mask), np.nan)
    a, b = cols["first_scheduled_step"], cols["first_token_step"]
    rows = np.flatnonzero(long_mask & (a >= 0) & (b >= a))
    if len(rows) == 0:
        return out
    replica = steps["replica"].to_numpy()
    _, rank = np.unique(replica, return_inverse=True)
    num = len(replica)
    key = rank.astype(np.int64) * num + np.arange(num)  # sorted key: (replica, global index)
    order = np.argsort(key, kind="stable")
    cum = np.r_[0, np.cumsum(steps["decode_tokens"].to_numpy()[order])]
    base = rank[a[rows]].astype(np.int64) * num
    lo = np.searchsorted(key[order], base + a[rows], side="left")
    hi = np.searchsorted(key[order], base + b[rows], side="right")
    out[rows] = cum[hi] - cum[lo]
    return out


def _short_p(arrival, completion, finished, long_mask, rejected) -> np.ndarray:
    """Per admitted long request: max completion of finished short requests in the system at its
    arrival, minus that arrival (a rejected long request never entered the system: NaN).

    A prefix max over arrival-sorted short requests: if the latest completion among those that
    arrived by `a` is after `a`, that is the max over the ones still in the system.
    """
    out = np.full(len(arrival), np.nan)
    short = ~long_mask & finished
    rows = np.flatnonzero(long_mask & ~rejected)
    if len(rows) == 0 or not short.any():
        return out
    sort = np.argsort(arrival[short], kind="stable")
    short_arrival = arrival[short][sort]
    latest_done = np.maximum.accumulate(completion[short][sort])
    upto = np.searchsorted(short_arrival, arrival[rows], side="right")
    latest = np.where(upto > 0, latest_done[np.maximum(upto - 1, 0)], -np.inf)
    present = latest > arrival[rows]
    out[rows[present]] = latest[present] - arrival[rows[present]]
    return out


def _meets_slo(frame: pd.DataFrame, slo: SLOConfig) -> np.ndarray:
    """Finished, and within every objective set; an undefined TPOT or ITL (one token) passes."""
    ok = (frame["status"] == "finished").to_numpy().copy()
    if slo.ttft is not None:
        ok &= frame["ttft"].to_numpy() <= slo.ttft
    for name in ("tpot", "itl_max"):
        limit = getattr(slo, name)
        if limit is not None:
            value = frame[name].to_numpy()
            ok &= np.isnan(value) | (value <= limit)
    return ok


def request_frame(requests: list[Request], recorder: Recorder, steps: pd.DataFrame,
                  config: MetricsConfig | None = None) -> pd.DataFrame:
    """One row per request with its latencies, interference metrics and SLO verdict.

    TPOT is defined once all output_len >= 2 tokens exist; itl_max once two tokens exist;
    e2e and normalized_latency for finished requests; dec_at_p for long requests that got their
    first token, short_p for long requests that were not rejected and found a short one in the system.
    """
    config = config or MetricsConfig()
    requests = list(requests)
    cols = _request_columns(requests)
    local = LocalOrder.of(steps)
    runs = token_runs(local, run_arrays(recorder, requests))
    tokens, last, itl_max = _per_request_runs(cols["request_id"], local, runs)
    status = np.array([Status(code).name.lower() for code in range(len(Status))], dtype=object)[cols["status_code"]]
    finished = cols["status_code"] == Status.FINISHED
    completion = np.where(finished, cols["completion_time"], np.nan)
    rejected = cols["status_code"] == Status.REJECTED
    long_mask = cols["prompt_len"] >= config.long_prompt_threshold
    out_len = cols["output_len"]
    complete = (tokens == out_len) & (out_len >= 2)
    frame = pd.DataFrame({
        "request_id": cols["request_id"], "arrival": cols["arrival"], "prompt_len": cols["prompt_len"],
        "output_len": out_len, "priority": cols["priority"], "replica": cols["replica"], "status": status,
        "first_scheduled": cols["first_scheduled"], "first_token_time": cols["first_token_time"],
        "last_token_time": last, "completion_time": completion, "output_tokens": tokens,
        "ttft": cols["first_token_time"] - cols["arrival"],
        "tpot": np.where(complete, (last - cols["first_token_time"]) / np.maximum(out_len - 1, 1), np.nan),
        "e2e": completion - cols["arrival"], "queue_delay": cols["first_scheduled"] - cols["arrival"],
        "normalized_latency": (completion - cols["arrival"]) / np.maximum(out_len, 1),
        "itl_max": itl_max, "num_preemptions": cols["num_preemptions"], "is_long": long_mask,
        "dec_at_p": _dec_at_p(cols, steps, long_mask),
        "short_p": _short_p(cols["arrival"], completion, finished, long_mask, rejected),
        "reject_reason": [r.reject_reason for r in requests],
    })
    frame["meets_slo"] = _meets_slo(frame, config.slo)
    return frame


# ---------------------------------------------------------------- summary


def _num(value):
    """A JSON-safe number: int stays int, NaN/inf/None become None."""
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    value = float(value)
    return value if math.isfinite(value) else None


def _percentiles(column: pd.Series, qs=(50, 90, 99)) -> list:
    values = column.to_numpy(dtype=np.float64)
    values = values[~np.isnan(values)]
    if len(values) == 0:
        return [None] * len(qs)
    return [_num(v) for v in np.percentile(values, qs, method="inverted_cdf")]


def summarize(requests_df: pd.DataFrame, steps_df: pd.DataFrame, recorder: Recorder,
              config: MetricsConfig | None = None, itl: ITLDistribution | None = None) -> dict:
    """Flat JSON-ready summary (None where undefined: no finished request, no long request, ...).

    Latency percentiles are over requests where the metric is defined; ITL over every gap.
    Throughput counts the output tokens of finished requests over makespan = last completion -
    first arrival. Stalls are ITL gaps above stall_factor x the ITL median: how many gaps, their
    summed length and the longest. short_p_undefined counts long requests without a short_P.
    num_preemptions sums the requests' counters. Pass `itl` (itl_distribution with the requests)
    to include runs still open at a cut; otherwise it is rebuilt from the recorder's closed runs.
    """
    config = config or MetricsConfig()
    itl = itl_distribution(recorder, steps=steps_df) if itl is None else itl
    df = requests_df
    out = _latency_summary(df, itl)
    out.update(_rate_summary(df))
    out.update(_interference_summary(df, itl, config.stall_factor))
    out.update(num_preemptions=int(df["num_preemptions"].sum()), num_rejected=int((df["status"] == "rejected").sum()),
               num_finished=int((df["status"] == "finished").sum()), num_requests=len(df), num_steps=len(steps_df))
    return out


def _latency_summary(df: pd.DataFrame, itl: ITLDistribution) -> dict:
    out = {}
    for name, qs in (("ttft", (50, 90, 99)), ("tpot", (50, 90, 99)), ("e2e", (50, 99)), ("queue_delay", (50, 99))):
        for q, v in zip(qs, _percentiles(df[name], qs)):
            out[f"{name}_p{q}"] = v
    for q, v in zip((50, 90, 99), itl.percentile([50, 90, 99])):
        out[f"itl_p{q}"] = _num(v)
    out["itl_max"] = _num(itl.values[-1]) if len(itl.values) else None
    return out


def _rate_summary(df: pd.DataFrame) -> dict:
    finished = df["status"] == "finished"
    makespan = df.loc[finished, "completion_time"].max() - df["arrival"].min() if finished.any() else math.nan
    per_s = 1.0 / makespan if makespan > 0 else math.nan
    return {
        "throughput_tokens_per_s": _num(df.loc[finished, "output_len"].sum() * per_s),
        "throughput_requests_per_s": _num(finished.sum() * per_s),
        "goodput_requests_per_s": _num(df["meets_slo"].sum() * per_s),
        "slo_attainment": _num(df["meets_slo"].mean() if len(df) else math.nan),
        "makespan": _num(makespan),
    }


def _interference_summary(df: pd.DataFrame, itl: ITLDistribution, stall_factor: float) -> dict:
    long = df[df["is_long"]]
    stalls = stall_events(itl, stall_factor)
    return {
        "dec_at_p_mean": _num(long["dec_at_p"].mean()),
        "dec_at_p_min": _num(long["dec_at_p"].min()),
        "short_p_mean": _num(long["short_p"].mean()),
        "short_p_max": _num(long["short_p"].max()),
        "short_p_undefined": int(long["short_p"].isna().sum()),
        "num_long_requests": len(long),
        "num_stalls": int(stalls["count"].sum()),
        "stall_seconds_total": _num((stalls["length"] * stalls["count"]).sum()),
        "stall_max": _num(stalls["length"].max()) if len(stalls) else None,
    }


# ---------------------------------------------------------------- preemption recovery, transfers, P/D pools
#
# Computed from logs the run keeps on the side: each replica's preemption log and host link, the
# P/D links' transfer logs and hand-off records (sim/kv_link.py, sim/pd.py). A *level series* is a
# step function over time (how many requests wait, how many KV blocks are held): values change
# only at event times, and at equal times decreases come before increases.

PREEMPTION_COLUMNS = ("time", "replica", "request_id", "mode", "recomputed_tokens", "swapped_bytes")
TRANSFER_COLUMNS = ("link", "request_id", "kind", "bytes", "submitted", "start", "end", "lane")


def preemption_frame(replicas) -> pd.DataFrame:
    """One row per preemption of any replica: when, which request, recompute or swap, the tokens
    whose KV it dropped (recompute) and the bytes it swapped out (swap), in time order."""
    rows = [row for replica in replicas for row in replica.preemption_log]
    frame = pd.DataFrame(rows, columns=list(PREEMPTION_COLUMNS))
    return frame.sort_values(["time", "replica"], kind="stable").reset_index(drop=True)


def transfer_frame(links) -> pd.DataFrame:
    """One row per transfer booked on `links` (sim/kv_link.py), with `queued` (wait for a lane) and
    `duration` (on the lane)."""
    rows = [(t.link, t.request_id, t.kind, t.nbytes, t.submitted, t.start, t.end, t.lane)
            for link in links for t in link.log]
    frame = pd.DataFrame(rows, columns=list(TRANSFER_COLUMNS))
    frame["queued"] = frame["start"] - frame["submitted"]
    frame["duration"] = frame["end"] - frame["start"]
    return frame


def recovery_summary(preemptions: pd.DataFrame, host_transfers: pd.DataFrame) -> dict:
    """Recomputed tokens (KV dropped by recompute preemptions: exactly the extra prefill work) and
    bytes moved over the host links (swap-outs and swap-ins), for every preemption mode."""
    mode = preemptions["mode"]
    return {
        "num_recomputed_tokens": int(preemptions["recomputed_tokens"].sum()),
        "swapped_bytes": float(host_transfers["bytes"].sum()),
        "num_recompute_preemptions": int((mode == "recompute").sum()),
        "num_swap_preemptions": int((mode == "swap").sum()),
    }


def handoff_frame(records) -> pd.DataFrame:
    """One row per P/D hand-off (sim/pd.py HandOff), in prefill order, with derived waits:
    backpressure_wait (ready to move, until decode room was reserved: from the prefill in p2p
    mode, from the end of the first hop in pool mode), link_queue (waits for a lane, all hops),
    transfer_time (time on the lanes, all hops), prefill_kv_held (prefill done until the
    prefill-side KV was freed)."""
    rows = []
    for rec in records:
        ready = rec.in_pool if not math.isnan(rec.in_pool) else rec.prefilled
        rows.append({
            "request_id": rec.req.id, "prefill_replica": rec.src.index,
            "decode_replica": rec.dst.index if rec.dst is not None else -1,
            "prefilled": rec.prefilled, "prefill_blocks": rec.prefill_blocks, "reserved": rec.reserved,
            "released_src": rec.released_src, "in_pool": rec.in_pool, "landed": rec.landed,
            "decode_admitted": rec.decode_admitted, "backpressure_wait": rec.reserved - ready,
            "link_queue": sum(h.queued for h in rec.hops) if rec.hops else math.nan,
            "transfer_time": sum(h.end - h.start for h in rec.hops) if rec.hops else math.nan,
            "prefill_kv_held": rec.released_src - rec.prefilled,
        })
    columns = ["request_id", "prefill_replica", "decode_replica", "prefilled", "prefill_blocks", "reserved",
               "released_src", "in_pool", "landed", "decode_admitted", "backpressure_wait", "link_queue",
               "transfer_time", "prefill_kv_held"]
    return pd.DataFrame(rows, columns=columns)


def level_series(enter, leave, weights=None, end: float = math.inf) -> tuple[np.ndarray, np.ndarray]:
    """(times, level): how much of `weights` (default 1 each) is inside [enter, leave) right after
    each event time. A NaN leave means "still inside at `end`"; a NaN enter is never inside."""
    enter = np.asarray(enter, dtype=np.float64)
    leave = np.asarray(leave, dtype=np.float64)
    weights = np.ones(len(enter)) if weights is None else np.asarray(weights, dtype=np.float64)
    inside = ~np.isnan(enter)
    enter, leave, weights = enter[inside], np.where(np.isnan(leave[inside]), end, leave[inside]), weights[inside]
    times = np.concatenate([enter, leave])
    deltas = np.concatenate([weights, -weights])
    order = np.lexsort((deltas, times))
    times, level = times[order], np.cumsum(deltas[order])
    finite = np.isfinite(times)
    return times[finite], level[finite]


def time_average(times: np.ndarray, level: np.ndarray, t0: float, t1: float) -> float:
    """Mean of a level series over [t0, t1] (0 before its first event)."""
    if t1 <= t0 or len(times) == 0:
        return math.nan if t1 <= t0 else 0.0
    edges = np.clip(np.append(times, t1), t0, t1)
    return float(np.sum(level * np.diff(edges)) / (t1 - t0))


def _queue_summary(prefix: str, enter, leave, t0: float, t1: float) -> dict:
    times, level = level_series(enter, leave, end=t1)
    return {f"{prefix}_queue_mean": _num(time_average(times, level, t0, t1)),
            f"{prefix}_queue_max": _num(level.max()) if len(level) else 0}


def pool_summary(steps: pd.DataFrame, requests: pd.DataFrame, pools: dict[str, list[int]],
                 handoffs: pd.DataFrame | None = None, transfers: pd.DataFrame | None = None) -> dict:
    """Per-pool utilisation (busy step time / makespan, averaged over the pool's replicas) and
    waiting-queue length (time average and max); with P/D hand-offs, the transfer, link-queue and
    backpressure distributions and the KV held on the prefill side while waiting to move.

    Queues: the prefill (or only) pool holds a request from its arrival to its first step; the
    decode pool from its landing to its first step there.
    """
    t0 = float(requests["arrival"].min()) if len(requests) else 0.0
    t1 = float(np.nanmax(np.r_[steps["end"].to_numpy(), t0]))
    span = t1 - t0
    busy = steps.groupby("replica")["duration"].sum()
    out = {}
    for name, indices in pools.items():
        used = np.array([busy.get(i, 0.0) for i in indices])
        out[f"{name}_replicas"] = len(indices)
        out[f"{name}_utilization"] = _num(used.mean() / span) if span > 0 else None
    admitted = requests[requests["status"] != "rejected"]
    entry = "prefill" if "prefill" in pools else next(iter(pools))
    out.update(_queue_summary(entry, admitted["arrival"], admitted["first_scheduled"], t0, t1))
    if handoffs is None:
        return out
    out.update(_queue_summary("decode", handoffs["landed"], handoffs["decode_admitted"], t0, t1))
    for name in ("transfer_time", "link_queue", "backpressure_wait", "prefill_kv_held"):
        for q, v in zip((50, 99), _percentiles(handoffs[name], (50, 99))):
            out[f"{name}_p{q}"] = v
        out[f"{name}_max"] = _num(handoffs[name].max())
    times, held = level_series(handoffs["prefilled"], handoffs["released_src"], handoffs["prefill_blocks"], end=t1)
    out["prefill_kv_held_blocks_max"] = _num(held.max()) if len(held) else 0
    out["prefill_kv_held_blocks_mean"] = _num(time_average(times, held, t0, t1))
    out["num_handoffs"] = len(handoffs)
    out["kv_transfer_bytes"] = float(transfers["bytes"].sum()) if transfers is not None else None
    return out


# ---------------------------------------------------------------- prefix caching


def cached_token_column(request_ids: np.ndarray, kv_caches) -> np.ndarray:
    """Per request (in `request_ids` order): prompt tokens its first admission found in a replica's
    prefix cache (0 without prefix caching, or for a request never admitted)."""
    hits: dict[int, int] = {}
    for kv in kv_caches:
        if kv.prefix is not None:
            for rid, tokens in kv.prefix.hit_tokens.items():
                hits.setdefault(rid, tokens)
    return np.fromiter((hits.get(int(rid), 0) for rid in request_ids), dtype=np.int64, count=len(request_ids))


def prefix_summary(requests_df: pd.DataFrame, kv_caches) -> dict:
    """prefix_hit_tokens (sum of `cached_tokens`), prefix_hit_rate (those / prompt tokens of the
    requests that were admitted; None without prefix caching or admissions) and evicted_blocks."""
    caches = [kv.prefix for kv in kv_caches if kv.prefix is not None]
    if "cached_tokens" in requests_df:
        cached = requests_df["cached_tokens"].to_numpy()
    else:
        cached = cached_token_column(requests_df["request_id"].to_numpy(), kv_caches)
    admitted = ~np.isnan(requests_df["first_scheduled"].to_numpy(dtype=np.float64))
    prompt = int(requests_df["prompt_len"].to_numpy()[admitted].sum())
    hit = int(cached[admitted].sum())
    return {
        "prefix_hit_tokens": hit,
        "prefix_hit_rate": _num(hit / prompt) if caches and prompt else None,
        "evicted_blocks": int(sum(cache.evicted_blocks for cache in caches)),
    }
