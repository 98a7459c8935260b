"""Errors a user can act on (issue 30): one line however long the input, 'did you mean', --set named."""
import json

import pytest
from typer.testing import CliRunner

from cbsim.cli.app import app
from cbsim.config import load_config
from cbsim.core.bounds import short_repr as echo
from cbsim.core.errors import ConfigError
from cbsim.core.suggest import did_you_mean

runner = CliRunner()
QUICKSTART = "experiments/quickstart.yaml"


def test_an_echoed_value_is_one_bounded_line():
    assert echo("short") == "'short'"
    value = ["x" * 10_000, "y\nz"]
    text = echo(value)
    assert "\n" not in text and len(text) < 200 and text.endswith("...")
    assert len(str(ConfigError("k", "a thing", "a" * 900_000))) < 300


def test_a_sharegpt_json_read_as_csv_says_so_in_one_line(tmp_path):
    data = tmp_path / "ShareGPT.json"
    data.write_text(json.dumps([{"id": str(i), "conversations": [{"from": "human", "value": "hi " * 200}]}
                                for i in range(300)]))
    exp = tmp_path / "e.yaml"
    exp.write_text(f"workload: {{trace: {{path: {data}, format: sharegpt}}, arrival: {{type: poisson, rate: 1}}}}\n")
    result = runner.invoke(app, ["validate", str(exp)])
    assert result.exit_code == 2 and len(result.output) < 1000, len(result.output)
    assert "format sharegpt_json" in result.output and result.output.count("\n") == 1


@pytest.mark.parametrize("override, hint", [("cluster.kv_cahce.block_size=8", "did you mean 'kv_cache'?"),
                                            ("policy.name=sarathii", "did you mean 'sarathi'?"),
                                            ("model=llama-3-8", "did you mean 'llama-3-8b'"),
                                            ("cost_model.gpu=h1000", "did you mean 'h100'"),
                                            ("server={engine: vllm, args: --max-num-seq 8}",
                                             "did you mean '--max-num-seqs'")])
def test_did_you_mean_and_set_named_as_set(override, hint):
    with pytest.raises(ConfigError) as err:
        load_config(QUICKSTART, [override])
    assert hint in str(err.value)
    assert str(err.value).startswith(f"--set {override}: ") and "quickstart.yaml" not in str(err.value)


def test_an_error_in_the_file_still_names_the_file(tmp_path):
    path = tmp_path / "e.yaml"
    path.write_text("polcy: {name: sarathi}\n")
    with pytest.raises(ConfigError, match=r"e\.yaml: polcy: .*did you mean 'policy'\?") as err:
        load_config(path, ["seed=1"])
    assert "--set" not in str(err.value)


def test_nothing_close_suggests_nothing():
    assert did_you_mean("zzzz", ["sarathi", "orca"]) == "" and did_you_mean(3, ["a"]) == ""
    assert did_you_mean("Sarathi", ["sarathi"]) == "; did you mean 'sarathi'?"
