"""Validation of cost-model profiles (fitted and vidur JSON) when they are loaded.

Invariant: a profile that passes `check_fitted` or `check_vidur` builds its cost model without a
KeyError or TypeError, and every term of a step time is a finite number >= 0: every key the model
reads is present with the right type; every number is finite; every measured time and fitted
coefficient is >= 0 (a fit is non-negative least squares, a time is never negative); every divisor
is > 0; every table axis strictly increases and every table has the shape of its axes; the format
is one this cbsim reads; and a profile measured on a TP > 1 shard carries the all-reduce that its
layer times leave out (without one, steps would come out silently too fast).

An error is a ProfileError naming the profile file and the key inside it (`coefficients.const`):
the bad content is in the profile, so the error is never nested under the experiment's keys.
"""
from __future__ import annotations

import math

import numpy as np

from cbsim.core.errors import ConfigError

from cbsim.sim.costmodels.features import LINEAR_FEATURES, PADDED_PREFIX, padded_segments, segment_name
from cbsim.sim.costmodels.collectives import link_model

FITTED_FORMATS = (1, 2)  # fitted.py reads these (format 1: one pair rate `pairs`, no tile)
VIDUR_FORMATS = (1,)  # vidur.py reads these
MAX_TP = 1024  # the bound cluster.tp has
MAX_LAYERS = 10_000  # no decoder has come near; a larger count is a typo, not a model
FORMAT_1_LINEAR = ("pairs", "prefill_kv", "decode_kv", "num_decode", "num_prefill", "const")
ROOFLINE_DIVISORS = ("hbm_bandwidth", "peak_flops", "decode_bw_eff", "prefill_flop_eff")
ROOFLINE_TERMS = ("decode_fixed_s", "kv_bytes_per_token", "prefill_fixed_s", "flops_per_pair",
                  "prefill_per_token_head_s", "q_heads")


class ProfileError(ConfigError):
    """A ConfigError whose key path lies inside a profile file (named by `file`)."""

    def under(self, prefix: str) -> "ProfileError":
        return self  # the key is the profile's, not one of the experiment's

    def in_file(self, file: str) -> ConfigError:
        return self if self.file else super().in_file(file)


