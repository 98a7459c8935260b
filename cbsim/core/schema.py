"""Typed config sections: a dataclass per section, built from a YAML mapping with validation.

Each field carries its help text in `metadata["help"]` (use `option(...)`). `parse(cls, mapping,
path)` checks types, rejects unknown keys and names the key path of the first error. Numbers are
finite (no NaN or infinity) and integers fit in int64: a huge value is an error here, not an
overflow or a hang later. A `Seconds` field (cbsim/core/units.py) takes a duration: a number of
seconds or a string with a unit ('500ms').
"""
from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from typing import Annotated, Any, Literal

from cbsim.core.errors import ConfigError, missing
from cbsim.core.suggest import did_you_mean
from cbsim.core.units import Duration, parse_duration

MAX_INT = 2 ** 63  # integers (int64) and integral floats must stay below this magnitude


def option(default=dataclasses.MISSING, help: str = "", **kw):
    """A config field with help text; mutable defaults go through default_factory."""
    if isinstance(default, (list, dict)) or dataclasses.is_dataclass(default):
        value = default
        return dataclasses.field(default_factory=lambda: copy.deepcopy(value), metadata={"help": help}, **kw)
    return dataclasses.field(default=default, metadata={"help": help}, **kw)


def field_help(cls) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, help) for every field of a config dataclass."""
    hints = typing.get_type_hints(cls, include_extras=True)
    rows = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "(required)"
        rows.append((f.name, _type_name(hints[f.name]), default, f.metadata.get("help", "")))
    return rows


def parse(cls, mapping, path: str = ""):
    """Build dataclass `cls` from `mapping`, validating every field; raises ConfigError."""
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, dict):
        raise ConfigError(path, f"a mapping for {cls.__name__}", mapping)
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(mapping) - set(fields))
    if unknown:
        raise ConfigError(_join(path, str(unknown[0])), f"one of the keys {sorted(fields)}"
                          + did_you_mean(unknown[0], fields), "an unknown key", has_got=False)
    values = {}
    for name, f in fields.items():
        key = _join(path, name)
        if name in mapping:
            values[name] = coerce(hints[name], mapping[name], key)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise missing(key, _type_name(hints[name]))
    obj = cls(**values)
    check = getattr(obj, "validate", None)
    if check is not None:
        try:
            check()
        except ConfigError as err:
            raise err.under(path) if path else err
    return obj


def coerce(tp, value, path: str):
    """Check (and gently convert: int -> float) one value against a type hint."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin is Annotated and isinstance(args[1], Duration):
        return parse_duration(value, path, args[1].objective)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:
            return coerce(options[0], value, path)
        for arg in options:
            try:
                return coerce(arg, value, path)
            except ConfigError:
                pass
        raise ConfigError(path, _type_name(tp), value)
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(path, "one of " + ", ".join(repr(a) for a in args), value)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"a list ({_type_name(tp)})", value)
        item = args[0] if args else Any
        return [coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, "a mapping", value)
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return parse(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, "true or false", value)
    if tp is int:
        number = int(value) if isinstance(value, float) and value.is_integer() else value
        if isinstance(number, int) and not isinstance(number, bool):
            if abs(number) >= MAX_INT:
                raise ConfigError(path, "an integer of magnitude below 2**63", value)
            return number
        raise ConfigError(path, "an integer", value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
            if not math.isfinite(number):
                raise ConfigError(path, "a finite number", value)
            return number
        raise ConfigError(path, "a number", value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(path, "a string", value)
    if tp is dict:
        if isinstance(value, dict):
            return value
        raise ConfigError(path, "a mapping", value)
    return value


def require(condition: bool, path: str, expected: str, got=None) -> None:
    """For `validate()` methods: raise a ConfigError at `path` unless `condition` holds."""
    if not condition:
        raise ConfigError(path, expected, got)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Annotated:
        return "duration" if isinstance(args[1], Duration) else _type_name(args[0])
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + (
            " or null" if type(None) in args else "")
    if origin in (list, tuple):
        return f"list of {_type_name(args[0])}" if args else "list"
    return getattr(tp, "__name__", str(tp))
