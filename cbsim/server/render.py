"""cbsim settings written back as an engine's flags: the inverse of `resolve`, read off the same table.

Invariant: resolving the rendered flags (the engine's `resolve`) gives back every wanted setting the
table maps, and only flags that change something are written: a flag is written when the engine,
given the flags written so far, would resolve its setting to another value (its default or a value
derived from an earlier flag) and the flag's value is not its own default (SGLang's switches have no
`--no-` form), or when the table pins it (the knobs a tuned deployment should state
whatever the engine's default). Flags are written in the table's order, so a flag that decides
other defaults (vLLM's --no-enable-chunked-prefill, SGLang's --page-size) comes before them.

A wanted setting no flag maps (e.g. cbsim's partial-prefill limits, which vLLM V1 does not have)
is not rendered: `unmatched` lists the wanted settings the engine would still run differently.
"""
from __future__ import annotations

import json
import shlex

from cbsim.server import ENGINES

PATH = "rendered flags"


def render(engine: str, wanted: dict, context) -> dict[str, object]:
    """Flags (name -> value, in table order) that make `engine` resolve to the `wanted` settings
    (dotted cbsim key -> value) it can express."""
    module = ENGINES[engine]
    flags: dict[str, object] = {}
    for name, flag in module.FLAGS.items():
        if flag.key is None or flag.key not in wanted:
            continue
        resolved, _ = module.resolve(flags, context, PATH)
        engine_value = resolved.get(flag.key, module.default(name, context))
        value = flag.to_flag(wanted[flag.key], wanted)
        if flag.pin or (engine_value != wanted[flag.key] and value != flag.default):
            flags[name] = value
    return flags


def unmatched(engine: str, wanted: dict, flags: dict, context) -> dict[str, tuple]:
    """The wanted settings that the engine, given `flags`, resolves differently: key -> (engine's, wanted)."""
    resolved, _ = ENGINES[engine].resolve(dict(flags), context, PATH)
    return {key: (resolved.get(key), value) for key, value in wanted.items()
            if key in resolved and resolved[key] != value}


def join(flags: dict) -> str:
    """The flags as a command-line string (`--x` / `--no-x` for switches, a mapping as JSON), shell-quoted."""
    parts = []
    for name, value in flags.items():
        if value is True:
            parts.append(f"--{name}")
        elif value is False:
            parts.append(f"--no-{name}")
        elif isinstance(value, dict):  # a JSON-valued flag (vLLM's --speculative-config)
            parts.append(f"--{name} {shlex.quote(json.dumps(value, separators=(',', ':')))}")
        else:
            parts.append(f"--{name} {shlex.quote(str(value))}")
    return " ".join(parts)
