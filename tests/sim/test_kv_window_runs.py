"""Sliding-window pages in the simulated cache (issue 11): a windowed model's requests hold what vLLM's
hybrid KV cache manager holds (sim/kv/window.py pages_held, in units of g layer-pages), checked
before every plan of random runs of every policy beside the usual budget invariants; a long-context
workload runs a larger batch than with cluster.kv_cache.hybrid_kv_cache_manager: false; without a
window nothing changes; prefix caching and P/D refuse a window."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cbsim.api import run_experiment
from cbsim.core.errors import ConfigError
from cbsim.policies import make_policy
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.kv.window import WindowPages, pages_held
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.costmodels.catalog.specs import ModelSpec
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request import Request, Status
from cbsim.sim.simulation import simulate

from factories import Run, TracedPolicy, assert_same_run, make_requests
from test_invariants import ENGINE, MAX_MODEL_LEN, POLICIES, WORKLOADS, check_run, to_requests

MISTRAL, GEMMA = model_spec("mistral-7b"), model_spec("gemma-2-27b")


def windowed_model(window: int, full: int, sliding: int) -> ModelSpec:
    return ModelSpec("w", 256, full + sliding, 4, 2, 64, 512, 1000, 100_000, sliding_window=window,
                     sliding_layers=sliding)


# ------------------------------------------------------------------------------- the units


def test_units_are_vllm_hybrid_blocks():
    mistral, gemma = WindowPages.of(MISTRAL, 16), WindowPages.of(GEMMA, 16)
    assert (mistral.group, mistral.units_per_block) == (32, 1)  # one group of 32 windowed layers
    assert (gemma.group, gemma.units_per_block) == (23, 2)  # a full and a windowed group of 23 layers
    assert WindowPages.of(model_spec("llama-3.1-8b"), 16) is None
    # Mistral, 10,000 tokens: 625 blocks less 369 wholly before the window (test_kv_window.py)
    assert mistral.held(625, 10_000) == 625 - 369 == pages_held(MISTRAL, 10_000, 16) // 32


@settings(max_examples=300, deadline=None)
@given(computed=st.integers(0, 20_000), new=st.integers(1, 5000), block=st.sampled_from([1, 4, 16, 32]),
       window=st.integers(1, 9000), layers=st.sampled_from([(0, 4), (2, 2), (3, 6), (5, 1)]))
def test_held_is_pages_held_during_the_step(computed, new, block, window, layers):
    """During a step from c to n tokens a request holds pages_held(n, computed=c) layer-pages (vLLM frees
    for c before it allocates for n), and top_of inverts held."""
    model = windowed_model(window, *layers)
    w = WindowPages.of(model, block)
    top = math.ceil((computed + new) / block)
    assert w.held(top, computed) * w.group == pages_held(model, computed + new, block, computed)
    assert w.top_of(w.held(top, computed), computed) == top
    assert w.held(top, computed) <= top * w.units_per_block  # never more than every layer holding every block


def test_the_cache_charges_units_and_frees_the_window():
    w = WindowPages.of(windowed_model(32, 0, 4), 8)  # 4 windowed layers: g = 4, one unit a block
    kv = KVCache(100, 8, window=w)
    req = Request(0, 0.0, 200, 10)
    req.num_computed_tokens = 0
    kv.resize(req, kv.held_for(req, 0, 64))  # a 64-token chunk: 8 blocks, nothing freed
    assert (req.num_blocks, kv.free_blocks) == (8, 92)
    req.num_computed_tokens = 64
    target = kv.held_for(req, 64, 72)  # 64 - 32 + 1 = 33 tokens skipped: 4 blocks freed, one allocated
    assert target == 9 - 4
    kv.resize(req, target)
    assert (req.num_blocks, kv.free_blocks) == (5, 95)
    kv.release(req)
    assert (req.num_blocks, kv.free_blocks, kv._top) == (0, 100, {})
    assert kv.blocks_for(17) == 3 and KVCache(10, 8, bytes_per_token=4.0, window=w).block_bytes == 32.0


# ------------------------------------------------------------------------------- runs


class PagesChecked(TracedPolicy):
    """Before every plan: free + held == the pool, and every running request holds
    pages_held(model, top, bs, C) / g units, C its progress at its last step and top the most tokens
    it was given room for (that step's end, or its reservation: prompt + output for static and orca
    max_len, its whole input with reserve_full_prompt)."""

    def __init__(self, inner, model, block_size, reserve_full_prompt):
        super().__init__(inner)
        self.model, self.block_size, self.reserve_full_prompt = model, block_size, reserve_full_prompt
        config = inner.config
        self.reserves = inner.name == "static" or getattr(config, "kv_reservation", None) == "max_len"
        self.last: dict[int, tuple[int, int, int]] = {}  # id -> (epoch, computed at its last step, top tokens)
        self.checked = 0

    def schedule(self, state):
        kv = state.kv
        held = 0
        for req in state.running:
            held += req.num_blocks
            epoch, computed, top = self.last[req.id]
            assert epoch == req.epoch
            assert req.num_blocks * kv.window.group == pages_held(self.model, top, self.block_size, computed), req
            self.checked += 1
        assert held + sum(r.num_blocks for r in state.waiting) + kv.free_blocks == kv.num_blocks
        assert kv.free_blocks >= 0
        plan = super().schedule(state)
        by_id = {r.id: r for r in (*state.running, *state.waiting)}
        for rid, n in plan.scheduled.items():
            req = by_id[rid]
            computed = req.num_computed_tokens
            top = computed + n
            if rid in plan.admitted:  # it holds nothing yet: its room starts here
                if self.reserves:
                    top = max(top, req.prompt_len + req.output_len)
                if self.reserve_full_prompt:
                    top = max(top, req.num_tokens)
            else:
                top = max(top, self.last[rid][2])
            self.last[rid] = (req.epoch, computed, top)
        return plan


def run_windowed(policy: dict, requests, model: ModelSpec, *, num_blocks: int, block_size: int = 16,
                 watermark_blocks: int = 0, hybrid: bool = True, preemption: str = "recompute",
                 victim: str = "last_admitted", cost: dict | None = None, reserve_full_prompt: bool = False,
                 fast_forward: bool = True, max_model_len: int = MAX_MODEL_LEN) -> Run:
    """factories.run_policy with the model's window in the cache (`num_blocks` in its units)."""
    window = WindowPages.of(model, block_size) if hybrid else None
    policies = []

    def new_policy():
        inner = make_policy(policy)
        p = PagesChecked(inner, model, block_size, reserve_full_prompt) if window is not None else TracedPolicy(inner)
        policies.append(p)
        return p

    settings_ = ReplicaSettings(preemption_mode=preemption, victim=victim, max_model_len=max_model_len,
                                fast_forward=fast_forward, swap_bandwidth=1e9)
    recorder, pool = simulate(requests, new_policy, load_cost_model(cost or {"type": "unit"}),
                              lambda: KVCache(num_blocks, block_size, watermark_blocks, reserve_full_prompt, 1024.0,
                                              window=window),
                              settings_, max_time=1e5)
    return Run(requests, recorder, pool, policies)


