"""`server:`: an engine's own command-line flags as the experiment's configuration.

    server: {engine: vllm, version: "0.11", args: "--max-num-batched-tokens 2048 --max-num-seqs 128"}

resolves, before the experiment is parsed, into the policy, KV-cache, parallelism and engine-overhead
settings that engine uses, its defaults included (vllm.py, sglang.py cite the source of each). The
resolved keys are merged into the experiment: a key the experiment sets itself refines an engine
default, but a key that a flag also sets must agree with it (else an error naming both), and the
engine's scheduler (policy.name) cannot be changed. The `server:` block itself is dropped: the
written config.yaml holds the resolved settings, which `cbsim validate` prints.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, fields

from cbsim.core.errors import ConfigError

from cbsim.server import sglang, vllm
from cbsim.server.flags import read_flags
from cbsim.sim.costmodels import _builtin  # noqa: F401  (registers the built-in cost models)
from cbsim.sim.costmodels.catalog.lookup import gpu_spec, model_spec
from cbsim.sim.costmodels.catalog.specs import DEFAULT_MODEL
from cbsim.sim.costmodels.registry import COST_MODELS, DEFAULT_COST_MODEL

ENGINES = {"vllm": vllm, "sglang": sglang}
KEYS = ("engine", "version", "args")
MIN_VLLM = (0, 8)  # V1 became vLLM's default engine in 0.8.0; cbsim maps V1's flags and defaults


@dataclass(frozen=True)
class Context:
    """What an engine's defaults and mappings depend on: the GPU (None when the cost model does not
    name one), the model's context length, the engine version (None: not given) and the options the
    experiment's cost model type has (pipeline parallelism maps onto `cost_model.pp` only where it is one)."""

    gpu: object | None
    max_model_len: int
    version: tuple[int, ...] | None = None
    cost_model_type: str | None = None
    cost_model_options: frozenset = frozenset()
    moe: bool = False  # the model has routed experts (expert parallelism applies to them only)


@dataclass(frozen=True)
class Resolution:
    engine: str
    version: str | None
    settings: dict  # dotted cbsim key -> value
    explicit: frozenset  # the keys a flag set
    ignored: tuple  # flags given that do not change a simulation


def apply_server(data: dict) -> tuple[dict, Resolution | None]:
    """The experiment mapping with its `server:` block resolved and merged (unchanged without one)."""
    server = data.get("server")
    if server is None:
        return data, None
    engine, version, args = _check(server)
    module = ENGINES[engine]
    flags, ignored, positional = read_flags(args, module.FLAGS, module.IGNORED, module.ALIASES, "server.args")
    model_flag = "model" if engine == "vllm" else "model-path"
    if positional:
        if engine != "vllm" or len(positional) > 1 or model_flag in flags:
            raise ConfigError("server.args", "flags only (vllm: at most one model name before them)", positional)
        flags[model_flag] = positional[0]
    merged = {k: v for k, v in copy.deepcopy(data).items() if k != "server"}
    merged.setdefault("cost_model", copy.deepcopy(DEFAULT_COST_MODEL))  # its GPU sets defaults; the engine goes in
    context = _context(merged, flags.get(model_flag), _version(version) if version else None)
    settings, explicit = module.resolve(flags, context, "server.args")
    if hasattr(module, "check_startup"):  # what the engine itself refuses to start with
        module.check_startup(settings, settings.get("cluster.max_model_len") or context.max_model_len, "server.args")
    for key, value in settings.items():
        if not key.startswith("model."):
            _merge(merged, key, value, key in explicit)
    _merge_model_fields(merged, {k[len("model."):]: v for k, v in settings.items() if k.startswith("model.")})
    return merged, Resolution(engine, version, settings, frozenset(explicit), tuple(ignored))


