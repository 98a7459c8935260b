"""Calibration that can correct kernels (issue 28): the per-class kernel factors in the roofline (1.0 is
bit for bit the uncorrected price, each factor scales its class linearly, other cost models refuse
them), their recovery by `calibrate --steps`, the identification report (refused, confounded, dropped),
one-line errors on a degenerate fit, the term sets of --fit-kernel-scale, the serving fit of a factor
(bounded: no abort at 0), and the warnings outside a calibration's domain."""
from __future__ import annotations

import dataclasses
import json
import warnings

import numpy as np
import pytest
from typer.testing import CliRunner

from cbsim.api import run_experiment
from cbsim.cli.app import app
from cbsim.cli.calibrate import _fit_names
from cbsim.core.errors import ConfigError
from cbsim.profiler.converters.step_table import MeasuredStep
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.costmodels.domain import ExtrapolationWarning, outside
from cbsim.sim.costmodels.engine import CLASS_TERMS, EngineTerms
from cbsim.sim.shape import StepShape
from cbsim.tools.calibrate.steps import DEFAULT_FIT, calibrate_steps
from test_engine import TINY

LLAMA = model_spec("llama-2-70b")
SHAPES = [StepShape.from_batch(decode=[600 + 50 * b] * b) for b in (1, 4, 16, 64)] + \
         [StepShape.from_batch(prefill=[(p, 0)] * b) for p in (128, 1024, 4096) for b in (1, 4)] + \
         [StepShape.from_batch(prefill=[(512, 2048)], decode=[3000] * 32)]


def roofline(tp: int = 2, model=LLAMA, **engine):
    return load_cost_model({"type": "roofline", "gpu": "a100", "tp": tp, "engine": engine}, model)  # {}: a zero engine


def test_factor_one_prices_bit_for_bit_and_each_factor_is_linear():
    plain, ones = roofline(), roofline(**{name: 1.0 for name in CLASS_TERMS})
    contexts = np.array([500, 900, 1300])
    assert np.array_equal(plain.decode_run_times(contexts, 50), ones.decode_run_times(contexts, 50))
    for shape in SHAPES:
        base = ones.step_time(shape)
        assert plain.step_time(shape) == base
        for name in ("gemm_scale", "attention_scale", "collective_scale"):
            one, two, three = (roofline(**{name: f}).step_time(shape) for f in (1.0, 2.0, 3.0))
            assert two > one and three - two == pytest.approx(two - one, rel=1e-9), name
        assert roofline(moe_scale=3.0).step_time(shape) == base  # a dense model has no experts
        assert roofline(1, collective_scale=3.0).step_time(shape) == roofline(1).step_time(shape)  # no all-reduce
    mixtral = model_spec("mixtral-8x7b")
    shape = SHAPES[1]
    assert roofline(2, mixtral, moe_scale=2.0).step_time(shape) > roofline(2, mixtral).step_time(shape)


def test_cost_models_that_do_not_split_classes_refuse_the_factors():
    with pytest.raises(ConfigError, match="gemm_scale"):
        load_cost_model({"type": "vidur", "gpu": "a100", "tp": 2, "model": "llama-2-70b",
                         "engine": {"gemm_scale": 0.9}}, LLAMA)
    for name in ("gemm_scale", "kernel_scale"):
        with pytest.raises(ConfigError, match=name):
            EngineTerms(**{name: 0.0}).validate()


def synthetic(truth: dict, tps=(2, 8)) -> list[MeasuredStep]:
    steps = []
    for tp in tps:
        cost = roofline(tp, **truth)
        steps += [MeasuredStep(shape, cost.step_time(shape), tp=tp, gpu="a100", model="llama-2-70b")
                  for shape in SHAPES]
    return steps


