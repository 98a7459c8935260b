"""The server-flag reference (docs/reference/server-flags.md), generated from each engine's flag table.

Every flag `server.args` accepts is one `Flag` in cbsim/server/vllm.py or sglang.py: its type, the
engine's default and the file @ commit defining both, and the cbsim setting it sets. This renders
those tables as Markdown, so the reference lists exactly what the code maps (a test keeps the page
equal to this output; `cbsim schema --readme docs/reference/server-flags.md` rewrites it).
"""
from __future__ import annotations

from cbsim.server import ENGINES
from cbsim.server.flags import NO_STATIC_DEFAULT, Flag

TITLES = {"vllm": "vLLM V1 (`vllm serve`)", "sglang": "SGLang (`python -m sglang.launch_server`)"}


def _values(flag: Flag) -> str:
    if flag.boolean:
        return "switch (`--no-` form too)"
    if flag.choices:
        return ", ".join(f"`{c}`" for c in flag.choices)
    return {int: "integer", float: "number", str: "text"}.get(flag.parse, flag.parse.__name__)


def _default(flag: Flag) -> str:
    if flag.default is NO_STATIC_DEFAULT:
        return "not static: the engine derives it, or the experiment gives it"
    return "—" if flag.default is None else f"`{flag.default}`"


def _names(name: str, aliases: dict[str, str]) -> str:
    also = sorted(alias for alias, target in aliases.items() if target == name)
    return f"`--{name}`" + (" (also " + ", ".join(f"`{a}`" for a in also) + ")" if also else "")


def engine_table(engine: str) -> list[str]:
    """One engine's flags as a Markdown table, then the flags it accepts and ignores."""
    module = ENGINES[engine]
    rows = [f"## {TITLES[engine]}", "", "| flag | cbsim setting | values | default | source |",
            "|---|---|---|---|---|"]
    for name, flag in module.FLAGS.items():
        key = f"`{flag.key}`" if flag.key else "— (checked, sets no key of its own)"
        rows.append(f"| {_names(name, module.ALIASES)} | {key} | {_values(flag)} | {_default(flag)} | "
                    f"{flag.source} |")
    ignored = ", ".join(f"`--{n}`" for n in sorted(module.IGNORED))
    return rows + ["", f"Accepted and ignored (they do not change a simulation): {ignored}.", ""]


def flags_markdown() -> str:
    """The flag tables of every engine cbsim maps."""
    lines: list[str] = []
    for engine in ENGINES:
        lines += engine_table(engine)
    return "\n".join(lines).rstrip() + "\n"
