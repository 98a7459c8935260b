"""Policies by name: one decorator, `@register("sarathi")`, on a class with a nested `Config`.

Adding a policy touches one file: the class, its Config dataclass (fields made with
cbsim.core.schema.option, each with help text) and the decorator. `parse_policy(mapping)` reads the
experiment's `policy:` mapping once, where the config is loaded, into a PolicySpec (the class and its
typed Config); each replica then builds its own policy from it (`spec.build()`). `make_policy(mapping)`
does both at once; `policy_help()` lists every policy for `cbsim policies`.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

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


@dataclass(frozen=True)
class PolicySpec:
    """A `policy:` mapping parsed once: the registered class and its validated, typed Config."""

    cls: type
    config: object  # cls.Config, every field checked

    def build(self):
        """A fresh policy (one per replica: a policy may keep per-replica state)."""
        return self.cls(self.config)


def parse_policy(mapping, path: str = "policy") -> PolicySpec:
    """The PolicySpec a YAML `policy:` mapping names; ConfigError (naming `path`) on bad input."""
    load_all()
    cls = POLICIES.lookup(mapping, path)
    options = {k: v for k, v in mapping.items() if k != "name"}
    for alias, canonical in ALIASES.items():
        if alias in options:
            if canonical in options:
                raise ConfigError(f"{path}.{alias}", f"either {alias} or {canonical}, not both", options[alias])
            options[canonical] = options.pop(alias)
    return PolicySpec(cls, parse(cls.Config, options, path))


def make_policy(mapping, path: str = "policy"):
    """Build the policy a YAML `policy:` mapping names; ConfigError on bad input."""
    return parse_policy(mapping, path).build()


def policy_help() -> list[tuple[str, str, list]]:
    """(name, summary, [(field, type, default, help), ...]) for every registered policy."""
    load_all()
    rows = []
    for name in sorted(POLICIES):
        cls = POLICIES[name]
        summary = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        rows.append((name, summary, field_help(cls.Config)))
    return rows
