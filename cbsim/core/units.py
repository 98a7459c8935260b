"""Durations as users write them: `500ms`, `0.5s`, `2 s`, `1.5min`, or a bare number of seconds.

cbsim computes in seconds. A config field typed `Seconds` (or `SLOSeconds`) accepts a number (seconds,
the meaning a bare number always had) or a string with a unit; `cbsim schema` shows the type as
"duration". A bare number of 100 or more given for a TTFT, TPOT or ITL objective is almost surely meant as
milliseconds (vLLM's `--goodput ttft:500` and AIConfigurator's `--ttft 1000` are in ms): it is still
read as seconds, with a warning that says how to write milliseconds.

Latency flags also take vLLM's `metric:value` form, the value in milliseconds, as `vllm bench serve
--goodput` parses it (vllm/benchmarks/serve.py `parse_goodput`: "KEY:VALUE pairs, where the key is a
metric name, and the value is a number in milliseconds"); see `limit_seconds`.
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from typing import Annotated

from cbsim.core.errors import ConfigError

log = logging.getLogger("cbsim")

UNITS = {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0, "h": 3600.0}
_TEXT = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([a-zµ]*)\s*$")
EXPECTED = "a duration: seconds, or a number with a unit (500ms, 0.5s, 2 s, 1.5min; units " + \
    ", ".join(u for u in UNITS if u != "µs") + ")"
MS_HINT_FROM = 100.0  # a bare latency objective this large is likely milliseconds (warned, not changed)
SHORT_LATENCIES = ("ttft", "tpot", "itl")  # objectives on these (not e2e, queue delay) are warned about


@dataclass(frozen=True)
class Duration:
    """The marker of a duration field (typing.Annotated metadata); `objective`: a latency limit, whose
    large bare numbers are warned about."""

    objective: bool = False


Seconds = Annotated[float, Duration()]
SLOSeconds = Annotated[float, Duration(objective=True)]


def parse_duration(value, path: str, objective: bool = False) -> float:
    """Seconds from a number (seconds) or a string with a unit; ConfigError at `path` otherwise."""
    match = _TEXT.match(value) if isinstance(value, str) else None
    if match and not match.group(2):  # '3': a bare number written as text
        value = float(match.group(1))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
        if objective and MS_HINT_FROM <= seconds < math.inf:
            log.warning("%s: %g is read as seconds (a bare number is seconds); write '%gms' for milliseconds",
                        path, seconds, seconds)
    elif match and match.group(2) in UNITS:
        seconds = float(match.group(1)) * UNITS[match.group(2)]
    else:
        raise ConfigError(path, EXPECTED, value)
    if not math.isfinite(seconds):
        raise ConfigError(path, "a finite duration", value)
    return seconds


def limit_seconds(item: str, path: str, is_time) -> tuple[str, float]:
    """A limit flag's (metric, limit): `metric=value` (a time in seconds or with a unit, another metric
    a bare number) or vLLM's `metric:value`, a time in milliseconds. `is_time(metric)` tells which."""
    if "=" in item:
        name, _, text = item.partition("=")
        name = name.strip()
        try:
            number = float(text)
        except ValueError:
            number = None
        if is_time(name) and (number is None or math.isfinite(number)):
            return name, parse_duration(text, f"{path} {name}", objective=name.startswith(SHORT_LATENCIES))
        if number is None:
            raise ConfigError(path, f"{name}=<number>", item)
        return name, number  # NaN, infinity, 0 or less: the caller's range check names it
    if ":" in item:
        name, _, text = item.partition(":")
        name = name.strip()
        if not is_time(name):
            raise ConfigError(path, f"metric:milliseconds for a latency metric ({name} is not one; use "
                              f"{name}=<value>)", item)
        try:
            return name, float(text) / 1e3
        except ValueError:
            raise ConfigError(path, "metric:milliseconds with a number (vLLM's --goodput form, ttft_p99:500)",
                              item) from None
    raise ConfigError(path, "metric=limit (seconds or with a unit: ttft_p99=500ms) or metric:milliseconds "
                      "(ttft_p99:500)", item)

