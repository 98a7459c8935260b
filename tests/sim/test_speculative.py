"""Speculative decoding (sim/speculative.py): verify rows, acceptance, KV lookahead, metrics.

Invariants over random workloads and engines (sarathi, orca and sglang plans): every request finishes
exactly once with exactly output_len tokens; each step's scheduled tokens, speculative ones counted,
stay within the token budget and max_num_seqs; KV blocks are never over-committed and all are free at
the end; a decode verifies 1 + k tokens where the budget allows. Determinism: same seed, same tables;
a run without `speculative` draws nothing (the golden tables and tables_sha check bit-identity).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.api import run_experiment
from cbsim.config import load_config
from cbsim.policies import make_policy
from cbsim.tools.sweep.sweep import load_sweep, sweep_points
from cbsim.core.errors import ConfigError
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.request import Status
from cbsim.sim.shape import StepShape
from cbsim.sim.speculative import Speculation, SpeculativeConfig, Speculator, rate_for_length

import factories
from factories import make_requests, run_policy
from paths import ROOT

UNIT = load_cost_model({"type": "unit"})


def speculation(k=3, acceptance=0.6, method="ngram", seed=0):
    config = SpeculativeConfig(method=method, num_speculative_tokens=k, acceptance=acceptance)
    config.validate()
    return Speculation(config, np.random.default_rng(seed), num_layers=32)


# -- acceptance -------------------------------------------------------------------------
def test_acceptance_stops_at_the_first_rejected_position():
    spec = speculation(k=3, acceptance=[1.0, 1.0, 0.0]).make(UNIT)
    assert {spec.accept(3) for _ in range(50)} == {2}
    assert spec.accept(1) == 1 and spec.accept(0) == 0  # fewer drafts verified (the budget cut them)


def test_mean_acceptance_length_matches_the_chain_formula():
    p, k = 0.7, 4
    spec = speculation(k=k, acceptance=p).make(UNIT)
    mean = 1 + np.mean([spec.accept(k) for _ in range(20000)])
    assert mean == pytest.approx(1 + sum(p ** i for i in range(1, k + 1)), rel=0.02)


def test_rate_for_length_inverts_the_formula():
    p = rate_for_length(2.77, 7)
    assert 1 + sum(p ** i for i in range(1, 8)) == pytest.approx(2.77, abs=1e-9)
    assert 0.5 < p < 0.7


@pytest.mark.parametrize("section,field", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "acceptance"),  # no cited default for eagle
    ({"method": "eagle3", "num_speculative_tokens": 2, "acceptance": [0.5]}, "acceptance"),
    ({"method": "ngram", "num_speculative_tokens": 2, "acceptance": 1.5}, "acceptance"),
    ({"method": "ngram", "num_speculative_tokens": 0, "acceptance": 0.5}, "num_speculative_tokens"),
    ({"method": "draft_model", "num_speculative_tokens": 2, "acceptance": 0.5}, "model"),
    ({"method": "medusa", "num_speculative_tokens": 2, "acceptance": 0.5}, "method"),
])
def test_bad_sections_name_the_field(section, field):
    with pytest.raises(ConfigError, match=f"speculative.{field}"):
        run_experiment({**EXPERIMENT, "speculative": section})


# -- the drafter's cost ------------------------------------------------------------------
def test_drafter_costs_by_method():
    target = load_cost_model({"type": "roofline", "gpu": "h100", "tp": 1}, model_spec("llama-3-8b"))
    rows = [(3, 100), (3, 500)]
    one_step = target.step_time(StepShape(decode=(101, 501), tokens_sampled=2))
    eagle = speculation(method="eagle3").make(target)
    ngram = speculation(method="ngram").make(target)
    eagle.rows = ngram.rows = rows
    assert ngram.draft_seconds() == 0.0
    assert eagle.draft_seconds() == pytest.approx(3 * one_step / 32)  # a one-layer head per draft token
    config = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model="llama-3-8b", acceptance=0.5)
    draft = Speculator(config, np.random.default_rng(0), target, 32, draft_cost=target)
    draft.rows = rows
    assert draft.draft_seconds() == pytest.approx(sum(target.step_time(StepShape(decode=(101 + j, 501 + j),
                                                                                 tokens_sampled=2))
                                                      for j in range(3)))


# -- invariants over random runs ----------------------------------------------------------
POLICIES = st.sampled_from([
    {"name": "sarathi", "token_budget": 24, "max_num_seqs": 4},
    {"name": "sarathi", "token_budget": 7, "max_num_seqs": 8},
    {"name": "orca", "max_num_seqs": 3, "kv_reservation": "paged"},
    {"name": "sglang", "token_budget": 64, "max_num_seqs": 4},
])
WORKLOADS = st.lists(st.tuples(st.floats(0, 3, allow_nan=False), st.integers(1, 60), st.integers(1, 30)),
                     min_size=1, max_size=10)


class Budgeted:
    """Wraps a policy; checks each plan's budgets with speculative tokens counted."""

    def __init__(self, inner, budget, seqs, k):
        self.inner, self.budget, self.seqs, self.k = inner, budget, seqs, k
        self.name, self.config, self.steady_when_blocked = inner.name, inner.config, inner.steady_when_blocked
        self.verify_rows = 0

    def schedule(self, state):
        plan = self.inner.schedule(state)
        by_id = {r.id: r for r in state.running + list(state.waiting)}
        assert sum(plan.scheduled.values()) <= self.budget
        assert len(plan.scheduled) + len(plan.padding) <= self.seqs
        for rid, n in plan.scheduled.items():
            req = by_id[rid]
            if req.num_output_tokens and req.need == 1 and rid not in plan.admitted:
                assert n <= 1 + self.k
                self.verify_rows += n > 1
        return plan

    def reject_reason(self, req, state):
        return self.inner.reject_reason(req, state)


