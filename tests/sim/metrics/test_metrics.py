"""Metrics, plots and trace export on hand-built recorders, checked against per-token brute force.

`Script` is a tiny hand-driven log: each call is one step of one replica and says which requests
prefilled, sampled or decoded in it. It records through the real Recorder API (token/close_run)
and keeps every token time on the side, so each metric can be recomputed token by token.
"""
from __future__ import annotations

import json
import math
import tracemalloc
from collections import defaultdict

import numpy as np
import pandas.testing as pd_testing
import pytest

from cbsim.core.errors import ConfigError
from cbsim.core.schema import parse
from cbsim.sim.metrics import itl as itl_module
from cbsim.sim.metrics import step_order
from cbsim.sim.metrics.bucket_sort import split_points, stable_sort_by_value
from cbsim.sim.metrics import (
    MetricsConfig, SLOConfig, StepColumns, itl_distribution, request_frame, stall_events, step_frame, summarize,
    token_times, weighted_percentile)
from cbsim.sim.outputs.plots import plot_run
from cbsim.sim.metrics.recorder import Recorder
from cbsim.sim.request import Request, Status
from cbsim.sim.outputs.trace_export import step_name, write_chrome_trace

SUMMARY_KEYS = {
    "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99", "itl_p50", "itl_p90", "itl_p99",
    "itl_max", "e2e_p50", "e2e_p99", "queue_delay_p50", "queue_delay_p99", "throughput_tokens_per_s",
    "throughput_requests_per_s", "goodput_requests_per_s", "slo_attainment", "dec_at_p_mean", "dec_at_p_min",
    "short_p_mean", "short_p_max", "num_long_requests", "num_stalls", "stall_seconds_total", "stall_max",
    "num_preemptions", "num_rejected", "num_finished", "num_requests", "num_steps", "makespan"}


class Script:
    def __init__(self):
        self.rec = Recorder()
        self.reqs: dict[int, Request] = {}
        self.times = defaultdict(list)  # request id -> token times (the brute-force truth)
        self.token_steps = defaultdict(list)  # request id -> global step of each token
        self.last = {}  # replica -> its last global step

    def request(self, rid, arrival, prompt_len, output_len, **kw):
        self.reqs[rid] = Request(rid, arrival, prompt_len, output_len, **kw)

    def step(self, replica, start, end, prefill=(), sample=(), decode=(), preempt=(), padding=0, hold=False, kv=0):
        """prefill: {id: chunk}; sample: ids whose chunk ends the prefill (a token); decode: ids decoding."""
        prefill = dict(prefill)
        idx = self.rec.num_steps
        for rid in preempt:
            req = self.reqs[rid]
            req.num_preemptions += 1
            req.status = Status.PREEMPTED
            self.rec.close_run(req)
        self.rec.add_step(replica=replica, start=start, end=end, prefill_tokens=sum(prefill.values()),
                          decode_tokens=len(decode), padding_tokens=padding,
                          num_seqs=len(prefill) + len(decode) + padding, kv_blocks_used=kv,
                          preemptions=len(preempt), swap_bytes=0.0)
        for rid in list(prefill) + list(decode):
            req = self.reqs[rid]
            req.status, req.replica = Status.RUNNING, replica
            if req.first_scheduled_step < 0:
                req.first_scheduled, req.first_scheduled_step = start, idx
        for rid in list(sample) + list(decode):
            self._token(self.reqs[rid], idx, replica, end, hold)
        self.last[replica] = idx
        return idx

    def _token(self, req, idx, replica, end, hold):
        self.rec.token(req, idx, self.last.get(replica, -1))
        self.times[req.id].append(end)
        self.token_steps[req.id].append(idx)
        req.num_output_tokens += 1
        if req.first_token_step < 0:
            req.first_token_time, req.first_token_step = end, idx
        if req.is_done:
            self.rec.close_run(req)
            if not hold:
                self.finish(req.id, end)

    def finish(self, rid, time):
        self.reqs[rid].status, self.reqs[rid].completion_time = Status.FINISHED, time

    def frames(self, config=None):
        steps = step_frame(self.rec)
        return steps, request_frame(list(self.reqs.values()), self.rec, steps, config)


def brute_force(script: Script) -> dict[int, dict]:
    """Every per-request metric recomputed from the explicit token times."""
    out = {}
    for rid, req in script.reqs.items():
        t = np.array(script.times[rid])
        gaps = np.diff(t)
        done = req.status == Status.FINISHED
        out[rid] = {
            "ttft": t[0] - req.arrival if len(t) else math.nan,
            "last_token_time": t[-1] if len(t) else math.nan,
            "itl_max": gaps.max() if len(gaps) else math.nan,
            "tpot": (t[-1] - t[0]) / (req.output_len - 1) if len(t) == req.output_len >= 2 else math.nan,
            "e2e": req.completion_time - req.arrival if done else math.nan,
            "normalized_latency": (req.completion_time - req.arrival) / req.output_len if done else math.nan,
            "queue_delay": req.first_scheduled - req.arrival,
            "output_tokens": len(t),
        }
    return out


