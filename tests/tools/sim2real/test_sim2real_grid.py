"""`cbsim sim2real grid` without an engine: the plumbing (one engine per max_num_batched_tokens, the rate
set in each point's workload), the Kendall tau arithmetic, and the committed CPU result's own taus."""
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from cbsim.cli.app import app
from cbsim.tools.sim2real import grid
from factories import assert_user_error
from paths import ROOT

EXPERIMENTS = ROOT / "experiments" / "sim2real"
RECORDED = ROOT / "docs" / "howto" / "sim2real-cpu" / "grid.json"


def _point(budget, rate, measured, predicted):
    metrics = {k: {"measured": m, "measured_repeats": [m, m * 1.1], "predicted": p, "error": p / m - 1,
                   "spread": 0.1, "same_run": p} for k, m, p in zip(grid.GRID_KEYS, measured, predicted)}
    return {"max_num_batched_tokens": budget, "rate": rate, "metrics": metrics}


def test_tau_is_one_when_the_ranks_agree_and_minus_one_when_reversed():
    up = [_point(128, r, [r, r, r], [2 * r, 2 * r, 3 * r]) for r in (1, 2, 3, 4)]
    down = [_point(128, r, [r, r, r], [5 - r, 5 - r, 5 - r]) for r in (1, 2, 3, 4)]
    assert all(grid.rank_agreement(up)[k]["predicted"]["tau"] == pytest.approx(1) for k in grid.GRID_KEYS)
    assert all(grid.rank_agreement(up)[k]["meets_target"] for k in grid.GRID_KEYS)
    assert all(grid.rank_agreement(down)[k]["predicted"]["tau"] == pytest.approx(-1) for k in grid.GRID_KEYS)
    assert all(grid.rank_agreement(up)[k]["between_repeats"]["tau"] == pytest.approx(1) for k in grid.GRID_KEYS)


def _pairs_tau(a, b):
    """Kendall's tau-a by counting pairs (no ties): (concordant - discordant) / pairs."""
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += np.sign(a[i] - a[j]) * np.sign(b[i] - b[j])
    return s / (n * (n - 1) / 2)


def test_the_committed_cpu_grid_holds_the_taus_of_its_own_points():
    report = json.loads(RECORDED.read_text())
    assert len(report["points"]) == len(report["max_num_batched_tokens"]) * len(report["rates"]) == 9
    for key in grid.GRID_KEYS:
        measured = [p["metrics"][key]["measured"] for p in report["points"]]
        predicted = [p["metrics"][key]["predicted"] for p in report["points"]]
        tau = report["kendall_tau"][key]["predicted"]["tau"]
        assert tau == pytest.approx(grid.rank_agreement(report["points"])[key]["predicted"]["tau"])
        assert tau == pytest.approx(_pairs_tau(measured, predicted))
        assert report["kendall_tau"][key]["meets_target"] == (tau >= 0.9)


class FakeEngines:
    started: list = []

    def __init__(self, say=print):
        pass

    def get(self, flags):
        FakeEngines.started.append(flags.max_num_batched_tokens)
        return type("Real", (), {"flags": flags})()

    def close(self):
        pass


def test_the_grid_starts_one_engine_per_budget_and_sets_each_rate(monkeypatch, tmp_path):
    served = []

    def serve(real, name, meta, requests, fit, repeats, folder):
        rate = meta["workload"]["arrival"]["rate"]
        served.append((real.flags.max_num_batched_tokens, rate, len(requests), requests[-1].arrival))
        budget = real.flags.max_num_batched_tokens
        value = 1.0 / budget + rate  # any numbers: the point is where they land
        return {"metrics": {k: {"measured": value, "measured_repeats": [value] * repeats, "predicted": value,
                                "error": 0.0, "spread": 0.0} for k in grid.GRID_KEYS},
                "same_run": {}}, None

    monkeypatch.setattr(grid, "Engines", FakeEngines)
    monkeypatch.setattr(grid, "calibrate", lambda engines, path, flags, out, say: ({"engine": {}}, {}))
    monkeypatch.setattr(grid, "serve_and_predict", serve)
    FakeEngines.started = []
    report = grid.run_grid(EXPERIMENTS / "grid.yaml", EXPERIMENTS / "calibration.yaml", grid.EngineFlags(),
                           [128, 512], [0.5, 4.0], 2, tmp_path, say=lambda _: None)
    assert FakeEngines.started == [128, 512]
    assert [s[:3] for s in served] == [(128, 0.5, 16), (128, 4.0, 16), (512, 0.5, 16), (512, 4.0, 16)]
    assert served[0][3] > 4 * served[1][3]  # the same requests, arriving 8x slower
    assert report["kendall_tau"]["e2e_mean"]["predicted"]["tau"] == pytest.approx(1)
    assert "| 512 | 4 |" in (tmp_path / "grid.md").read_text()
    assert json.loads((tmp_path / "grid.json").read_text())["points"] == report["points"]


@pytest.mark.parametrize("option, value", [("--mnbt", "128"), ("--rates", "1,x"), ("--mnbt", "0,128")])
def test_a_grid_of_fewer_than_two_good_values_is_a_user_error(option, value, tmp_path):
    args = ["sim2real", "grid", "--workload", "w.yaml", "--calibration", "c.yaml", "--out", str(tmp_path), option, value]
    assert_user_error(CliRunner().invoke(app, args), option, "two or more comma-separated")


def test_a_workload_without_a_rate_cannot_be_gridded(tmp_path):
    from cbsim.core.errors import ConfigError
    from cbsim.tools.sim2real.workload import with_rate

    with pytest.raises(ConfigError, match=r"w.yaml: workload.arrival: expected an arrival with a rate"):
        with_rate({"arrival": "all_at_once"}, 1.0, tmp_path / "w.yaml")


@pytest.mark.xfail(strict=True, reason="measured on the shared 2-core machine (docs/howto/sim2real-cpu/grid.json): "
                   "tau E2E -0.06, TTFT 0.39, TPOT -0.33; the machine's speed drifted between the grid's runs "
                   "(same-run calibration: 0.94 / 0.83 / 1.00; the measurement against itself, between repeats: "
                   "0.78 / 0.67 / 0.83, under the 0.9 target too)")
def test_the_committed_cpu_grid_meets_the_rank_agreement_target():
    report = json.loads(RECORDED.read_text())
    assert all(report["kendall_tau"][key]["meets_target"] for key in grid.GRID_KEYS)
