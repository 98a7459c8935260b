"""Bounded work before validation (issue 26, defects 6, 7 and 12): a YAML alias bomb, a --set value
built of aliases, JSON nested 5,000 deep in every JSON reader and a model of 10^9 layers each end in one
line naming the file, in bounded time, never a hang or a RecursionError (cbsim/core/bounds.py)."""
import json
import time

import pytest

from factories import TINY_EXPERIMENT as TINY
from factories import assert_user_error, cli, write_experiment

from cbsim.config import read_yaml
from cbsim.core import bounds
from cbsim.core.errors import ConfigError

DEEP = "[" * 5000 + "]" * 5000


def write(tmp_path, data, name="exp.yaml"):
    if isinstance(data, dict):
        return write_experiment(tmp_path, data, name)
    path = tmp_path / name
    path.write_text(data)
    return path


def alias_bomb() -> str:
    """Nine levels of nine aliases: 300 bytes that name one list 9^9 (387 million) times."""
    value = '&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'
    previous = "a"
    for name in "bcdefghi":
        value = f"&{name} [" + ",".join([value] + [f"*{previous}"] * 8) + "]"
        previous = name
    return value


def quick(result, started, limit=20.0):
    assert time.monotonic() - started < limit, "took too long: the work was not bounded"
    return result


def test_a_yaml_alias_bomb_fails_fast_with_one_line(tmp_path):
    path = write(tmp_path, f"name: {alias_bomb()}\n", "bomb.yaml")
    assert path.stat().st_size < 500
    started = time.monotonic()
    assert_user_error(quick(cli("validate", path), started), "bomb.yaml", "aliases that expand to at most")


def test_a_set_value_of_aliases_fails_fast_and_shows_one_short_line(tmp_path):
    started = time.monotonic()
    result = quick(cli("validate", write(tmp_path, TINY), "--set", f"seed={alias_bomb()}"), started)
    assert_user_error(result, "--set seed", "aliases")
    assert len(result.output) < 400


def test_a_recursive_alias_is_refused(tmp_path):
    assert_user_error(cli("validate", write(tmp_path, "name: &a [*a]\n", "r.yaml")), "r.yaml", "recursive alias")


def test_aliases_within_the_budget_still_read():
    assert bounds.load_yaml("a: &x [1, 2]\nb: *x\n") == {"a": [1, 2], "b": [1, 2]}


def test_a_yaml_file_over_the_size_cap_is_refused_before_reading(tmp_path, monkeypatch):
    monkeypatch.setattr("cbsim.config.MAX_YAML_BYTES", 100)
    path = write(tmp_path, TINY)
    with pytest.raises(ConfigError, match="a YAML file of at most"):
        read_yaml(path)


def test_an_error_message_shows_one_short_line_of_a_huge_value():
    text = str(ConfigError("seed", "an integer", list(range(10**6))))
    assert len(text) < 200 and "\n" not in text
    assert "4,000,000 bits" not in bounds.short_repr(10**5000) and "bits" in bounds.short_repr(10**5000)
    assert bounds.short_repr({"b": 1, "a": 2}) == "{'b': 1, 'a': 2}"  # a small value as repr shows it
    assert len(bounds.short_repr("x" * 10**6)) <= bounds.MAX_SHOWN


def test_json_nested_too_deep_is_a_decode_error_not_a_recursion_error():
    with pytest.raises(json.JSONDecodeError, match="nested at most 64"):
        bounds.loads(DEEP)
    with pytest.raises(json.JSONDecodeError, match="nested at most 64"):
        bounds.loads("[" * 100 + "]" * 100)  # within the parser's recursion limit, beyond ours
    assert bounds.loads("[" * 64 + "]" * 64) is not None


@pytest.mark.parametrize("kind", ["trace", "fitted", "vidur", "engine", "hf_config"])
def test_every_json_reader_refuses_deep_nesting_naming_the_file(tmp_path, kind):
    deep = tmp_path / "deep.json"
    if kind == "trace":
        deep = tmp_path / "deep.jsonl"
        deep.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 2}) + "\n" + DEEP + "\n")
        data = {**TINY, "workload": {"trace": {"format": "mooncake", "path": "deep.jsonl", "slot_width": 0}}}
    else:
        deep.write_text(DEEP)
        cost = {"fitted": {"type": "fitted", "profile": str(deep)}, "vidur": {"type": "vidur", "profile": str(deep)},
                "engine": {"type": "roofline", "gpu": "h100", "engine": str(deep)}, "hf_config": TINY["cost_model"]}[kind]
        data = {**TINY, "cost_model": cost, **({"model": str(deep)} if kind == "hf_config" else {})}
    result = cli("validate", write(tmp_path, data))
    assert_user_error(result, deep.name)
    assert "nested" in result.output or "readable engine file" in result.output


def test_measured_results_nested_too_deep_are_one_line(tmp_path):
    measured = tmp_path / "bench.json"
    measured.write_text(DEEP)
    assert_user_error(cli("compare", write(tmp_path, TINY), measured, "--out", tmp_path / "o"), "bench.json", "nested")


def hf_config(tmp_path, **changes):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
              "vocab_size": 128256, "max_position_embeddings": 8192, "torch_dtype": "bfloat16", **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 10**9), ("max_position_embeddings", 10**12),
                                        ("vocab_size", 2**40)])
def test_a_model_beyond_any_released_one_is_refused_before_per_layer_work(tmp_path, key, value):
    model = hf_config(tmp_path, **{key: value})
    data = {**TINY, "model": str(model), "cost_model": {"type": "roofline", "gpu": "h100"}}
    started = time.monotonic()
    assert_user_error(quick(cli("validate", write(tmp_path, data)), started, 10.0), "config.json", key, "at most")
