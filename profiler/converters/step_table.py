"""Measured whole-step times: the table `cbsim calibrate --steps` fits the engine terms on.

One JSON object per line, the composition format of profiler/heldout/*.jsonl plus the time:
    {"prefill": [[c, h], ...], "decode": [ctx, ...], "time_s": 0.0123}
optionally with "tp" (the base cost model is evaluated at that TP), "model", "gpu" and "weight"
(a relative weight in the fit, default 1). Every row is checked; an error names the file, the line
and the key. `splitwise_steps` converts the Splitwise profiling CSV (shared/data/measured/) into
such rows.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from cbsim.core import bounds
from cbsim.core.errors import ConfigError
from cbsim.sim.shape import StepShape

KEYS = ("prefill", "decode", "time_s", "tp", "model", "gpu", "weight")


@dataclass(frozen=True)
class MeasuredStep:
    """One measured step: its shape, its wall time and where it was measured."""

    shape: StepShape
    time_s: float
    tp: int | None = None
    model: str | None = None
    gpu: str | None = None
    weight: float = 1.0

    @property
    def kind(self) -> str:
        """prefill, decode or mixed."""
        if self.shape.prefill and self.shape.decode:
            return "mixed"
        return "prefill" if self.shape.prefill else "decode"


MAX_STEP_S = 600.0  # a forward pass of any served model takes milliseconds to seconds; a longer "step" is a unit slip

def read_steps(path) -> list[MeasuredStep]:
    """Every row of a step table; ConfigError naming file, line and key on a bad row or an empty file."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ConfigError("steps", "an existing step table (JSON lines)", str(path)) from None
    except UnicodeDecodeError:
        raise ConfigError("steps", "a UTF-8 text file of JSON lines", str(path), file=str(path)) from None
    rows = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            rows.append(_row(line, f"line {number}", str(path)))
    if not rows:
        raise ConfigError("steps", "at least one measured step", "an empty table", file=str(path))
    return rows


def _row(line: str, where: str, file: str) -> MeasuredStep:
    def fail(key, expected, got=None, has_got=True):
        raise ConfigError(f"{where}: {key}", expected, got, file=file, has_got=has_got)

    try:
        obj = bounds.loads(line)
    except json.JSONDecodeError as err:
        fail("row", f"a JSON object ({err.msg})", has_got=False)
    if not isinstance(obj, dict):
        fail("row", "a JSON object", obj)
    unknown = sorted(set(obj) - set(KEYS))
    if unknown:
        fail(unknown[0], "one of the keys " + ", ".join(KEYS), "an unknown key", has_got=False)
    time_s = obj.get("time_s")
    if not _number(time_s) or not 0 < time_s <= MAX_STEP_S:
        fail("time_s", f"a number of seconds > 0 and <= {MAX_STEP_S:g} (one forward pass)", time_s)
    prefill, decode = obj.get("prefill", []), obj.get("decode", [])
    if not isinstance(prefill, list) or not all(isinstance(p, list) and len(p) == 2 and _count(p[0], 1)
                                                 and _count(p[1], 0) for p in prefill):
        fail("prefill", "a list of [c, h] pairs of integers, c >= 1, h >= 0", prefill)
    if not isinstance(decode, list) or not all(_count(x, 1) for x in decode):
        fail("decode", "a list of context lengths (integers >= 1)", decode)
    if not prefill and not decode:
        fail("prefill", "at least one prefill chunk or decode row", has_got=False)
    tp = obj.get("tp")
    if tp is not None and not _count(tp, 1):
        fail("tp", "an integer >= 1", tp)
    weight = obj.get("weight", 1.0)
    if not _number(weight) or not weight > 0:
        fail("weight", "a finite number > 0", weight)
    for key in ("model", "gpu"):
        if obj.get(key) is not None and not isinstance(obj[key], str):
            fail(key, "a name", obj[key])
    shape = StepShape.from_batch(prefill=[tuple(p) for p in prefill], decode=decode)
    return MeasuredStep(shape, float(time_s), tp, obj.get("model"), obj.get("gpu"), float(weight))


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def step_row(step: MeasuredStep) -> dict:
    """The JSON object of one step (the inverse of reading it)."""
    row = {"prefill": [list(p) for p in step.shape.prefill], "decode": list(step.shape.decode),
           "time_s": step.time_s}
    for key in ("tp", "model", "gpu"):
        if getattr(step, key) is not None:
            row[key] = getattr(step, key)
    if step.weight != 1.0:
        row["weight"] = step.weight
    return row
