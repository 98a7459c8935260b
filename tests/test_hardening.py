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

from cbsim.cli import app
from cbsim.config import load_config
from cbsim.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
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


def assert_user_error(result, *needles):
    """Exit code 2, one line on stderr naming every needle, no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    text = result.output.strip()
    assert text.startswith("error: ") and "\n" not in text and "Traceback" not in text, text
    for needle in needles:
        assert str(needle) in text, (needle, text)


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
    assert_user_error(cli("validate", QUICKSTART, "--set", override), "quickstart.yaml", key, "one of")
