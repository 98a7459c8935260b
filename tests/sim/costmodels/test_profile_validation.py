"""Issue 14, items 8 and 13: every profile is validated on load (a named error for the file and the
key, never a hang, a KeyError or a step-order traceback); every step and transfer time the event
loop schedules is guarded; GPUs per replica are resolved once, for KV sizing and per-GPU goodput."""
import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cbsim.cli.app import app
from cbsim.config import load_config
from cbsim.core.errors import ConfigError
from cbsim.policies import make_policy
from cbsim.preflight import probe_step_times
from cbsim.sim.costmodels.fitted import FittedCostModel
from cbsim.sim.costmodels.profile_check import ProfileError
from cbsim.sim.costmodels.vidur import VidurCostModel
from cbsim.sim.cost import CostModel
from cbsim.sim.durations import CLOCK_LIMIT, DurationError
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.kv.link import KVLink
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.shape import StepShape
from cbsim.sim.simulation import simulate

from factories import assert_user_error, make_requests
from paths import ROOT

PROFILES = ROOT / "sim" / "costmodels" / "profiles"
FITTED = PROFILES / "fitted" / "a100-llama-2-70b-tp2-published.json"
VIDUR_TP2 = PROFILES / "vidur" / "a100-llama-2-70b-tp2.json"
VIDUR_ROOFLINE = PROFILES / "vidur" / "h100-llama-3-8b-tp1.json"
DROP = object()
runner = CliRunner()


def mutated(tmp_path, source: Path, path: str, value, name: str = "bad.json") -> Path:
    """A copy of a profile with the key at dotted `path` set to `value` (DROP: removed)."""
    data = json.loads(source.read_text())
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node[part]
    if value is DROP:
        del node[leaf]
    else:
        node[leaf] = value
    out = tmp_path / name
    out.write_text(json.dumps(data))
    return out


def assert_profile_error(err: ConfigError, file: Path, key: str):
    assert err.file == str(file), str(err)
    assert err.path == key or err.path.startswith(key + ".") or err.path.startswith(key + "["), str(err)
    assert str(err).startswith(f"{file}: {err.path}: expected"), str(err)


def test_every_shipped_profile_passes():
    FittedCostModel.from_file(FITTED)
    for path in sorted((PROFILES / "vidur").glob("*.json")):
        VidurCostModel.from_file(path)


# 8. Fitted profiles: NaN/inf/negative coefficients, num_layers 0, step_overhead -1, missing sections,
# a TP-2 profile without its all-reduce, unknown formats: each a ProfileError naming file and key

FITTED_CASES = [
    ("coefficients.const", math.nan), ("coefficients.const", math.inf), ("coefficients.decode_kv", -1e-9),
    ("coefficients.g[0,8)", math.nan), ("coefficients.pairs_new", DROP), ("coefficients.gp[128,256)", DROP),
    ("num_layers", 0), ("num_layers", 80.0), ("num_layers", "80"), ("step_overhead", -1), ("step_overhead", math.inf),
    ("num_layers", DROP), ("knots", DROP), ("coefficients", DROP), ("lm_head", DROP), ("step_overhead", DROP),
    ("residuals", DROP), ("lm_head.per_row", -1.0), ("lm_head.const", math.nan), ("knots", [0, 32, 8]),
    ("tile", 0), ("tp", 0), ("tp", 10 ** 6), ("format", 99), ("allreduce", DROP), ("allreduce", None),
    ("allreduce.num_workers", 4), ("allreduce.kind", "carrier-pigeon"), ("allreduce.bytes_per_token", 0),
    ("residuals.probs", [0.5, 0.1]), ("residuals.quantiles", [0.0]), ("residuals.quantiles", DROP),
]


@pytest.mark.parametrize("key, value", FITTED_CASES)
def test_08_bad_fitted_profile_is_an_error_naming_file_and_key(tmp_path, key, value):
    path = mutated(tmp_path, FITTED, key, value)
    with pytest.raises(ProfileError) as err:
        FittedCostModel.from_file(path)
    assert_profile_error(err.value, path, key)


