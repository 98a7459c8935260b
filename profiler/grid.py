"""Batch grids: which batch shapes the profiler measures, and in what order.

A batch is prefill chunks (c, h) plus decode context lengths, tagged with its source: `grid`
(used for fitting), `anchor` (one of a few shapes repeated through the run: the noise floor and
drift) or `heldout` (never fitted: shapes read from a JSONL file the simulator writes, one
`{"prefill": [[c, h], ...], "decode": [ctx, ...]}` per line).

Invariants: every grid batch keeps its KV tokens (sum of h + c and of ctx) within the grid's
`max_kv_tokens` and its context lengths within `max_context`; the run order is the grid shuffled
with the anchors and held-out batches spread evenly through it, so a run cut short still covers
the whole space and keeps some of each source.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cbsim.core import bounds
from cbsim.core.errors import ConfigError


@dataclass(frozen=True)
class Batch:
    prefill: tuple[tuple[int, int], ...] = ()
    decode: tuple[int, ...] = ()
    source: str = "grid"

    @property
    def kv_tokens(self) -> int:
        return sum(c + h for c, h in self.prefill) + sum(self.decode)

    @property
    def max_ctx(self) -> int:
        return max([c + h for c, h in self.prefill] + list(self.decode), default=0)

    @property
    def num_tokens(self) -> int:
        return sum(c for c, _ in self.prefill) + len(self.decode)

    @property
    def is_decode_only(self) -> bool:
        return not self.prefill and bool(self.decode)


@dataclass(frozen=True)
class Grid:
    name: str
    batches: tuple[Batch, ...]
    anchors: tuple[Batch, ...] = ()
    anchor_repeats: int = 0
    max_kv_tokens: int = 0
    max_context: int = 0


def make_batch(prefill=(), decode=(), source: str = "grid") -> Batch:
    """A batch from plain lists, checked: c > 0, h >= 0, ctx > 0, and not empty."""
    prefill = tuple((int(c), int(h)) for c, h in prefill)
    decode = tuple(int(x) for x in decode)
    if not prefill and not decode:
        raise ValueError("a batch needs a prefill chunk or a decode row")
    if any(c <= 0 or h < 0 for c, h in prefill) or any(x <= 0 for x in decode):
        raise ValueError(f"bad batch: prefill {prefill}, decode {decode}")
    return Batch(prefill, decode, source)


def spread_contexts(rng: np.random.Generator, n: int, mean: float, sigma: float, max_context: int) -> list[int]:
    """n lognormal context lengths with the given mean, clipped to [1, max_context]."""
    mu = math.log(mean) - sigma * sigma / 2
    return [int(x) for x in np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, max_context)]


def _loguniform(rng, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _fits(batch: Batch, max_kv: int, max_context: int) -> bool:
    return batch.kv_tokens <= max_kv and batch.max_ctx <= max_context


def prefill_batches(chunks, histories, max_context: int) -> list[Batch]:
    """One chunk c with history h, for every pair with h + c <= max_context."""
    out = []
    for c in chunks:
        hs = sorted({h for h in histories if h + c <= max_context} | {max_context - c})
        out += [make_batch([(c, h)]) for h in hs if h >= 0]
    return out


def decode_batches(sizes, contexts, max_kv: int) -> list[Batch]:
    """B decodes all at context ctx, for every pair within the KV limit."""
    return [make_batch(decode=[ctx] * b) for b in sizes for ctx in contexts if b * ctx <= max_kv]


def spread_decode_batches(rng, sizes, means, max_kv: int, max_context: int, sigma: float = 1.0) -> list[Batch]:
    """B decodes with lognormal contexts of the given mean, kept when they fit the KV limit."""
    out = []
    for b in sizes:
        for mean in means:
            if b * mean <= 0.8 * max_kv:
                batch = make_batch(decode=spread_contexts(rng, b, mean, sigma, max_context))
                if batch.kv_tokens <= max_kv:
                    out.append(batch)
    return out


def mixed_batches(rng, chunks, histories, sizes, decode_means, max_kv, max_context, lo=256, hi=8192) -> list[Batch]:
    """One chunk (c, h) plus B decodes (Sarathi-style) for lo <= c + B <= hi."""
    out = []
    for i, (c, h, b) in enumerate((c, h, b) for c in chunks for h in histories for b in sizes):
        if lo <= c + b <= hi and h + c <= max_context:
            mean = min(decode_means[i % len(decode_means)], 0.5 * (max_kv - c - h) / b)
            batch = make_batch([(c, h)], spread_contexts(rng, b, mean, 1.0, max_context))
            if _fits(batch, max_kv, max_context):
                out.append(batch)
    return out


def budget_batches(rng, budgets, sizes, histories, decode_mean: float, max_kv: int, max_context: int) -> list[Batch]:
    """Batches of exactly B total tokens for each token budget B (a saturated Sarathi step): one
    chunk of B tokens for each history, and a chunk of B - b tokens (history cycling through
    `histories`) beside b lognormal decodes for each b in `sizes` below B."""
    out = [make_batch([(budget, h)]) for budget in budgets for h in histories]
    for i, (budget, b) in enumerate((budget, b) for budget in budgets for b in sizes if b < budget):
        h = histories[i % len(histories)]
        out.append(make_batch([(budget - b, h)], spread_contexts(rng, b, decode_mean, 1.0, max_context)))
    return [batch for batch in out if _fits(batch, max_kv, max_context)]


def tile_edge_batches(rng, multiples, offsets, history: int, decodes: int, decode_mean: float, max_kv: int,
                      max_context: int) -> list[Batch]:
    """Batches of T = m + d total tokens for each multiple m of the GEMM tile and offset d (0: the
    bottom of a step, a few tokens: just past it): one chunk with the given history, and one chunk
    beside `decodes` lognormal decodes. GEMM times rise in a step just past each multiple of the
    tile; pairs of such batches identify its height."""
    out = []
    for m in multiples:
        for t in (m + d for d in offsets):
            out.append(make_batch([(t, history)]))
            if t > decodes:
                contexts = spread_contexts(rng, decodes, decode_mean, 1.0, max_context)
                out.append(make_batch([(t - decodes, history)], contexts))
    return [batch for batch in out if _fits(batch, max_kv, max_context)]


def random_batches(rng, n: int, max_kv: int, max_context: int, chunks=(0, 3), max_chunk: int = 4096,
                   max_decodes: int = 256, source: str = "grid") -> list[Batch]:
    """n random batches off the regular grid: k chunks (k in [chunks[0], chunks[1]]) of log-uniform
    size and history, plus a log-uniform number (at most max_decodes) of lognormal decodes."""
    out = []
    while len(out) < n:
        k = int(rng.integers(chunks[0], chunks[1] + 1))
        prefill = []
        for _ in range(k):
            c = min(_loguniform(rng, 16, max_chunk), max_context)
            h = 0 if rng.random() < 0.3 else _loguniform(rng, 16, max(16, max_context // 4))
            prefill.append((c, min(h, max_context - c)))
        b = 0 if (max_decodes == 0 or (k and rng.random() < 0.3)) else _loguniform(rng, 1, max_decodes)
        decode = spread_contexts(rng, b, _loguniform(rng, 64, max(64, max_context // 8)), 1.0, max_context)
        if prefill or decode:
            batch = make_batch(prefill, decode, source)
            if _fits(batch, max_kv, max_context):
                out.append(batch)
    return out


def tiny_grid(rng: np.random.Generator) -> Grid:
    """A CPU grid over the `tiny` model: every kind of batch once, the pipeline in seconds."""
    max_kv, max_ctx = 20000, 16384
    batches = (
        prefill_batches([8, 32, 128, 512], [0, 64, 1024], 2048)
        + [make_batch([(64, max_ctx - 64)])]
        + random_batches(rng, 2, max_kv, 2048, chunks=(2, 3), max_chunk=128, max_decodes=0)
        + decode_batches([1, 8, 32], [16, 256, 2048], max_kv)
        + [make_batch(decode=[max_ctx])]
        + spread_decode_batches(rng, [4, 16], [256], max_kv, 2048)
        + mixed_batches(rng, [32, 256], [0, 512], [4, 16], [128, 1024], max_kv, 2048, lo=16, hi=1024)
    )
    anchors = (make_batch(decode=[512] * 8, source="anchor"), make_batch([(128, 256)], [64] * 4, source="anchor"))
    return Grid("tiny", tuple(batches), anchors, 3, max_kv, max_ctx)


H200_8B_MAX_KV = 800_000  # KV tokens a real Llama-3-8B engine holds on one H200 (~131 kB per token)
TILE_MULTIPLES = tuple(128 * k for k in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32, 48, 64))  # T at GEMM steps


def h200_8b_grid(rng: np.random.Generator) -> Grid:
    """The Llama-3-8B grid for one H200 (PROFILER.md): about 840 grid batches and 40 anchors.

    Beside the regular and random batches it holds batches of exactly the common token budgets
    (256 ... 8192: where Sarathi steps sit) and batches at and just past multiples of 128 tokens
    (where GEMM tile steps are), so the fit can identify the tile term."""
    max_kv, max_ctx = H200_8B_MAX_KV, 131072
    chunks = [16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384]
    histories = [0, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 98304]
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512]
    contexts = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072]
    batches = (
        prefill_batches(chunks, histories, max_ctx)
        + random_batches(rng, 60, max_kv, max_ctx, chunks=(2, 8), max_chunk=4096, max_decodes=0)
        + decode_batches(sizes, contexts, max_kv)
        + spread_decode_batches(rng, [4, 16, 64, 128, 256, 512], [256, 1024, 4096, 16384, 65536], max_kv, max_ctx)
        + mixed_batches(rng, [16, 64, 128, 256, 512, 1024, 2048, 4096, 8192], [0, 4096, 32768],
                        [1, 4, 16, 32, 64, 128, 256, 512], [1024, 8192], max_kv, max_ctx)
        + random_batches(rng, 100, max_kv, max_ctx, chunks=(1, 1), max_chunk=8192, max_decodes=512)
        + random_batches(rng, 100, max_kv, max_ctx, chunks=(2, 2), max_chunk=4096, max_decodes=256)
        + budget_batches(rng, [256, 512, 1024, 2048, 4096, 8192], [16, 64, 128], [0, 8192], 2048, max_kv, max_ctx)
        + tile_edge_batches(rng, TILE_MULTIPLES, (0, 8), 1024, 32, 2048, max_kv, max_ctx)
    )
    anchors = (
        make_batch(decode=[2048] * 64, source="anchor"),
        make_batch(decode=[2048] * 256, source="anchor"),
        make_batch([(512, 0)], source="anchor"),
        make_batch([(2048, 8192)], source="anchor"),
        make_batch([(256, 1024)], [1024] * 64, source="anchor"),
    )
    return Grid("h200-8b", tuple(batches), anchors, 8, max_kv, max_ctx)


GRIDS = {"tiny": tiny_grid, "h200-8b": h200_8b_grid}


def named_grid(name: str, rng: np.random.Generator) -> Grid:
    """The grid called `name` (see GRIDS); ConfigError when unknown."""
    if name not in GRIDS:
        raise ConfigError("grid", "one of " + ", ".join(GRIDS), name)
    return GRIDS[name](rng)


def run_order(grid: Grid | None, heldout, rng: np.random.Generator) -> list[Batch]:
    """The grid shuffled, with the anchor repeats and the held-out batches each spread evenly through it."""
    base = [] if grid is None else [grid.batches[i] for i in rng.permutation(len(grid.batches))]
    anchors = [] if grid is None else [a for _ in range(grid.anchor_repeats) for a in grid.anchors]
    heldout = list(heldout)
    if not base:
        return anchors + heldout
    slots = [(float(i), b) for i, b in enumerate(base)]
    for group in (anchors, heldout):
        slots += [((i + 0.5) * len(base) / len(group) - 0.25, b) for i, b in enumerate(group)]
    return [b for _, b in sorted(slots, key=lambda t: t[0])]


def read_batches(path) -> list[Batch]:
    """Held-out batches from a JSONL file; ConfigError naming the file and line on bad input."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as err:
        raise ConfigError("batches", "a readable JSONL file", str(path)) from err
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        key = f"line {number}"
        try:
            item = bounds.loads(line)
            if not isinstance(item, dict) or set(item) - {"prefill", "decode"}:
                raise ValueError("keys other than prefill/decode")
            out.append(make_batch(item.get("prefill", []), item.get("decode", []), "heldout"))
        except (ValueError, TypeError) as err:
            raise ConfigError(key, '{"prefill": [[c, h], ...], "decode": [ctx, ...]}', line,
                              file=str(path)) from err
    return out


def write_batches(path, batches) -> None:
    """Write batches as JSONL in the format `read_batches` reads."""
    with open(path, "w") as f:
        for b in batches:
            f.write(json.dumps({"prefill": [list(p) for p in b.prefill], "decode": list(b.decode)}) + "\n")
