"""Physical features of a batch, from a StepShape or from a measurement row's composition strings.

Invariant: one definition of every feature, used by the fit (on measured batches) and by the
`fitted` cost model (on simulated steps), so a profile is always evaluated on exactly the
quantities it was fitted on. Derived columns of a measurement CSV are recomputed from the
composition strings ("c:h;c:h" for prefill chunks, "ctx;ctx" for decode contexts), never trusted.

Features of one batch (per layer; the GEMMs see every token once):
  T       total tokens: sum of chunk sizes c plus the number of decode rows
  Tp      T padded to whole GEMM tiles: tile * ceil(T / tile) when T > tile, else T
  Ph      history pairs of the prefill chunks: sum of c * h (new tokens x cached tokens)
  Pn      new-token pairs: sum of c * (c + 1) / 2 (the causal triangle of each chunk)
  Kp      KV tokens the prefill chunks read: sum of h + c
  Kd      KV tokens the decode rows read: sum of the context lengths
  n_dec   decode rows;  n_pref  prefill chunks
P = Ph + Pn (all causal pairs) is kept for format-1 profiles, which had one rate for both.

g(T), the GEMM time, is piecewise linear in T: the ramp basis below gives one column per segment
between knots, whose coefficient is the slope on that segment (non-negative slopes make g
non-decreasing without forcing it convex). GEMM kernels run in row tiles, so their time rises in
a step just past each multiple of the tile; a second ramp basis over Tp, with the same knots and
non-negative slopes, adds that staircase. Its segments that end at or below the tile duplicate g's
exactly (there Tp = T, and above the tile both columns are full), so they get no column.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from cbsim.sim.shape import StepShape

LINEAR_FEATURES = ("pairs_history", "pairs_new", "prefill_kv", "decode_kv", "num_decode", "num_prefill", "const")
PADDED_PREFIX = "gp"  # names of the slopes of g over the tile-padded tokens: "gp[128,256)"


class Aggregates(NamedTuple):
    tokens: int
    pairs: float
    pairs_history: int
    pairs_new: int
    prefill_kv: int
    decode_kv: int
    num_decode: int
    num_prefill: int


def aggregates(shape: StepShape) -> Aggregates:
    """The features of one step shape (plain Python; called once per simulated step)."""
    return rows_aggregates(shape.prefill, len(shape.decode), sum(shape.decode))


def rows_aggregates(prefill, n_dec: int, decode_kv: int) -> Aggregates:
    """The features of a step from its prefill rows (c, h) and its decode rows' count and context sum."""
    pairs = 0.0
    ph = pn = kp = tokens = 0
    for c, h in prefill:
        pairs += c * (h + (c + 1) / 2)
        ph += c * h
        pn += c * (c + 1) // 2
        kp += c + h
        tokens += c
    return Aggregates(tokens + n_dec, pairs, ph, pn, kp, decode_kv, n_dec, len(prefill))


