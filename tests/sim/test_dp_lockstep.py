"""Data-parallel attention ranks in lockstep (sim/dp_lockstep.py).

The cost model is a fake exposing `data_parallel` (an affine model's step time, so the ranks' steps
differ by their tokens). Checked, with hypothesis over workloads, D and the interval: every request
finishes with exactly its tokens; the steps of one deployment's ranks either coincide (same start,
same end) or do not overlap; a step lasts the max of its ranks' forwards, and of the dummy batch's
when a rank sat it out; `dp_lockstep: false` is the independent replicas bit for bit; a rank defers
a prompt to the next aligned step under vLLM's prefill_schedule_interval (an exact trace).
"""
from __future__ import annotations

from collections import defaultdict

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.core.errors import ConfigError
from cbsim.policies import make_policy
from cbsim.sim.cost import CostModel
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.dp_lockstep import DUMMY_BATCH, LockstepReplica
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.shape import StepShape
from cbsim.sim.simulation import simulate

from factories import make_requests
from test_invariants import WORKLOADS, to_requests

LINEAR = {"type": "linear", "base": 0.01, "per_token": 1e-3}


DUMMY_SECONDS = 0.05  # longer than most steps here, so a test sees whether a dummy batch counts


class DataParallel(CostModel):
    """`inner`'s step time, on one of `ranks` data-parallel attention ranks; the dummy batch (one
    decode row of context 1, which no request's decode has) takes DUMMY_SECONDS."""

    name = "dp"

    def __init__(self, inner: CostModel, ranks: int):
        self.inner, self.data_parallel = inner, ranks

    def step_time(self, shape) -> float:
        return DUMMY_SECONDS if shape == DUMMY_BATCH else self.inner.step_time(shape)


class Among(DataParallel):
    """DataParallel whose routed experts cost EXPERT seconds a token they receive: alone, a rank's
    experts receive D x its tokens; in lockstep, the ranks' sum (step_time_among, as the roofline)."""

    def step_time_among(self, shape, share: float) -> float:
        base = DUMMY_SECONDS if shape == DUMMY_BATCH else self.inner.step_time(shape)
        return base + EXPERT * share * shape.num_tokens

    def step_time(self, shape) -> float:
        return self.step_time_among(shape, self.data_parallel)


EXPERT = 2e-3


def run(requests, ranks: int, replicas: int, cost_class=DataParallel, **fields):
    cost = cost_class(load_cost_model(LINEAR), ranks)
    recorder, pool = simulate(requests, lambda: make_policy({"name": "sarathi", "token_budget": 64}), cost,
                              lambda: KVCache(2000, 16, 0), ReplicaSettings(max_model_len=1000, **fields),
                              replicas=replicas, max_time=1e5)
    return pd.DataFrame(recorder.step_table()), pool, cost


def step_seconds(cost, row) -> float:
    """A rank's forward, from its row of the step table (the affine model prices tokens only)."""
    return cost.inner.base + cost.inner.per_token * (row.prefill_tokens + row.decode_tokens)


@settings(max_examples=40, deadline=None)
@given(WORKLOADS, st.integers(2, 3), st.sampled_from([1, 2, 3]))
def test_ranks_step_together(specs, ranks, interval):
    requests = to_requests(specs)
    steps, pool, cost = run(requests, ranks, ranks, prefill_schedule_interval=interval)
    assert all(isinstance(r, LockstepReplica) for r in pool)
    for req in requests:
        assert req.num_output_tokens == req.output_len
    rows = defaultdict(list)
    for row in steps.itertuples():
        rows[row.start].append(row)
    dummy = DUMMY_SECONDS
    spans = sorted((start, group[0].end) for start, group in rows.items())
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert start >= end  # steps of the deployment never overlap: they coincide or follow
    for start, group in rows.items():
        assert len({r.end for r in group}) == 1 and len({r.replica for r in group}) == len(group)
        seconds = [step_seconds(cost, r) for r in group] + ([dummy] if len(group) < ranks else [])
        assert group[0].end - start == pytest.approx(max(seconds), rel=1e-9)


@settings(max_examples=25, deadline=None)
@given(WORKLOADS, st.integers(2, 3))
def test_switch_off_is_independent_replicas(specs, ranks):
    off, pool, _ = run(to_requests(specs), ranks, ranks, dp_lockstep=False)
    assert not any(isinstance(r, LockstepReplica) for r in pool)
    cost = load_cost_model(LINEAR)  # no data_parallel at all: replicas as cbsim always ran them
    plain, _ = simulate(to_requests(specs), lambda: make_policy({"name": "sarathi", "token_budget": 64}), cost,
                        lambda: KVCache(2000, 16, 0), ReplicaSettings(max_model_len=1000), replicas=ranks,
                        max_time=1e5)
    assert off.equals(pd.DataFrame(plain.step_table()))