class _Check:
    """Typed look-ups into one profile; each failure raises a ProfileError naming file and key."""

    def __init__(self, file: str | None):
        self.file = file or None

    def fail(self, path: str, expected: str, got=None, has_got: bool = True):
        raise ProfileError(path, expected, got, file=self.file, has_got=has_got)

    def get(self, node: dict, key: str, prefix: str, expected: str):
        path = f"{prefix}.{key}" if prefix else key
        if key not in node:
            self.fail(path, f"a value ({expected})", has_got=False)
        return node[key], path

    def mapping(self, node: dict, key: str, prefix: str = "") -> tuple[dict, str]:
        value, path = self.get(node, key, prefix, "a mapping")
        if not isinstance(value, dict):
            self.fail(path, "a mapping", value)
        return value, path

    def text(self, node: dict, key: str, prefix: str = "") -> str:
        value, path = self.get(node, key, prefix, "a string")
        if not isinstance(value, str):
            self.fail(path, "a string", value)
        return value

    def number(self, node: dict, key: str, prefix: str = "", low: float | None = 0.0, positive: bool = False) -> float:
        """A finite number, >= low (or > 0 when `positive`; no bound when low is None)."""
        value, path = self.get(node, key, prefix, "a number")
        expected = "a finite number" + (" > 0" if positive else "" if low is None else f" >= {low:g}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            self.fail(path, expected, value)
        if (positive and not value > 0) or (low is not None and value < low):
            self.fail(path, expected, value)
        return float(value)

    def integer(self, node: dict, key: str, prefix: str = "", low: int = 1, high: int | None = None) -> int:
        value, path = self.get(node, key, prefix, "an integer")
        expected = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            self.fail(path, expected, value)
        return value

    def numbers(self, node: dict, key: str, prefix: str = "", low: float | None = 0.0, positive: bool = False,
                increasing: bool = False, length: int | None = None) -> np.ndarray:
        """A non-empty list of finite numbers (each >= low, or > 0); strictly increasing if asked;
        of `length` items if given."""
        value, path = self.get(node, key, prefix, "a list of numbers")
        bound = " > 0" if positive else "" if low is None else f" >= {low:g}"
        order = ", strictly increasing" if increasing else ""
        size = f" ({length} of them)" if length is not None else ""
        expected = f"a non-empty list of finite numbers{bound}{order}{size}"
        array = _array(value, 1)
        if array is None or len(array) == 0 or (length is not None and len(array) != length):
            self.fail(path, expected, _short(value))
        bad = ~np.isfinite(array)
        if positive:
            bad |= ~(array > 0)
        elif low is not None:
            bad |= array < low
        if bad.any():
            i = int(np.argmax(bad))
            self.fail(f"{path}[{i}]", expected, value[i])
        if increasing and np.any(np.diff(array) <= 0):
            i = int(np.argmax(np.diff(array) <= 0)) + 1
            self.fail(f"{path}[{i}]", expected, value[i])
        return array

    def tp(self, node: dict, optional: bool) -> int:
        """The TP degree the profile was measured at (an optional one that is null or absent: 1)."""
        if optional and node.get("tp") is None:
            return 1
        return self.integer(node, "tp", "", 1, MAX_TP)

    def format(self, node: dict, formats: tuple[int, ...], how: str) -> int:
        fmt = node.get("format", 1)
        if isinstance(fmt, bool) or fmt not in formats:
            self.fail("format", f"a profile format this cbsim reads, one of {list(formats)} ({how})", fmt)
        return fmt


def check_fitted(profile: dict, file: str | None = None) -> None:
    """Raise a ProfileError unless `profile` is a fitted profile fitted.py can read (module docstring)."""
    c = _Check(file)
    fmt = c.format(profile, FITTED_FORMATS, "refit with `cbsim fit`")
    c.integer(profile, "num_layers", "", 1, MAX_LAYERS)
    tp = c.tp(profile, optional=True)
    knots = c.numbers(profile, "knots", increasing=True).tolist()
    tile = None
    if fmt == 2 and "tile" not in profile:  # without it the padded slopes would be dropped, silently
        c.fail("tile", "the tile step's token count, or null where the fit has none (cbsim fit writes it in "
               "every format-2 profile)", has_got=False)
    if profile.get("tile") is not None:
        tile = c.integer(profile, "tile", "", 1)
    coef, path = c.mapping(profile, "coefficients")
    padded = [name for name in coef if str(name).startswith(PADDED_PREFIX)] if isinstance(coef, dict) else []
    if tile is None and padded:
        c.fail("tile", f"a token count: the coefficients hold tile-step slopes ({padded[0]}, ...)", None)
    names = [segment_name(knots, k) for k in range(len(knots))]
    names += [segment_name(knots, k, PADDED_PREFIX) for k in padded_segments(knots, tile)]
    names += list(LINEAR_FEATURES if fmt == 2 else FORMAT_1_LINEAR)
    for name in [*names, *(k for k in coef if k not in names)]:  # every one NNLS wrote is >= 0
        c.number(coef, name, path)
    lm, path = c.mapping(profile, "lm_head")
    c.number(lm, "const", path)
    c.number(lm, "per_row", path)
    c.number(profile, "step_overhead")
    check_allreduce(c, profile, tp)
    res, path = c.mapping(profile, "residuals")
    probs = c.numbers(res, "probs", path, increasing=True)
    if probs[-1] > 1 or len(probs) < 2:
        c.fail(f"{path}.probs", "at least two probabilities in [0, 1], strictly increasing", _short(res["probs"]))
    quantiles = c.numbers(res, "quantiles", path, low=None, length=len(probs))
    if np.any(np.diff(quantiles) < 0):
        c.fail(f"{path}.quantiles", "non-decreasing quantiles (log residuals)", _short(res["quantiles"]))


def check_vidur(profile: dict, file: str | None = None) -> None:
    """Raise a ProfileError unless `profile` is a converted vidur profile vidur.py can read."""
    c = _Check(file)
    c.format(profile, VIDUR_FORMATS, "convert it again with `cbsim vidur-convert`")
    c.integer(profile, "num_layers", "", 1, MAX_LAYERS)
    tp = c.tp(profile, optional=False)
    ops, path = c.mapping(profile, "token_ops")
    n = len(c.numbers(ops, "num_tokens", path, increasing=True))
    ms, ms_path = c.mapping(ops, "ms", path)
    if not ms:
        c.fail(ms_path, "at least one token-level operator", ms)
    for op in ms:
        c.numbers(ms, op, ms_path, length=n)
    c.numbers(ops, "emb_ms", path, length=n)
    lm, path = c.mapping(profile, "lm_head")
    if c.text(lm, "op", path) not in ms:
        c.fail(f"{path}.op", f"an operator of token_ops.ms ({', '.join(ms)})", lm["op"])
    c.number(lm, "ratio", path)
    attention, path = c.mapping(profile, "attention")
    kind = attention.get("kind")
    if kind == "table":
        _table_attention(c, attention, path)
    elif kind == "roofline":
        for key in ROOFLINE_DIVISORS:
            c.number(attention, key, path, positive=True)
        for key in ROOFLINE_TERMS:
            c.number(attention, key, path)
    else:
        c.fail(f"{path}.kind", "'table' or 'roofline'", kind)
    check_allreduce(c, profile, tp)


def _table_attention(c: _Check, attention: dict, path: str) -> None:
    """Decode: a full grid (batch_size x kv); prefill: rows (chunk) over kv whose measured cells (not
    null) form a prefix of every row and of every column, with at least one per row."""
    dec, dpath = c.mapping(attention, "decode", path)
    rows = len(c.numbers(dec, "batch_size", dpath, positive=True, increasing=True))
    cols = len(c.numbers(dec, "kv", dpath, increasing=True))
    grid = _array(dec.get("ms"), 2)
    if "ms" not in dec or grid is None or grid.shape != (rows, cols) or not np.all(np.isfinite(grid) & (grid >= 0)):
        c.fail(f"{dpath}.ms", f"a {rows} x {cols} table of finite numbers >= 0", _short(dec.get("ms")))
    pre, ppath = c.mapping(attention, "prefill", path)
    rows = len(c.numbers(pre, "chunk", ppath, positive=True, increasing=True))
    cols = len(c.numbers(pre, "kv", ppath, increasing=True))
    value = pre.get("ms")
    expected = (f"a {rows} x {cols} table of finite numbers >= 0 or null, the numbers a prefix of every row "
                "and column, at least one per row")
    table = None
    if isinstance(value, list) and all(isinstance(row, list) for row in value):
        table = _array([[np.nan if v is None else v for v in row] for row in value], 2)
    if table is None or table.shape != (rows, cols) or np.any(np.isinf(table)) or np.any(table < 0):
        c.fail(f"{ppath}.ms", expected, _short(value))
    measured = ~np.isnan(table)
    if not measured.any(axis=1).all() or not all(_is_prefix(lines) for lines in (measured, measured.T)):
        c.fail(f"{ppath}.ms", expected, _short(value))


def check_allreduce(c: _Check, profile: dict, tp: int) -> None:
    """The `allreduce` section: required on a TP > 1 profile (its layer times are one shard's and
    leave the communication out), checked wherever present; its GPU count is the profile's TP."""
    spec = profile.get("allreduce")
    if spec is None:
        if tp > 1:
            c.fail("allreduce", f"an all-reduce section: this profile was measured on a TP-{tp} shard, whose "
                   "layer times leave out the communication (cbsim fit and cbsim vidur-convert write one)",
                   has_got=False)
        return
    spec, path = c.mapping(profile, "allreduce")
    kind = spec.get("kind")
    if kind not in ("table", "analytic", "nccl"):
        c.fail(f"{path}.kind", "'table', 'analytic' or 'nccl'", kind)
    if "per_layer" in spec:
        c.integer(spec, "per_layer", path, 1)
    c.number(spec, "bytes_per_token", path, positive=True)
    if kind != "table" or "num_workers" in spec:
        workers = c.integer(spec, "num_workers", path, 1, MAX_TP)
        if tp > 1 and workers != tp:
            c.fail(f"{path}.num_workers", f"the profile's tp ({tp})", workers)
    if kind == "table":
        size = len(c.numbers(spec, "bytes", path, increasing=True))
        c.numbers(spec, "ms", path, length=size)
    elif kind == "analytic":
        c.number(spec, "latency_s", path)
        c.number(spec, "bus_bandwidth", path, positive=True)
    else:
        try:
            link_model(c.text(spec, "gpu", path), c.text(spec, "topology", path))
        except (ValueError, KeyError) as err:
            c.fail(f"{path}.topology", f"a GPU and topology collectives.py models ({err})", spec.get("topology"))


def _is_prefix(lines: np.ndarray) -> bool:
    """Whether the True cells of every line of a boolean table come first."""
    counts = lines.sum(axis=1)
    return bool(np.array_equal(lines, np.arange(lines.shape[1])[None, :] < counts[:, None]))


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond float range
        return False


def _array(value, ndim: int) -> np.ndarray | None:
    """`value` as a float64 array of `ndim` dimensions if it is one of plain numbers (JSON null already
    replaced by NaN where allowed), else None (strings, booleans only, ragged lists, huge integers)."""
    if not isinstance(value, list):
        return None
    try:
        array = np.asarray(value)
    except (ValueError, OverflowError):  # ragged
        return None
    if array.ndim != ndim or array.dtype.kind not in "iuf":
        return None
    return array.astype(np.float64)


def _short(value):
    """A value short enough for a one-line message."""
    text = repr(value)
    return value if len(text) <= 60 else text[:57] + "..."
