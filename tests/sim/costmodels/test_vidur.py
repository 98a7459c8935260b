"""The `vidur` cost model and its converter: exact at published points, monotone, fast to load,
bit-identical decode runs. Tests that read the source tables skip when the shared data is absent."""
from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import typer
from typer.testing import CliRunner

from cbsim.core.errors import ConfigError
from cbsim.profiler.converters import vidur_data
from cbsim.sim.costmodels.engine import Engine, EngineTerms
from cbsim.sim.costmodels.curves import Curve, Grid, isotonic, isotonic_table
from cbsim.sim.costmodels.registry import load_cost_model
from cbsim.sim.costmodels.vidur import VidurCostModel, normalise_model_name, shipped_profiles
from cbsim.cli.fit import register
from cbsim.sim.shape import StepShape

DATA = Path(os.environ.get("CBSIM_DATA", "/work/shared/data")) / "vidur"
needs_data = pytest.mark.skipif(not (DATA / "data" / "profiling").is_dir(), reason="shared vidur data not present")
SHIPPED = vidur_data.shipped_dir()
REQUIRED = ["a100-llama-2-70b-tp2", "a100-llama-2-7b-tp1", "h100-llama-2-7b-tp1", "a100-llama-3-8b-tp1",
            "h100-llama-3-8b-tp1"]


def host_engine(per_step, per_seq, overlap):
    """An engine of host terms only (the former CpuOverhead)."""
    return Engine(EngineTerms(host_per_step_s=per_step, host_per_seq_s=per_seq, overlap=overlap), "test")


def model_of(name: str, **kw) -> VidurCostModel:
    return VidurCostModel.from_file(SHIPPED / f"{name}.json", **kw)


# --- tables ----------------------------------------------------------------------------------

def test_curve_and_grid_scalar_and_vector_paths_agree():
    rng = np.random.default_rng(0)
    xs = np.cumsum(rng.integers(1, 50, 30)).astype(float)
    curve = Curve(xs, np.cumsum(rng.random(30)))
    q = rng.uniform(-10, xs[-1] * 2, 500)
    assert np.array_equal(curve.many(q), [curve.at(float(v)) for v in q])
    assert [curve.at(x) for x in xs] == curve.ys  # exact at knots
    grid = Grid([1, 2, 4, 8], [10, 20, 40], np.cumsum(np.cumsum(rng.random((4, 3)), 0), 1))
    for a in (0.5, 1, 3, 8, 20):
        b = rng.uniform(0, 100, 50)
        assert np.array_equal(grid.many(a, b), [grid.at(a, float(v)) for v in b])


def test_isotonic_smoothing_is_monotone_and_keeps_sums():
    y = np.array([1.0, 3.0, 2.0, 2.0, 5.0, 4.0])
    iso = isotonic(y)
    assert np.all(np.diff(iso) >= 0) and iso.sum() == pytest.approx(y.sum())
    table = isotonic_table(np.array([[1.0, 0.5, 2.0], [0.9, 3.0, np.nan]]))
    assert np.all(np.diff(table[0]) >= 0) and table[1, 0] >= table[0, 0] and np.isnan(table[1, 2])


# --- shipped profiles ------------------------------------------------------------------------

def test_required_profiles_are_shipped_and_load():
    assert set(REQUIRED) <= set(shipped_profiles())
    for name in REQUIRED:
        model = load_cost_model({"type": "vidur", "profile": str(SHIPPED / f"{name}.json")}, model=None)
        assert model.step_time(StepShape.from_batch([(512, 0)], [1000] * 8)) > 0
    full = json.loads((SHIPPED / "a100-llama-2-70b-tp2.json").read_text())
    assert full["provenance"]["measured"] == ["token_ops", "attention", "allreduce"]
    for name in REQUIRED[1:]:
        prov = json.loads((SHIPPED / f"{name}.json").read_text())["provenance"]
        assert "attention" not in prov["measured"] and prov["attention"].startswith("modelled: roofline")


def test_config_by_gpu_model_tp_and_errors():
    model = load_cost_model({"type": "vidur", "gpu": "a100", "model": "llama-2-70b", "tp": 2}, model=None)
    assert model.num_layers == 80 and model.allreduce is not None
    by_spec = load_cost_model({"type": "vidur", "gpu": "h100"}, model=SimpleNamespace(name="meta-llama/Meta-Llama-3-8B"))
    assert by_spec.profile["model"] == "llama-3-8b"
    with pytest.raises(ConfigError, match="model"):
        load_cost_model({"type": "vidur", "gpu": "a40", "model": "llama-2-7b"}, model=None)
    with pytest.raises(ConfigError, match="tp"):
        load_cost_model({"type": "vidur", "model": "llama-2-7b", "tp": 0}, model=None)
    assert normalise_model_name("Llama-2-7b-hf") == "llama-2-7b"


