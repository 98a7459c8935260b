"""Policies by name: one decorator, `@register("sarathi")`, on a class with a nested `Config`.

Adding a policy touches one file: the class, its Config dataclass (fields made with
cbsim.core.schema.option, each with help text) and the decorator. `make_policy(mapping)` builds one
from the experiment's `policy:` mapping; `policy_help()` lists them all for `cbsim policies`.
"""
from __future__ import annotations

import importlib
import pkgutil

from cbsim.core.errors import ConfigError
from cbsim.core.registry import Registry
from cbsim.core.schema import field_help, parse

POLICIES = Registry("policy", "name")
register = POLICIES.register
ALIASES = {"max_num_batched_tokens": "token_budget"}


def load_all() -> dict[str, type]:
    """Import every module of this package so that each policy registers itself."""
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{__package__}.{info.name}")
    return POLICIES


def make_policy(mapping, path: str = "policy"):
    """Build the policy a YAML `policy:` mapping names; ConfigError on bad input."""
    load_all()
    cls = POLICIES.lookup(mapping, path)
    options = {k: v for k, v in mapping.items() if k != "name"}
    for alias, canonical in ALIASES.items():
        if alias in options:
            if canonical in options:
                raise ConfigError(f"{path}.{alias}", f"either {alias} or {canonical}, not both", options[alias])
            options[canonical] = options.pop(alias)
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
