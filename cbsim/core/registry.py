"""A tiny generic registry: classes of one kind by name, with one decorator and one lookup.

Policies (`policy: {name: ...}`) and cost models (`cost_model: {type: ...}`) both use it: the
decorator names the class and refuses duplicates; `lookup` turns a YAML mapping's discriminating
key into the class, or a ConfigError that lists the known names.
"""
from __future__ import annotations

from cbsim.core.errors import ConfigError, missing
from cbsim.core.suggest import did_you_mean


class Registry(dict):
    def __init__(self, kind: str, key: str):
        super().__init__()
        self.kind = kind  # "policy"
        self.key = key  # the mapping key that names the entry: "name"

    def register(self, name: str):
        """Class decorator: `@POLICIES.register("sarathi")`."""

        def decorate(cls):
            if name in self:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            cls.name = name
            self[name] = cls
            return cls

        return decorate

    def lookup(self, mapping, path: str):
        """The class a mapping names with `self.key`; ConfigError naming `path` otherwise."""
        known = "one of " + ", ".join(sorted(self))
        if not isinstance(mapping, dict):
            raise ConfigError(path, f"a mapping with a '{self.key}' key", mapping)
        if self.key not in mapping:
            raise missing(f"{path}.{self.key}", known)
        name = mapping[self.key]
        if not isinstance(name, str) or name not in self:
            raise ConfigError(f"{path}.{self.key}", known + did_you_mean(name, self), name)
        return self[name]
