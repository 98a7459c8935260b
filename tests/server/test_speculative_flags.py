"""The engines' speculative-decoding flags resolve to the `speculative:` section (cbsim/server/speculative.py)."""
from __future__ import annotations

import pytest

from cbsim.config import load_config
from cbsim.core.errors import ConfigError

WORKLOAD = {"num_requests": 5, "arrival": {"type": "poisson", "rate": 1.0},
            "prompt_len": {"type": "fixed", "value": 100}, "output_len": {"type": "fixed", "value": 10}}


def resolved(engine, args, **extra):
    data = {"name": "s", "model": "llama-3-8b", "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1},
            "server": {"engine": engine, "args": args}, "workload": WORKLOAD, **extra}
    return load_config(data).speculative


@pytest.mark.parametrize("config,method", [
    ('{"method": "eagle3", "model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}', "eagle3"),
    ('{"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3}', "eagle3"),  # inferred
    ('{"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 3}', "eagle"),
    ('{"method": "deepseek_mtp", "num_speculative_tokens": 3}', "mtp"),
    ('{"method": "suffix", "num_speculative_tokens": 3}', "ngram"),
])
def test_vllm_speculative_config(config, method):
    spec = resolved("vllm", f"--speculative-config '{config}'", speculative={"acceptance": 0.6})
    assert (spec.method, spec.num_speculative_tokens, spec.acceptance) == (method, 3, 0.6)


def test_vllm_draft_model_names_the_draft():
    spec = resolved("vllm", """--speculative-config '{"model": "llama-3-8b", "num_speculative_tokens": 5}'""",
                    speculative={"acceptance": [0.8, 0.7, 0.6, 0.5, 0.4]})
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "llama-3-8b", 5)


def test_sglang_chain_flags():
    spec = resolved("sglang", "--speculative-algorithm EAGLE3 --speculative-num-steps 4 --speculative-eagle-topk 1 "
                    "--speculative-num-draft-tokens 5")
    assert (spec.method, spec.num_speculative_tokens) == ("eagle3", 4)
    assert resolved("sglang", "") is None


@pytest.mark.parametrize("engine,args,needle", [
    ("vllm", """--speculative-config '{"method": "medusa", "num_speculative_tokens": 3}'""", "method"),
    ("vllm", """--speculative-config '{"method": "eagle3"}'""", "num_speculative_tokens"),
    ("vllm", "--speculative-config '[1, 2]'", "--speculative-config"),
    ("sglang", "--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-eagle-topk 4",
     "--speculative-eagle-topk"),
    ("sglang", "--speculative-algorithm EAGLE3 --speculative-num-steps 3 --speculative-num-draft-tokens 8",
     "--speculative-num-draft-tokens"),
    ("sglang", "--speculative-algorithm NEXTN", "--speculative-num-steps"),
    ("sglang", "--speculative-algorithm NEXTN --speculative-num-steps 2", "speculative.acceptance"),
])
def test_refused_flags_name_themselves(engine, args, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        resolved(engine, args)
