"""Swap at the bandwidth the engine achieves (sim/preemption.py swap_bandwidth): the configured figure
wins; else the engine preset's (vLLM V0's per-block copies, vllm PR #11531: 3.1 GB/s); else the PCIe
peak. An engine that never swaps (vLLM V1, SGLang) is warned about when a swap is asked of it."""
from __future__ import annotations

import warnings

import pytest

from cbsim.build import build_replica_parts
from cbsim.config import load_config
from cbsim.sim.costmodels.engine import load_engine
from cbsim.sim.preemption import PCIE_PEAK_GB_S, swap_bandwidth

RUN = {"name": "swap", "model": "llama-3-8b", "cost_model": {"type": "roofline", "gpu": "a100"},
       "cluster": {"kv_cache": {"num_blocks": 1000}}, "policy": {"name": "sarathi", "token_budget": 512},
       "workload": {"num_requests": 10, "arrival": {"type": "all_at_once"}, "prompt_len": {"type": "fixed", "value": 100},
                    "output_len": {"type": "fixed", "value": 10}}}


def settings_of(engine: str, **preemption):
    config = load_config({**RUN, "cost_model": {**RUN["cost_model"], "engine": engine}, "preemption": preemption})
    return build_replica_parts(config)[3]


def test_the_engine_gives_the_default():
    assert settings_of("vidur-a100-tp1", mode="swap").swap_bandwidth == 3.1e9  # V0 swap_blocks, PR #11531
    assert settings_of("trtllm", mode="swap").swap_bandwidth == PCIE_PEAK_GB_S * 1e9  # no figure: the link's peak
    assert settings_of("vidur-a100-tp1", mode="swap", swap_bandwidth_gb_s=12.5).swap_bandwidth == 12.5e9
    assert swap_bandwidth(None, None, "swap") == PCIE_PEAK_GB_S * 1e9  # a cost model without an engine


@pytest.mark.parametrize("engine", ["vllm-v1", "sglang"])
def test_a_swap_asked_of_an_engine_that_recomputes_is_warned_about(engine):
    assert not load_engine(engine).terms.swap_preemption
    with pytest.warns(UserWarning, match=f"engine {engine} does not swap"):
        assert swap_bandwidth(None, load_engine(engine), "auto") == PCIE_PEAK_GB_S * 1e9
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        swap_bandwidth(None, load_engine(engine), "recompute")  # recompute is what it does: silent
        swap_bandwidth(None, load_engine("vidur-a100-tp1"), "swap")  # a V0-style engine swaps: silent


def test_a_bad_bandwidth_is_refused():
    from cbsim.core.errors import ConfigError

    with pytest.raises(ConfigError, match="swap_bandwidth_gb_s"):
        load_config({**RUN, "preemption": {"swap_bandwidth_gb_s": 0}})
