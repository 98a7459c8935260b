"""A fuzz battery over every input cbsim reads (issue 26): experiment configs, traces, fitted profiles,
Hugging Face configs, measured results and command-line arguments, each mutated by hypothesis and given
to the CLI in this process. Every case must end in one of two ways: exit 0 with a complete results folder
(its completion marker written), or exit 2 with one line `error: ...`; never a traceback, a hang (each
case runs under an alarm) or a half-written folder.

The default battery is small enough for CI (about 20 s on two cores; derandomized, so a failure
reproduces); the `slow` variant runs ten times as many cases per input.
"""
from __future__ import annotations

import math

import contextlib
import copy
import json
import os
import signal
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from cbsim.cli.app import app
from cbsim.core.atomic import is_complete

from paths import ROOT
PROFILE = ROOT / "sim" / "costmodels" / "profiles" / "fitted" / "a100-llama-2-70b-tp2-published.json"
PER_CASE_S = 30  # a case that takes longer is a hang
runner = CliRunner()

TINY = {
    "name": "fuzz", "seed": 3, "cost_model": {"type": "linear", "base": 0.01, "per_token": 1e-4},
    "cluster": {"kv_cache": {"num_blocks": 400}, "replicas": 1},
    "policy": {"name": "sarathi", "token_budget": 128},
    "workload": {"num_requests": 8, "arrival": {"type": "poisson", "rate": 20.0},
                 "prompt_len": {"type": "uniform", "min": 10, "max": 300},
                 "output_len": {"type": "uniform", "min": 1, "max": 20}},
    "sim": {"max_time": None}, "metrics": {"slo": {"ttft": 1.0}}, "output": {"plots": False, "trace": False},
}
HF_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 512, "num_hidden_layers": 4,
             "num_attention_heads": 8, "num_key_value_heads": 8, "intermediate_size": 1024, "vocab_size": 32000,
             "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
MEASURED = {"ttft_mean": 0.05, "ttft_p50": 0.04, "itl_p99": 0.02, "throughput_tokens_per_s": 900.0}
TRACE_ROWS = [{"timestamp": 1000 * i, "input_length": 100 + i, "output_length": 5, "hash_ids": [i]} for i in range(4)]

NASTY = st.sampled_from([0, -1, 1, 2**31, 2**63, -2**63, 2**64, 10**30, -0.0, 0.5, 1e300, -1e300, 1e-300, 5e-324,
                         float("nan"), float("inf"), "", "x" * 300, "../..", "\x00", "é", "auto", "vllm", "orca",
                         "null", True, False, None, [], {}])
SCALARS = st.one_of(NASTY, st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=5)


