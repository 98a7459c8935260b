"""The experiment file: a typed, validated ExperimentConfig.

`load_config(source, overrides)` accepts a YAML path or a mapping, applies `--set key.path=value`
overrides, validates every section (including the policy, cost model and workload, which are
validated by their own registries), and raises ConfigError naming the file and the key path.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .errors import ConfigError
from .schema import option, parse, require


@dataclass
class KVCacheConfig:
    block_size: int = option(16, help="tokens per KV block (page)")
    num_blocks: int | Literal["auto"] = option("auto", help="KV blocks per replica, or 'auto': from GPU memory, "
                                                 "weights and gpu_memory_utilization (needs a gpu)")
    gpu_memory_utilization: float = option(0.9, help="fraction of GPU memory the engine may use (auto sizing)")
    watermark: float = option(0.01, help="fraction of blocks kept free when admitting a new request")
    reserve_full_prompt: bool = option(False, help="admit a request only if its whole input fits, not just "
                                       "its first chunk")

    def validate(self) -> None:
        require(self.block_size >= 1, "block_size", "an integer >= 1", self.block_size)
        require(self.num_blocks == "auto" or self.num_blocks >= 1, "num_blocks", "an integer >= 1 or 'auto'",
                self.num_blocks)
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "a number in (0, 1]",
                self.gpu_memory_utilization)
        require(0 <= self.watermark < 1, "watermark", "a number in [0, 1)", self.watermark)


@dataclass
class ClusterConfig:
    replicas: int = option(1, help="number of replicas (each one GPU group running the policy)")
    router: Literal["round_robin", "least_loaded"] = option("round_robin", help="how arrivals pick a replica")
    gpu: str | None = option(None, help="GPU for KV sizing; default: the cost model's gpu")
    tp: int | None = option(None, help="tensor-parallel degree for KV sizing; default: the cost model's tp or 1")
    max_model_len: int | None = option(None, help="longest prompt + output a request may have; default: the model's")
    kv_cache: KVCacheConfig = option(KVCacheConfig(), help="paged KV cache")

    def validate(self) -> None:
        require(self.replicas >= 1, "replicas", "an integer >= 1", self.replicas)
        require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "an integer >= 2",
                self.max_model_len)


@dataclass
class PreemptionConfig:
    mode: Literal["recompute", "swap"] = option("recompute", help="recompute: free blocks and prefill again; "
                                                "swap: move KV to host memory and back")
    victim: Literal["last_admitted", "lowest_priority"] = option("last_admitted", help="which request to evict")
    swap_bandwidth_gb_s: float = option(25.0, help="host link bandwidth for swap, GB/s (PCIe 4 x16 ~ 25)")

    def validate(self) -> None:
        require(self.swap_bandwidth_gb_s > 0, "swap_bandwidth_gb_s", "a number > 0", self.swap_bandwidth_gb_s)


@dataclass
class SimConfig:
    fast_forward: bool = option(True, help="advance runs of identical decode steps at once (same results)")
    max_time: float | None = option(None, help="stop the simulation at this simulated time (seconds)")
    cost_noise: bool = option(False, help="multiply each step time by a factor drawn (seeded) from the cost "
                              "model's residuals (fitted models); turns fast-forward off")


@dataclass
class OutputConfig:
    dir: str | None = option(None, help="results folder; default results/<name> from the CLI, none from Python")
    plots: bool = option(True, help="write PNG plots")
    trace: bool = option(True, help="write a Perfetto/Chrome trace JSON of the steps")
    formats: list[Literal["csv", "parquet"]] = option(["csv", "parquet"], help="table file formats")
    shapes: int = option(0, help="write shapes.jsonl with this many step shapes sampled from the run "
                         "(held-out batches for `cbsim profile --batches`); 0 = none")


@dataclass
class ExperimentConfig:
    name: str = option("experiment", help="experiment name (the default results folder)")
    seed: int = option(0, help="seed of the run's single random generator")
    model: Any = option("llama-3-8b", help="model preset name or a full spec mapping")
    cost_model: dict = option({"type": "roofline", "gpu": "h100", "tp": 1}, help="step-latency model: "
                              "{type: unit|linear|roofline|fitted|vidur, ...}")
    cluster: ClusterConfig = option(ClusterConfig(), help="replicas and their KV caches")
    policy: dict = option({"name": "sarathi"}, help="scheduling policy: {name: ..., options}")
    preemption: PreemptionConfig = option(PreemptionConfig(), help="what happens when KV runs out")
    workload: dict = option({}, help="requests: synthetic, explicit list or trace")
    metrics: Any = option(None, help="metric settings: long_prompt_threshold, slo, stall_factor")
    output: OutputConfig = option(OutputConfig(), help="what to write")
    sim: SimConfig = option(SimConfig(), help="simulator switches")
    source: str | None = field(default=None, repr=False, init=False)  # the file it came from

    def to_dict(self) -> dict:
        data = asdict(self)
        data.pop("source")
        return data


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("<file>", "an existing YAML file", str(path))
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError("<file>", f"valid YAML ({err})".replace("\n", " "), has_got=False, file=str(path))
    if not isinstance(data, dict):
        raise ConfigError("<root>", "a mapping of experiment keys", data, file=str(path))
    return data


def apply_overrides(data: dict, overrides: list[str] | None) -> dict:
    """`key.path=value` strings (value parsed as YAML) set into a copy of `data`."""
    data = copy.deepcopy(data)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError("--set", "key.path=value", item)
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw)
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(key, f"a mapping at {part}", node)
        node[parts[-1]] = value
    return data


def load_config(source, overrides: list[str] | None = None) -> ExperimentConfig:
    """Parse and validate an experiment from a YAML path, a mapping or an ExperimentConfig."""
    if isinstance(source, ExperimentConfig):
        if not overrides:
            return source
        source, file = source.to_dict(), source.source
    elif isinstance(source, (str, Path)):
        file = str(source)
        source = read_yaml(source)
    else:
        file = None
    try:
        data = apply_overrides(source, overrides)
        config = parse(ExperimentConfig, {k: v for k, v in data.items() if k != "source"})
        config.source = file
        validate_sections(config)
    except ConfigError as err:
        raise err.in_file(file) if file else err
    return config


def validate_sections(config: ExperimentConfig) -> None:
    """Validate the sections owned by registries by building them once (cheap, no I/O)."""
    from cbsim.policies import make_policy
    from cbsim.profiler.costmodels import load_cost_model
    from cbsim.profiler.specs import model_spec
    from cbsim.sim.metrics import MetricsConfig
    from cbsim.workloads import parse_workload

    model = model_spec(config.model, "model")
    load_cost_model(config.cost_model, model)
    make_policy(config.policy)
    parse_workload(config.workload, "workload")
    if not isinstance(config.metrics, MetricsConfig):
        config.metrics = parse(MetricsConfig, config.metrics, "metrics")
