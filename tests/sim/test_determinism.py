"""Same config and seed: byte-identical request and step files (and an agentic run's session tables);
another seed: different ones."""
import hashlib

from cbsim.api import run_experiment

CONFIG = {
    "name": "det", "seed": 11, "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1},
    "cluster": {"replicas": 2, "router": "least_loaded", "kv_cache": {"num_blocks": 150}},
    "policy": {"name": "sarathi", "token_budget": 256},
    "workload": {"num_requests": 120, "arrival": {"type": "gamma", "rate": 30.0, "cv": 2.0},
                 "prompt_len": {"type": "lognormal", "median": 300, "sigma": 1.0, "max": 3000},
                 "output_len": {"type": "uniform", "min": 1, "max": 120}},
    "output": {"plots": False, "trace": True, "formats": ["csv", "parquet"]},
}


def digests(out):
    return {name: hashlib.sha256((out / name).read_bytes()).hexdigest()
            for name in ("requests.csv", "requests.parquet", "steps.csv", "steps.parquet", "trace.json")}


def test_same_seed_gives_byte_identical_files(tmp_path):
    a = run_experiment(CONFIG, out_dir=tmp_path / "a")
    b = run_experiment(CONFIG, out_dir=tmp_path / "b")
    assert digests(tmp_path / "a") == digests(tmp_path / "b")
    assert a.summary["num_preemptions"] > 0  # the KV cache is tight enough to exercise preemption


def test_another_seed_differs(tmp_path):
    run_experiment(CONFIG, out_dir=tmp_path / "a")
    run_experiment({**CONFIG, "seed": 12}, out_dir=tmp_path / "b")
    assert digests(tmp_path / "a")["requests.csv"] != digests(tmp_path / "b")["requests.csv"]


def test_cost_noise_is_seeded_and_needs_residuals(tmp_path):
    import pytest

    from cbsim.core.errors import ConfigError

    with pytest.raises(ConfigError, match="sim.cost_noise"):
        run_experiment({**CONFIG, "sim": {"cost_noise": True}})


def test_agentic_sessions_give_byte_identical_tables(tmp_path):
    from test_agentic_sessions import CONFIG as AGENTIC

    def files(out):
        return {n: hashlib.sha256((out / n).read_bytes()).hexdigest()
                for n in ("requests.csv", "steps.parquet", "sessions.csv", "session_turns.csv")}

    a = run_experiment(AGENTIC, out_dir=tmp_path / "a")
    run_experiment(AGENTIC, out_dir=tmp_path / "b")
    run_experiment({**AGENTIC, "seed": 8}, out_dir=tmp_path / "c")
    assert files(tmp_path / "a") == files(tmp_path / "b") != files(tmp_path / "c")
    assert a.summary["num_subagents"] > 0
