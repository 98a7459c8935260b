"""Engines' speculative-decoding flags as cbsim's `speculative:` section (sim/speculative.py).

vLLM (`--speculative-config`, a JSON object; vllm/engine/arg_utils.py parses it with json.loads into
vllm/config/speculative.py SpeculativeConfig): `method` among SpeculativeMethod ("ngram", "ngram_gpu",
"suffix", "eagle", "eagle3", the MTP model types such as "deepseek_mtp" or "mtp", "draft_model", and
"medusa" / "mlp_speculator", which cbsim does not model); without a method, SpeculativeConfig's
`__post_init__` infers it from the draft model's name ("eagle3" in it: eagle3, "eagle-": eagle,
else draft_model). `num_speculative_tokens` is k; `model` the draft.

SGLang (python/sglang/srt/server_args.py): `--speculative-algorithm` EAGLE, EAGLE3, NEXTN (DeepSeek's
MTP layers, run as EAGLE), STANDALONE (a draft model), NGRAM; `--speculative-num-steps` is the draft
depth, k; `--speculative-eagle-topk` the branching per step and `--speculative-num-draft-tokens` the
tokens verified: with topk 1 SGLang sets num_draft_tokens = num_steps + 1 (a chain, what cbsim
models); a tree (topk > 1) is refused here. `--speculative-draft-model-path` is the draft.

Acceptance is not an engine flag: give `speculative.acceptance` in the experiment (eagle3 has a
cited default).
"""
from __future__ import annotations

import json

from cbsim.core.errors import ConfigError

VLLM_SOURCE = "vllm/config/speculative.py (SpeculativeMethod, SpeculativeConfig.__post_init__)"
SGLANG_SOURCE = "python/sglang/srt/server_args.py (speculative_*)"
VLLM_METHODS = {"ngram": "ngram", "ngram_gpu": "ngram", "suffix": "ngram", "eagle": "eagle", "eagle3": "eagle3",
                "draft_model": "draft_model"}
SGLANG_ALGORITHMS = {"EAGLE": "eagle", "EAGLE3": "eagle3", "NEXTN": "mtp", "STANDALONE": "draft_model",
                     "NGRAM": "ngram"}


def json_object(text: str) -> dict:
    """--speculative-config's value: a JSON object (ValueError otherwise, which the flag reader reports)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def from_vllm(config: dict, path: str) -> dict:
    """Dotted `speculative.*` settings of a vLLM --speculative-config object."""
    where = f"{path} --speculative-config"
    method, model = config.get("method"), config.get("model")
    if method is None:
        name = str(model or "").lower()
        method = "eagle3" if "eagle3" in name else "eagle" if "eagle-" in name else "draft_model"
    if method == "mtp" or str(method).endswith("_mtp"):
        ours = "mtp"
    elif method in VLLM_METHODS:
        ours = VLLM_METHODS[method]
    else:
        raise ConfigError(f"{where} method", "one of ngram, suffix, eagle, eagle3, draft_model or an MTP type "
                          "(medusa and mlp_speculator are not modelled)", method)
    k = config.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"{where} num_speculative_tokens", "an integer >= 1 (cbsim does not read it from "
                          "the draft model's config)", k)
    settings = {"speculative.method": ours, "speculative.num_speculative_tokens": k}
    if ours == "draft_model":
        settings["speculative.model"] = model
    return settings


def from_sglang(flags: dict, path: str) -> dict:
    """Dotted `speculative.*` settings of SGLang's --speculative-* flags (none without an algorithm)."""
    algorithm = flags.get("speculative-algorithm")
    if algorithm is None:
        return {}
    steps = flags.get("speculative-num-steps")
    if steps is None or steps < 1:
        raise ConfigError(f"{path} --speculative-num-steps", "an integer >= 1 (SGLang otherwise picks it by "
                          "architecture; cbsim needs it given)", steps)
    topk = flags.get("speculative-eagle-topk", 1)
    if topk != 1:
        raise ConfigError(f"{path} --speculative-eagle-topk", "1: a chain of drafts (cbsim does not model draft "
                          "trees)", topk)
    drafts = flags.get("speculative-num-draft-tokens", steps + 1)
    if drafts != steps + 1:
        raise ConfigError(f"{path} --speculative-num-draft-tokens", f"--speculative-num-steps + 1 ({steps + 1}), "
                          "as SGLang sets it with topk 1", drafts)
    ours = SGLANG_ALGORITHMS[algorithm]
    settings = {"speculative.method": ours, "speculative.num_speculative_tokens": steps}
    if ours == "draft_model":
        settings["speculative.model"] = flags.get("speculative-draft-model-path")
    return settings


SGLANG_NAMES = {ours: theirs for theirs, ours in SGLANG_ALGORITHMS.items()}


def to_vllm(section: dict) -> str:
    """A `speculative:` section as vLLM's --speculative-config JSON (from_vllm reads it back)."""
    config = {"method": section["method"], "num_speculative_tokens": section["num_speculative_tokens"]}
    if section["method"] == "draft_model":
        config["model"] = section["model"]
    return json.dumps(config, separators=(",", ":"))


def to_sglang(section: dict) -> dict:
    """A `speculative:` section as SGLang's --speculative-* flags, a chain of drafts (from_sglang reads
    them back): topk 1 and num_draft_tokens = num_steps + 1."""
    k = section["num_speculative_tokens"]
    flags = {"speculative-algorithm": SGLANG_NAMES[section["method"]], "speculative-num-steps": k,
             "speculative-eagle-topk": 1, "speculative-num-draft-tokens": k + 1}
    if section["method"] == "draft_model":
        flags["speculative-draft-model-path"] = section["model"]
    return flags