def _check(server) -> tuple[str, str | None, object]:
    if not isinstance(server, dict):
        raise ConfigError("server", "a mapping {engine: vllm|sglang, version, args}", server)
    for key in server:
        if key not in KEYS:
            raise ConfigError(f"server.{key}", "one of the keys " + ", ".join(KEYS), has_got=False)
    engine = server.get("engine")
    if not isinstance(engine, str) or engine not in ENGINES:  # a mapping or list is no engine name (nor hashable)
        raise ConfigError("server.engine", "one of " + ", ".join(ENGINES), engine)
    version = server.get("version")
    if version is not None:
        version = str(version)
        if engine == "vllm" and _version(version) < MIN_VLLM:
            raise ConfigError("server.version", "a vLLM version of 0.8 or later (cbsim maps the V1 engine's "
                              "flags and defaults; V0's differ)", version)
    return engine, version, server.get("args", "")


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.lstrip("v").split(".")[:2])
    except ValueError:
        raise ConfigError("server.version", "a version such as 0.11 or 0.11.2", text) from None


def _context(data: dict, model, version: tuple[int, ...] | None = None) -> Context:
    spec = model_spec(model if model is not None else data.get("model", DEFAULT_MODEL), "model")
    cluster = data.get("cluster") or {}
    max_len = cluster.get("max_model_len") if isinstance(cluster, dict) else None
    cost_model = data.get("cost_model") if isinstance(data.get("cost_model"), dict) else {}
    gpu_name = cost_model.get("gpu")
    gpu = gpu_spec(gpu_name, "cost_model.gpu") if gpu_name is not None else None
    return Context(gpu, max_len if isinstance(max_len, int) else spec.max_model_len, version,
                   cost_model.get("type"), cost_model_options(cost_model), spec.num_experts > 0)


def cost_model_options(cost_model: dict) -> frozenset:
    """The option names of the cost model type a `cost_model:` mapping names (none if it names no known
    type: the experiment's own validation reports that)."""
    try:
        return frozenset(f.name for f in fields(COST_MODELS.lookup(cost_model, "cost_model").Config))
    except ConfigError:
        return frozenset()


def _merge(data: dict, key: str, value, from_flag: bool) -> None:
    """Set dotted `key` unless the experiment sets it; a flag's value and the experiment's must agree."""
    *parents, leaf = key.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(".".join(parents[:i + 1]), "a mapping (server: sets keys below it)", child)
        node = child
    if leaf not in node:
        node[leaf] = value
    elif not _same(key, node[leaf], value) and (from_flag or key == "policy.name"):
        raise ConfigError(key, f"{value!r}, the value server.args sets (or remove one of the two)", node[leaf])


def _merge_model_fields(data: dict, fields: dict) -> None:
    """Precision flags (model.kv_dtype, model.weight_dtype) laid over the experiment's model: a name becomes
    {config: name, field: value}; a mapping gains the fields, and one it sets itself must agree."""
    if not fields:
        return
    model = data.get("model", DEFAULT_MODEL)
    if not isinstance(model, dict):
        data["model"] = {"config": model, **fields}
        return
    for field, value in fields.items():
        if field in model and model[field] != value:
            raise ConfigError(f"model.{field}", f"{value!r}, the value server.args sets (or remove one of the two)",
                              model[field])
    data["model"] = {**model, **fields}


def _same(key: str, ours, theirs) -> bool:
    """Equal values; for `model`, names of the same model ('llama-3-8b', 'meta-llama/Meta-Llama-3-8B')."""
    if ours == theirs:
        return True
    if key != "model":
        return False
    try:
        return model_spec(ours, "model") == model_spec(theirs, "model")
    except ConfigError:
        return False


def describe(resolution: Resolution) -> list[str]:
    """Lines for `cbsim validate`: every resolved key (marking those a flag set) and the ignored flags."""
    title = f"server: {resolution.engine}" + (f" {resolution.version}" if resolution.version else "")
    lines = [title + " resolves to (* = set by a flag, else the engine's default):"]
    for key, value in resolution.settings.items():
        lines.append(f"  {'*' if key in resolution.explicit else ' '} {key} = {value!r}")
    if resolution.ignored:
        lines.append("  ignored (no effect on a simulation): " + " ".join(f"--{n}" for n in resolution.ignored))
    return lines
