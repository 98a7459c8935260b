"""Policies by name: one decorator, `@register("sarathi")`, on a class with a nested `Config`.

Adding a policy touches one file: the class, its Config dataclass (fields made with
cbsim.schema.option, each with help text) and the decorator. `make_policy(mapping)` builds one
from the experiment's `policy:` mapping; `policy_help()` lists them all for `cbsim policies`.
"""
from __future__ import annotations

import importlib
import pkgutil

from cbsim.errors import ConfigError, missing
from cbsim.schema import field_help, parse

POLICIES: dict[str, type] = {}
ALIASES = {"max_num_batched_tokens": "token_budget"}


def register(name: str):
    def decorate(cls):
        if name in POLICIES:
            raise ValueError(f"policy {name!r} registered twice")
        cls.name = name
        POLICIES[name] = cls
        return cls

    return decorate


def load_all() -> dict[str, type]:
    """Import every module of this package so that each policy registers itself."""
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{__package__}.{info.name}")
    return POLICIES


def make_policy(mapping, path: str = "policy"):
    """Build the policy a YAML `policy:` mapping names; ConfigError on bad input."""
    load_all()
    if not isinstance(mapping, dict):
        raise ConfigError(path, "a mapping with a 'name' key", mapping)
    if "name" not in mapping:
        raise missing(f"{path}.name", "one of " + ", ".join(sorted(POLICIES)))
    name = mapping["name"]
    if name not in POLICIES:
        raise ConfigError(f"{path}.name", "one of " + ", ".join(sorted(POLICIES)), name)
    options = {k: v for k, v in mapping.items() if k != "name"}
    for alias, canonical in ALIASES.items():
        if alias in options:
            if canonical in options:
                raise ConfigError(f"{path}.{alias}", f"either {alias} or {canonical}, not both", options[alias])
            options[canonical] = options.pop(alias)
    cls = POLICIES[name]
    return cls(parse(cls.Config, options, path))


def policy_help() -> list[tuple[str, str, list]]:
    """(name, summary, [(field, type, default, help), ...]) for every registered policy."""
    load_all()
    rows = []
    for name in sorted(POLICIES):
        cls = POLICIES[name]
        summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        rows.append((name, summary, field_help(cls.Config)))
    return rows
