"""A model or GPU by name: presets first, then the catalog (Hugging Face config.json files shipped in
models/, GPUs in gpus.py), then a path or a mapping of the record's fields."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from cbsim.core.errors import ConfigError
from cbsim.core.suggest import did_you_mean
from cbsim.core.schema import parse
from cbsim.sim.costmodels.catalog.gpus import GPU_CATALOG
from cbsim.sim.costmodels.catalog.hf_config import catalog_key, catalog_names, catalog_spec, read_hf_config
from cbsim.sim.costmodels.catalog.specs import GPU_ALIASES, GPU_PRESETS, MODEL_PRESETS, GPUSpec, ModelSpec


def _model_key(name: str) -> str:
    """Normalise a Hugging Face id or spelling: 'meta-llama/Meta-Llama-3-8B-Instruct' -> 'llama-3-8b'."""
    key = name.strip().lower().rsplit("/", 1)[-1].replace("_", "-")
    key = key.replace("meta-llama-", "llama-")
    for suffix in ("-hf", "-instruct", "-chat", "-it"):
        key = key.removesuffix(suffix)
    return key


def _window_layers(given: dict, merged: dict) -> dict:
    """`merged` with sliding_layers filled in when `given` sets sliding_window alone: every layer
    for a window, none for 0."""
    window = given.get("sliding_window")
    if "sliding_layers" in given or not isinstance(window, int) or isinstance(window, bool):
        return merged
    layers = merged.get("num_layers")
    return {**merged, "sliding_layers": layers if window > 0 and isinstance(layers, int) else 0}


def model_spec(name_or_mapping, path: str = "model") -> ModelSpec:
    """A model by name, a config.json path, or a mapping.

    A name is a preset (llama-2-7b, llama-3-8b, ...; Hugging Face ids accepted) or a catalog file
    (sim/costmodels/catalog/models/<name>.json: `cbsim models` lists them); a path is a Hugging Face config.json
    or a folder holding one. A mapping gives every ModelSpec field (head_dim may be left out: it
    defaults to hidden // num_heads), or `config:` (any of the above) with fields laid over it:
    {config: llama-3.1-8b, weight_dtype: fp8, kv_dtype: fp8}.
    """
    if isinstance(name_or_mapping, ModelSpec):
        return name_or_mapping
    if isinstance(name_or_mapping, str):
        key = _model_key(name_or_mapping)
        if key in MODEL_PRESETS:
            return MODEL_PRESETS[key]
        if catalog_key(key):
            return catalog_spec(catalog_key(key))
        if Path(name_or_mapping).exists():
            return read_hf_config(name_or_mapping)
        raise ConfigError(path, "a model preset (" + ", ".join(MODEL_PRESETS) + "), a catalog model ("
                          + ", ".join(catalog_names()) + "), a path to a config.json, or a mapping of its fields"
                          + did_you_mean(name_or_mapping, [*MODEL_PRESETS, *catalog_names()]), name_or_mapping)
    if not isinstance(name_or_mapping, dict):
        raise ConfigError(path, "a model preset name or a mapping of its fields", name_or_mapping)
    mapping = dict(name_or_mapping)
    if "config" in mapping:
        base = mapping.pop("config")
        if not isinstance(base, str):
            raise ConfigError(f"{path}.config", "a model name or a path to a config.json", base)
        base_spec = model_spec(base, f"{path}.config")
        merged = {**{f.name: getattr(base_spec, f.name) for f in fields(ModelSpec)}, **mapping}
        return parse(ModelSpec, _window_layers(mapping, merged), path)
    mapping = _window_layers(mapping, mapping)
    hidden, heads = mapping.get("hidden"), mapping.get("num_heads")
    if "head_dim" not in mapping and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        mapping["head_dim"] = hidden // heads
    return parse(ModelSpec, mapping, path)


def gpu_spec(name, path: str = "gpu") -> GPUSpec:
    """A GPU by name (case-insensitive: a preset, an alias such as 'a100-80gb', or a catalog GPU:
    `cbsim gpus`), or a mapping of GPUSpec fields."""
    if isinstance(name, GPUSpec):
        return name
    if isinstance(name, dict):
        return parse(GPUSpec, name, path)
    key = name.strip().lower() if isinstance(name, str) else None
    key = GPU_ALIASES.get(key, key)
    if key in GPU_PRESETS:
        return GPU_PRESETS[key]
    if key in GPU_CATALOG:
        return GPU_CATALOG[key]
    known = [*GPU_PRESETS, *GPU_ALIASES, *GPU_CATALOG]
    raise ConfigError(path, "a GPU (" + ", ".join(known) + ") or a mapping of its fields" + did_you_mean(name, known),
                      name)
