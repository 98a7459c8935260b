"""Multimodal requests from workloads (workloads/multimodal.py): explicit mm_inputs, synthetic images
drawn after everything else, trace cells parsed, a system prompt moving a trace's images back."""
from __future__ import annotations

import numpy as np
import pytest

from cbsim.core.errors import ConfigError
from cbsim.workloads import build_requests, parse_workload
from cbsim.workloads.multimodal import parse_mm_inputs
from cbsim.workloads.readers import trace_rows as _rows

SYNTHETIC = {"num_requests": 200, "arrival": {"type": "poisson", "rate": 5.0},
             "prompt_len": {"type": "uniform", "min": 10, "max": 400}, "output_len": {"type": "fixed", "value": 8}}


def build(workload, seed=0):
    return build_requests(parse_workload(workload), np.random.default_rng(seed))


def test_explicit_requests_carry_their_images():
    reqs = build({"requests": [{"arrival": 0, "prompt_len": 100, "output_len": 4, "mm_inputs": [[10, 30], [50, 20]]},
                               {"arrival": 1, "prompt_len": 50, "output_len": 4}]})
    assert reqs[0].mm_inputs == ((10, 30), (50, 20)) and reqs[1].mm_inputs is None


@pytest.mark.parametrize("images, key", [([[10, 30], [20, 5]], "mm_inputs[1]"), ([[90, 20]], "mm_inputs[0]"),
                                         ([[0, 0]], "mm_inputs[0]"), ([[1]], "mm_inputs[0]")])
def test_bad_explicit_images_name_the_entry(images, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        parse_workload({"requests": [{"arrival": 0, "prompt_len": 100, "output_len": 4, "mm_inputs": images}]})


def test_synthetic_images_are_drawn_last_and_grow_the_prompt():
    plain = build(SYNTHETIC)
    images = build({**SYNTHETIC, "multimodal": {"tokens_per_image": 256, "fraction": 0.5, "images": 2,
                                                "offset": 32}})
    assert [r.arrival for r in plain] == [r.arrival for r in images]  # every other draw unchanged
    carrying = [r for r in images if r.mm_inputs]
    assert 70 <= len(carrying) <= 130
    for before, after in zip(plain, images):
        if after.mm_inputs:
            start = min(32, before.prompt_len)
            assert after.mm_inputs == ((start, 256), (start + 256, 256))
            assert after.prompt_len == before.prompt_len + 512
        else:
            assert after.prompt_len == before.prompt_len


def test_synthetic_images_only_beside_synthetic_sources():
    with pytest.raises(ConfigError, match="multimodal"):
        parse_workload({"requests": [{"arrival": 0, "prompt_len": 1, "output_len": 1}],
                        "multimodal": {"tokens_per_image": 4}})
    with pytest.raises(ConfigError, match="tokens_per_image"):
        parse_workload({**SYNTHETIC, "multimodal": {"fraction": 0.5}})
    with pytest.raises(ConfigError, match="fraction"):
        parse_workload({**SYNTHETIC, "multimodal": {"tokens_per_image": 4, "fraction": 0}})


@pytest.mark.parametrize("cell, expected", [
    ("[[3, 5], [10, 2]]", ((3, 5), (10, 2))), ("3:5 10:2", ((3, 5), (10, 2))), ([[0, 4]], ((0, 4),)),
    ("", None), (None, None), (float("nan"), None), ([], None)])
def test_trace_cells(cell, expected):
    assert parse_mm_inputs(cell, "trace (line 2).mm_inputs") == expected


@pytest.mark.parametrize("cell", ["3-5", "[[3, 5], [4, 1]]", "[3, 5]", "x:y", 7])
def test_bad_trace_cells_name_the_line(cell):
    with pytest.raises(ConfigError, match=r"trace \(line 2\)\.mm_inputs"):
        parse_mm_inputs(cell, "trace (line 2).mm_inputs")


def test_trace_rows_keep_their_images_through_filters():
    trace = _rows("t", [0.0, 1.0, 2.0], [100, float("nan"), 50], [4, 4, 4],
                  mm_inputs=[((0, 10),), ((0, 1),), None])
    assert trace.mm_inputs == [((0, 10),), None]  # the unreadable middle row dropped with its images


def test_a_system_prompt_in_front_moves_a_traces_images_back(monkeypatch, tmp_path):
    """Until the generic readers fill TraceData.mm_inputs (workloads/datasets.py), a trace's images are
    checked through build: shared_prefix puts 64 tokens in front, the images move back by 64."""
    import cbsim.workloads.build as build_module

    trace = _rows("t", [0.0, 1.0], [100, 50], [4, 4], mm_inputs=[((10, 20),), None])
    monkeypatch.setattr(build_module, "load_trace", lambda *a, **k: trace)
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_len,output_len\n0,100,4\n1,50,4\n")
    reqs = build({"trace": {"format": "generic_csv", "path": str(path)},
                  "shared_prefix": {"mode": "system_prompts", "num_prefixes": 1, "prefix_len": 64}})
    assert [r.mm_inputs for r in reqs] == [((74, 20),), None] and reqs[0].prompt_len == 164


def test_synthetic_adapter_mix_is_drawn_last():
    plain = build(SYNTHETIC)
    mixed = build({**SYNTHETIC, "adapters": {"x": 2, "y": 1, "base": 1}})
    assert [(r.arrival, r.prompt_len) for r in plain] == [(r.arrival, r.prompt_len) for r in mixed]
    counts = {a: sum(r.adapter == a for r in mixed) for a in ("x", "y", None)}
    assert sum(counts.values()) == 200 and 70 <= counts["x"] <= 130 and counts[None] > 20
    with pytest.raises(ConfigError, match="adapters.x"):
        parse_workload({**SYNTHETIC, "adapters": {"x": 0}})
