"""cluster.pp_chunk_pipelining reaches the pipelined replica: a long prompt's chunks overlap across
micro-batches when it is on (vLLM V1, SGLang), and wait for each other when it is off (early V1)."""
from __future__ import annotations

from cbsim.api import run_experiment

LONG_PROMPTS = {
    "name": "pp_chunks", "seed": 0, "model": "llama-3.1-8b",
    "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1, "pp": 2},
    "policy": {"name": "sarathi", "token_budget": 512},
    "workload": {"num_requests": 6, "arrival": {"type": "poisson", "rate": 0.2},
                 "prompt_len": {"type": "uniform", "min": 3000, "max": 4000},
                 "output_len": {"type": "uniform", "min": 4, "max": 8}},
    "output": {"plots": False, "trace": False}}


def test_chunk_pipelining_shortens_a_long_prompt_and_false_turns_it_off():
    on = run_experiment(LONG_PROMPTS)
    off = run_experiment({**LONG_PROMPTS, "cluster": {"pp_chunk_pipelining": False}})
    assert on.summary["num_finished"] == off.summary["num_finished"] == 6
    # 6-8 chunks on 2 stages: k + 1 stage times to the first token against 2k
    assert on.summary["ttft_p50"] < 0.75 * off.summary["ttft_p50"]
    assert on.config.cluster.pp_chunk_pipelining and not off.config.cluster.pp_chunk_pipelining
