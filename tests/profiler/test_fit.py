"""The fitting half of the profiler: features, fit of F(x), the `fitted` cost model, costcheck, CLI.

Measurements are synthetic: a known layer(x) with multiplicative log-normal noise, written in the
measurement CSV contract (with metadata.json), so the fit's recovery can be checked exactly. Two
truths: one without GEMM tile steps (`synthetic`) and one with a staircase over the tokens padded
to 128-token tiles (`stepped`); the fit must choose the tile (or none) by cross-validation.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
import typer
from typer.testing import CliRunner

from cbsim.core.errors import ConfigError
from cbsim.sim.costmodels import features
from cbsim.profiler.costcheck import costcheck, error_table
from cbsim.sim.costmodels.fitted import FittedCostModel
from cbsim.sim.costmodels.engine import Engine, EngineTerms
from cbsim.sim.costmodels.curves import Curve
from cbsim.sim.costmodels.registry import load_cost_model
from cbsim.profiler.fit import fit_profile, load_measurements, parse_tiles, select_graph, write_profile
from cbsim.cli.fit import register
from cbsim.sim.shape import StepShape

# the true layer(x): g(T) piecewise linear with knots 0/64/512/2048, then the linear terms
TRUE_KNOTS = [0.0, 64.0, 512.0, 2048.0]
TRUE_SLOPES = [5e-9, 1e-7, 5e-7, 6e-7]
TRUE = {"pairs_history": 4e-11, "pairs_new": 1.2e-10, "prefill_kv": 1e-9, "decode_kv": 1.2e-9, "num_decode": 2e-7,
        "num_prefill": 5e-6, "const": 3e-5}
# the stepped truth: g over T (lower slopes) plus gp over T padded to 128-token tiles
TILE = 128
STEP_SLOPES = [5e-9, 1e-7, 3.5e-7, 4.2e-7]
STEP_PADDED = [0.0, 5e-8, 1.5e-7, 1.8e-7]  # segment 0 ends at 64 <= the tile: no gp column there
TRUE_LM = (2e-5, 1e-7)
NOISE = 0.02
LAYERS = 32


def host_engine(per_step, per_seq, overlap):
    """An engine of host terms only (the former CpuOverhead)."""
    return Engine(EngineTerms(host_per_step_s=per_step, host_per_seq_s=per_seq, overlap=overlap), "test")


def ramp(t: float, slopes) -> float:
    return sum(s * min(max(t - lo, 0.0), hi - lo) for s, lo, hi in zip(slopes, TRUE_KNOTS, TRUE_KNOTS[1:] + [math.inf]))


def true_g(t: int, tile: int | None = None) -> float:
    """The true GEMM time: g(T), or with a tile g(T) + gp(Tp) (Tp from the definition, not features.py)."""
    if tile is None:
        return ramp(t, TRUE_SLOPES)
    padded = t if t <= tile else math.ceil(t / tile) * tile
    return ramp(t, STEP_SLOPES) + ramp(padded, STEP_PADDED)


def true_layer(shape: StepShape, tile: int | None = None) -> float:
    t = shape.num_tokens
    ph = sum(c * h for c, h in shape.prefill)
    pn = sum(c * (c + 1) / 2 for c, _ in shape.prefill)
    kp = sum(c + h for c, h in shape.prefill)
    return true_g(t, tile) + TRUE["pairs_history"] * ph + TRUE["pairs_new"] * pn + TRUE["prefill_kv"] * kp \
        + TRUE["decode_kv"] * sum(shape.decode) + TRUE["num_decode"] * len(shape.decode) \
        + TRUE["num_prefill"] * len(shape.prefill) + TRUE["const"]


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
    for m in (128, 256, 384, 512, 640, 1024, 1536, 2048, 3072, 4096):  # at and just past tile multiples
        for t in (m, m + 8):
            out.append(("prefill", [(t, 512)], []))
            out.append(("mixed", [(t - 32, 1024)], [2048] * 32))
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


def write_synthetic(tmp_path, seed: int = 0, noise: float = NOISE, tile: int | None = None):
    """A measurement CSV + metadata.json from the true model (stepped with a tile); returns the CSV path."""
    rng = np.random.default_rng(seed)
    batches = [("grid", b) for b in grid_batches(rng)] + [("heldout", b) for b in heldout_batches(rng)]
    batches += [("anchor", ("decode", [], [1024] * 16))] * 5
    rows = []
    for i, (source, (cls, prefill, decode)) in enumerate(batches):
        shape = StepShape.from_batch(prefill, decode)
        agg = features.aggregates(shape)
        y = true_layer(shape, tile) * math.exp(rng.normal(0.0, noise))
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


@pytest.fixture(scope="module")
def stepped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fit_stepped")
    csv = write_synthetic(tmp, seed=1, noise=0.01, tile=TILE)
    frame, meta = load_measurements(csv)
    return {"csv": csv, "frame": frame, "profile": fit_profile(frame, meta, csv_path=csv)}


# --- features --------------------------------------------------------------------------------

def test_features_agree_with_step_shape():
    shape = features.shape_of("100:20;7:0", "5;300")
    agg = features.aggregates(shape)
    assert agg.tokens == shape.num_tokens == 109
    assert agg.pairs == shape.attention_pairs == agg.pairs_history + agg.pairs_new
    assert (agg.pairs_history, agg.pairs_new) == (100 * 20, 100 * 101 // 2 + 7 * 8 // 2)
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


def test_padded_tokens_and_the_step_columns():
    t = [1, 100, 128, 129, 256, 257, 1000]
    assert [features.padded_tokens(x, 128) for x in t] == [1, 100, 128, 256, 256, 384, 1024]
    assert features.padded_token_column(t, 128).tolist() == [features.padded_tokens(x, 128) for x in t]
    knots = [0.0, 64.0, 128.0, 512.0]
    assert features.padded_segments(knots, None) == [] and features.padded_segments(knots, 128) == [2, 3]
    assert features.padded_segments(knots, 100) == [1, 2, 3]
    cols = {name: np.arange(len(t), dtype=float) for name in features.LINEAR_FEATURES}
    cols["tokens"] = np.array(t, dtype=float)
    x0, names0 = features.design_matrix(cols, knots)
    x, names = features.design_matrix(cols, knots, 128)
    assert names == names0[:4] + ["gp[128,512)", "gp[512,inf)"] + names0[4:]
    assert np.array_equal(x[:, :4], x0[:, :4]) and np.array_equal(x[:, 6:], x0[:, 4:])
    # gp over Tp: 129 -> 256 lies 128 into [128, 512); 1000 -> 1024 is past 512
    assert x[:, 4].tolist() == [0, 0, 0, 128, 128, 256, 384] and x[:, 5].tolist() == [0] * 6 + [512]
    # a skipped segment (ending at or below the tile) would duplicate g's column exactly
    full = features.ramp_basis(features.padded_token_column(t, 128), knots)
    assert np.array_equal(full[:, :2], x0[:, :2])


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
    for name in ("pairs_history", "pairs_new", "decode_kv"):
        assert coef[name] == pytest.approx(TRUE[name], rel=0.05), name
    model = FittedCostModel(prof)
    rng = np.random.default_rng(7)
    errors = [model.layer_time(s) / true_layer(s) - 1 for _, p, d in heldout_batches(rng, 200)
              for s in [StepShape.from_batch(p, d)]]
    errors = np.abs(errors)
    assert np.median(errors) < 0.01 and np.quantile(errors, 0.9) < 0.025
    assert prof["lm_head"]["per_row"] == pytest.approx(TRUE_LM[1], rel=0.1)
    assert prof["lm_head"]["const"] == pytest.approx(TRUE_LM[0], rel=0.1)


def test_data_without_steps_chooses_no_tile(synthetic):
    prof = synthetic["profile"]
    sel = prof["provenance"]["tile_selection"]
    assert sel["candidates"] == ["none", "64", "128", "256"] and sel["chosen"] == "none"
    assert prof["tile"] is None and not any(name.startswith("gp[") for name in prof["coefficients"])
    assert set(sel["out_of_fold"]) == {"none", "64", "128", "256"}
    assert all(0 < s["rms"] < 0.03 for s in sel["out_of_fold"].values())


def test_fit_recovers_the_tile_and_the_steps(stepped):
    prof = stepped["profile"]
    sel = prof["provenance"]["tile_selection"]
    assert prof["tile"] == TILE and sel["chosen"] == "128" and prof["format"] == 2
    oof = sel["out_of_fold"]
    assert oof["128"]["mse"] + oof["128"]["mse_se"] < oof["none"]["mse"]
    assert oof["128"]["rms"] < min(oof["64"]["rms"], oof["256"]["rms"])
    coef = prof["coefficients"]
    assert all(w >= 0 for w in coef.values()) and any(coef[n] > 0 for n in coef if n.startswith("gp["))
    assert coef["pairs_history"] == pytest.approx(TRUE["pairs_history"], rel=0.02)
    assert coef["pairs_new"] == pytest.approx(TRUE["pairs_new"], rel=0.06)
    assert coef["decode_kv"] == pytest.approx(TRUE["decode_kv"], rel=0.01)
    model = FittedCostModel(prof)
    for m in (256, 384, 512, 1024, 2048, 4096):  # at a tile multiple and one token past it
        for dec in (0, 32):
            at, past = (StepShape.from_batch([(t - dec, 1000)], [1500] * dec) for t in (m, m + 1))
            for shape in (at, past):
                assert model.layer_time(shape) == pytest.approx(true_layer(shape, TILE), rel=0.025)
            if m <= 1024:  # the step itself; beyond, it is under 2 % of the layer and the noise hides it
                step = true_layer(past, TILE) - true_layer(at, TILE)
                assert model.layer_time(past) - model.layer_time(at) == pytest.approx(step, rel=0.25)
    flat = FittedCostModel(fit_profile(stepped["frame"], {"model": {"num_layers": LAYERS}}, tiles=["none"]))
    at, past = StepShape.from_batch([(512, 1000)], []), StepShape.from_batch([(513, 1000)], [])
    assert flat.tile is None  # a continuous g cannot follow the step
    assert flat.layer_time(past) - flat.layer_time(at) < 0.2 * (true_layer(past, TILE) - true_layer(at, TILE))


def test_tile_candidates_are_checked():
    assert parse_tiles(["none", "128", 64, None, "128"]) == (None, 128, 64)
    for bad in (["0"], ["-64"], ["tile"], [1.5], []):
        with pytest.raises(ConfigError, match="tiles"):
            parse_tiles(bad)


def test_a_tile_above_every_batch_is_skipped(synthetic):
    frame = synthetic["frame"]
    small = frame[frame["num_tokens"] <= 512]
    prof = fit_profile(small, {"model": {"num_layers": LAYERS}}, tiles=["none", "1024"])
    assert prof["provenance"]["tile_selection"]["out_of_fold"]["1024"] == {"skipped": "Tp = T on every grid row"}
    assert prof["tile"] is None
    with pytest.raises(ConfigError, match="tiles"):
        fit_profile(small, {"model": {"num_layers": LAYERS}}, tiles=["1024"])


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
@pytest.mark.parametrize("which", ["synthetic", "stepped"])
def test_decode_runs_are_bit_identical(request, which, overlap):
    prof = dict(request.getfixturevalue(which)["profile"])
    prof["allreduce"] = {"kind": "analytic", "num_workers": 2, "per_layer": 2, "bytes_per_token": 8192,
                         "bus_bandwidth": 2e11, "latency_s": 1e-5}
    model = FittedCostModel(prof, engine=host_engine(8e-4, 4e-5, overlap))
    assert model.tile == (TILE if which == "stepped" else None)
    rng = np.random.default_rng(3)
    for n in (1, 7, 64, 128, 129, 300):
        ctx = rng.integers(1, 30000, n)
        run = model.decode_run_times(ctx, 40)
        ref = np.array([model.step_time(StepShape(decode=tuple(int(x) + j for x in ctx), tokens_sampled=n))
                        for j in range(40)])
        assert np.array_equal(run, ref)


def format_1(profile: dict) -> dict:
    """The same fit written as a format-1 profile: one pair rate, no tile (as cbsim wrote before)."""
    coef = {k: v for k, v in profile["coefficients"].items() if k not in ("pairs_history", "pairs_new")}
    coef["pairs"] = profile["coefficients"]["pairs_history"]
    old = {k: v for k, v in profile.items() if k != "tile"}
    return {**old, "format": 1, "coefficients": coef}


def test_format_1_profiles_give_the_numbers_they_gave(synthetic):
    prof = format_1(synthetic["profile"])
    model = FittedCostModel(prof)
    coef, knots = prof["coefficients"], prof["knots"]
    slopes = [coef[features.segment_name(knots, k)] for k in range(len(knots))]
    g = Curve(knots, features.ramp_values_at_knots(knots, slopes), tail_slope=slopes[-1])
    rng = np.random.default_rng(9)
    for cls, prefill, decode in heldout_batches(rng, 60):
        shape = StepShape.from_batch(prefill, decode)
        agg = features.aggregates(shape)
        # the format-1 expression, term by term in its order
        old = (g.at(agg.tokens) + coef["pairs"] * agg.pairs + coef["prefill_kv"] * agg.prefill_kv
               + coef["decode_kv"] * agg.decode_kv + coef["num_decode"] * agg.num_decode
               + coef["num_prefill"] * agg.num_prefill + coef["const"])
        assert model.layer_time(shape) == old
    assert model.tile is None and model.describe()["format"] == 1
    with pytest.raises(ValueError, match="format"):
        FittedCostModel({**prof, "format": 3})


def test_cpu_overhead_adds_or_overlaps(synthetic):
    shape = StepShape.from_batch([], [500] * 4)
    gpu = FittedCostModel(synthetic["profile"]).step_time(shape)
    serial = FittedCostModel(synthetic["profile"], engine=host_engine(1e-3, 1e-4, False)).step_time(shape)
    assert serial == pytest.approx(gpu + 1e-3 + 4e-4)
    hidden = FittedCostModel(synthetic["profile"], engine=host_engine(1e-3, 1e-4, True)).step_time(shape)
    assert hidden == pytest.approx(max(gpu, 1.4e-3))
    exposed = FittedCostModel(synthetic["profile"], engine=host_engine(1.0, 0.0, True)).step_time(shape)
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
    assert model.engine.terms.host_per_step_s == pytest.approx(0.790e-3) and model.engine.terms.overlap
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
    result = runner.invoke(app, ["fit", str(synthetic["csv"]), "--out", str(out), "--tiles", "none,128"])
    assert result.exit_code == 0 and "tile none (of none, 128)" in result.output, result.output
    assert json.loads(out.read_text())["provenance"]["tile_selection"]["candidates"] == ["none", "128"]
    result = runner.invoke(app, ["fit", str(synthetic["csv"]), "--out", str(out), "--tiles", "none,big"])
    assert result.exit_code == 2 and "tiles" in result.output
