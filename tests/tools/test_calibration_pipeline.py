"""End to end on CPU: simulate -> sample step shapes -> profile (grid + those held-out shapes) -> fit
-> costcheck -> run an experiment on the fitted profile, with and without seeded cost noise."""
import json

import pytest
from typer.testing import CliRunner

from cbsim.api import run_experiment
from cbsim.cli.app import app

pytest.importorskip("torch")
runner = CliRunner()

SIM = {
    "name": "shapes", "seed": 2, "model": "tiny", "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1},
    "cluster": {"kv_cache": {"num_blocks": 200}},
    "policy": {"name": "sarathi", "token_budget": 64},
    "workload": {"num_requests": 30, "arrival": {"type": "poisson", "rate": 50.0},
                 "prompt_len": {"type": "uniform", "min": 8, "max": 200},
                 "output_len": {"type": "uniform", "min": 2, "max": 30}},
    "output": {"plots": False, "trace": False, "shapes": 6},
}


def test_profile_fit_costcheck_and_run_on_the_fit(tmp_path):
    sim = run_experiment(SIM, out_dir=tmp_path / "sim")
    shapes = tmp_path / "sim" / "shapes.jsonl"
    assert len(shapes.read_text().splitlines()) == 6 and len(sim.shapes) == 6

    prof = tmp_path / "prof"
    result = runner.invoke(app, ["profile", "--device", "cpu", "--model", "tiny", "--backend", "sdpa", "--grid",
                                 "tiny", "--out", str(prof), "--batches", str(shapes), "--threads", "1"])
    assert result.exit_code == 0, result.output
    profile = tmp_path / "tiny.json"
    result = runner.invoke(app, ["fit", str(prof / "measurements.csv"), "--out", str(profile), "--num-layers", "2"])
    assert result.exit_code == 0, result.output
    fitted = json.loads(profile.read_text())
    assert fitted["type"] == "fitted" and fitted["validation"] and fitted["format"] == 2
    selection = fitted["provenance"]["tile_selection"]  # CPU timings have no GEMM tile steps to speak of
    assert selection["candidates"] == ["none", "64", "128", "256"]
    assert selection["chosen"] == ("none" if fitted["tile"] is None else str(fitted["tile"]))
    assert f"tile {selection['chosen']} (of none, 64, 128, 256)" in result.output

    result = runner.invoke(app, ["costcheck", str(profile), str(prof / "measurements.csv"),
                                 "--out", str(tmp_path / "scatter.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "scatter.png").stat().st_size > 0 and "median" in result.output.lower()

    experiment = {**SIM, "cost_model": {"type": "fitted", "profile": str(profile)},
                  "output": {"plots": False, "trace": False}}
    plain = run_experiment(experiment)
    assert plain.summary["num_finished"] == 30 and plain.summary["makespan"] > 0
    noisy_a = run_experiment({**experiment, "sim": {"cost_noise": True}})
    noisy_b = run_experiment({**experiment, "sim": {"cost_noise": True}})
    assert noisy_a.steps["duration"].tolist() == noisy_b.steps["duration"].tolist()  # seeded
    assert noisy_a.steps["duration"].tolist() != plain.steps["duration"].tolist()
