"""The prediction band (cbsim/band.py, `metrics.band`, `run --band`, `compare --band`): the run again at
the low and high step-time factor. At factor 1 it is the run itself, bit for bit; near the knee the band
is far wider than the step-time factor (a queue), far from it about as wide; a fitted model's interval
comes from its residuals; a bad band is a one-line error before anything is simulated."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from cbsim.api import run_experiment
from cbsim.band import BANDED, band_overrides, scaled_config
from cbsim.cli.app import app
from cbsim.config import load_config
from cbsim.core.errors import ConfigError
from cbsim.sim.costmodels.fitted import FittedCostModel
from cbsim.sim.costmodels.registry import load_cost_model
from cbsim.sim.metrics.knee import knee_note
from cbsim.sim.metrics.summary_units import schema_markdown, unit_of
from cbsim.tools.compare.compare import compare
from cbsim.tools.compare.measured import MeasuredRun

from test_knee import RUN as KNEE_RUN

runner = CliRunner()
PROFILE = "a100-llama-2-70b-tp2-published.json"  # shipped, with out-of-fold residuals
RUN = {**KNEE_RUN, "name": "band", "workload": {**KNEE_RUN["workload"], "num_requests": 300}}  # test_knee's run


def with_band(config: dict, rate: float | None = None, **band) -> dict:
    workload = config["workload"] if rate is None else {**config["workload"],
                                                        "arrival": {"type": "poisson", "rate": rate}}
    return {**config, "workload": workload, "metrics": {"band": band}}


@pytest.mark.parametrize("engine", [None, "sglang", "trtllm", {"preset": "vllm-v1", "kernel_scale": 1.1}])
def test_a_band_at_factor_one_is_the_run_itself(engine):
    config = {**RUN, "cost_model": {**RUN["cost_model"], **({} if engine is None else {"engine": engine})}}
    base = run_experiment(config).summary
    band = run_experiment(with_band(config, step_scales=[1.0, 1.0])).summary
    for key in BANDED:
        assert band[f"{key}_low"] == band[f"{key}_high"] == base[key]


def test_the_band_scales_the_kernels_and_not_the_host():
    cfg = load_config(with_band(RUN, step_scales=[0.5, 2.0]))
    low = scaled_config(cfg, {"cluster": 0.5})
    assert low.cost_model["engine"]["kernel_scale"] == 0.5 and not low.metrics.band.is_set()
    assert low.cost_model["engine"]["host_per_step_s"] == 126.0e-6  # vllm-v1's, unscaled
    calibrated = scaled_config(load_config({**RUN, "cost_model": {**RUN["cost_model"], "engine": {
        "preset": "vllm-v1", "kernel_scale": 1.2}}}), {"cluster": 2.0})
    assert calibrated.cost_model["engine"]["kernel_scale"] == pytest.approx(2.4)  # on top of the calibrated factor


def test_near_the_knee_the_band_is_wider_than_the_step_time():
    light = run_experiment(with_band(RUN, step_scales=[0.9, 1.1])).summary
    near = run_experiment(with_band(RUN, 1.1 * light["capacity_requests_per_s"], step_scales=[0.9, 1.1])).summary
    assert 0.9 < near["load_vs_capacity"] < 1.0  # within 10 % of the knee (the sample's arrival span)
    light_width = light["ttft_p50_high"] / light["ttft_p50_low"]
    near_width = near["ttft_p50_high"] / near["ttft_p50_low"]
    assert 1.0 < light_width < 1.5  # far from the knee: about the step time's 1.1 / 0.9
    assert near_width > 3 * light_width  # near it the queue amplifies the same uncertainty
    assert near["ttft_p50_low"] <= near["ttft_p50"] <= near["ttft_p50_high"]
    assert near["load_vs_capacity_low"] < near["load_vs_capacity"] < near["load_vs_capacity_high"]
    note = knee_note(near)
    assert "TTFT p50 is [" in note and "x0.9 .. x1.1" in note


def test_a_fitted_profile_gives_its_residual_interval():
    model = load_cost_model({"type": "fitted", "profile": PROFILE}, None)
    assert isinstance(model, FittedCostModel)
    low, high = model.interval_factors(0.9)
    assert low < 1 < high and model.interval_factors(0.5)[1] < high  # a narrower interval is narrower
    config = {**RUN, "model": "llama-2-70b", "cost_model": {"type": "fitted", "profile": PROFILE},
              "cluster": {"tp": 2}, "workload": {**RUN["workload"], "num_requests": 100}}
    summary = run_experiment(with_band(config, interval=0.9)).summary
    assert (summary["band_step_scale_low"], summary["band_step_scale_high"]) == (low, high)
    assert "interval 0.9" in summary["band_source"]
    assert summary["e2e_p50_low"] < summary["e2e_p50"] < summary["e2e_p50_high"]


def test_bad_bands_are_refused_before_simulating():
    with pytest.raises(ConfigError, match="metrics.band.interval.*fitted cost model"):
        run_experiment(with_band(RUN, interval=0.9))  # a roofline has no residuals
    with pytest.raises(ConfigError, match="engine none prices the kernels alone"):
        run_experiment(with_band({**RUN, "cost_model": {**RUN["cost_model"], "engine": "none"}},
                                 step_scales=[0.9, 1.1]))
    with pytest.raises(ConfigError, match="cost model with an engine"):
        run_experiment(with_band({**RUN, "cost_model": {"type": "linear", "base": 0.01, "per_token": 1e-4}},
                                 step_scales=[0.9, 1.1]))
    for bad in ({"step_scales": [1.1, 1.2]}, {"step_scales": [0.9]}, {"interval": 1.0},
                {"interval": 0.9, "step_scales": [0.9, 1.1]}):
        with pytest.raises(ConfigError, match="metrics.band"):
            load_config(with_band(RUN, **bad))
    with pytest.raises(ConfigError, match="--band"):
        band_overrides("1.2")
    assert band_overrides("0.9") == ["metrics.band.interval=0.9", "metrics.band.step_scales=null"]
    assert band_overrides(" 0.8, 1.25") == ["metrics.band.step_scales=[0.8, 1.25]", "metrics.band.interval=null"]


def test_run_and_compare_print_the_band(tmp_path):
    exp = tmp_path / "exp.json"  # JSON is YAML
    exp.write_text(json.dumps(RUN))
    result = runner.invoke(app, ["run", str(exp), "--out", str(tmp_path / "r"), "--band", "0.9,1.1", "-q"])
    assert result.exit_code == 0, result.output
    assert "ttft_p50" in result.stdout and " .. " in result.stdout and "band " in result.stdout
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["band_step_scale_high"] == 1.1
    bad = runner.invoke(app, ["run", str(exp), "--out", str(tmp_path / "s"), "--band", "0.9", "-q"])
    assert bad.exit_code == 2 and "metrics.band.interval" in bad.output and not (tmp_path / "s").exists()
    measured = MeasuredRun({"ttft_p50": 1e-6, "e2e_p50": 1.0}, source="bench")
    compared = compare(with_band(RUN, step_scales=[0.9, 1.1]), measured).to_dict()
    assert compared["meta"]["band"].startswith("step_scales")
    assert compared["ttft_p50"]["measured_in_band"] is False
    assert compared["ttft_p50"]["simulated_low"] < compared["ttft_p50"]["simulated_high"]


def test_the_band_keys_are_documented():
    assert unit_of("ttft_p50_low") == "s" and unit_of("capacity_requests_per_s_high") == "requests/s"
    assert unit_of("band_step_scale_low") == "factor" and unit_of("load_vs_capacity") == "ratio"
    assert "`<key>_low`, `<key>_high`" in schema_markdown() and "`band_source`" in schema_markdown()


def test_compare_table_has_a_band_column():
    from cbsim.cli.compare import format_table
    from cbsim.tools.compare.compare import Row

    rows = {"ttft_p50": Row(0.5, 0.1, 4.0), "e2e_p50": Row(2.0, 2.1, 0.05)}
    table = format_table(rows, {"ttft_p50": (0.08, 0.3), "e2e_p50": (1.9, 2.4)})
    ttft, e2e = (next(line for line in table.splitlines() if line.startswith(name)) for name in ("ttft_p50", "e2e_p50"))
    assert "80 .. 300 *" in ttft and e2e.endswith("1900 .. 2400") and "band (ms)" in table
    assert "band" not in format_table(rows)


def test_a_pd_run_scales_both_pools():
    small = ["workload.num_requests=120", "output.plots=false", "output.trace=false"]
    base = run_experiment("experiments/pd_vs_colocated.yaml", overrides=small).summary
    same = run_experiment("experiments/pd_vs_colocated.yaml", overrides=small + ["metrics.band.step_scales=[1,1]"]).summary
    assert same["ttft_p50_low"] == same["ttft_p50_high"] == base["ttft_p50"]
    wide = run_experiment("experiments/pd_vs_colocated.yaml", overrides=small + ["metrics.band.step_scales=[0.9,1.2]"])
    cfg = scaled_config(wide.config, {"prefill": 2.0, "decode": 3.0})
    assert cfg.cluster.prefill.cost_model["engine"]["kernel_scale"] == 2.0
    assert cfg.cluster.decode.cost_model["engine"]["kernel_scale"] == 3.0
    assert wide.summary["ttft_p50_low"] < base["ttft_p50"] < wide.summary["ttft_p50_high"]