def all_gaps(script: Script) -> np.ndarray:
    return np.sort(np.concatenate([np.diff(t) for t in script.times.values()] + [np.zeros(0)]))


def check_against_brute_force(script: Script, requests=None):
    steps, df = script.frames()
    truth = brute_force(script)
    for row in df.itertuples():
        for name, want in truth[row.request_id].items():
            got = getattr(row, name)
            same = (math.isnan(want) and math.isnan(got)) or got == pytest.approx(want, abs=1e-12)
            assert same, (row.request_id, name, got, want)
    dist = itl_distribution(script.rec, list(script.reqs.values()) if requests is None else requests)
    np.testing.assert_allclose(np.repeat(dist.values, dist.weights), all_gaps(script), atol=1e-12)
    return steps, df, dist


# ---------------------------------------------------------------- scenarios


def two_requests() -> Script:
    s = Script()
    s.request(0, 0.0, 100, 4)
    s.request(1, 0.5, 50, 3)
    s.step(0, 0.0, 1.0, prefill={0: 100}, sample=[0], kv=7)
    s.step(0, 1.0, 1.5, prefill={1: 50}, sample=[1], decode=[0], kv=11)
    s.step(0, 1.5, 1.75, decode=[0, 1], kv=11)
    s.step(0, 1.75, 2.25, decode=[0, 1], kv=11)
    return s


def breaks_and_replicas() -> Script:
    """Two interleaved replicas: a recompute preemption (C), a static batch that releases a request
    after its last token (D), padding, and a run across an idle gap (G)."""
    s = Script()
    for rid, arrival, prompt, out in ((2, 0.0, 10, 5), (3, 0.0, 8, 2), (4, 0.2, 6, 2), (5, 0.0, 4, 3),
                                      (6, 1.5, 30, 2), (7, 2.9, 20, 3)):
        s.request(rid, arrival, prompt, out)
    s.request(8, 0.1, 90_000, 10, status=Status.REJECTED, reject_reason="prompt longer than max_model_len")
    s.step(0, 0.0, 1.0, prefill={2: 10}, sample=[2])                      # g0
    s.step(1, 0.0, 0.8, prefill={3: 8, 5: 4}, sample=[3, 5], hold=True)   # g1 static batch {3, 5}
    s.step(0, 1.0, 1.4, prefill={4: 6}, sample=[4], decode=[2])           # g2
    s.step(0, 1.4, 1.6, decode=[2, 4])                                    # g3
    s.step(1, 0.8, 1.0, decode=[3, 5], hold=True)                         # g4: request 3 done, held
    s.step(0, 1.6, 2.0, prefill={6: 30}, sample=[6], preempt=[2])         # g5: C preempted
    s.step(1, 1.0, 1.3, decode=[5], padding=1, hold=True)                 # g6
    s.finish(3, 1.3)
    s.finish(5, 1.3)
    s.step(0, 2.0, 2.3, prefill={2: 13}, sample=[2], decode=[6])          # g7: C recomputed
    s.step(1, 3.0, 3.5, prefill={7: 20}, sample=[7])                      # g8 after an idle gap
    s.step(1, 3.5, 3.6, decode=[7])                                       # g9
    s.step(0, 2.3, 2.4, decode=[2])                                       # g10
    s.step(1, 4.0, 4.1, decode=[7])                                       # g11 after another idle gap
    return s


def interference() -> Script:
    """The interference case: short requests decoding when long prompts arrive at t=1. Replica 0 mixes
    the long chunks with decodes (Sarathi-like); replica 1 runs them alone (prefill-first)."""
    s = Script()
    for rid, arrival, prompt, out in ((10, 0.0, 100, 6), (11, 0.0, 100, 7), (12, 1.0, 4096, 2),
                                      (13, 0.0, 100, 4), (14, 1.0, 4096, 2), (15, 1.5, 50, 2),
                                      (16, 0.0, 60, 1), (17, 10.0, 3000, 1)):
        s.request(rid, arrival, prompt, out)
    s.step(0, 0.0, 0.5, prefill={10: 100, 11: 100}, sample=[10, 11], kv=14)         # a0
    s.step(1, 0.0, 0.3, prefill={16: 60, 13: 100}, sample=[16, 13], kv=9)           # b0
    s.step(0, 0.5, 0.6, decode=[10, 11], kv=15)                                     # a1
    s.step(1, 0.3, 0.4, decode=[13], kv=9)                                          # b1
    s.step(0, 0.6, 0.7, decode=[10, 11], kv=16)                                     # a2
    s.step(1, 0.4, 1.02, decode=[13], kv=9)                                         # b2
    s.step(0, 0.7, 1.05, decode=[10, 11], kv=16)                                    # a3
    s.step(1, 1.02, 1.4, prefill={14: 2048}, kv=137)                                # b3: decodes stall
    s.step(0, 1.05, 1.5, prefill={12: 2048}, decode=[10, 11], kv=144)               # a4
    s.step(1, 1.4, 1.8, prefill={14: 2048}, sample=[14], kv=265)                    # b4
    s.step(0, 1.5, 1.95, prefill={12: 2048}, sample=[12], decode=[10, 11], kv=273)  # a5: 10 done
    s.step(1, 1.8, 1.9, decode=[13, 14], kv=266)                                    # b5: 13 and 14 done
    s.step(0, 1.95, 2.05, prefill={15: 50}, sample=[15], decode=[11, 12], kv=275)   # a6: 11, 12 done
    s.step(0, 2.05, 2.15, decode=[15], kv=4)                                        # a7
    s.step(1, 10.0, 10.5, prefill={17: 3000}, sample=[17], kv=188)                  # b6
    return s


