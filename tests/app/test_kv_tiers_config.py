"""cluster.kv_cache.tiers end to end: validation (one line naming the file and field, exit 2), a run's
summary keys, kv_tiers table and figure, determinism, and the tier off leaving everything as it was."""
import json

import pytest
from typer.testing import CliRunner

from cbsim.api import run_experiment
from cbsim.cli.app import app
from cbsim.config import load_config
from cbsim.core.errors import ConfigError

runner = CliRunner()
CPU = {"name": "cpu", "capacity_gib": 2.5}


def experiment(tiers=None, mode="recompute", **kv):
    """Multi-turn shared prefixes on a small cache, so the GPU evicts and later turns come back."""
    return {"name": "tiers", "seed": 3, "model": "llama-3-8b",
            "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1},
            "cluster": {"kv_cache": {"num_blocks": 300, "prefix_caching": True, "tiers": tiers, **kv}},
            "policy": {"name": "sarathi", "token_budget": 2048, "max_num_seqs": 16},
            "preemption": {"mode": mode},
            "workload": {"num_requests": 120, "arrival": {"type": "poisson", "rate": 8.0},
                         "prompt_len": {"type": "uniform", "min": 100, "max": 400},
                         "output_len": {"type": "fixed", "value": 32},
                         "shared_prefix": {"mode": "multi_turn", "num_prefixes": 12, "prefix_len": 512,
                                           "hash_block_size": 16, "turns": 4, "think_time": 2.0}},
            "output": {"plots": False, "trace": False}}


@pytest.mark.parametrize("tiers,extra,field", [
    ({"levels": [{"name": "ssd", "capacity_gib": 1, "bandwidth_gb_s": 5}]}, {}, "levels[0].name"),
    ({"levels": [{"name": "cpu"}]}, {}, "capacity_gib"),
    ({"levels": [{"name": "cpu", "capacity_gib": 1, "capacity_ratio": 2}]}, {}, "capacity_gib"),
    ({"levels": [CPU, {"name": "ssd", "capacity_gib": 10}]}, {}, "levels[1].bandwidth_gb_s"),
    ({"levels": [CPU, CPU]}, {}, "levels"),
    ({"levels": [CPU], "write_policy": "write_around"}, {}, "write_policy"),
    ({"levels": [CPU]}, {"prefix_caching": False}, "cluster.kv_cache.tiers"),
])
def test_bad_tiers_name_the_field(tmp_path, tiers, extra, field):
    with pytest.raises(ConfigError) as err:
        load_config(experiment(tiers, **extra))
    assert field in str(err.value)
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps(experiment(tiers, **extra)))
    result = runner.invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and "bad.yaml" in result.output and field.split(".")[-1] in result.output
    assert "Traceback" not in result.output


def test_swap_space_and_a_cpu_tier_are_one_budget():
    data = experiment({"levels": [CPU]}, mode="swap")
    data["preemption"]["swap_space_gib"] = 4
    with pytest.raises(ConfigError, match="swap_space_gib"):
        run_experiment(data)


def test_a_run_with_a_cpu_tier_reports_its_hits_and_writes_its_table(tmp_path):
    off = run_experiment(experiment())
    on = run_experiment(experiment({"levels": [CPU]}), tmp_path / "on")
    s = on.summary
    assert s["kv_tier_cpu_restored_tokens"] > 0 and s["prefix_hit_rate"] > off.summary["prefix_hit_rate"]
    assert s["kv_tier_gpu_hit_rate"] + s["kv_tier_cpu_hit_rate"] == pytest.approx(s["prefix_hit_rate"])
    assert 0 < s["kv_tier_cpu_peak_blocks"] <= s["kv_tier_cpu_capacity_blocks"]
    assert "kv_tier_cpu_hit_rate" not in off.summary and off.kv_tiers is None
    assert (on.out_dir / "kv_tiers.parquet").exists() and "restore_wait" not in off.requests
    restored = on.requests["restore_wait"].notna()
    assert restored.any() and (on.requests.loc[restored, "restore_wait"] <= on.requests.loc[restored, "ttft"]).all()
    assert on.kv_tiers["blocks"].max() <= s["kv_tier_cpu_capacity_blocks"]
    again = run_experiment(experiment({"levels": [CPU]}))
    assert again.summary | {"sim_wall_seconds": 0} == s | {"sim_wall_seconds": 0}
    assert again.requests.equals(on.requests)


def test_swap_goes_to_the_cpu_tier_and_a_full_tier_recomputes():
    tiny = run_experiment(experiment({"levels": [{"name": "cpu", "capacity_ratio": 0.01}]}, mode="swap",
                                     watermark=0.0))
    roomy = run_experiment(experiment({"levels": [{"name": "cpu", "capacity_ratio": 4}]}, mode="swap",
                                      watermark=0.0))
    assert tiny.summary["num_preemptions"] > 0 and roomy.summary["num_preemptions"] > 0
    modes = lambda r: set(r.preemptions["mode"]) if r.preemptions is not None and len(r.preemptions) else set()
    assert "swap" in modes(roomy) and "recompute" in modes(tiny)