def first_prefill(steps, replica: int, after: float) -> float:
    rows = steps[(steps.replica == replica) & (steps.prefill_tokens > 0) & (steps.start > after)]
    return float(rows.start.min())


def test_prefill_waits_for_the_aligned_step():
    """Two ranks; rank 0 decodes request 0 from t = 0; request 2 arrives at rank 0 amid the wave's
    step 2 (round robin: 0, 1, 0). vLLM: step_counter 3 at the next boundary, 3 % 2 != 0, a decode
    runs there and step 2 drained the queue (not capacity-bound): the prompt waits one step."""
    specs = [(0.0, 4, 30), (0.0, 4, 30), (0.0335, 4, 2)]  # both ranks busy: no dummy batch
    base, _, _ = run(make_requests(specs), 2, 2)
    paced, _, _ = run(make_requests(specs), 2, 2, prefill_schedule_interval=2)
    starts = sorted(set(base.start))
    assert starts[2] < 0.0335 < starts[3]  # it arrives amid the third step (step_counter 2)
    assert first_prefill(base, 0, 0.0) == starts[3]
    assert first_prefill(paced, 0, 0.0) == sorted(set(paced.start))[4]  # the aligned step after


def test_interval_needs_lockstep_ranks():
    with pytest.raises(ConfigError, match="prefill_schedule_interval"):
        run(make_requests([(0.0, 4, 2)]), 2, 2, dp_lockstep=False, prefill_schedule_interval=2)


@settings(max_examples=30, deadline=None)
@given(WORKLOADS, st.integers(2, 3))
def test_experts_receive_the_ranks_sum(specs, ranks):
    """Each rank's step re-priced with its experts at every rank's tokens (an idle rank's dummy token
    included), not D x its own: a step lasts max over ranks of (own forward + EXPERT x total)."""
    steps, _, _ = run(to_requests(specs), ranks, ranks, cost_class=Among)
    for start, group in steps.groupby("start"):
        rows = list(group.itertuples())
        idle = ranks - len(rows)
        total = sum(r.prefill_tokens + r.decode_tokens for r in rows) + idle
        seconds = [step_seconds(Among(load_cost_model(LINEAR), ranks), r) + EXPERT * total for r in rows]
        seconds += [DUMMY_SECONDS + EXPERT * total] if idle else []
        assert rows[0].end - start == pytest.approx(max(seconds), rel=1e-9)


def test_roofline_prices_the_ranks_sum():
    """step_time_among at share D is step_time; a prompt chunk's rank among decoding ranks is cheaper
    at the ranks' real sum than at D x its chunk."""
    from cbsim.sim.costmodels.catalog.lookup import model_spec
    cost = load_cost_model({"type": "roofline", "gpu": "h200", "tp": 1, "expert_parallel": True,
                            "data_parallel": 8}, model_spec("deepseek-v3"))
    mixed = StepShape.from_batch(prefill=[(1948, 0)], decode=[1500] * 100)
    assert cost.step_time_among(mixed, 8) == cost.step_time(mixed)
    assert cost.step_time_among(mixed, (2048 + 700) / 2048) < 0.9 * cost.step_time(mixed)


def test_wave_runs_on_in_dummy_steps_to_the_all_reduce():
    """vLLM all-reduces the ranks' unfinished work every 32 steps: after the last request, every rank
    runs dummy steps (DUMMY_SECONDS each) until the wave's step counter reaches 32. Request 0 takes
    steps 0 and 1 (ending at 0.10, a dummy on the idle rank setting each step's time); request 1,
    arriving at 0.12 amid the third dummy-only step, starts at its end (0.15); request 2, arriving
    after the 30 dummy steps (0.10 + 30 x 0.05 = 1.6), starts at its arrival."""
    steps, _, _ = run(make_requests([(0.0, 4, 2), (0.12, 4, 2), (5.0, 4, 2)]), 2, 2)
    starts = sorted(set(steps.start))
    assert starts[:2] == pytest.approx([0.0, DUMMY_SECONDS])
    assert starts[2] == pytest.approx(3 * DUMMY_SECONDS)
    assert starts[4] == 5.0


def test_interval_is_refused_on_pd_pools():
    """P/D pools' ranks step alone: an interval there would be silently ignored, so the config refuses it."""
    from cbsim.config import load_config
    config = {"name": "pd-interval", "model": "llama-2-7b", "cost_model": {"type": "roofline", "gpu": "h100"},
              "workload": {"num_requests": 2, "arrival": {"type": "poisson", "rate": 1.0},
                           "prompt_len": {"type": "fixed", "value": 8}, "output_len": {"type": "fixed", "value": 4}},
              "cluster": {"mode": "pd", "prefill_schedule_interval": 2, "prefill": {"replicas": 1},
                          "decode": {"replicas": 1}}}
    with pytest.raises(ConfigError, match="prefill_schedule_interval.*mode pd"):
        load_config(config)