# ---------------------------------------------------------------- per-request numbers


def test_two_requests_exact():
    s = two_requests()
    steps, df, dist = check_against_brute_force(s)
    a, b = df.set_index("request_id").loc[0], df.set_index("request_id").loc[1]
    assert (a.ttft, b.ttft) == (1.0, 1.0)
    assert a.tpot == pytest.approx(1.25 / 3) and b.tpot == pytest.approx(0.75 / 2)
    assert (a.itl_max, b.itl_max) == (0.5, 0.5)
    assert (a.e2e, b.queue_delay, b.normalized_latency) == (2.25, 0.5, pytest.approx(1.75 / 3))
    assert list(df["status"]) == ["finished", "finished"]
    assert np.repeat(dist.values, dist.weights).tolist() == [0.25, 0.25, 0.5, 0.5, 0.5]
    assert dist.count == 5 and dist.percentile(50) == 0.5  # linear: rank (5 - 1) / 2 = 2, the 3rd of 5
    assert dist.total_tokens == 7
    assert list(steps.columns[:3]) == ["step", "replica", "start"]
    assert steps["duration"].tolist() == [1.0, 0.5, 0.25, 0.5]


def test_preemption_static_release_and_idle_gaps():
    s = breaks_and_replicas()
    steps, df, dist = check_against_brute_force(s)
    df = df.set_index("request_id")
    runs = s.rec.run_table()
    assert (runs["request_id"] == 2).sum() == 2  # the preemption split C's tokens into two runs
    assert df.loc[2, "itl_max"] == pytest.approx(2.3 - 1.6)  # the break: first of run 2 - last of run 1
    assert df.loc[2, "num_preemptions"] == 1
    assert df.loc[3, "last_token_time"] == 1.0 and df.loc[3, "completion_time"] == 1.3
    assert df.loc[3, "tpot"] == pytest.approx(0.2) and df.loc[3, "e2e"] == 1.3  # tpot from tokens, e2e from release
    assert df.loc[7, "itl_max"] == pytest.approx(0.5)  # 3.6 -> 4.1 across the idle replica: end to end
    assert df.loc[8, "status"] == "rejected" and math.isnan(df.loc[8, "ttft"]) and not df.loc[8, "meets_slo"]
    assert df.loc[8, "reject_reason"].startswith("prompt longer")
    for rid, times in s.times.items():
        np.testing.assert_allclose(token_times(s.rec, rid), times)


def test_open_run_of_a_cut_simulation_is_counted():
    s = two_requests()
    s.request(9, 1.0, 10, 50)
    s.step(0, 2.25, 2.5, prefill={9: 10}, sample=[9])
    s.step(0, 2.5, 2.6, decode=[9])
    s.step(0, 2.6, 2.9, decode=[9])  # the run is cut here: request 9's run is never closed
    assert s.reqs[9].run_tokens == 3
    steps, df, dist = check_against_brute_force(s)
    row = df.set_index("request_id").loc[9]
    assert row.status == "running" and row.output_tokens == 3 and math.isnan(row.tpot) and math.isnan(row.e2e)
    assert itl_distribution(s.rec).count == dist.count - 2  # closed runs only


def test_broken_records_are_refused():
    s = two_requests()
    s.rec.run_tokens[0] += 1  # a run claiming one token more than its steps hold
    with pytest.raises(ValueError, match="consecutive steps"):
        itl_distribution(s.rec)
    bad = Recorder()
    for start in (0.0, 1.0):
        bad.add_step(replica=0, start=start, end=1.0, prefill_tokens=1, decode_tokens=0, padding_tokens=0,
                     num_seqs=1, kv_blocks_used=0, preemptions=0, swap_bytes=0.0)
    with pytest.raises(ValueError, match="strictly increase"):
        itl_distribution(bad)


