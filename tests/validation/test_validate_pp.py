"""validation/validate_pp.py: the published pipeline-parallel rows load, each cites its source, and the
cbsim experiment of each builds and runs (no shared data needed: the workload is synthetic, so nothing
here skips without ../shared/data)."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from paths import ROOT

SCRIPT = ROOT / "validation" / "validate_pp.py"


@pytest.fixture(scope="module")
def vpp():
    spec = importlib.util.spec_from_file_location("cbsim_validate_pp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_row_cites_its_source_and_its_layout(vpp):
    assert len(vpp.ROWS) == 10
    for row in vpp.ROWS:
        assert row.layout in vpp.LAYOUTS and row.layout in vpp.SETUPS
        assert row.qps == math.inf or row.req_s < row.qps
        if row.layout.endswith("_l4"):  # Substratus: 1,000 ShareGPT prompts at once, throughput only
            assert vpp.SOURCES[row.layout] == vpp.SUBSTRATUS and row.mean_ttft_ms is None
            assert 225 < row.mean_prompt < 240 and 170 < row.mean_output < 180
            continue
        assert vpp.SOURCES[row.layout].startswith("gist.github.com/surajssd/")
        # transcription check: every row of the harness has ~213-token prompts and ~214-token outputs
        assert 205 < row.mean_prompt < 222 and 205 < row.mean_output < 222
        assert row.median_tpot_ms < row.mean_ttft_ms * 1.5 or row.qps == 1  # the columns are not swapped


def test_the_layouts_are_the_vms(vpp):
    nc48 = vpp.LAYOUTS["tp2_pp2_nc48"]
    assert nc48["tp"] * nc48["pp"] == 4 and nc48["gpus_per_node"] == 2
    assert nc48["gpu"]["inter_node_bandwidth"] == pytest.approx(40e9 / 8 / 2)  # 40,000 Mbps over 2 GPUs
    assert vpp.LAYOUTS["tp4_pp2_nd96"]["gpus_per_node"] == 4  # one stage per VM: the boundary crosses the network
    assert "pp" not in vpp.LAYOUTS["tp4_pp1_nc96"]


def test_the_lengths_have_the_published_means(vpp):
    spec = vpp.lengths(213.5, 1024)
    z = np.random.default_rng(1).standard_normal(400_000)
    mean = np.clip(spec["median"] * np.exp(spec["sigma"] * z), spec["min"], spec["max"]).mean()
    assert mean == pytest.approx(213.5, rel=0.01)


@pytest.mark.parametrize("index", [0, 4, 8])
def test_a_row_runs_through_cbsim(vpp, index):
    row = vpp.ROWS[index]
    predicted = vpp.predict(row, seeds=(0,), num_requests=40)
    assert predicted["output_tok_s"] > 0 and predicted["req_s"] > 0
    assert 0 < predicted["median_tpot_ms"] < 1000 and 0 < predicted["mean_ttft_ms"] < 10_000
    config = vpp.experiment(row, 0)
    assert config["cost_model"]["pp"] in (2, 4) and "llama-3.1-70b" in str(config["model"])
    assert config["workload"]["num_requests"] == vpp.SETUPS[row.layout]["num_requests"]