VIDUR_CASES = [
    (VIDUR_TP2, "format", 99), (VIDUR_TP2, "token_ops", DROP), (VIDUR_TP2, "token_ops.emb_ms", [1.0]),
    (VIDUR_TP2, "num_layers", 0), (VIDUR_TP2, "tp", DROP), (VIDUR_TP2, "allreduce", None),
    (VIDUR_TP2, "lm_head.op", "nope"), (VIDUR_TP2, "lm_head.ratio", math.nan), (VIDUR_TP2, "attention.kind", "x"),
    (VIDUR_TP2, "attention.decode.ms", [[0.1]]), (VIDUR_TP2, "attention.prefill.chunk", [0]),
    (VIDUR_TP2, "attention", DROP), (VIDUR_ROOFLINE, "attention.decode_bw_eff", 0),
    (VIDUR_ROOFLINE, "attention.decode_fixed_s", -1e-6), (VIDUR_ROOFLINE, "attention.q_heads", math.inf),
]


@pytest.mark.parametrize("source, key, value", VIDUR_CASES)
def test_08_bad_vidur_profile_is_an_error_naming_file_and_key(tmp_path, source, key, value):
    path = mutated(tmp_path, source, key, value)
    with pytest.raises(ProfileError) as err:
        VidurCostModel.from_file(path)
    assert_profile_error(err.value, path, key)


def test_08_nan_in_a_vidur_table_and_a_ragged_prefill_table_are_named(tmp_path):
    data = json.loads(VIDUR_TP2.read_text())
    data["token_ops"]["ms"]["add"][3] = math.nan
    path = tmp_path / "nan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"token_ops\.ms\.add\[3\]"):
        VidurCostModel.from_file(path)
    data = json.loads(VIDUR_TP2.read_text())
    data["attention"]["prefill"]["ms"][0][0] = None  # a hole before measured cells
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"attention\.prefill\.ms"):
        VidurCostModel.from_file(path)


TINY = {
    "name": "tiny", "seed": 3, "model": "llama-2-70b",
    "cluster": {"kv_cache": {"num_blocks": 400}},
    "policy": {"name": "sarathi", "token_budget": 128},
    "workload": {"num_requests": 12, "arrival": {"type": "poisson", "rate": 20.0},
                 "prompt_len": {"type": "uniform", "min": 10, "max": 300},
                 "output_len": {"type": "uniform", "min": 1, "max": 40}},
    "output": {"plots": False, "trace": False},
}


def experiment(tmp_path, cost_model: dict, name="exp.yaml", **top) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({**TINY, "cost_model": cost_model, **top}))
    return path


@pytest.mark.parametrize("command", ["validate", "run"])
def test_08_cli_rejects_a_nan_profile_with_exit_code_2(tmp_path, command):
    profile = mutated(tmp_path, FITTED, "coefficients.const", math.nan, "nan-profile.json")
    exp = experiment(tmp_path, {"type": "fitted", "profile": str(profile)})
    args = [command, str(exp)] + (["--out", str(tmp_path / "out")] if command == "run" else [])
    assert_user_error(runner.invoke(app, args), "nan-profile.json", "coefficients.const", "finite")


def test_08_validate_probes_step_times_a_run_would_reject(tmp_path):
    huge = experiment(tmp_path, {"type": "linear", "base": 0.01, "per_token": 1e300})
    assert_user_error(runner.invoke(app, ["validate", str(huge)]), "exp.yaml", "cost_model", "step times")
    slow = experiment(tmp_path, {"type": "fitted", "profile": str(FITTED)}, "s.yaml",
                      preemption={"swap_bandwidth_gb_s": 1e-300})
    assert_user_error(runner.invoke(app, ["validate", str(slow)]), "s.yaml", "preemption.swap_bandwidth_gb_s")


# 8. The duration guard: a NaN, infinite, zero or negative step time, or a transfer that ends beyond
# the clock's range, is a DurationError at the step (before: a hang or a step-order traceback)