@pytest.mark.parametrize("name", REQUIRED)
def test_monotone_in_tokens_context_and_batch(name):
    model = model_of(name)
    chunks = [model.step_time(StepShape.from_batch([(c, 0)])) for c in range(1, 9000, 61)]
    assert np.all(np.diff(chunks) >= 0)
    for c in (1, 100, 2000, 5000):
        hist = [model.step_time(StepShape.from_batch([(c, h)])) for h in range(0, 40000, 397)]
        assert np.all(np.diff(hist) >= 0), c
    for b in (1, 16, 128, 300):
        ctx = model.decode_run_times(np.full(b, 1), 20000)[::101]
        assert np.all(np.diff(ctx) >= 0), b
    for k in (100, 3000, 20000):
        batch = [model.step_time(StepShape.from_batch([], [k] * b)) for b in range(1, 520, 7)]
        assert np.all(np.diff(batch) >= 0), k


@pytest.mark.parametrize("name", ["a100-llama-2-70b-tp2", "h100-llama-3-8b-tp1"])
@pytest.mark.parametrize("overlap", [False, True])
def test_decode_runs_are_bit_identical(name, overlap):
    model = model_of(name, engine=host_engine(1.4e-3, 43.5e-6, overlap))
    rng = np.random.default_rng(1)
    for n in (1, 5, 128, 200):
        ctx = rng.integers(1, 9000, n)
        run = model.decode_run_times(ctx, 150)
        ref = [model.step_time(StepShape(decode=tuple(int(x) + j for x in ctx), tokens_sampled=n)) for j in range(150)]
        assert np.array_equal(run, ref)


def test_step_composition():
    model = model_of("a100-llama-2-70b-tp2")
    shape = StepShape.from_batch([(512, 0)], [1000] * 8)
    layer = model.layer_time(shape)
    comm = model.allreduce.seconds(520)
    gpu = model.step_time(shape)
    assert gpu > 80 * (layer + comm)  # plus embedding and LM head
    assert gpu < 80 * (layer + comm) * 1.02
    with_cpu = model_of("a100-llama-2-70b-tp2", engine=host_engine(1e-3, 1e-5, False))
    assert with_cpu.step_time(shape) == pytest.approx(gpu + 1e-3 + 9e-5)


# --- against the published tables ------------------------------------------------------------

def _published(path: Path, **keys) -> pd.DataFrame:
    frame = pd.read_csv(path)
    for k, v in keys.items():
        frame = frame[frame[k] == v]
    return frame


@needs_data
def test_reproduces_published_token_operators_exactly():
    model = model_of("a100-llama-2-70b-tp2", monotone=False)
    frame = _published(DATA / "data/profiling/compute/a100/meta-llama/Llama-2-70b-hf/mlp.csv",
                       num_tensor_parallel_workers=2)
    frame = frame.drop_duplicates("num_tokens", keep=False)
    for _, row in frame.sample(25, random_state=0).iterrows():
        for op in ("attn_pre_proj", "mlp_up_proj", "mlp_down_proj", "input_layernorm"):
            assert model.operator_time(op, int(row["num_tokens"])) == row[f"time_stats.{op}.median"] * 1e-3


@needs_data
def test_reproduces_published_attention_exactly():
    model = model_of("a100-llama-2-70b-tp2", monotone=False)
    frame = pd.read_csv(DATA / "history/e2d00e9/data/profiling/a100/attention.csv")
    dec = frame[~frame["is_prefill"]].drop_duplicates(["batch_size", "kv_cache_size"], keep=False)
    for _, row in dec.sample(25, random_state=0).iterrows():
        b, kv = int(row["batch_size"]), int(row["kv_cache_size"])
        assert model.attention.decode(b, b * kv) == row["time_stats.attn_decode.median"] * 1e-3
    pre = frame[frame["is_prefill"]].drop_duplicates(["prefill_chunk_size", "kv_cache_size"], keep=False)
    for _, row in pre.sample(25, random_state=0).iterrows():
        c, h = int(row["prefill_chunk_size"]), int(row["kv_cache_size"])
        assert model.attention.prefill(c, h) == row["time_stats.attn_prefill.median"] * 1e-3


@needs_data
def test_smoothing_changes_little():
    raw, smooth = model_of("a100-llama-2-70b-tp2", monotone=False), model_of("a100-llama-2-70b-tp2")
    shapes = [StepShape.from_batch([(c, h)]) for c in (64, 500, 2000) for h in (0, 1000)]
    shapes += [StepShape.from_batch([], [k] * b) for b in (1, 8, 64) for k in (100, 1000, 3000)]
    for shape in shapes:
        assert smooth.step_time(shape) == pytest.approx(raw.step_time(shape), rel=0.05)


@needs_data
def test_convert_cli_reproduces_a_shipped_profile(tmp_path):
    app = typer.Typer()
    register(app)
    result = CliRunner().invoke(app, ["vidur-convert", "--data", str(DATA.parent), "--out", str(tmp_path),
                                      "--gpu", "h100", "--model", "llama-2-7b", "--tp", "1"])
    assert result.exit_code == 0, result.output
    fresh = json.loads((tmp_path / "h100-llama-2-7b-tp1.json").read_text())
    assert fresh == json.loads((SHIPPED / "h100-llama-2-7b-tp1.json").read_text())
    result = CliRunner().invoke(app, ["vidur-convert", "--data", str(tmp_path), "--gpu", "a100", "--model", "x"])
    assert result.exit_code == 2