def key_paths(node, prefix=()) -> list[tuple]:
    """Every path to a value inside nested dicts and lists."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    out = []
    for key, child in items:
        out.append(prefix + (key,))
        out += key_paths(child, prefix + (key,))
    return out


def near(value):
    """Values close to `value`: a number scaled or at an edge, a string from the names cbsim knows."""
    if isinstance(value, bool) or value is None:
        return VALUES
    if isinstance(value, (int, float)):
        return st.one_of(st.sampled_from([0, 1, -1, value * 2, value / 2, -value, value + 1,
                                          (int(value) if math.isfinite(value) else 0) or 1]),
                         st.floats(min_value=-1e6, max_value=1e6), st.integers(-10, 10**6), NASTY)
    if isinstance(value, str):
        return st.sampled_from(["sarathi", "orca", "static", "splitfuse", "prefill_first", "sglang", "vllm", "linear",
                                "roofline", "poisson", "gamma", "constant", "uniform", "fixed", "lognormal", "csv",
                                "parquet", "pd", "recompute", "swap", "h100", "a100", value + "x", ""])
    return VALUES


@st.composite
def mutated(draw, base):
    """`base` with one to three values replaced (often by one near the old), deleted, or added beside them."""
    data = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = key_paths(data)
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        action = draw(st.sampled_from(["near", "near", "set", "delete", "add"]))
        if action == "near":
            parent[path[-1]] = draw(near(parent[path[-1]]))
        elif action == "delete":
            del parent[path[-1]]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=10))] = draw(VALUES)
        else:
            parent[path[-1]] = draw(VALUES)
    return data


@contextlib.contextmanager
def alarm(seconds: int):
    def hang(signum, frame):
        raise TimeoutError(f"a case ran past {seconds} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def scratch():
    """A temporary folder, also the current one (a mutated output.dir cannot reach the repository)."""
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        try:
            yield Path(folder)
        finally:
            os.chdir(here)


def invoke(*args):
    with alarm(PER_CASE_S):
        return runner.invoke(app, [str(a) for a in args])


def check(result, out: Path | None = None, usage_ok: bool = False) -> None:
    """Exit 0 with a complete folder (when `out`), or exit 2 with one error line; nothing else."""
    text = result.output
    assert not isinstance(result.exception, TimeoutError), "hang: " + str(result.exception)
    assert "Traceback" not in text, text
    assert result.exit_code in (0, 2), (result.exit_code, repr(result.exception), text[-2000:])
    if result.exit_code == 0:
        if out is not None:
            assert is_complete(out), f"exit 0 without a complete folder at {out}"
        return
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    if usage_ok and not errors:  # the command line's own usage errors (click: 'Usage: ...', exit 2)
        assert "Usage" in text or "Error" in text, text
        return
    assert len(errors) == 1, text
    if out is not None:
        assert not out.exists() or is_complete(out), "a failed run left a folder without its marker"


def run_config(data, folder: Path, command: str = "run", extra=()) -> None:
    exp = folder / "exp.yaml"
    exp.write_text(yaml.safe_dump(data, allow_unicode=True) if isinstance(data, dict) else str(data))
    out = folder / "out"
    if command == "run":
        check(invoke("run", exp, "--out", out, "-q", *extra), out)
    else:
        check(invoke(command, exp, *extra))


FUZZ = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
EXAMPLES = {"config": 60, "trace": 15, "profile": 15, "hf_config": 15, "measured": 10, "args": 30, "faults": 10}


def battery(scale: int):
    """The battery's tests at `scale` times the CI number of cases."""

    @settings(max_examples=EXAMPLES["config"] * scale, **FUZZ)
    @given(mutated(TINY))
    def configs(data):
        with scratch() as folder:
            run_config(data, folder)

    @settings(max_examples=EXAMPLES["trace"] * scale, **FUZZ)
    @given(mutated({"rows": TRACE_ROWS}), st.sampled_from(["", "\n{", "\xff", "[" * 3000]))
    def traces(rows, tail):
        with scratch() as folder:
            lines = [json.dumps(row, allow_nan=True) for row in rows["rows"]] if isinstance(rows.get("rows"), list) else []
            (folder / "t.jsonl").write_text("\n".join(lines) + "\n" + tail, errors="surrogateescape")
            data = {**TINY, "workload": {"trace": {"format": "mooncake", "path": "t.jsonl", "slot_width": 0}}}
            run_config(data, folder)

    @settings(max_examples=EXAMPLES["profile"] * scale, **FUZZ)
    @given(mutated(json.loads(PROFILE.read_text())))
    def profiles(profile):
        with scratch() as folder:
            (folder / "p.json").write_text(json.dumps(profile, allow_nan=True))
            run_config({**TINY, "cost_model": {"type": "fitted", "profile": "p.json"}}, folder, "validate")

    @settings(max_examples=EXAMPLES["hf_config"] * scale, **FUZZ)
    @given(mutated(HF_CONFIG))
    def hf_configs(config):
        with scratch() as folder:
            (folder / "config.json").write_text(json.dumps(config, allow_nan=True))
            data = {**TINY, "model": "config.json", "cost_model": {"type": "roofline", "gpu": "h100"}}
            run_config(data, folder)

    @settings(max_examples=EXAMPLES["measured"] * scale, **FUZZ)
    @given(mutated(MEASURED))
    def measured(record):
        with scratch() as folder:
            (folder / "bench.json").write_text(json.dumps(record, allow_nan=True))
            exp = folder / "exp.yaml"
            exp.write_text(yaml.safe_dump(TINY))
            check(invoke("compare", exp, folder / "bench.json", "--out", folder / "cmp"), folder / "cmp")

    words = st.sampled_from(["--set", "seed=1", "seed=-1", "policy.name=orca", "workload.num_requests=0",
                             "sim.max_time=0.01", "output.formats=[csv]", "name=x", "--out", "", ".", "out",
                             "-q", "--overwrite", "policy=", "=", "a.b.c=1", "cluster.replicas=2", "exp.yaml"])

    @settings(max_examples=EXAMPLES["args"] * scale, **FUZZ)
    @given(st.sampled_from(["run", "validate"]), st.lists(words, max_size=6))
    def arguments(command, args):
        with scratch() as folder:
            (folder / "exp.yaml").write_text(yaml.safe_dump(TINY))
            result = invoke(command, "exp.yaml", *args)
            check(result, usage_ok=True)
            for name in ("out", "results/fuzz", *(a for a in args if a not in ("", "."))):
                path = folder / name
                if path.is_dir() and (path / "summary.json").exists():
                    assert is_complete(path), f"{path}: results without their marker"

    @settings(max_examples=EXAMPLES["faults"] * scale, **FUZZ)
    @given(st.sampled_from(["cbsim.api.write_parquet", "cbsim.core.atomic._fsync", "cbsim.api.bench_result"]),
           st.integers(0, 6), st.sampled_from([28, 13, 5]))
    def faults(target, after, code):
        """The disk fills (ENOSPC), refuses (EACCES) or fails (EIO) at the `after`-th write of one kind:
        exit 2 with one line, and the previous complete folder stays as it was, or the run completes."""
        import unittest.mock

        with scratch() as folder:
            exp = folder / "exp.yaml"
            exp.write_text(yaml.safe_dump({**TINY, "output": {"plots": False, "formats": ["parquet", "csv"]}}))
            out = folder / "out"
            check(invoke("run", exp, "--out", out, "-q"), out)
            before = {p.name: p.read_bytes() for p in out.iterdir()}
            module, _, name = target.rpartition(".")
            real = getattr(__import__(module, fromlist=[name]), name)
            calls = []

            def failing(*args, **kwargs):
                calls.append(1)
                if len(calls) > after:
                    raise OSError(code, os.strerror(code))
                return real(*args, **kwargs)

            with unittest.mock.patch(target, failing):
                result = invoke("run", exp, "--out", out, "-q", "--set", "seed=4")
            check(result, out)
            if result.exit_code == 2:
                assert {p.name: p.read_bytes() for p in out.iterdir()} == before
            assert sorted(p.name for p in folder.iterdir()) == [".out.lock", "exp.yaml", "out"]

    return [configs, traces, profiles, hf_configs, measured, arguments, faults]


@pytest.mark.parametrize("case", battery(1), ids=lambda f: f.__name__)
def test_fuzz(case):
    case()


@pytest.mark.slow
@pytest.mark.parametrize("case", battery(10), ids=lambda f: f.__name__)
def test_fuzz_large(case):
    case()