WINDOWS = st.tuples(st.integers(1, 80), st.sampled_from([(0, 2), (1, 1), (2, 1), (1, 3)]))


@pytest.mark.slow
@given(POLICIES, WORKLOADS, ENGINE, WINDOWS)
def test_budgets_and_pages_hold_at_every_step_for_every_policy(policy, specs, engine, window):
    model = windowed_model(window[0], *window[1])
    engine = dict(engine)
    run = run_windowed(policy, to_requests(specs), model, **engine)
    check_run(run, policy, engine)  # token, sequence and KV budgets; every request done once; tokens conserved
    assert (run.recorder.step_table()["kv_blocks_used"] >= 0).all()
    assert run.replicas[0].kv._top == {}  # every request's room forgotten with its blocks


@settings(max_examples=60, deadline=None)
@given(specs=WORKLOADS, window=WINDOWS, num_blocks=st.integers(8, 60), block=st.sampled_from([1, 4, 16]),
       preemption=st.sampled_from(["recompute", "swap"]))
def test_the_window_is_stepped_not_fast_forwarded(specs, window, num_blocks, block, preemption):
    """fast_forward=True runs every step (may_leap refuses a window): the same run as stepping."""
    model = windowed_model(window[0], *window[1])
    policy = {"name": "sarathi", "token_budget": 32, "max_num_seqs": 6}
    runs = [run_windowed(policy, to_requests(specs), model, num_blocks=num_blocks, block_size=block,
                         preemption=preemption, fast_forward=ff) for ff in (True, False)]
    assert_same_run((runs[0].requests, runs[0].recorder), (runs[1].requests, runs[1].recorder))
    if any(r.status == Status.FINISHED and r.output_len > 1 for r in runs[0].requests):
        assert runs[0].policies[0].checked > 0  # some request was checked between two of its steps