def test_steps_fit_recovers_class_factors_and_refuses_what_no_row_has():
    truth = {"host_per_step_s": 2e-3, "host_per_seq_s": 40e-6, "gemm_scale": 0.8, "attention_scale": 1.4,
             "collective_scale": 0.6}
    report = calibrate_steps(synthetic(truth), "llama-2-70b", {"type": "roofline", "gpu": "a100"},
                             ("host_per_step_s", "host_per_seq_s", *CLASS_TERMS))
    for name, value in truth.items():
        assert report["terms"][name] == pytest.approx(value, rel=0.02), name
    found = report["identification"]
    assert "moe_scale" in found["refused"] and "moe_scale" not in report["fitted"]
    assert all(t["status"] == "identified" for t in found["terms"].values()), found["terms"]
    assert report["domain"] == {"gpu": ["a100"], "model": ["llama-2-70b"], "tp": [2, 8], "batch": [1, 64],
                                "context": [128, 4096]}
    assert report["errors"]["in_sample"]["all"]["max_abs"] < 1e-3


def test_confounded_terms_are_named_and_dropped_on_request():
    # the launch floor binds only at TP8: TP2 and TP8 see launch + 14 x per-rank cost, never the two apart
    truth = {"host_per_step_s": 1e-3, "launch_per_layer_s": 500e-6}
    steps = synthetic(truth)
    fit = ("host_per_step_s", "launch_per_layer_s", "collective_per_rank_s")
    kept = calibrate_steps(steps, "llama-2-70b", {"type": "roofline", "gpu": "a100"}, fit)
    terms = kept["identification"]["terms"]
    assert terms["collective_per_rank_s"]["status"] == "confounded"
    assert any(line.startswith("collective_per_rank_s: confounded") for line in kept["identification"]["warnings"])
    dropped = calibrate_steps(steps, "llama-2-70b", {"type": "roofline", "gpu": "a100"}, fit, drop_unidentified=True)
    assert dropped["fitted"] == ["host_per_step_s", "launch_per_layer_s"]
    assert "launch_per_layer_s" in dropped["identification"]["refused"]["collective_per_rank_s"]
    assert dropped["terms"]["launch_per_layer_s"] == pytest.approx(500e-6, rel=0.02)


def test_degenerate_fits_are_one_line_errors(tmp_path):
    one = synthetic({})[:1]
    with pytest.raises(ConfigError, match="at least as many measured steps as terms"):
        calibrate_steps(one, "llama-2-70b", {"type": "roofline", "gpu": "a100"}, DEFAULT_FIT)
    with pytest.raises(ConfigError, match="identify"):
        calibrate_steps(one, "llama-2-70b", {"type": "vidur", "gpu": "a100", "model": "llama-2-70b"}, ("gemm_scale",))
    table = tmp_path / "steps.jsonl"
    table.write_text(json.dumps({"decode": [100], "time_s": 0.05, "tp": 2}) + "\n")
    base = tmp_path / "base.yaml"
    base.write_text("model: llama-2-70b\ncost_model: {type: roofline, gpu: a100}\n")
    result = CliRunner().invoke(app, ["calibrate", "--steps", str(table), "--cost-model", str(base),
                                      "--out", str(tmp_path / "e.json")])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and "fit" in result.output


def test_kernel_flags_add_to_the_modes_own_default():
    from cbsim.tools.calibrate.serving import DEFAULT_FIT as SERVING

    assert _fit_names(None, True, False, "serving") == (*SERVING, "kernel_scale")  # frontend_s kept
    assert _fit_names(None, True, False, "steps") == (*DEFAULT_FIT, "kernel_scale")
    assert _fit_names("host_per_step_s", False, True, "serving") == ("host_per_step_s", *CLASS_TERMS)