def random_script(rng: np.random.Generator, num_steps=400, num_replicas=3, num_requests=60, grouped=False) -> Script:
    """Random replicas (interleaved, or `grouped` in contiguous blocks) with idle gaps; requests with
    several runs written straight into the recorder; half of them long, scheduled a few steps
    before their first token."""
    s = Script()
    replica = rng.integers(0, num_replicas, num_steps)
    replica = np.sort(replica) if grouped else replica
    clock = np.zeros(num_replicas)
    local = defaultdict(list)
    for g, r in enumerate(replica):
        start = clock[r] + (rng.exponential(0.5) if rng.random() < 0.1 else 0.0)
        clock[r] = start + rng.uniform(0.01, 0.1)
        s.rec.add_step(replica=r, start=start, end=clock[r], prefill_tokens=0, decode_tokens=int(rng.integers(0, 9)),
                       padding_tokens=0, num_seqs=1, kv_blocks_used=0, preemptions=0, swap_bytes=0.0)
        local[r].append(g)
    end = s.rec.step_table()["end"]
    for rid in range(num_requests):
        r = int(rng.choice(sorted(local)))
        cuts = np.sort(rng.choice(len(local[r]), size=2 * int(rng.integers(1, min(4, len(local[r]) // 2 + 1))),
                                  replace=False))
        s.request(rid, 0.0, int(rng.choice([10, 5000])), 1)
        for f, l in cuts.reshape(-1, 2):
            steps = local[r][f:l + 1]
            for name, value in (("run_request", rid), ("run_first_step", steps[0]),
                                ("run_last_step", steps[-1]), ("run_tokens", len(steps))):
                getattr(s.rec, name).append(value)
            s.times[rid].extend(end[steps])
            s.token_steps[rid].extend(steps)
        req = s.reqs[rid]
        req.output_len = len(s.times[rid])
        req.first_token_time, req.first_token_step = s.times[rid][0], local[r][cuts[0]]
        req.first_scheduled = s.times[rid][0] - 0.01
        req.first_scheduled_step = local[r][max(cuts[0] - int(rng.integers(0, 5)), 0)]
        s.finish(rid, s.times[rid][-1])
    return s


def brute_dec_at_p(script: Script, threshold: int) -> dict[int, float]:
    """Per long request: tokens that short requests produced, each one's first token excepted, in the
    steps of its replica from first_scheduled_step up to (not including) first_token_step."""
    replica = script.rec.step_table()["replica"]
    decodes = [g for rid, steps in script.token_steps.items()
               if script.reqs[rid].prompt_len < threshold for g in steps[1:]]
    out = {}
    for rid, req in script.reqs.items():
        a, b = req.first_scheduled_step, req.first_token_step
        if req.prompt_len >= threshold and 0 <= a <= b:
            out[rid] = float(sum(a <= g < b and replica[g] == replica[a] for g in decodes))
    return out


@pytest.mark.parametrize("num_replicas,grouped", [(3, False), (1, False), (3, True)])
def test_random_runs_match_expanded_tokens(num_replicas, grouped):
    rng = np.random.default_rng(7)
    for _ in range(5):
        s = random_script(rng, num_replicas=num_replicas, grouped=grouped)
        _, df, dist = check_against_brute_force(s)
        assert dist.total_tokens == sum(len(t) for t in s.times.values())
        want = brute_dec_at_p(s, MetricsConfig().long_prompt_threshold)
        got = df.set_index("request_id")["dec_at_p"]
        assert got.dropna().to_dict() == want


def all_outputs(script: Script):
    steps, df = script.frames()
    dist = itl_distribution(script.rec, list(script.reqs.values()), steps)
    return df, dist, summarize(df, steps, script.rec, itl=dist), stall_events(dist, 2.0)


@pytest.mark.parametrize("make", [two_requests, breaks_and_replicas, interference,
                                  lambda: random_script(np.random.default_rng(1)),
                                  lambda: random_script(np.random.default_rng(2), num_replicas=1),
                                  lambda: random_script(np.random.default_rng(3), grouped=True)])
def test_block_and_bucket_edges_change_nothing(make, monkeypatch):
    whole = all_outputs(make())
    monkeypatch.setattr(step_order, "BLOCK", 7)
    monkeypatch.setattr(itl_module, "BUCKET", 5)
    s = make()
    pieces = all_outputs(s)
    pd_testing.assert_frame_equal(whole[0], pieces[0], check_exact=True)
    for name in ("values", "weights", "step", "times", "replica"):
        np.testing.assert_array_equal(getattr(whole[1], name), getattr(pieces[1], name))
    assert whole[2] == pieces[2]
    pd_testing.assert_frame_equal(whole[3], pieces[3], check_exact=True)
    check_against_brute_force(s)


@pytest.mark.parametrize("make", [breaks_and_replicas, interference,
                                  lambda: random_script(np.random.default_rng(4)),
                                  lambda: random_script(np.random.default_rng(5), num_replicas=1)])
def test_step_columns_give_the_metrics_the_frame_gives(make):
    """The request frame, the ITL and the summary read the same from StepColumns (a column made when
    first read) as from the whole step frame, bit for bit; and the columns are the frame's."""
    whole = all_outputs(make())
    s = make()
    reqs = list(s.reqs.values())
    columns = StepColumns(s.rec)
    df = request_frame(reqs, s.rec, columns)
    dist = itl_distribution(s.rec, reqs, columns)
    pd_testing.assert_frame_equal(whole[0], df, check_exact=True)
    for name in ("values", "weights", "step", "times", "replica"):
        np.testing.assert_array_equal(getattr(whole[1], name), getattr(dist, name))
    assert summarize(df, columns, s.rec, itl=dist) == whole[2]
    frame = step_order.densified(step_frame(s.rec))
    assert set(columns._made) == {"replica", "end"} and len(columns) == len(frame)  # read: those two only
    for name in frame.columns:
        assert name in columns and columns[name].dtype == frame[name].dtype, name
        np.testing.assert_array_equal(columns[name], frame[name].to_numpy(), err_msg=name)


def test_itl_gaps_end_where_their_tokens_are():
    s = breaks_and_replicas()
    dist = itl_distribution(s.rec, list(s.reqs.values()))
    assert dist.values.dtype == np.float64 and dist.weights.dtype == np.int32 and dist.step.dtype == np.int32
    assert np.all(np.diff(dist.values) >= 0)
    got = sorted((v, t) for v, t, w in zip(dist.values, dist.times, dist.weights) for _ in range(w))
    want = sorted((b - a, b) for t in s.times.values() for a, b in zip(t, t[1:]))
    assert got == want
    np.testing.assert_array_equal(dist.replica, s.rec.step_table()["replica"][dist.step])


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_stable_sort_by_value_equals_numpy_stable_argsort(chunk):
    rng = np.random.default_rng(chunk)
    values = np.concatenate([rng.lognormal(size=300).round(2), np.full(200, 1.0), rng.uniform(0, 3, 100)])
    rng.shuffle(values)
    payload = np.arange(len(values)), rng.integers(0, 9, len(values))
    want = np.argsort(values, kind="stable")

    def chunks():
        for i in range(0, len(values), chunk):
            yield values[i:i + chunk], payload[0][i:i + chunk], payload[1][i:i + chunk]

    for splits in (np.zeros(0), split_points(values[::7], 8), split_points(values, 40), np.array([1.0])):
        got = stable_sort_by_value(chunks, (np.int64, np.int32), splits)
        np.testing.assert_array_equal(got[0], values[want])
        np.testing.assert_array_equal(got[1], payload[0][want])
        np.testing.assert_array_equal(got[2], payload[1][want])
        assert got[2].dtype == np.int32
        keyed = stable_sort_by_value(chunks, (np.int64, np.int32), splits, key=lambda index, _: values[index])
        assert len(keyed) == 2  # the payload only: each bucket's values read back through the key
        np.testing.assert_array_equal(keyed[0], payload[0][want])
        np.testing.assert_array_equal(keyed[1], payload[1][want])
    cuts = split_points(values, 8)
    assert np.all(np.diff(cuts) > 0) and 1.0 in cuts and np.nextafter(1.0, 2) in cuts  # the heavy value alone


@pytest.mark.parametrize("make", [breaks_and_replicas, interference,
                                  lambda: random_script(np.random.default_rng(4)),
                                  lambda: random_script(np.random.default_rng(5), num_replicas=1),
                                  lambda: random_script(np.random.default_rng(6), grouped=True)])
def test_itl_lengths_read_back_are_the_gaps_bit_for_bit(make):
    """The distribution keeps no lengths: read back from the steps (and the breaks kept apart), they
    are the brute-force gaps, stably sorted, float for float."""
    s = make()
    steps, _ = s.frames()
    dist = itl_distribution(s.rec, list(s.reqs.values()), steps)
    gaps = np.sort(all_gaps(s), kind="stable")
    np.testing.assert_array_equal(np.repeat(dist.values, dist.weights), gaps)  # exact, not within 1e-12
    index = np.arange(len(dist.step))
    np.testing.assert_array_equal(dist.values_at(index[::-3]), dist.values[::-3])
    assert dist.values_at([-1])[0] == dist.values[-1]
    for value in (-1.0, 0.0, *gaps[::7], np.inf, np.nan):
        assert dist.count_at_most(value) == np.searchsorted(dist.values, value, side="right"), value


def test_itl_construction_scratch_stays_small(monkeypatch):
    """Building the ITL distribution of a long run needs little memory beyond the result (8 bytes a gap:
    weight and step; the lengths are read back): the steps are scanned in blocks and the gaps sorted
    bucket by bucket (a whole-run argsort or the gaps' lengths kept would be the result again)."""
    monkeypatch.setattr(step_order, "BLOCK", 4096)
    monkeypatch.setattr(itl_module, "BUCKET", 4096)
    rec = Recorder()
    n = 200_000
    start = np.cumsum(np.random.default_rng(0).uniform(0.01, 0.02, n))
    rec.add_steps(replica=0, start=start, end=start + 0.005, prefill_tokens=0, decode_tokens=8, padding_tokens=0,
                  num_seqs=8, kv_blocks_used=0, preemptions=0, swap_bytes=0.0)
    first = np.arange(0, n, 100)  # 8 staggered runs of 800 steps at any time
    for f in first[first + 800 <= n]:
        for name, value in (("run_request", int(f)), ("run_first_step", int(f)), ("run_last_step", int(f) + 799),
                            ("run_tokens", 800)):
            getattr(rec, name).append(value)
    steps = step_frame(rec)
    tracemalloc.start()
    try:
        dist = itl_distribution(rec, steps=steps)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    result = dist.weights.nbytes + dist.step.nbytes  # the lengths are read back from the steps
    assert result == 8 * len(dist.step) and len(dist.step) > 0.99 * n and len(dist.break_at) == 0
    assert peak - kept < result / 2, (peak - kept, result)  # the lengths, or an argsort, would be `result` again


# ---------------------------------------------------------------- percentiles


def test_weighted_percentile_equals_numpy_on_expanded_data():
    rng = np.random.default_rng(3)
    qs = [0, 0.1, 1, 10, 25, 29, 33.3, 50, 57, 90, 99, 99.9, 100]
    for size in (1, 2, 5, 50, 500):
        values = rng.lognormal(size=size).round(3)  # ties included
        weights = rng.integers(0, 20, size=size)
        weights[0] = max(weights[0], 1)
        expanded = np.repeat(values, weights)
        want = np.percentile(expanded, qs, method="linear")
        np.testing.assert_array_equal(weighted_percentile(values, weights, qs), want)
    ties = np.arange(1.0, 101.0)  # unit weights: q x n lands exactly on (or a rounding hair off) a count
    for q in (25, 29, 50, 57, 90, 99):
        assert weighted_percentile(ties, np.ones(100, int), q) == np.percentile(ties, q, method="linear")
    assert weighted_percentile([1.0, 2.0, 3.0, 4.0], [1, 1, 1, 1], 50) == 2.5  # the two middle values, interpolated
    assert weighted_percentile([2.0, 1.0], [2, 2], 50) == 1.5  # 1, 1, 2, 2: between ranks 1 and 2
    assert math.isnan(weighted_percentile(np.zeros(0), np.zeros(0, int), 50))
    with pytest.raises(ValueError):
        weighted_percentile([1.0], [1], 101)


def test_itl_percentiles_and_stalls_match_brute_force():
    s = interference()
    _, _, dist = check_against_brute_force(s)
    gaps = all_gaps(s)
    for q in (50, 90, 99):
        assert dist.percentile(q) == np.percentile(gaps, q, method="linear")
    threshold = 5.0 * np.percentile(gaps, 50, method="linear")
    stalls = stall_events(dist, 5.0)
    assert stalls["count"].sum() == (gaps > threshold).sum() > 0
    assert (stalls["length"] * stalls["count"]).sum() == pytest.approx(gaps[gaps > threshold].sum())
    # request 13's break on replica 1 (decodes starved by the long prefill) is a stall ending at 1.9
    assert ((stalls["replica"] == 1) & (stalls["time"] == 1.9) & np.isclose(stalls["length"], 0.88)).any()


# ---------------------------------------------------------------- interference metrics


def test_dec_at_p_and_short_p_on_the_seed_interference_case():
    s = interference()
    _, df = s.frames()
    df = df.set_index("request_id")
    assert df["is_long"].tolist() == [False, False, True, False, True, False, False, True]
    # 12: replica 0 step a4 carries the decodes of 10 and 11; a5 ends the prefill, so its tokens
    # come when the prefill is done and are outside the window
    assert df.loc[12, "dec_at_p"] == 2
    # 14: replica 1 runs its chunks alone; a4 (replica 0, two decodes) sits between them globally
    assert df.loc[14, "dec_at_p"] == 0
    assert df.loc[17, "dec_at_p"] == 0
    assert df["dec_at_p"][~df["is_long"]].isna().all()
    # shorts in the system at t=1: 10 (done 1.95), 11 (done 2.05), 13 (done 1.9); 16 left at 0.3
    # and 15 arrived at 1.5, after the long ones
    assert df.loc[12, "short_p"] == pytest.approx(1.05) and df.loc[14, "short_p"] == pytest.approx(1.05)
    assert math.isnan(df.loc[17, "short_p"])  # nobody short left at t=10


def test_short_p_counts_only_finished_shorts_and_admitted_longs():
    rows = [  # id, arrival, prompt, status, completion
        (0, 0.0, 100, Status.FINISHED, 3.0),
        (1, 0.5, 100, Status.RUNNING, math.nan),  # never finished (cut run): ignored
        (2, 0.2, 100, Status.REJECTED, math.nan),  # rejected short: ignored
        (3, 1.0, 100, Status.FINISHED, 5.0),
        (4, 2.5, 100, Status.FINISHED, 9.0),  # arrives after the long one at t=2
        (5, 2.0, 5000, Status.FINISHED, 8.0),
        (6, 2.0, 5000, Status.REJECTED, math.nan),
        (7, 6.0, 5000, Status.FINISHED, 12.0),  # 4 and 9 are in the system at t=6
        (8, 9.5, 5000, Status.FINISHED, 12.0),  # nobody short left: 9 completes exactly at 9.5
        (9, 0.0, 100, Status.FINISHED, 9.5),
    ]
    reqs = [Request(i, a, p, 5, status=st, completion_time=c) for i, a, p, st, c in rows]
    rec = Recorder()
    df = request_frame(reqs, rec, step_frame(rec), MetricsConfig(long_prompt_threshold=4096)).set_index("request_id")
    assert df.loc[5, "short_p"] == 7.5 and df.loc[7, "short_p"] == 3.5  # 9 is the last to finish
    assert df["short_p"].loc[[0, 1, 2, 3, 4, 6, 8, 9]].isna().all()
    assert df["dec_at_p"].isna().all()  # nobody was scheduled


# ---------------------------------------------------------------- summary


def test_summary_keys_values_and_json():
    s = interference()
    steps, df = s.frames()
    summary = summarize(df, steps, s.rec)
    assert SUMMARY_KEYS <= set(summary)
    json.dumps(summary, allow_nan=False)
    assert all(v is None or type(v) in (int, float) for v in summary.values())
    assert summary["dec_at_p_mean"] == pytest.approx(2 / 3) and summary["dec_at_p_min"] == 0
    assert summary["short_p_mean"] == pytest.approx(1.05) and summary["short_p_undefined"] == 1
    assert summary["num_long_requests"] == 3 and summary["num_steps"] == 15 and summary["num_requests"] == 8
    assert summary["makespan"] == 10.5
    assert summary["throughput_tokens_per_s"] == pytest.approx(25 / 10.5)
    assert summary["ttft_p50"] == np.percentile(df["ttft"], 50, method="linear")
    gaps = all_gaps(s)
    assert summary["itl_max"] == gaps.max() and summary["num_stalls"] == (gaps > 5 * np.median(gaps)).sum()
    assert summary["stall_max"] == pytest.approx(0.88)


def test_goodput_and_slo_attainment():
    s = breaks_and_replicas()
    steps, df = s.frames(MetricsConfig(slo=SLOConfig(ttft=1.0, tpot=0.25)))
    # ttft <= 1: 2 (1.0), 3 (0.8), 5 (0.8), 6 (0.5), 7 (0.6), not 4 (1.2); tpot <= 0.25 of those: 3 (0.2), 5 (0.25)
    # 6 (0.3) misses; 2 (0.35) misses; 7 ((4.1 - 3.5) / 2 = 0.3) misses; rejected 8 never meets
    assert sorted(df.loc[df["meets_slo"], "request_id"]) == [3, 5]
    summary = summarize(df, steps, s.rec, MetricsConfig(slo=SLOConfig(ttft=1.0, tpot=0.25)))
    assert summary["slo_attainment"] == pytest.approx(2 / 7)
    assert summary["makespan"] == 4.1 and summary["goodput_requests_per_s"] == pytest.approx(2 / 4.1)
    assert summary["num_rejected"] == 1 and summary["num_finished"] == 6 and summary["num_preemptions"] == 1
    # the only long request (8) was rejected: dec@P and short_P are undefined -> None
    assert summary["num_long_requests"] == 1 and summary["short_p_undefined"] == 1
    assert summary["dec_at_p_mean"] is None and summary["short_p_mean"] is None


def test_summary_of_an_empty_run_is_all_none_or_zero():
    rec = Recorder()
    steps = step_frame(rec)
    df = request_frame([Request(0, 0.0, 10, 5, status=Status.REJECTED)], rec, steps)
    summary = summarize(df, steps, rec)
    json.dumps(summary, allow_nan=False)
    assert summary["itl_p50"] is None and summary["makespan"] is None and summary["slo_attainment"] is None  # no SLO
    with_slo = summarize(df, steps, rec, MetricsConfig(slo=SLOConfig(ttft=1.0)))
    assert with_slo["slo_attainment"] == 0.0 and with_slo["goodput_requests_per_s"] is None  # no makespan


def test_metrics_config_parses_and_names_bad_keys():
    config = parse(MetricsConfig, {"long_prompt_threshold": 1024, "slo": {"ttft": 2, "itl_max": 0.5}})
    assert config.slo.ttft == 2.0 and config.slo.tpot is None and config.long_prompt_threshold == 1024
    with pytest.raises(ConfigError, match=r"metrics\.slo\.ttft"):
        parse(MetricsConfig, {"slo": {"ttft": -1}}, "metrics")
    with pytest.raises(ConfigError, match="stall_factor"):
        parse(MetricsConfig, {"stall_factor": 0})


# ---------------------------------------------------------------- plots and trace


def test_plots_are_written(tmp_path):
    s = interference()
    steps, df = s.frames()
    dist = itl_distribution(s.rec, list(s.reqs.values()))
    paths = plot_run(df, steps, dist.values, dist.weights, tmp_path, stalls=stall_events(dist, 5.0))
    assert [p.name for p in paths] == ["latency_cdf.png", "step_timeline.png", "kv_usage.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_plots_aggregate_long_runs(tmp_path):
    rec = Recorder()
    n = 25_000
    start = np.arange(n) * 0.01
    rec.add_steps(replica=np.arange(n) % 2, start=start, end=start + 0.009,
                  prefill_tokens=(np.arange(n) % 50 == 0) * 512, decode_tokens=32, padding_tokens=0, num_seqs=33, kv_blocks_used=np.arange(n) % 700,
                  preemptions=0, swap_bytes=0.0)
    steps = step_frame(rec)
    df = request_frame([], rec, steps)
    paths = plot_run(df, steps, np.array([0.01, 0.02]), np.array([10, 1]), tmp_path)
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_chrome_trace(tmp_path):
    s = interference()
    steps = step_frame(s.rec)
    path = tmp_path / "trace.json"
    assert write_chrome_trace(steps, path, max_steps=1000) == 15
    trace = json.loads(path.read_text())
    events = trace["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 15 and sum(e["ph"] == "C" for e in events) == 15
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"replica 0", "replica 1"}
    a4 = next(e for e in complete if e["args"]["step"] == 8)
    assert a4["name"] == "P2048+D2" and a4["pid"] == 0 and a4["ts"] == 1.05e6 and a4["dur"] == pytest.approx(0.45e6)
    assert write_chrome_trace(steps, path, max_steps=4) == 4
    capped = json.loads(path.read_text())
    assert sum(e["ph"] == "X" for e in capped["traceEvents"]) == 4 and capped["otherData"]["truncated"]
    assert step_name(0, 30, 2) == "D30+pad2" and step_name(0, 0) == "empty"


@pytest.mark.parametrize("policy,want", [
    ({"name": "sarathi", "token_budget": 20}, 24),  # 12 window steps x 2 short decodes (long 2's excluded)
    ({"name": "orca", "token_budget": None}, 0),  # the whole prompt in one step: the decodes stall
    ({"name": "prefill_first", "chunk_size": 17}, 0),  # chunks run alone: the decodes stall
])
def test_dec_at_p_counts_short_decodes_before_the_prefill_ends(policy, want):
    """dec@P: decode tokens of the other *short* running requests while the long prompt is unfinished."""
    from factories import make_requests, run_policy

    run = run_policy(policy, make_requests([(0, 10, 60), (0, 10, 60), (0, 100, 60), (3.0, 200, 2)]))
    steps = step_frame(run.recorder)
    df = request_frame(run.requests, run.recorder, steps, MetricsConfig(long_prompt_threshold=100))
    assert df.set_index("request_id").loc[3, "dec_at_p"] == want
    long = run.requests[3]
    window = steps.iloc[long.first_scheduled_step:long.first_token_step]
    assert window["decode_tokens"].sum() >= want  # the steps also carry request 2's (long) decodes


def test_short_decodes_are_counted_in_one_narrow_array_over_the_steps():
    """Per slot, the short requests' decode tokens: one int32 array over the steps, filled in place
    (two int64 bincounts and their cumulative sum were three times eight bytes a step)."""
    from cbsim.sim.metrics.request_metrics import _short_decodes
    from cbsim.sim.metrics.step_order import LocalOrder
    from cbsim.sim.metrics.token_runs import run_arrays, token_runs

    s = random_script(np.random.default_rng(7))
    steps, _ = s.frames()
    reqs = list(s.reqs.values())
    local = LocalOrder.of(steps)
    runs = token_runs(local, run_arrays(s.rec, reqs))
    ids = np.array([r.id for r in reqs])
    prompts = np.array([r.prompt_len for r in reqs])
    long_mask = prompts > np.median(prompts)
    got = _short_decodes(ids, long_mask, local, runs)
    short = ~long_mask[np.searchsorted(ids, runs.request_id)]
    opens = np.r_[True, runs.request_id[1:] != runs.request_id[:-1]]
    want = np.zeros(len(local), dtype=np.int64)
    for f, l in zip(runs.first[short] + opens[short], runs.last[short]):
        want[f:l + 1] += 1
    assert got.dtype == np.int32 and np.array_equal(got, want) and want.any()