def test_long_contexts_hold_fewer_blocks_and_the_difference_is_the_window():
    """One 600-token request, window 64, blocks of 8, 2 windowed + 2 full layers (g = 2, 2 units a block):
    at its last step (606 -> 607 tokens) the full pair holds 76 blocks, the windowed pair 76 - 67 = 9."""
    model = windowed_model(64, 2, 2)
    reqs = lambda: make_requests([(0.0, 600, 8)])  # noqa: E731
    policy = {"name": "sarathi", "token_budget": 32, "max_num_seqs": 4}
    on = run_windowed(policy, reqs(), model, num_blocks=400, block_size=8, max_model_len=1000)
    off = run_windowed(policy, reqs(), model, num_blocks=200, block_size=8, hybrid=False, max_model_len=1000)
    used_on, used_off = on.recorder.step_table()["kv_blocks_used"], off.recorder.step_table()["kv_blocks_used"]
    assert len(used_on) == len(used_off)
    assert used_off[-1] == math.ceil(607 / 8) == 76  # all-layer blocks
    # last step: 606 computed -> 607; the windowed pair frees (606 - 64 + 1) // 8 = 67 blocks
    assert used_on[-1] == pages_held(model, 607, 8, 606) // 2 == 76 + (76 - 67)
    assert (used_on[:3] == 2 * used_off[:3]).all()  # chunks of 32 to token 96: nothing left the window yet
    assert used_on[3] == 2 * 16 - (96 - 64 + 1) // 8  # the 4th chunk (96 -> 128) frees 4 windowed blocks
    assert used_on[-1] < 2 * used_off[-1]


MISTRAL_RUN = {
    "name": "long", "seed": 3, "model": "mistral-7b", "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1},
    "cluster": {"kv_cache": {"num_blocks": 3000}}, "policy": {"name": "sarathi", "token_budget": 2048},
    "workload": {"num_requests": 40, "arrival": {"type": "poisson", "rate": 50.0},
                 "prompt_len": {"type": "uniform", "min": 6000, "max": 12000},
                 "output_len": {"type": "uniform", "min": 50, "max": 300}},
    "output": {"plots": False, "trace": False}}


def _with(config: dict, **kv) -> dict:
    return {**config, "cluster": {**config.get("cluster", {}), "kv_cache": {**config["cluster"]["kv_cache"], **kv}}}


def test_a_long_context_workload_runs_a_larger_batch_with_the_window():
    on = run_experiment(MISTRAL_RUN)
    off = run_experiment(_with(MISTRAL_RUN, hybrid_kv_cache_manager=False))
    assert on.summary["num_finished"] == off.summary["num_finished"] == 40
    seqs_on, seqs_off = on.steps["num_seqs"], off.steps["num_seqs"]
    assert seqs_on.max() > seqs_off.max() and seqs_on.mean() > 1.5 * seqs_off.mean()
    assert on.steps["end"].max() < off.steps["end"].max()
    assert on.steps["kv_blocks_used"].max() <= 3000  # Mistral: one unit is one all-layer block (g = 32)


