"""`cbsim run` without an experiment file: the experiment built from `vllm bench serve`'s flags.

    cbsim run --model llama-3-8b --gpu h100 --request-rate 4 --num-prompts 500 --input-len 1024 --output-len 128

The flags and their defaults are vLLM's (vllm/benchmarks/serve.py and benchmarks/datasets.py, `vllm bench
serve` with `--dataset-name random`): --request-rate inf (every request at once; a finite rate is a Poisson
process, or gamma gaps of shape --burstiness: coefficient of variation 1/sqrt(burstiness)), --num-prompts
1000, --random-input-len 1024, --random-output-len 128, --random-range-ratio 0 (lengths drawn uniformly
within [floor(len x (1 - r)), ceil(len x (1 + r))], RandomDataset), --max-concurrency none, --seed 0, --goodput KEY:ms (ttft, tpot:
metrics.slo; vLLM's e2el has no cbsim objective). `--input-len` / `--output-len` are the names of
`vllm bench latency` and `throughput`, accepted for the random ones. The rest is cbsim's: the GPU, tensor
parallelism and the scheduling policy (default: the experiment defaults, Sarathi on a roofline cost model).
"""
from __future__ import annotations

import math
import re

from cbsim.core.errors import ConfigError
from cbsim.core.units import limit_seconds

GOODPUT = {"ttft": "ttft", "tpot": "tpot"}  # vLLM's --goodput names -> metrics.slo keys
DEFAULTS = {"model": "llama-3-8b", "gpu": "h100", "tp": 1, "rate": math.inf, "burstiness": 1.0, "num_prompts": 1000,
            "input_len": 1024, "output_len": 128, "range_ratio": 0.0, "dataset_name": "random", "policy": None,
            "max_concurrency": None}  # vLLM bench serve's (module docstring); model and GPU cbsim's defaults
FLAG_NAMES = {"tp": "tensor-parallel-size", "rate": "request-rate", "num_prompts": "num-prompts", "input_len": "input-len",
              "output_len": "output-len", "range_ratio": "random-range-ratio", "dataset_name": "dataset-name",
              "max_concurrency": "max-concurrency"}  # a flags key -> its command-line name (the rest: the same)


def run_source(file, flags: dict, seed: int | None, goodput: list[str] | None,
               overrides: list[str] | None) -> tuple[object, list[str]]:
    """What `cbsim run` loads and the --set overrides it applies: without a file, the experiment `flags`
    describe (DEFAULTS where one is None); with one, the file, its --seed and --goodput laid first under
    the --set overrides, and none of the file-less flags (an error naming the first given)."""
    if file is None:
        values = {name: DEFAULTS[name] if value is None else value for name, value in flags.items()}
        return quick_experiment(**values, seed=0 if seed is None else seed, goodput=goodput), list(overrides or [])
    given = [name for name, value in flags.items() if value is not None]
    if given:
        raise ConfigError(f"--{FLAG_NAMES.get(given[0], given[0])}", "no experiment file (the flags describe a run "
                          "without one; with a file use --set)", has_got=False)
    first = [f"seed={seed}"] * (seed is not None)
    first += [f"metrics.slo.{key}={value!r}" for key, value in (slo_of(goodput) if goodput else {}).items()]
    return file, first + list(overrides or [])


def quick_experiment(model: str, gpu: str, tp: int, rate: float, num_prompts: int, input_len: int,
                     output_len: int, range_ratio: float, burstiness: float, policy: str | None,
                     max_concurrency: int | None, seed: int, goodput: list[str] | None,
                     dataset_name: str) -> dict:
    """The experiment mapping these flags describe (validated later by load_config, like a file)."""
    if dataset_name != "random":
        raise ConfigError("--dataset-name", "random (other datasets: write an experiment file with workload.trace)",
                          dataset_name)
    if not 0 <= range_ratio < 1:
        raise ConfigError("--random-range-ratio", "a ratio in [0, 1)", range_ratio)
    data = {
        "name": _slug(f"{model}-{gpu}"), "seed": seed, "model": model,
        "cost_model": {"type": "roofline", "gpu": gpu, "tp": tp},
        "workload": {"num_requests": num_prompts, "arrival": _arrival(rate, burstiness),
                     "prompt_len": _length(input_len, range_ratio), "output_len": _length(output_len, range_ratio)},
    }
    if policy is not None:
        data["policy"] = {"name": policy}
    if max_concurrency is not None:
        data["workload"]["max_concurrency"] = max_concurrency
    if goodput:
        data["metrics"] = {"slo": slo_of(goodput)}
    return data


def _arrival(rate: float, burstiness: float) -> dict:
    if math.isinf(rate):
        return {"type": "all_at_once"}
    if burstiness == 1.0:
        return {"type": "poisson", "rate": rate}
    if not burstiness > 0:
        raise ConfigError("--burstiness", "a number > 0 (1: Poisson)", burstiness)
    return {"type": "gamma", "rate": rate, "cv": 1.0 / math.sqrt(burstiness)}


def _length(mean: int, ratio: float) -> dict:
    """vLLM's random dataset: uniform integers in [floor(len (1 - r)), ceil(len (1 + r))], len itself at r = 0."""
    if ratio == 0:
        return {"type": "fixed", "value": mean}
    return {"type": "uniform", "min": max(1, math.floor(mean * (1 - ratio))), "max": math.ceil(mean * (1 + ratio))}


def slo_of(items: list[str]) -> dict:
    """metrics.slo from vLLM's --goodput KEY:VALUE pairs (milliseconds), or KEY=duration."""
    slo = {}
    for item in items:
        name, seconds = limit_seconds(item, "--goodput", lambda metric: metric in GOODPUT or metric == "e2el")
        if name not in GOODPUT:
            raise ConfigError("--goodput", "ttft or tpot (vLLM's e2el has no cbsim objective)", item)
        slo[GOODPUT[name]] = seconds
    return slo


def _slug(text: str) -> str:
    """A results folder name from a model id: 'meta-llama/Llama-3-8B-h100' -> 'meta-llama--Llama-3-8B-h100'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "--", text).strip("-.") or "run"