@settings(max_examples=40, deadline=None)
@given(POLICIES, WORKLOADS, st.integers(1, 4), st.sampled_from([0.0, 0.5, 1.0]), st.integers(8, 80),
       st.sampled_from([1, 4, 16]), st.integers(0, 3))
def test_invariants_with_speculation(policy, specs, k, rate, num_blocks, block_size, seed):
    t, rows = 0.0, []
    for gap, prompt, output in specs:
        t += gap
        rows.append((round(t, 3), prompt, output))
    requests = make_requests(rows)
    budget = policy.get("token_budget") or 1 << 62
    wrapped = []

    def traced(p):
        w = Budgeted(make_policy(p), budget, p["max_num_seqs"], k)
        wrapped.append(w)
        return w

    original, factories.make_policy = factories.make_policy, traced
    try:
        run = run_policy(policy, requests, num_blocks=num_blocks, block_size=block_size, max_model_len=128,
                         fast_forward=False, settings={"speculative": speculation(k, rate, seed=seed)})
    finally:
        factories.make_policy = original
    steps = run.recorder.step_table()
    assert (steps["kv_blocks_used"] <= num_blocks).all()
    assert run.replicas[0].kv.free_blocks == num_blocks
    runs = run.recorder.run_table()
    for req in requests:
        assert req.status in (Status.FINISHED, Status.REJECTED)
        if req.status == Status.REJECTED:
            assert req.reject_reason
            continue
        assert req.num_output_tokens == req.output_len  # never more: accepted tokens are capped
        chunks = int(runs["tokens"][runs["request_id"] == req.id].sum())
        assert chunks + req.spec_extra == req.output_len  # tokens conserved: chunks plus their extra tokens
        assert req.spec_accepted <= k * req.spec_steps
        if rate == 1.0 and req.spec_steps:  # every draft accepted, so the cap alone limits the tokens
            assert req.spec_extra == req.output_len - chunks


def test_a_decode_verifies_k_plus_one_tokens_and_emits_accepted_plus_one():
    requests = make_requests([(0.0, 8, 9)])
    run = run_policy({"name": "sarathi", "token_budget": 64, "max_num_seqs": 4}, requests, fast_forward=False,
                     settings={"speculative": speculation(k=3, acceptance=1.0)})
    req = requests[0]
    steps = run.recorder.step_table()
    # prefill emits token 1; then verify steps emit 4, 4 (all accepted) and the 9th token is capped
    assert req.num_output_tokens == 9 and req.spec_steps == 2 and req.spec_extra == 6
    assert list(steps["decode_tokens"]) == [0, 4, 4]  # 1 + k query tokens per verify row
    assert req.num_blocks == 0 and run.replicas[0].kv.free_blocks == run.replicas[0].kv.num_blocks


def test_rejected_lookahead_blocks_are_freed():
    """At each step's planning, a request that verified holds only the blocks of its computed tokens:
    the k lookahead slots of the rejected drafts were freed at the end of the step before."""
    seen = []

    class Watch(Budgeted):
        def schedule(self, state):
            for req in state.running:
                if req.spec_steps:
                    seen.append(req.num_blocks == state.kv.blocks_for(req.num_computed_tokens))
            return super().schedule(state)

    original = factories.make_policy
    factories.make_policy = lambda p: Watch(make_policy(p), 64, 4, 4)
    try:
        requests = make_requests([(0.0, 16, 40)])
        run_policy({"name": "sarathi", "token_budget": 64, "max_num_seqs": 4}, requests, fast_forward=False,
                   block_size=4, settings={"speculative": speculation(k=4, acceptance=0.0)})
    finally:
        factories.make_policy = original
    assert requests[0].spec_steps == 39 and requests[0].spec_accepted == 0
    assert len(seen) == 38 and all(seen)


