"""`cbsim tune` with pipeline-parallel candidates (listed in the tune file; the defaults stay TP degrees):
a {tp, pp} candidate runs tp x pp GPUs per replica, is ranked per GPU like the others, shows in the
table, and its engine flags carry the stages and resolve back; bad shapes name the key."""
from __future__ import annotations

import pandas as pd
import pytest
import yaml

from cbsim.core.errors import ConfigError
from cbsim.server import apply_server
from cbsim.tools.tune.tune import run_tune
from cbsim.tools.tune.flags import flags_text
from cbsim.tools.tune.report import write_outputs

BASE = {
    "name": "tiny_pp", "model": "llama-3-8b", "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1},
    "policy": {"name": "sarathi", "token_budget": 512, "max_num_seqs": 64},
    "workload": {"num_requests": 30, "arrival": {"type": "poisson", "rate": 10.0},
                 "prompt_len": {"type": "uniform", "min": 64, "max": 600},
                 "output_len": {"type": "uniform", "min": 8, "max": 40}},
    "output": {"plots": False, "trace": False},
}
SKIP = {name: [] for name in ("policy", "token_budget", "max_num_seqs", "chunk_size", "partial_prefills",
                              "admission", "queue_policy", "pd")}


def write_tune(folder, parallelism, gpus=2):
    (folder / "base.yaml").write_text(yaml.safe_dump(BASE))
    spec = {"name": "pp_tune", "base": "base.yaml", "slo": {"ttft_p99": 2.0, "itl_p99": 0.2},
            "gpus": {"count": gpus}, "search": {"lo": 2.0, "rel_tol": 0.25, "seeds": [0]},
            "stages": {"parallelism": parallelism, **SKIP}}
    path = folder / "tune.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_a_pipeline_candidate_is_searched_on_its_gpus_and_its_flags_resolve_back(tmp_path):
    result = run_tune(write_tune(tmp_path, [1, {"tp": 1, "pp": 2}]), tmp_path / "out", workers=1)
    outcome = result.stages[0]
    assert outcome.stage.name == "parallelism" and [c.label for c in outcome.candidates] == ["tp1", "tp1 pp2"]
    plain, piped = (c.point.config for c in outcome.candidates)
    assert (plain.cluster.replicas, plain.cost_model.get("pp", 1)) == (2, 1)
    assert (piped.cluster.replicas, piped.cost_model["pp"]) == (1, 2)
    assert all(c.record["num_gpus"] == 2 and c.record["status"] == "ok" for c in outcome.candidates)
    files = write_outputs(result, tmp_path / "out", plots=False)
    table = pd.read_parquet(files["table"])
    assert sorted(table["pp"].tolist()) == [1, 2]
    text = flags_text(piped)
    command = next(line for line in text.splitlines() if line.startswith("vllm serve"))
    assert "--pipeline-parallel-size 2" in command
    _, resolution = apply_server({"cost_model": dict(piped.cost_model),
                                  "server": {"engine": "vllm", "args": command.split("MODEL", 1)[1]}})
    assert resolution.settings["cost_model.pp"] == 2 and "cost_model.pp" in resolution.explicit


@pytest.mark.parametrize("candidate, key", [
    ({"tp": 2, "pp": 2}, "stages.parallelism[0]"),  # 4 GPUs a replica on a budget of 2
    ({"tp": 1, "pp": 0}, "stages.parallelism[0].pp"),
    ({"tp": 1, "stages": 2}, "stages.parallelism[0].stages"),
])
def test_bad_pipeline_candidates_name_the_key(tmp_path, candidate, key):
    with pytest.raises(ConfigError) as err:
        run_tune(write_tune(tmp_path, [candidate]), tmp_path / "out", workers=1)
    assert err.value.path == key
