"""MoE and MLA replicas run under every policy (issue 11): each request finishes or is rejected with a
reason, KV stays within the cache, tokens are conserved, and results are deterministic and the same
with and without fast-forward. Catalog models on the roofline: Mixtral-8x7B with expert parallelism
over TP2, DeepSeek-V2-Lite (MLA + MoE), Qwen3-30B-A3B as one rank of data-parallel attention over
8 GPUs' experts (all-to-all per MoE layer), and Llama-3.1-8B as two pipeline stages."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from cbsim.api import run_experiment

POLICIES = [{"name": "static", "max_num_seqs": 8}, {"name": "orca", "max_num_seqs": 16, "token_budget": None},
            {"name": "prefill_first", "chunk_size": 256}, {"name": "sarathi", "token_budget": 256},
            {"name": "splitfuse", "token_budget": 256}, {"name": "chunked_only", "chunk_size": 256},
            {"name": "sglang", "chunked_prefill_size": 256}]
MODELS = [("mixtral-8x7b", {"type": "roofline", "gpu": "h100", "tp": 2, "expert_parallel": True}),
          ("deepseek-v2-lite", {"type": "roofline", "gpu": "h100", "tp": 1}),
          ("qwen3-30b-a3b", {"type": "roofline", "gpu": "h200", "expert_parallel": True, "data_parallel": 8}),
          ("llama-3.1-8b", {"type": "roofline", "gpu": "h100", "pp": 2})]


def experiment(model, cost, policy, fast_forward=True):
    return {"name": "moe", "seed": 1, "model": model, "cost_model": cost, "policy": policy,
            "cluster": {"kv_cache": {"num_blocks": 300, "block_size": 16}},
            "workload": {"num_requests": 24, "arrival": {"type": "poisson", "rate": 40.0},
                         "prompt_len": {"type": "uniform", "min": 16, "max": 600},
                         "output_len": {"type": "uniform", "min": 1, "max": 60}},
            "sim": {"fast_forward": fast_forward}, "output": {"plots": False}}


def check(results):
    df, steps = results.requests, results.steps
    assert set(df["status"]) <= {"finished", "rejected"}
    assert (df.loc[df["status"] == "rejected", "reject_reason"] != "").all()
    done = df[df["status"] == "finished"]
    assert (done["output_tokens"] == done["output_len"]).all()
    assert (steps["kv_blocks_used"] <= 300).all() and (steps["end"] > steps["start"]).all()
    needed = (done["prompt_len"] + done["output_len"] - 1).sum()
    assert steps["prefill_tokens"].sum() + steps["decode_tokens"].sum() >= needed
    assert results.summary["mfu_mean"] is None or 0 < results.summary["mfu_mean"] < 1


def same(a, b):
    for name in ("requests", "steps"):
        pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name), check_exact=True)


@pytest.mark.parametrize("policy", POLICIES[3:4])
@pytest.mark.parametrize("model,cost", MODELS)
def test_moe_and_mla_replicas_keep_the_invariants(model, cost, policy):
    results = run_experiment(experiment(model, cost, policy))
    check(results)
    same(results, run_experiment(experiment(model, cost, policy)))


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("model,cost", MODELS)
def test_every_policy_on_moe_and_mla(model, cost, policy):
    fast = run_experiment(experiment(model, cost, policy))
    check(fast)
    same(fast, run_experiment(experiment(model, cost, policy, fast_forward=False)))
    assert np.isfinite(fast.steps["duration"]).all()


def test_pd_cluster_with_pipeline_prefill_and_data_parallel_decode():
    """A P/D cluster whose prefill replicas are two pipeline stages and whose decode replicas are ranks of
    data-parallel attention over 8 GPUs' experts: every request is handed off and finishes, GPUs count
    tp x pp per replica, and the run is deterministic."""
    from cbsim.config import load_config
    from cbsim.replica_gpus import num_gpus

    spec = {"name": "pd-moe", "seed": 3, "model": "qwen3-30b-a3b",
            "cost_model": {"type": "roofline", "gpu": "h200"},
            "cluster": {"mode": "pd", "kv_cache": {"block_size": 16, "num_blocks": 600},
                        "prefill": {"replicas": 2, "policy": {"name": "prefill_first", "token_budget": 2048},
                                    "cost_model": {"pp": 2}},
                        "decode": {"replicas": 2, "policy": {"name": "sarathi", "token_budget": 256},
                                   "cost_model": {"expert_parallel": True, "data_parallel": 8}},
                        "link": {"latency_s": 0.001, "bandwidth_gb_s": 25}},
            "workload": {"num_requests": 30, "arrival": {"type": "poisson", "rate": 30.0},
                         "prompt_len": {"type": "uniform", "min": 50, "max": 900},
                         "output_len": {"type": "uniform", "min": 2, "max": 40}},
            "output": {"plots": False, "trace": False}}
    results = run_experiment(spec)
    df = results.requests
    assert (df["status"] == "finished").all() and results.summary["num_handoffs"] == 30
    assert (df["output_tokens"] == df["output_len"]).all()
    assert num_gpus(load_config(spec)) == 2 * 2 + 2 * 1
    same(results, run_experiment(spec))
