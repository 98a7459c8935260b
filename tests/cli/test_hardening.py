"""Bad input, as a new user or an adversary would give it (issue 14): every case is a one-line error
naming the file and the key, with exit code 2, never a traceback, a hang or a silently wrong result.
Each numbered test follows the issue's numbering; the fuzz battery at the end mutates the shipped
quickstart one field at a time."""
import json
import math
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from factories import assert_user_error

from cbsim.cli.app import app
from cbsim.config import load_config
from cbsim.core.errors import ConfigError
from paths import ROOT

QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
runner = CliRunner()

TINY = {
    "name": "tiny", "seed": 3, "cost_model": {"type": "linear", "base": 0.01, "per_token": 1e-4},
    "cluster": {"kv_cache": {"num_blocks": 400}},
    "policy": {"name": "sarathi", "token_budget": 128},
    "workload": {"num_requests": 20, "arrival": {"type": "poisson", "rate": 20.0},
                 "prompt_len": {"type": "uniform", "min": 10, "max": 300},
                 "output_len": {"type": "uniform", "min": 1, "max": 40}},
    "output": {"plots": False, "trace": False},
}


def write(tmp_path, data, name="exp.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data)
    return path


def cli(*args):
    return runner.invoke(app, [str(a) for a in args])



# 1. Non-UTF-8 files

def test_01_non_utf8_config_is_a_one_line_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    assert_user_error(cli("validate", path), "bad.yaml", "UTF-8")


# 2. Deep nesting

def test_02_deeply_nested_yaml_is_a_clean_error(tmp_path):
    path = write(tmp_path, "a: " + "[" * 5000 + "]" * 5000 + "\n", "deep.yaml")
    assert_user_error(cli("validate", path), "deep.yaml", "nested")


# 3. --set values that are not YAML

def test_03_set_value_that_is_not_yaml_names_the_key(tmp_path):
    path = write(tmp_path, TINY)
    assert_user_error(cli("validate", path, "--set", "policy.token_budget=["), "exp.yaml", "policy.token_budget")


# Duplicate keys

def test_duplicate_yaml_keys_are_rejected_naming_key_and_file(tmp_path):
    text = yaml.safe_dump(TINY) + "policy: {name: orca}\n"
    assert_user_error(cli("validate", write(tmp_path, text)), "exp.yaml", "policy", "once")
    nested = "name: x\nworkload:\n  num_requests: 3\n  num_requests: 4\n"
    with pytest.raises(ConfigError, match="num_requests.*once"):
        load_config(write(tmp_path, nested, "nested.yaml"))


# 4. A list where a name is expected

@pytest.mark.parametrize("override, key", [
    ("policy.name=[1]", "policy.name"),
    ("cost_model.type=[1]", "cost_model.type"),
    ("workload.arrival.type=[1]", "workload.arrival.type"),
    ("workload.prompt_len.type={a: 1}", "workload.prompt_len.type"),
])
def test_04_a_list_where_a_name_is_expected_names_the_key(override, key):
    assert_user_error(cli("validate", QUICKSTART, "--set", override), f"--set {override}", key, "one of")


# Trace files for items 5 to 7 and the dropped-rows report: tiny files written per test.

def mooncake_line(t, prompt, output):
    blocks = -(-prompt // 512) if isinstance(prompt, int) and prompt < 10 ** 6 else 0
    return json.dumps({"timestamp": t, "input_length": prompt, "output_length": output,
                       "hash_ids": list(range(blocks))})


def trace_experiment(tmp_path, fmt, name, text, **trace):
    (tmp_path / name).write_text(text)
    workload = {"trace": {"format": fmt, "path": name, "slot_width": 0, **trace} if fmt == "mooncake"
                else {"format": fmt, "path": name, **trace}}
    return write(tmp_path, {**TINY, "workload": workload})


GOOD_MOONCAKE = "\n".join(mooncake_line(1000 * i, 100 + i, 5) for i in range(4)) + "\n"


# 5. A window or filter leaving no request

def test_05_a_window_that_leaves_no_request_names_the_filter(tmp_path):
    exp = trace_experiment(tmp_path, "mooncake", "t.jsonl", GOOD_MOONCAKE, start=1e9)
    assert_user_error(cli("run", exp, "--out", tmp_path / "out"), "t.jsonl", "workload.trace.start", "span 0 to 3")
    assert not (tmp_path / "out").exists()


def test_05_a_length_filter_or_a_header_only_csv_is_a_clean_error(tmp_path):
    exp = trace_experiment(tmp_path, "mooncake", "t.jsonl", GOOD_MOONCAKE, max_prompt_len=50)
    assert_user_error(cli("validate", exp), "workload.trace.max_prompt_len", "shortest prompt left has 100")
    exp = trace_experiment(tmp_path, "azure", "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert_user_error(cli("validate", exp), "a.csv", "workload.trace.path", "at least one usable row")


# 6. NaN timestamps and lengths are dropped and counted, never silently

def test_06_nan_rows_in_mooncake_azure_and_vidur_are_counted(tmp_path):
    mooncake = GOOD_MOONCAKE + '{"timestamp": NaN, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n'
    azure = ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00.0,100,5\n,100,5\n"
             "2023-11-16 18:00:01.0,,5\n2023-11-16 18:00:02.0,100.5,5\n2023-11-16 18:00:03.0,100,5\n")
    vidur = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,5\nnan,100,5\n1.0,100,\n2.0,100,5\n"
    for fmt, name, text, expected in (
            ("mooncake", "t.jsonl", mooncake, {"missing or non-numeric value": 1}),
            ("azure", "a.csv", azure, {"missing or non-numeric value": 2, "non-integer length": 1}),
            ("vidur", "v.csv", vidur, {"missing or non-numeric value": 2})):
        exp = trace_experiment(tmp_path, fmt, name, text)
        result = cli("workload", "describe", exp)
        assert result.exit_code == 0, result.output
        for reason, n in expected.items():
            assert f"{reason}: {n}" in result.output, (fmt, result.output)
            assert f"warning: {n} trace rows dropped: {reason}" in result.output, (fmt, result.output)


# 7. Integers beyond int64 and integral huge floats

def test_07_trace_lengths_beyond_int64_are_dropped_not_overflowing(tmp_path):
    text = GOOD_MOONCAKE + mooncake_line(5000, 10 ** 30, 5) + "\n" + mooncake_line(6000, 100, 2 ** 70) + "\n"
    exp = trace_experiment(tmp_path, "mooncake", "t.jsonl", text)
    result = cli("workload", "describe", exp)
    assert result.exit_code == 0, result.output
    assert "4 requests" in result.output and "length beyond 2**53: 2" in result.output


# Nothing dropped silently: the summary and the run's stderr

def test_dropped_rows_reach_the_summary_and_a_warning(tmp_path):
    text = GOOD_MOONCAKE + mooncake_line(5000, 0, 5) + "\n"
    exp = trace_experiment(tmp_path, "mooncake", "t.jsonl", text, max_requests=3)
    result = cli("run", exp, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["dropped_rows"] == {"zero length": 1, "over max_requests": 1}
    assert "warning: 1 trace rows dropped: zero length" in result.output
    assert "over max_requests" not in result.output.split("dropped_rows")[0]


@pytest.mark.parametrize("override, key, expected", [
    ("workload.num_requests=1.0e+300", "workload.num_requests", "below 2**63"),
    ("workload.num_requests=100000000", "workload.num_requests", "10,000,000"),
    ("policy.token_budget=99999999999999999999999", "policy.token_budget", "below 2**63"),
    ("workload.prompt_len.max=1.0e+18", "workload.prompt_len.max", "max_model_len (8192)"),
    ("workload.shared_prefix={prefix_len: 1.0e+18}", "workload.shared_prefix.prefix_len", "max_model_len"),
    ("workload.output_len.value=100000", "workload.output_len.value", "max_model_len"),
    ("workload.arrival.rate=.nan", "workload.arrival.rate", "a finite number"),
    ("workload.arrival.rate=.inf", "workload.arrival.rate", "a finite number"),
])
def test_07_huge_integral_floats_and_lengths_are_bounded_at_validation(override, key, expected):
    assert_user_error(cli("validate", QUICKSTART, "--set", override), f"--set {override}", key, expected)


# 9. Values that passed validate and then crashed, or were silently replaced

@pytest.mark.parametrize("override, key", [
    ("seed=-1", "seed"), ("sim.max_time=0", "sim.max_time"), ("output.shapes=-1", "output.shapes"),
    ("cluster.replicas=100000", "cluster.replicas"), ("cluster.kv_cache.num_blocks=1.0e+15", "num_blocks"),
])
def test_09_bad_seed_max_time_shapes_and_replicas_are_named(override, key):
    assert_user_error(cli("validate", QUICKSTART, "--set", override), f"--set {override}", key)


@pytest.mark.parametrize("workers", ["0", "-1"])
def test_09_sweep_workers_below_one_are_refused(tmp_path, workers):
    from cbsim.tools.sweep.sweep import run_sweep

    sweep = write(tmp_path, {"base": TINY, "grid": {"policy.token_budget": [64]}}, "sweep.yaml")
    assert_user_error(cli("sweep", sweep, "--workers", workers, "--out", tmp_path / "o"), "--workers")
    with pytest.raises(ConfigError, match="workers"):
        run_sweep(sweep, workers=int(workers))


# 10. Capacity SLOs

@pytest.mark.parametrize("limit", ["nan", "inf", "0", "-1"])
def test_10_capacity_slos_must_be_finite_and_positive(tmp_path, limit):
    assert_user_error(cli("capacity", write(tmp_path, TINY), "--slo", f"itl_p99={limit}"), "slo.itl_p99", "> 0")


# 11. Output folder checked before simulating

def test_11_unwritable_output_folder_fails_before_simulating(tmp_path, monkeypatch):
    import cbsim.api

    monkeypatch.setattr(cbsim.api, "simulate_run", lambda *a: pytest.fail("simulated before checking --out"))
    assert_user_error(cli("run", write(tmp_path, TINY), "--out", "/dev/null/x"), "--out", "/dev/null/x")
    blocker = tmp_path / "file"
    blocker.write_text("")
    exp = write(tmp_path, {**TINY, "output": {"dir": str(blocker / "sub"), "plots": False}})
    assert_user_error(cli("run", exp), "exp.yaml", "output.dir", "is not a folder")
    sweep = write(tmp_path, {"base": TINY, "grid": {"policy.token_budget": [64]}}, "sweep.yaml")
    assert_user_error(cli("sweep", sweep, "--out", blocker / "x"), "--out")


# 12. Names become folders under results/

@pytest.mark.parametrize("name", ["../../../x", "a/b", "..", "", "a\\\\b"])
def test_12_names_with_path_separators_or_dots_are_refused(tmp_path, name):
    assert_user_error(cli("validate", write(tmp_path, {**TINY, "name": name})), "exp.yaml", "name", "folder name")
    with pytest.raises(ConfigError, match="name"):
        from cbsim.tools.sweep.sweep import load_sweep

        load_sweep({"base": TINY, "grid": {"policy.token_budget": [64]}, "name": name})


# Newcomer: the CLI finds traces in ../shared/data like reproduce.py and the notebooks

def test_cli_finds_traces_beside_the_repository_without_cbsim_data(monkeypatch, tmp_path):
    from cbsim.core import data

    monkeypatch.delenv("CBSIM_DATA", raising=False)
    found = data.data_dir()
    if found is None or not (found / "traces").is_dir():
        pytest.skip("no shared/data beside the repository")
    assert found.resolve() == (ROOT.parent / "shared" / "data").resolve()
    result = cli("validate", ROOT / "experiments" / "lpm_mooncake.yaml")
    assert result.exit_code == 0, result.output
    monkeypatch.setenv("CBSIM_DATA", str(tmp_path))
    assert data.data_dir() == tmp_path
    assert_user_error(cli("validate", ROOT / "experiments" / "lpm_mooncake.yaml"), "workload.trace.path",
                      str(tmp_path))


# Newcomer: tests and the Python API never overwrite results/quickstart

def test_run_experiment_writes_only_to_an_explicit_out_dir(tmp_path, monkeypatch):
    from cbsim.api import run_experiment

    monkeypatch.chdir(tmp_path)
    small = ["workload.num_requests=20", "output.plots=false", "output.trace=false"]
    results = run_experiment(QUICKSTART, overrides=small)
    assert results.out_dir is None and not (tmp_path / "results").exists()
    run_experiment(QUICKSTART, out_dir=tmp_path / "mine", overrides=small)
    assert (tmp_path / "mine" / "summary.json").is_file()
    result = cli("run", QUICKSTART, *[arg for item in small for arg in ("--set", item)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "results" / "quickstart" / "summary.json").is_file()  # the CLI writes where it did


# 14. cbsim fit / costcheck: errors name the file and the row

MEASURED = ("batch_id,cls,source,prefill,decode,layer_s_median,lm_head_s\n"
            "0,decode,grid,,8,0.001,0.0002\n1,prefill,grid,128:0,,0.002,0.0002\n")


@pytest.mark.parametrize("extra, key", [
    ("2,decode,grid,,16,nan,0.0002\n", "layer_s_median (row 2, line 4)"),
    ("2,decode,grid,,16,-0.001,0.0002\n", "layer_s_median (row 2, line 4)"),
    ("2,decode,grid,,16,0.001,-1\n", "lm_head_s (row 2, line 4)"),
    ("2,decode,grid,,16\n", "line 4"),
])
def test_14_bad_timing_rows_are_errors_naming_file_and_row(tmp_path, extra, key):
    from cbsim.profiler.fit import load_measurements

    path = tmp_path / "m.csv"
    path.write_text(MEASURED + extra)
    with pytest.raises(ConfigError) as err:
        load_measurements(path)
    assert str(err.value).startswith(f"{path}: {key}")
    assert_user_error(cli("fit", path, "--out", tmp_path / "p.json"), "m.csv", key)
    assert not (tmp_path / "p.json").exists()


def test_14_unreadable_measurements_and_profiles_name_the_file(tmp_path):
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    assert_user_error(cli("fit", empty, "--out", tmp_path / "p.json"), "empty.csv")
    good = tmp_path / "m.csv"
    good.write_text(MEASURED)
    binary = tmp_path / "profile.json"
    binary.write_bytes(b"\x86\xff\x00")
    assert_user_error(cli("costcheck", binary, good), "profile.json")


# The fuzz battery: the shipped quickstart mutated one field at a time. Every outcome is a valid
# config (validate says ok) or a ConfigError naming the file and the mutated key (or its parent,
# a child or a sibling: a changed median is reported at the bound it conflicts with).

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

BASE = yaml.safe_load(QUICKSTART.read_text())
MUTATIONS = {
    "drop": None, "string": "x", "list": [1], "mapping": {"a": 1}, "negative": -1, "zero": 0,
    "huge_int": 10 ** 30, "huge_float": 1.0e300, "nan": math.nan, "inf": math.inf, "unicode": "ünï©ødé",
    "bool": True, "unknown_key": "zzz_unknown",
}


def key_paths(node, prefix=""):
    for key, value in node.items():
        path = f"{prefix}{key}"
        yield path
        if isinstance(value, dict):
            yield from key_paths(value, path + ".")


PATHS = sorted(key_paths(BASE))


def mutate(data: dict, path: str, kind: str) -> dict:
    data = json.loads(json.dumps(data))
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node[part]
    if kind == "drop":
        del node[leaf]
    elif kind == "unknown_key":
        target = node[leaf] if isinstance(node[leaf], dict) else node
        target["zzz_unknown"] = 1
    else:
        node[leaf] = MUTATIONS[kind]
    return data


def related(named: str, key: str) -> bool:
    """The error's key is the mutated key, or its parent, a child or a sibling of it."""
    a, b = named.split("."), key.split(".")
    common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return common >= min(len(a), len(b)) or common >= len(b) - 1 or named == "<root>"


@settings(max_examples=120, derandomize=True, deadline=None)
@given(path=st.sampled_from(PATHS), kind=st.sampled_from(sorted(MUTATIONS)))
def test_fuzz_one_field_of_quickstart(tmp_path_factory, path, kind):
    folder = tmp_path_factory.mktemp("fuzz")
    file = folder / "mutant.yaml"
    file.write_text(yaml.safe_dump(mutate(BASE, path, kind), allow_unicode=True))
    try:
        load_config(file)
        loaded = None
    except ConfigError as err:
        loaded = err
        assert err.file == str(file), (path, kind, str(err))
        shown = "zzz_unknown" if kind == "unknown_key" else path
        assert related(err.path, shown) or shown in err.path, (path, kind, str(err))
    result = cli("validate", file)
    if loaded is not None:
        assert_user_error(result, "mutant.yaml")
    else:
        assert result.exit_code in (0, 2), (path, kind, result.output, result.exception)
        if result.exit_code == 2:
            assert_user_error(result, "mutant.yaml")


# cbsim validate validates: what run rejects before simulating, validate rejects

def test_validate_opens_traces_and_profiles_and_builds_the_replicas(tmp_path):
    header = trace_experiment(tmp_path, "vidur", "v.csv", "a,b\n1,2\n")
    assert_user_error(cli("validate", header), "v.csv", "workload.trace", "num_prefill_tokens")
    missing = write(tmp_path, {**TINY, "workload": {"trace": {"format": "azure", "path": "nope.csv"}}}, "m.yaml")
    assert_user_error(cli("validate", missing), "m.yaml", "workload.trace.path", "an existing trace file")
    binary = tmp_path / "profile.json"
    binary.write_bytes(b"\x86\xff\x00")
    exp = write(tmp_path, {**TINY, "cost_model": {"type": "fitted", "profile": str(binary)}}, "p.yaml")
    assert_user_error(cli("validate", exp), "profile.json", "cost_model.profile", "valid JSON")
    noise = write(tmp_path, {**TINY, "sim": {"cost_noise": True}}, "n.yaml")
    assert_user_error(cli("validate", noise), "n.yaml", "sim.cost_noise")


# Newcomer: the fast subset and the notebooks extra

def test_slow_marker_is_registered_and_the_notebooks_extra_exists():
    import re
    import tomllib

    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert any(m.startswith("slow:") for m in conf["tool"]["pytest"]["ini_options"]["markers"])
    extra = {re.split("[<>=]", d)[0] for d in conf["project"]["optional-dependencies"]["notebooks"]}
    assert {"jupyter", "nbconvert"} <= extra


def test_09_workload_describe_refuses_a_negative_seed(tmp_path):
    exp = write(tmp_path, TINY)
    assert_user_error(cli("workload", "describe", exp, "--seed", "-1"), "exp.yaml", "--seed", ">= 0")
    assert_user_error(cli("workload", "describe", write(tmp_path, {**TINY, "seed": -2}, "s.yaml")), "s.yaml", "seed")