def test_serving_fit_of_a_kernel_factor_stays_in_range_and_recovers_it():
    from cbsim.config import load_config
    from cbsim.tools.calibrate.serving import calibrate_serving, simulate_metrics
    from cbsim.tools.compare.measured import MeasuredRun

    cfg = load_config(TINY)  # the engine tests' small sarathi run
    sim = simulate_metrics(cfg, {"gemm_scale": 0.7})
    run = MeasuredRun({k: sim[k] for k in ("ttft_mean", "itl_mean", "e2e_mean")}, source="truth")
    report = calibrate_serving([(cfg, run, [])], fit=("gemm_scale", "moe_scale", "collective_scale"), max_evals=40)
    assert report["terms"]["gemm_scale"] == pytest.approx(0.7, rel=0.03)
    assert set(report["identification"]["refused"]) == {"moe_scale", "collective_scale"}
    assert report["domain"] == {"gpu": ["h100"], "model": ["llama-3-8b"], "tp": [1]}


def test_predictions_outside_the_calibrated_domain_warn(tmp_path):
    domain = {"gpu": ["a100"], "model": ["llama-2-70b"], "tp": [2, 8], "batch": [1, 64], "context": [128, 8256]}
    assert outside(domain, gpu="a100", model="llama-2-70b", tp=4, batch=64, context=8000) == []
    assert len(outside(domain, gpu="h100", model="llama-3-8b", tp=1, batch=65, context=9000)) == 5
    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"terms": dataclasses.asdict(EngineTerms(gemm_scale=0.9)), "domain": domain}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_cost_model({"type": "roofline", "gpu": "a100", "tp": 4, "engine": str(path)}, LLAMA)
    with pytest.warns(ExtrapolationWarning, match="gpu h100"):
        load_cost_model({"type": "roofline", "gpu": "h100", "tp": 4, "engine": str(path)}, LLAMA)
    run = {"model": {"config": "llama-2-70b", "max_model_len": 16384}, "cost_model": {"type": "roofline", "gpu": "a100", "tp": 2, "engine": str(path)},
           "workload": {"num_requests": 3, "arrival": {"type": "all_at_once"},
                        "prompt_len": {"type": "fixed", "value": 9000}, "output_len": {"type": "fixed", "value": 4}},
           "output": {"plots": False, "trace": False}}
    with pytest.warns(ExtrapolationWarning, match="context up to 9004"):
        run_experiment(run)


def test_robust_fit_is_not_dragged_by_an_anomalous_step():
    truth = {"host_per_step_s": 2e-3, "host_per_seq_s": 40e-6}
    steps = synthetic(truth)
    steps[0] = dataclasses.replace(steps[0], time_s=steps[0].time_s * 3.0)  # a step that did not fit in memory
    fit = ("host_per_step_s", "host_per_seq_s")
    cost = {"type": "roofline", "gpu": "a100"}
    plain = calibrate_steps(steps, "llama-2-70b", cost, fit)
    robust = calibrate_steps(steps, "llama-2-70b", cost, fit, robust=True)
    assert robust["loss"]["loss"] == "soft_l1" and plain["loss"] == {"loss": "linear"}
    off = {name: abs(report["terms"]["host_per_step_s"] / truth["host_per_step_s"] - 1)
           for name, report in (("plain", plain), ("robust", robust))}
    assert off["robust"] < 0.1 < 1.0 < off["plain"], off


def test_identification_of_a_fit_with_fewer_values_than_terms():
    from cbsim.tools.calibrate.identify import identification, warnings_of

    jac = np.array([[1.0, 0.5, 0.0], [0.0, 1.0, 2.0]])
    found = identification(jac, ("a", "b", "c"), np.ones(3), 0.0, [0.0] * 3, [np.inf] * 3)
    assert "2 measured values for 3 terms" in found["underdetermined"]
    assert {t["status"] for t in found["terms"].values()} == {"confounded"}
    assert warnings_of(found)[0] == found["underdetermined"]
    clean = identification(np.eye(3), ("a", "b", "c"), np.ones(3), 0.0, [0.0] * 3, [np.inf] * 3)
    assert "underdetermined" not in clean and {t["status"] for t in clean["terms"].values()} == {"identified"}
