"""The fitting half of the profiler: features, fit of F(x), the `fitted` cost model, costcheck, CLI.

Measurements are synthetic: a known layer(x) with multiplicative log-normal noise, written in the
measurement CSV contract (with metadata.json), so the fit's recovery can be checked exactly.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import typer
from typer.testing import CliRunner

from cbsim.errors import ConfigError
from cbsim.profiler import features
from cbsim.profiler.costcheck import costcheck, error_table
from cbsim.profiler.costmodels.fitted import FittedCostModel
from cbsim.profiler.costmodels.cpu_overhead import CpuOverhead
from cbsim.profiler.costmodels.registry import load_cost_model
from cbsim.profiler.fit import fit_profile, load_measurements, select_graph, write_profile
from cbsim.profiler.fit_cli import register
from cbsim.sim.shape import StepShape

# the true layer(x): g(T) piecewise linear with knots 0/64/512/2048, then the linear terms
TRUE_KNOTS = [0.0, 64.0, 512.0, 2048.0]
TRUE_SLOPES = [5e-9, 1e-7, 5e-7, 6e-7]
TRUE = {"pairs": 4e-11, "prefill_kv": 1e-9, "decode_kv": 1.2e-9, "num_decode": 2e-7, "num_prefill": 5e-6, "const": 3e-5}
TRUE_LM = (2e-5, 1e-7)
NOISE = 0.02
LAYERS = 32


def true_layer(shape: StepShape) -> float:
    t, p, kp, kd, nd, npf = features.aggregates(shape)
    g = sum(s * min(max(t - lo, 0.0), hi - lo) for s, lo, hi in zip(TRUE_SLOPES, TRUE_KNOTS, TRUE_KNOTS[1:] + [math.inf]))
    return g + TRUE["pairs"] * p + TRUE["prefill_kv"] * kp + TRUE["decode_kv"] * kd + TRUE["num_decode"] * nd \
        + TRUE["num_prefill"] * npf + TRUE["const"]


def grid_batches(rng) -> list[tuple[str, list, list]]:
    out = []
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        for ctx in (128, 512, 2048, 8192, 32768):
            out.append(("decode", [], [ctx] * b))
            out.append(("decode", [], [int(x) for x in np.maximum(1, rng.lognormal(math.log(ctx), 0.8, b))]))
    for c in (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 8192):
        for h in (0, 1024, 4096, 16384):
            out.append(("prefill", [(c, h)], []))
        out.append(("prefill", [(c, 0), (max(1, c // 2), 2048)], []))
    for c in (128, 256, 512, 1024, 2048):
        for b in (8, 32, 128):
            out.append(("mixed", [(c, 1024)], [1024] * b))
            out.append(("mixed", [(c, 0), (64, 4096)], [4096] * b))
    for c in (1024, 4096):
        for h in (32768, 65536, 100000):
            out.append(("long", [(c, h)], []))
    return out


def heldout_batches(rng, n: int = 80) -> list[tuple[str, list, list]]:
    out = []
    for i in range(n):
        kind = ("decode", "prefill", "mixed", "long")[i % 4]
        if kind == "decode":
            out.append((kind, [], [int(x) for x in rng.integers(50, 20000, int(rng.integers(1, 300)))]))
        elif kind == "prefill":
            out.append((kind, [(int(rng.integers(16, 6000)), int(rng.integers(0, 20000)))], []))
        elif kind == "mixed":
            out.append((kind, [(int(rng.integers(32, 2048)), int(rng.integers(0, 8000)))],
                        [int(x) for x in rng.integers(50, 8000, int(rng.integers(1, 200)))]))
        else:
            out.append((kind, [(int(rng.integers(512, 4096)), int(rng.integers(40000, 120000)))], []))
    return out


def write_synthetic(tmp_path, seed: int = 0, noise: float = NOISE):
    """A measurement CSV + metadata.json from the true model; returns the CSV path."""
    rng = np.random.default_rng(seed)
    batches = [("grid", b) for b in grid_batches(rng)] + [("heldout", b) for b in heldout_batches(rng)]
    batches += [("anchor", ("decode", [], [1024] * 16))] * 5
    rows = []
    for i, (source, (cls, prefill, decode)) in enumerate(batches):
        shape = StepShape.from_batch(prefill, decode)
        agg = features.aggregates(shape)
        y = true_layer(shape) * math.exp(rng.normal(0.0, noise))
        rows.append({
            "batch_id": i, "cls": cls, "source": source,
            "prefill": ";".join(f"{c}:{h}" for c, h in prefill), "decode": ";".join(str(x) for x in decode),
            "num_prefill_tokens": shape.num_prefill_tokens, "num_decode": agg.num_decode, "num_tokens": agg.tokens,
            "sum_c": shape.num_prefill_tokens, "sum_c2": sum(c * c for c, _ in prefill),
            "sum_ch": sum(c * h for c, h in prefill), "attn_pairs": agg.pairs, "prefill_kv_read": agg.prefill_kv,
            "decode_kv_read": agg.decode_kv, "max_ctx": max([h + c for c, h in prefill] + decode),
            "num_seqs": shape.num_seqs, "layer_s_median": y, "layer_s_p10": y * (1 - noise),
            "layer_s_p90": y * (1 + noise),
            "lm_head_s": (TRUE_LM[0] + TRUE_LM[1] * shape.num_seqs) * math.exp(rng.normal(0.0, noise)),
            "graph": 0, "repeats": 10, "flops": 0.0, "bytes": 0.0, "flagged": 0,
        })
    path = tmp_path / "measurements.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    meta = {"gpu": "NVIDIA H200", "model": {"name": "synthetic-8b", "num_layers": LAYERS, "hidden": 4096}}
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fit")
    csv = write_synthetic(tmp)
    frame, meta = load_measurements(csv)
    profile = fit_profile(frame, meta, csv_path=csv)
    path = tmp / "profile.json"
    write_profile(profile, path)
    return {"csv": csv, "frame": frame, "profile": profile, "path": path}


# --- features --------------------------------------------------------------------------------

def test_features_agree_with_step_shape():
    shape = features.shape_of("100:20;7:0", "5;300")
    agg = features.aggregates(shape)
    assert agg.tokens == shape.num_tokens == 109
    assert agg.pairs == shape.attention_pairs
    assert agg.prefill_kv == shape.prefill_kv_read == 127
    assert agg.decode_kv == shape.decode_kv_read == 305
    assert (agg.num_decode, agg.num_prefill) == (2, 2)
    assert features.parse_prefill(float("nan")) == () and features.parse_decode("") == ()
    with pytest.raises(ValueError):
        features.parse_prefill("12")


def test_ramp_basis_reproduces_piecewise_linear_g():
    knots = [0.0, 64.0, 512.0]
    slopes = np.array([1.0, 2.0, 3.0])
    t = np.array([0.0, 10.0, 64.0, 100.0, 512.0, 1000.0])
    g = features.ramp_basis(t, knots) @ slopes
    assert np.allclose(g, [0, 10, 64, 64 + 72, 64 + 896, 64 + 896 + 3 * 488])
    assert np.allclose(features.ramp_values_at_knots(knots, slopes), [0, 64, 960])


def test_choose_knots_needs_data_in_every_segment():
    t = np.r_[np.arange(1, 40), np.full(3, 5000.0)]
    knots = features.choose_knots(t, min_rows=8)
    assert knots[0] == 0.0 and all(k < 40 for k in knots)


def test_derived_column_mismatches_are_counted(synthetic, tmp_path):
    frame = synthetic["frame"].copy()
    assert synthetic["profile"]["provenance"]["derived_column_mismatches"]["attn_pairs"] == 0
    frame.loc[frame.index[:3], "attn_pairs"] = 1.0
    prof = fit_profile(frame, {"model": {"num_layers": LAYERS}})
    assert prof["provenance"]["derived_column_mismatches"]["attn_pairs"] == 3


def test_graph_rows_are_preferred_per_batch():
    frame = pd.DataFrame({"batch_id": [0, 0, 1], "graph": [0, 1, 0], "layer_s_median": [2.0, 1.0, 3.0]})
    assert select_graph(frame, "prefer")["layer_s_median"].tolist() == [1.0, 3.0]
    assert select_graph(frame, "eager")["layer_s_median"].tolist() == [2.0, 3.0]


# --- the fit ---------------------------------------------------------------------------------

def test_fit_recovers_the_true_model(synthetic):
    prof = synthetic["profile"]
    coef = prof["coefficients"]
    for name in ("pairs", "decode_kv"):
        assert coef[name] == pytest.approx(TRUE[name], rel=0.05), name
    model = FittedCostModel(prof)
    rng = np.random.default_rng(7)
    errors = [model.layer_time(s) / true_layer(s) - 1 for _, p, d in heldout_batches(rng, 200)
              for s in [StepShape.from_batch(p, d)]]
    errors = np.abs(errors)
    assert np.median(errors) < 0.01 and np.quantile(errors, 0.9) < 0.025
    assert prof["lm_head"]["per_row"] == pytest.approx(TRUE_LM[1], rel=0.1)
    assert prof["lm_head"]["const"] == pytest.approx(TRUE_LM[0], rel=0.1)


def test_profile_records_validation_and_provenance(synthetic):
    prof = synthetic["profile"]
    assert prof["type"] == "fitted" and prof["num_layers"] == LAYERS and prof["tp"] == 1
    assert prof["gpu"] == "NVIDIA H200" and prof["model"] == "synthetic-8b"
    val = prof["validation"]
    assert val["basis"] == "heldout"
    assert list(val["layer_error"]) == ["decode", "prefill", "mixed", "long", "overall"]
    overall = val["layer_error"]["overall"]
    assert overall["n"] == 80 and overall["median_abs"] < 0.03 and abs(overall["bias"]) < 0.01
    assert val["noise_floor"]["anchor_rows"] == 5
    assert 0.8 <= val["interval_90_coverage"] <= 1.0
    pv = prof["provenance"]
    assert len(pv["csv_sha256"]) == 64 and pv["rows"]["grid_fitted"] == pv["rows"]["source_grid"]
    q = prof["residuals"]["quantiles"]
    assert q == sorted(q) and q[50] == pytest.approx(0.0, abs=0.01)


def test_kfold_validation_without_heldout_rows(synthetic):
    frame = synthetic["frame"]
    prof = fit_profile(frame[frame["source"] == "grid"], {"model": {"num_layers": LAYERS}}, folds=4)
    assert prof["validation"]["basis"].startswith("4-fold")
    assert prof["validation"]["layer_error"]["overall"]["median_abs"] < 0.03


def test_fit_requires_layer_count(synthetic):
    with pytest.raises(ConfigError, match="num_layers"):
        fit_profile(synthetic["frame"], {})


def test_tp_fit_adds_table_allreduce(synthetic):
    # the measuring half's metadata layout: a TP shard named *-tpN, the GPU under environment
    meta = {"environment": {"gpu": "NVIDIA H200"},
            "model": {"name": "llama-3-70b-tp2", "num_layers": LAYERS, "hidden": 4096}}
    prof = fit_profile(synthetic["frame"], meta)
    assert prof["tp"] == 2 and prof["gpu"] == "NVIDIA H200"
    assert prof["allreduce"]["kind"] == "table" and prof["allreduce"]["node"] == "h100_dgx"
    tp1, tp2 = FittedCostModel(synthetic["profile"]), FittedCostModel(prof)
    shape = StepShape.from_batch([(512, 0)], [1000] * 8)
    assert tp2.step_time(shape) > tp1.step_time(shape)


# --- the fitted cost model -------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [False, True])
def test_decode_runs_are_bit_identical(synthetic, overlap):
    prof = dict(synthetic["profile"])
    prof["allreduce"] = {"kind": "analytic", "num_workers": 2, "per_layer": 2, "bytes_per_token": 8192,
                         "bus_bandwidth": 2e11, "latency_s": 1e-5}
    model = FittedCostModel(prof, cpu_overhead=CpuOverhead(8e-4, 4e-5, overlap))
    rng = np.random.default_rng(3)
    for n in (1, 7, 64, 300):
        ctx = rng.integers(1, 30000, n)
        run = model.decode_run_times(ctx, 40)
        ref = np.array([model.step_time(StepShape(decode=tuple(int(x) + j for x in ctx), tokens_sampled=n))
                        for j in range(40)])
        assert np.array_equal(run, ref)


def test_cpu_overhead_adds_or_overlaps(synthetic):
    shape = StepShape.from_batch([], [500] * 4)
    gpu = FittedCostModel(synthetic["profile"]).step_time(shape)
    serial = FittedCostModel(synthetic["profile"], cpu_overhead=CpuOverhead(1e-3, 1e-4, False)).step_time(shape)
    assert serial == pytest.approx(gpu + 1e-3 + 4e-4)
    hidden = FittedCostModel(synthetic["profile"], cpu_overhead=CpuOverhead(1e-3, 1e-4, True)).step_time(shape)
    assert hidden == pytest.approx(max(gpu, 1.4e-3))
    exposed = FittedCostModel(synthetic["profile"], cpu_overhead=CpuOverhead(1.0, 0.0, True)).step_time(shape)
    assert exposed == 1.0


def test_prediction_interval_contains_most_measurements(synthetic):
    model = FittedCostModel(synthetic["profile"])
    frame = synthetic["frame"]
    held = frame[frame["source"] == "heldout"]
    inside = 0
    for p, d, y in zip(held["prefill"], held["decode"], held["layer_s_median"]):
        shape = features.shape_of(p, d)
        lo, hi = model.prediction_interval(shape, 0.9)
        lm = model.gpu_time(shape) - LAYERS * model.layer_time(shape)
        inside += lo <= LAYERS * y + lm <= hi
        assert lo < model.step_time(shape) < hi
    assert inside / len(held) >= 0.8


def test_sample_factor_follows_residuals(synthetic):
    model = FittedCostModel(synthetic["profile"])
    draws = np.log([model.sample_factor(np.random.default_rng(11)) for _ in range(3)])
    assert len(set(draws)) == 1  # the generator alone decides
    rng = np.random.default_rng(5)
    logs = np.log([model.sample_factor(rng) for _ in range(4000)])
    assert abs(np.median(logs)) < 0.005
    assert 0.5 * NOISE < logs.std() < 2 * NOISE


def test_registry_config_and_errors(synthetic, tmp_path):
    model = load_cost_model({"type": "fitted", "profile": str(synthetic["path"]), "num_layers": 2,
                             "cpu_overhead": {"preset": "vidur-a100-tp1", "overlap": True}}, model=object())
    assert isinstance(model, FittedCostModel) and model.num_layers == 2
    assert model.cpu.per_step == pytest.approx(0.790e-3) and model.cpu.overlap
    assert model.describe()["type"] == "fitted"
    with pytest.raises(ConfigError, match="profile"):
        load_cost_model({"type": "fitted", "profile": str(tmp_path / "nope.json")}, model=object())
    with pytest.raises(ConfigError, match="cpu_overhead.preset"):
        load_cost_model({"type": "fitted", "profile": str(synthetic["path"]), "cpu_overhead": {"preset": "x"}},
                        model=object())


# --- costcheck and CLI -----------------------------------------------------------------------

def test_error_table_statistics():
    table = error_table([1.0, 1.0, 2.0, 2.0], [1.1, 0.9, 2.0, 3.0], ["decode", "decode", "prefill", "prefill"])
    assert table["decode"]["median_abs"] == pytest.approx(0.1) and table["decode"]["bias"] == pytest.approx(0.0)
    assert table["prefill"]["max_abs"] == pytest.approx(0.5) and table["overall"]["n"] == 4


def test_costcheck_on_synthetic_csv(synthetic, tmp_path):
    png = tmp_path / "scatter.png"
    table, text = costcheck(synthetic["path"], synthetic["csv"], out_png=png)
    assert list(table) == ["decode", "prefill", "mixed", "long", "overall"]
    assert table["overall"]["n"] == 80 and table["overall"]["median_abs"] < 0.03
    assert "heldout rows" in text and "overall" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_cli_fit_and_costcheck(synthetic, tmp_path):
    app = typer.Typer()
    register(app)
    runner = CliRunner()
    out = tmp_path / "p.json"
    result = runner.invoke(app, ["fit", str(synthetic["csv"]), "--out", str(out), "--num-layers", "40"])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["num_layers"] == 40 and "overall" in result.output
    result = runner.invoke(app, ["costcheck", str(out), str(synthetic["csv"]), "--out", str(tmp_path / "s.png")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "s.png").exists()
    result = runner.invoke(app, ["fit", str(tmp_path / "missing.csv"), "--out", str(out)])
    assert result.exit_code == 2
