"""Command-line flags of a serving engine, read the way the engine's argparse reads them.

`server.args` is a flag string (`"--max-num-seqs 128 --enable-prefix-caching"`, as typed after
`vllm serve MODEL`), a list of such tokens, or a mapping (`{max-num-seqs: 128}`; keys with or
without the leading dashes, `_` or `-` alike). Each engine declares its flags in a table of `Flag`s
(the value's type, and for a boolean its `--no-` form); a flag missing from the table is an error
naming it, unless the engine lists it as one that does not change a simulation (ports, logging).

The same table is read both ways: `read_flags` parses flags and the engine's `resolve` turns them
into cbsim settings (each Flag names the setting it sets, `key`, and the engine's default for it);
render.py writes settings back as flags (`to_flag`, the inverse), so each engine has one table.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Callable

from cbsim.core.errors import ConfigError
from cbsim.core.suggest import did_you_mean

TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes"), ("false", "0", "no")


NO_STATIC_DEFAULT = object()  # the engine derives the default (from the GPU, the model, the KV pool)


def same_value(value, wanted: dict):
    """to_flag of a flag whose value is the setting's value."""
    return value


@dataclass(frozen=True)
class Flag:
    """One engine flag: how its value parses, where the engine's source defines it and its default,
    and which cbsim setting it sets (with the inverse, setting -> flag value, for rendering)."""

    parse: Callable[[str], object]  # str -> value (int, float, str, bool)
    source: str  # file (and version) of the engine that defines the flag and its default
    boolean: bool = False  # a switch: `--x` is true, `--no-x` false (argparse BooleanOptionalAction)
    choices: tuple[str, ...] = ()
    default: object = NO_STATIC_DEFAULT  # the engine's default when the flag is not given (source above)
    key: str | None = None  # the dotted cbsim setting the flag sets; None: it sets none of its own
    to_flag: Callable[[object, dict], object] = same_value  # (setting value, all wanted settings) -> flag value
    pin: bool = False  # rendered even at the engine's default (a knob a tuned deployment should state)

    def value(self, flags: dict, name: str):
        """The flag's value in `flags`, else the engine's default."""
        return flags[name] if name in flags else self.default


def flag_name(raw: str) -> str:
    """'--max_num_seqs' / 'max-num-seqs' -> 'max-num-seqs'."""
    return raw.strip().lstrip("-").replace("_", "-")


def read_flags(args, table: dict[str, Flag], ignored: frozenset[str], aliases: dict[str, str],
               path: str) -> tuple[dict[str, object], list[str], list[str]]:
    """(flag -> parsed value, ignored flags given, positional arguments) of `args`.

    ConfigError at `path` for an unknown flag, a value that does not parse, or a flag given twice.
    """
    pairs, positional = _pairs(args, table, aliases, path)
    values: dict[str, object] = {}
    skipped: list[str] = []
    for name, raw in pairs:
        if name in ignored:
            skipped.append(name)
            continue
        flag = table.get(name)
        if flag is None:
            known = ", ".join(f"--{n}" for n in sorted(table))
            raise ConfigError(f"{path} --{name}", f"a flag cbsim maps ({known}), or one that does not change a "
                              "simulation (--host, --port, ...: the README lists them)"
                              + did_you_mean(name, [*table, *ignored], "--"),
                              has_got=False)
        if name in values:
            raise ConfigError(f"{path} --{name}", "each flag once", has_got=False)
        values[name] = _value(name, flag, raw, path)
    return values, skipped, positional


def _pairs(args, table, aliases, path) -> tuple[list[tuple[str, object]], list[str]]:
    """(name, raw value) pairs in order; raw is None for a bare switch, False for its --no- form."""
    if isinstance(args, dict):
        return [(_canonical(flag_name(str(k)), table, aliases), v) for k, v in args.items()], []
    if isinstance(args, str):
        try:
            tokens = shlex.split(args)
        except ValueError as err:
            raise ConfigError(path, f"a shell-quoted flag string ({err})", args) from None
    elif isinstance(args, list) and all(isinstance(t, (str, int, float)) for t in args):
        tokens = [str(t) for t in args]
    else:
        raise ConfigError(path, "a flag string, a list of flag tokens or a mapping of flags", args)
    pairs, positional, i = [], [], 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not token.startswith("-"):
            positional.append(token)
            continue
        name, eq, value = token.partition("=")
        name = _canonical(flag_name(name), table, aliases)
        if eq:
            pairs.append((name, value))
        elif name.startswith("no-") and name[3:] in table and table[name[3:]].boolean:
            pairs.append((name[3:], False))
        elif (table.get(name) and table[name].boolean) or i >= len(tokens) or tokens[i].startswith("--"):
            pairs.append((name, None))
        else:
            pairs.append((name, tokens[i]))
            i += 1
    return pairs, positional


def _canonical(name: str, table, aliases) -> str:
    return aliases.get(name, name)


def _value(name: str, flag: Flag, raw, path: str):
    where = f"{path} --{name}"
    if flag.boolean:
        if raw is None or raw is True or raw is False:
            return raw is not False
        word = str(raw).strip().lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
        raise ConfigError(where, "true or false (or the bare switch / its --no- form)", raw)
    if raw is None:
        raise ConfigError(where, "a value after the flag", has_got=False)
    try:
        value = flag.parse(str(raw).strip())
    except (TypeError, ValueError):
        raise ConfigError(where, f"a value of type {getattr(flag.parse, '__name__', 'value')}", raw) from None
    if flag.choices and value not in flag.choices:
        raise ConfigError(where, "one of " + ", ".join(flag.choices), raw)
    return value


def explicit_keys(table: dict[str, Flag], flags: dict, settings: dict) -> set[str]:
    """The resolved settings that a given flag set (the table's `key` of each flag in `flags`)."""
    return {table[name].key for name in flags if name in table and table[name].key in settings}


def pipeline_setting(stages, context, where: str) -> dict:
    """`cost_model.pp` from a pipeline-parallel flag: set when the flag is given and the experiment's
    cost model type has a `pp` option; without one, more than one stage is a ConfigError (cbsim cannot
    model it there) and a single stage sets nothing."""
    if stages is None:
        return {}
    if "pp" in context.cost_model_options:
        return {"cost_model.pp": stages}
    if stages != 1:
        raise ConfigError(where, f"1 (cost model {context.cost_model_type!r} does not model pipeline parallelism: "
                          "it has no cost_model.pp)", stages)
    return {}