class BadCost(CostModel):
    """0.01 s per step until the `after`-th step, then `value` (fast-forward runs: `run_value` at
    their fourth step)."""

    def __init__(self, value, after=0, run_value=None):
        self.value, self.after, self.run_value, self.calls = value, after, run_value, 0

    def step_time(self, shape):
        self.calls += 1
        return self.value if self.calls > self.after else 0.01

    def decode_run_times(self, contexts, steps):
        out = np.full(steps, 0.01)
        if self.run_value is not None and steps > 3:
            out[3] = self.run_value
        return out


def simulate_with(cost, fast_forward=True, num_requests=3):
    requests = make_requests([(0.0, 50, 200)] * num_requests)
    settings_ = ReplicaSettings(fast_forward=fast_forward, max_model_len=4096)
    return simulate(requests, lambda: make_policy({"name": "sarathi", "token_budget": 256}), cost,
                    lambda: KVCache(1000, 16, 0, False, 1024.0), settings_, max_time=1e6)


@pytest.mark.parametrize("value, after", [(math.nan, 0), (math.inf, 0), (-0.01, 0), (0.0, 0), (CLOCK_LIMIT, 0),
                                          (math.nan, 5), (-0.01, 5), (0.0, 5), (1e-30, 5)])
def test_08_bad_step_time_is_a_duration_error(value, after):
    """after 5 steps, 1e-30 s no longer moves the clock (~0.05 s): the step would end as it starts"""
    with pytest.raises(DurationError) as err:
        simulate_with(BadCost(value, after), fast_forward=False)
    assert err.value.path == "cost_model" and "replica 0" in str(err.value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -0.01, 0.0])
def test_08_bad_step_time_inside_a_fast_forward_run_is_a_duration_error(value):
    with pytest.raises(DurationError, match="cost_model"):
        simulate_with(BadCost(0.01, run_value=value))


def test_08_valid_steps_pass_the_guard():
    recorder, _ = simulate_with(BadCost(0.01, run_value=0.01))
    assert recorder.num_steps > 0


@pytest.mark.parametrize("bandwidth, latency", [(1e-300 * 1e9, 1e-4), (25e9, math.inf), (math.inf, math.nan)])
def test_08_a_transfer_beyond_the_clock_names_the_link_key(bandwidth, latency):
    link = KVLink("prefill0", bandwidth, 0.0, key="cluster.link")
    link.latency = latency  # as a link built from a config would carry it
    with pytest.raises(DurationError) as err:
        link.submit(0.0, 8192 * 131072)
    assert err.value.path == "cluster.link" and "prefill0" in str(err.value)
    assert link.log == []
    assert KVLink("host0", 25e9).submit(5.0, 0).end == 5.0  # nothing moved in no time is fine


PD = {
    "name": "pd", "model": "llama-3-8b", "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1},
    "cluster": {"mode": "pd", "kv_cache": {"block_size": 16, "num_blocks": 400},
                "prefill": {"replicas": 1, "policy": {"name": "prefill_first", "token_budget": 4096}},
                "decode": {"replicas": 1, "policy": {"name": "sarathi", "token_budget": 256}},
                "link": {"latency_s": 0.001, "bandwidth_gb_s": 1e-300}},
    "workload": {"num_requests": 4, "arrival": {"type": "poisson", "rate": 20},
                 "prompt_len": {"type": "uniform", "min": 20, "max": 200},
                 "output_len": {"type": "uniform", "min": 2, "max": 10}},
    "output": {"plots": False, "trace": False},
}


def test_08_pd_link_bandwidth_1e_300_is_named_by_validate_and_run(tmp_path):
    exp = tmp_path / "pd.yaml"
    exp.write_text(yaml.safe_dump(PD))
    assert_user_error(runner.invoke(app, ["validate", str(exp)]), "pd.yaml", "cluster.link.bandwidth_gb_s")
    result = runner.invoke(app, ["run", str(exp), "--out", str(tmp_path / "out")])
    assert_user_error(result, "cluster.link", "prefill0")