def test_without_a_window_the_key_changes_nothing():
    llama = {**MISTRAL_RUN, "model": "llama-3.1-8b", "workload": {**MISTRAL_RUN["workload"], "num_requests": 15}}
    on, off = run_experiment(llama), run_experiment(_with(llama, hybrid_kv_cache_manager=False))
    for name in on.steps.columns:
        if name != "sim_wall_seconds":
            assert np.array_equal(on.steps[name].to_numpy(), off.steps[name].to_numpy()), name
    columns = [c for c in on.requests.columns if c != "sim_wall_seconds"]
    assert on.requests[columns].equals(off.requests[columns])


def test_prefix_caching_refuses_a_window():
    with pytest.raises(ConfigError) as err:
        run_experiment(_with(MISTRAL_RUN, prefix_caching=True))
    assert err.value.path == "cluster.kv_cache.hybrid_kv_cache_manager" and "prefix_caching" in str(err.value)
    run = run_experiment(_with({**MISTRAL_RUN, "workload": {**MISTRAL_RUN["workload"], "num_requests": 3}},
                               prefix_caching=True, hybrid_kv_cache_manager=False))
    assert run.summary["num_finished"] == 3


def test_pd_refuses_a_window():
    config = {**MISTRAL_RUN, "workload": {**MISTRAL_RUN["workload"], "num_requests": 3},
              "cluster": {"kv_cache": {"num_blocks": 3000}, "mode": "pd",
                          "prefill": {"replicas": 1}, "decode": {"replicas": 1}}}
    with pytest.raises(ConfigError) as err:
        run_experiment(config)
    assert err.value.path == "cluster.kv_cache.hybrid_kv_cache_manager" and "cluster.mode" in str(err.value)
    assert run_experiment(_with(config, hybrid_kv_cache_manager=False)).summary["num_finished"] == 3


def test_gemma_counts_half_blocks_and_its_utilisation_stays_a_fraction():
    """Gemma-2-27B (23 windowed + 23 full layers): a unit is 23 layer-pages, two to an all-layer block, so
    500 blocks are 1,000 units; kv_blocks_used and the KV usage summary count units of that pool."""
    config = {**MISTRAL_RUN, "model": "gemma-2-27b", "cluster": {"kv_cache": {"num_blocks": 500}},
              "workload": {**MISTRAL_RUN["workload"], "num_requests": 12, "prompt_len": {"type": "uniform", "min": 3000,
                                                                                        "max": 7000}}}
    on, off = run_experiment(config), run_experiment(_with(config, hybrid_kv_cache_manager=False))
    assert on.kv_blocks == {0: 1000} and off.kv_blocks == {0: 500}
    assert on.steps["kv_blocks_used"].max() <= 1000 and off.steps["kv_blocks_used"].max() <= 500
    for run in (on, off):
        assert 0 < run.summary["kv_usage_mean"] <= run.summary["kv_usage_p99"] <= 1


def test_results_name_the_tokens_a_kv_block_holds():
    """The step table's kv_blocks_used counts the cache's units: the dashboard turns them into tokens with
    Results.kv_unit_tokens (Gemma-2: two units a block, so half a block's tokens each)."""
    small = {**MISTRAL_RUN, "workload": {**MISTRAL_RUN["workload"], "num_requests": 2,
                                         "prompt_len": {"type": "uniform", "min": 100, "max": 200}}}
    assert run_experiment({**small, "model": "gemma-2-27b"}).kv_unit_tokens == 8
    assert run_experiment(small).kv_unit_tokens == 16  # Mistral: one unit is one all-layer block
    assert run_experiment(_with({**small, "model": "gemma-2-27b"}, hybrid_kv_cache_manager=False)).kv_unit_tokens == 16