def padded_tokens(tokens: int, tile: int) -> int:
    """Tp of one batch: T rounded up to a whole number of tiles when T > tile, else T (integers)."""
    return tokens if tokens <= tile else -(-tokens // tile) * tile


def padded_token_column(tokens, tile: int) -> np.ndarray:
    """Tp of many batches; element k equals padded_tokens(tokens[k], tile)."""
    t = np.asarray(tokens, dtype=np.float64)
    return np.where(t > tile, np.ceil(t / tile) * tile, t)


def parse_prefill(text) -> tuple[tuple[int, int], ...]:
    """'c:h;c:h' -> ((c, h), ...); empty or missing -> ()."""
    text = _clean(text)
    if not text:
        return ()
    out = []
    for item in text.split(";"):
        c, _, h = item.partition(":")
        if not _:
            raise ValueError(f"prefill item {item!r} is not 'c:h'")
        out.append((int(c), int(h)))
    return tuple(out)


def parse_decode(text) -> tuple[int, ...]:
    """'ctx;ctx' -> (ctx, ...); empty or missing -> ()."""
    text = _clean(text)
    return tuple(int(x) for x in text.split(";")) if text else ()


def _clean(text) -> str:
    if text is None or (isinstance(text, float) and np.isnan(text)):
        return ""
    return str(text).strip()


def shape_of(prefill_text, decode_text) -> StepShape:
    """The StepShape of a measured batch (every row samples a token)."""
    return StepShape.from_batch(parse_prefill(prefill_text), parse_decode(decode_text))


def table_aggregates(prefill_texts, decode_texts) -> dict[str, np.ndarray]:
    """Feature columns (and num_seqs) for many composition strings; keys as in Aggregates."""
    rows = [aggregates(shape_of(p, d)) for p, d in zip(prefill_texts, decode_texts)]
    cols = {name: np.array([r[i] for r in rows], dtype=np.float64) for i, name in enumerate(Aggregates._fields)}
    cols["num_seqs"] = cols["num_decode"] + cols["num_prefill"]
    return cols


def ramp_basis(tokens, knots) -> np.ndarray:
    """Columns clip(T - t_k, 0, t_{k+1} - t_k) for each segment; the last segment is unbounded.

    `knots` starts at 0 and is strictly increasing; g(T) = basis @ slopes.
    """
    t = np.asarray(tokens, dtype=np.float64)[:, None]
    lo = np.asarray(knots, dtype=np.float64)
    hi = np.append(lo[1:], np.inf)
    return np.clip(t - lo[None, :], 0.0, (hi - lo)[None, :])


def ramp_values_at_knots(knots, slopes) -> np.ndarray:
    """g at each knot (g(0) = 0): the running sum of slope * segment length."""
    lengths = np.diff(np.asarray(knots, dtype=np.float64))
    return np.concatenate([[0.0], np.cumsum(np.asarray(slopes, dtype=np.float64)[:-1] * lengths)])


def padded_segments(knots, tile: int | None) -> list[int]:
    """Indices of the segments of g over Tp that get a column: those ending above the tile (the
    last segment never ends); none without a tile."""
    if tile is None:
        return []
    return [k for k in range(len(knots)) if k + 1 == len(knots) or knots[k + 1] > tile]


def design_matrix(cols: dict[str, np.ndarray], knots, tile: int | None = None) -> tuple[np.ndarray, list[str]]:
    """The fit's design matrix, with column names: ramp columns of g(T), then (with a tile) those of
    g over Tp (padded_segments), then LINEAR_FEATURES."""
    tokens = cols["tokens"]
    blocks = [ramp_basis(tokens, knots)]
    names = [segment_name(knots, k) for k in range(len(knots))]
    padded = padded_segments(knots, tile)
    if padded:
        blocks.append(ramp_basis(padded_token_column(tokens, tile), knots)[:, padded])
        names += [segment_name(knots, k, PADDED_PREFIX) for k in padded]
    blocks += [cols[name] if name != "const" else np.ones_like(tokens) for name in LINEAR_FEATURES]
    return np.column_stack(blocks), names + list(LINEAR_FEATURES)


def segment_name(knots, k: int, prefix: str = "g") -> str:
    """Name of a slope on segment k, e.g. 'g[64,128)', 'g[4096,inf)' or (prefix 'gp') 'gp[128,256)'."""
    hi = knots[k + 1] if k + 1 < len(knots) else "inf"
    return f"{prefix}[{knots[k]:g},{hi if isinstance(hi, str) else format(hi, 'g')})"


def choose_knots(tokens, min_rows: int = 8) -> list[float]:
    """Knots for g(T): 0, then the powers of two inside the data's range (GEMM tile and wave steps
    fall on them; between them g is linear).

    A knot is kept only if the segment it closes holds at least `min_rows` rows with at least two
    distinct T values, so every slope is determined by data; the last segment must hold them too.
    """
    t = np.sort(np.asarray(tokens, dtype=np.float64))
    if len(t) == 0:
        return [0.0]
    candidates = [float(2**k) for k in range(3, 24) if t[0] < 2**k < t[-1]]
    knots = [0.0]
    for c in candidates:
        seg = t[(t >= knots[-1]) & (t < c)]
        rest = t[t >= c]
        if _enough(seg, min_rows) and _enough(rest, min_rows):
            knots.append(c)
    return knots


def _enough(values: np.ndarray, min_rows: int) -> bool:
    return len(values) >= min_rows and len(np.unique(values)) >= 2