# 13. GPUs per replica: one rule for KV sizing and per-GPU goodput

def test_13_a_tp2_profile_counts_two_gpus_per_replica_and_sizes_kv_with_two():
    from cbsim.build import build_replica_parts
    from cbsim.tools.sweep.capacity import num_gpus
    from cbsim.sim.costmodels.catalog.lookup import gpu_spec, model_spec
    from cbsim.sim.kv.sizing import kv_cache_blocks

    base = {**TINY, "cluster": {"replicas": 2, "gpu": "a100", "kv_cache": {"num_blocks": "auto"}}}
    for cost in ({"type": "fitted", "profile": "a100-llama-2-70b-tp2-published.json"},
                 {"type": "vidur", "profile": "a100-llama-2-70b-tp2.json"}):
        cfg = load_config({**base, "cost_model": cost})
        assert num_gpus(cfg) == 2 * 2
        _, _, make_kv, _ = build_replica_parts(cfg)
        expected = kv_cache_blocks(model_spec("llama-2-70b"), gpu_spec("a100"), 2, 16, 0.9)
        assert make_kv().num_blocks == expected
        explicit = load_config({**base, "cost_model": cost, "cluster": {**base["cluster"], "tp": 4}})
        assert num_gpus(explicit) == 2 * 4
        assert build_replica_parts(explicit)[2]().num_blocks == kv_cache_blocks(
            model_spec("llama-2-70b"), gpu_spec("a100"), 4, 16, 0.9)


def test_13_goodput_per_gpu_divides_by_the_profiles_tp():
    from cbsim.api import run_experiment

    cfg = {**TINY, "cost_model": {"type": "fitted", "profile": "a100-llama-2-70b-tp2-published.json"},
           "metrics": {"slo": {"ttft": 10.0, "tpot": 1.0}}}
    summary = run_experiment(cfg).summary
    assert summary["num_gpus"] == 2
    assert summary["goodput_per_gpu"] == pytest.approx(summary["goodput_requests_per_s"] / 2)


def test_13_pd_pools_use_the_same_rule():
    from cbsim.tools.sweep.capacity import num_gpus

    cluster = {**PD["cluster"], "link": {"bandwidth_gb_s": 25},
               "decode": {"replicas": 3, "cost_model": {"type": "vidur", "profile": str(VIDUR_TP2)}}}
    cfg = load_config({**PD, "model": "llama-2-70b", "cost_model": {"type": "fitted", "profile": str(FITTED)},
                       "cluster": cluster})
    assert num_gpus(cfg) == 1 * 2 + 3 * 2
    tp1 = {**cluster, "decode": {"replicas": 3, "cost_model": {"type": "vidur", "profile": str(VIDUR_ROOFLINE)}}}
    assert num_gpus(load_config({**PD, "cost_model": {"type": "fitted", "profile": str(FITTED)},
                                 "cluster": tp1})) == 1 * 2 + 3 * 1


# The fuzz battery for profiles: the shipped fitted and vidur profiles mutated one field at a time.
# Every outcome is a profile that loads and whose probe steps are finite and > 0, or a ProfileError
# naming the file and the mutated key (or a key it names: knots and tile name the coefficients), or
# the DurationError `cbsim validate` raises when a huge value makes the steps leave the clock.

MUTATIONS = {
    "drop": DROP, "string": "x", "list": [1], "mapping": {"a": 1}, "negative": -1, "zero": 0,
    "huge_int": 10 ** 30, "huge_float": 1.0e300, "nan": math.nan, "inf": math.inf, "unicode": "ünï©ødé",
    "bool": True, "null": None,
}
SKIP = ("provenance", "validation", "geometry", "hardware")  # descriptive: the models never read them


def key_paths(node, prefix=""):
    for key, value in node.items():
        path = f"{prefix}{key}"
        if key in SKIP and not prefix:
            continue
        yield path
        if isinstance(value, dict):
            yield from key_paths(value, path + ".")