# -- runs from an experiment ---------------------------------------------------------------
EXPERIMENT = {"name": "spec", "seed": 3, "model": "llama-3-8b", "cost_model": {"type": "roofline", "gpu": "h100"},
              "policy": {"name": "sarathi", "token_budget": 256, "max_num_seqs": 16},
              "workload": {"num_requests": 30, "arrival": {"type": "poisson", "rate": 20.0},
                           "prompt_len": {"type": "fixed", "value": 64}, "output_len": {"type": "uniform",
                                                                                         "min": 2, "max": 40}},
              "speculative": {"method": "eagle3", "num_speculative_tokens": 3}}


def test_same_seed_same_tables_and_metrics():
    one, two = run_experiment(EXPERIMENT), run_experiment(EXPERIMENT)
    assert one.requests.equals(two.requests) and one.steps.equals(two.steps)
    df = one.requests
    assert (df["output_tokens"] == df["output_len"]).all()
    p = rate_for_length(2.77, 7)
    assert one.summary["mean_acceptance_length"] == pytest.approx(1 + p + p * p + p ** 3, rel=0.15)
    assert df["acceptance_length"].between(1, 4).all()
    assert one.summary["tokens_per_gap"] > 1.5  # several tokens per chunk: the gaps are between chunks
    assert (df["tpot"] <= df["itl_max"]).all()  # TPOT per token is below the per-chunk gaps
    assert df["tpot"].mean() * 1.5 < df["itl_max"].mean()
    other = run_experiment({**EXPERIMENT, "seed": 4})
    assert not other.requests["accepted_tokens"].equals(df["accepted_tokens"])


def test_without_speculation_no_columns_and_no_keys():
    plain = run_experiment({**EXPERIMENT, "speculative": None})
    assert "acceptance_length" not in plain.requests and "mean_acceptance_length" not in plain.summary
    assert "speculative" not in plain.config.to_dict()


def test_speculation_speeds_up_a_lone_request():
    """Batch 1 on an H100: the 4-token verify row costs about a decode step, so TPOT falls by about
    the acceptance length (less the head's cost)."""
    lone = {**EXPERIMENT, "workload": {"num_requests": 1, "arrival": {"type": "poisson", "rate": 1.0},
                                       "prompt_len": {"type": "fixed", "value": 64},
                                       "output_len": {"type": "fixed", "value": 200}}}
    plain = run_experiment({**lone, "speculative": None}).summary["tpot_p50"]
    spec = run_experiment(lone).summary
    assert 1.6 < plain / spec["tpot_p50"] < spec["mean_acceptance_length"]


@pytest.mark.parametrize("extra", [
    {"cluster": {"mode": "pd", "prefill": {"replicas": 1}, "decode": {"replicas": 1}}},
    {"policy": {"name": "static", "max_num_seqs": 8}},
])
def test_pd_clusters_and_static_batches_refuse_speculation(extra):
    with pytest.raises(ConfigError, match="speculative: expected null"):
        run_experiment({**EXPERIMENT, **extra})


def test_shipped_example_and_crossover_sweep_load():
    folder = ROOT / "experiments" / "speculative"
    assert load_config(folder / "eagle3.yaml").speculative.method == "eagle3"
    points = sweep_points(load_sweep(folder / "batch_crossover.yaml"))
    assert len(points) == 16  # 8 batches, with and without speculation


@pytest.mark.parametrize("extra", [
    {"preemption": {"mode": "recompute"}},
    {"preemption": {"mode": "swap"}},
    {"model": "mistral-7b"},  # a sliding window: the lookahead resizes with the window's units
    {"policy": {"name": "sglang", "token_budget": 256, "max_num_seqs": 16}},
    {"policy": {"name": "orca", "max_num_seqs": 16, "kv_reservation": "paged"}},
])
def test_short_kv_preempts_and_conserves_tokens(extra):
    """A KV cache too small for the batch's lookahead slots: decodes preempt others (or themselves), and
    every request still ends with exactly output_len tokens."""
    cfg = {**EXPERIMENT, "cluster": {"kv_cache": {"num_blocks": 24, "block_size": 16}}, **extra,
           "workload": {**EXPERIMENT["workload"], "prompt_len": {"type": "uniform", "min": 16, "max": 120}}}
    result = run_experiment(cfg)
    df = result.requests
    assert (df["status"] == "finished").all() and (df["output_tokens"] == df["output_len"]).all()
    if "model" not in extra:  # (a windowed model counts layer-pages: sim/kv/window.py)
        assert (result.steps["kv_blocks_used"] <= 24).all()
    if "preemption" in extra:
        assert result.summary["num_preemptions"] > 0
