"""A generic trace's `mm_inputs` column reaches the requests (workloads/datasets.py -> multimodal.py)."""
from __future__ import annotations

import numpy as np
import pytest

from cbsim.core.errors import ConfigError
from cbsim.workloads import build_run, parse_workload

CSV = 'arrival_s,prompt_len,output_len,mm_inputs\n0.0,1000,10,"[[10, 576]]"\n0.5,300,10,\n1.0,2000,10,5:576 700:576\n'
JSONL = ('{"arrival_s": 0, "prompt_len": 800, "output_len": 5, "mm_inputs": [[0, 576]]}\n'
         '{"arrival_s": 1, "prompt_len": 80, "output_len": 5}\n')


def images(tmp_path, name: str, text: str, fmt: str) -> list:
    path = tmp_path / name
    path.write_text(text)
    run = build_run(parse_workload({"trace": {"format": fmt, "path": str(path)}}), np.random.default_rng(0))
    return [r.mm_inputs for r in run.requests]


def test_csv_images_reach_each_request_in_both_cell_forms(tmp_path):
    assert images(tmp_path, "t.csv", CSV, "generic_csv") == [((10, 576),), None, ((5, 576), (700, 576))]


def test_jsonl_images_reach_each_request(tmp_path):
    assert images(tmp_path, "t.jsonl", JSONL, "generic_jsonl") == [((0, 576),), None]


@pytest.mark.parametrize("cell, expected", [
    ('"[[10, 576]]"', "placeholder within the prompt of 100 tokens"),
    ("x:y", "offset:length"),
    ('"[[20, 5], [10, 5]]"', "sorted"),
])
def test_a_bad_images_cell_names_the_file_line_and_column(tmp_path, cell, expected):
    with pytest.raises(ConfigError) as err:
        images(tmp_path, "bad.csv", f"arrival_s,prompt_len,output_len,mm_inputs\n0.0,100,10,{cell}\n", "generic_csv")
    message = str(err.value)
    assert "bad.csv" in message and "(line 2).mm_inputs" in message and expected in message