def related(named: str, key: str) -> bool:
    a, b = named.split("[")[0].split("."), key.split(".")
    if b[0] in ("knots", "tile", "format", "tp") and a[0] in ("coefficients", "allreduce", "tp"):
        return True  # these decide which coefficients exist and how many GPUs the all-reduce spans
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return common >= min(len(a), len(b)) or common >= len(b) - 1


def fuzz_one(tmp_path_factory, source: Path, cls, path: str, kind: str):
    folder = tmp_path_factory.mktemp("profile")
    file = mutated(folder, source, path, MUTATIONS[kind], "mutant.json")
    try:
        model = cls.from_file(file)
    except ProfileError as err:
        assert err.file == str(file) and related(err.path, path), (path, kind, str(err))
        return
    except ConfigError as err:  # the type check of from_file names the file in its message
        assert path == "type" and str(file) in str(err), (path, kind, str(err))
        return
    try:
        probe_step_times(model, 4096)
    except DurationError:
        assert kind in ("huge_int", "huge_float"), (path, kind)
        return
    for shape in (StepShape(decode=(1,) * 8, tokens_sampled=8), StepShape(prefill=((300, 100),), tokens_sampled=1)):
        assert 0 < model.step_time(shape) < CLOCK_LIMIT, (path, kind)


FITTED_PATHS = sorted(key_paths(json.loads(FITTED.read_text())))
VIDUR_PATHS = sorted(key_paths(json.loads(VIDUR_TP2.read_text())))


@settings(max_examples=150, derandomize=True, deadline=None)
@given(path=st.sampled_from(FITTED_PATHS), kind=st.sampled_from(sorted(MUTATIONS)))
def test_fuzz_one_field_of_the_fitted_profile(tmp_path_factory, path, kind):
    fuzz_one(tmp_path_factory, FITTED, FittedCostModel, path, kind)


@settings(max_examples=50, derandomize=True, deadline=None)
@given(path=st.sampled_from(VIDUR_PATHS), kind=st.sampled_from(sorted(MUTATIONS)))
def test_fuzz_one_field_of_a_vidur_profile(tmp_path_factory, path, kind):
    fuzz_one(tmp_path_factory, VIDUR_TP2, VidurCostModel, path, kind)


def test_a_guarded_duration_during_a_run_names_the_experiment_file(tmp_path):
    """The guard fires mid-run (sim/durations.py); the error names the experiment file as well."""
    import yaml as _yaml

    from cbsim.api import run_experiment as _run

    data = _yaml.safe_load(open("experiments/pd_vs_colocated.yaml"))
    data["cluster"]["link"]["bandwidth_gb_s"] = 1.0e-300
    data["workload"]["num_requests"] = 5
    path = tmp_path / "slow_link.yaml"
    path.write_text(_yaml.safe_dump(data))
    with pytest.raises(ConfigError) as err:
        _run(str(path))
    assert err.value.file == str(path) and err.value.path.startswith("cluster.link")


def test_a_fitted_profile_without_its_tile_is_an_error_naming_file_and_key(tmp_path):
    """A format-2 profile whose `tile` key is missing (or null beside tile-step slopes) would run with
    those slopes dropped: TTFT p50 2,451 -> 1,242 ms, silently (issue 26, defect 9)."""
    from cbsim.sim.costmodels.fitted import FittedCostModel

    shipped = ROOT / "sim/costmodels/profiles/fitted/a100-llama-2-70b-tp2-published.json"
    profile = json.loads(shipped.read_text())
    assert profile["tile"] == 128
    for broken in ({k: v for k, v in profile.items() if k != "tile"}, {**profile, "tile": None}):
        path = tmp_path / "p.json"
        path.write_text(json.dumps(broken))
        with pytest.raises(ConfigError) as err:
            FittedCostModel.from_file(path)
        assert "p.json" in str(err.value) and "tile" in str(err.value)
