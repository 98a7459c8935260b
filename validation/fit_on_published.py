"""Check the `fitted` cost model's functional form against published real-GPU kernel timings.

    python validation/fit_on_published.py [--size full|tiny] [--out results/fit_on_published]
                                          [--noise 0.01] [--seed 0] [--monotone]
                                          [--budgets 512,2048] [--no-probes]

No GPU is needed. The "measurements" are the `vidur` cost model's `layer_time` (one decoder
layer, no all-reduce) for A100 / Llama-2-70B TP2, built from Vidur's published per-operator
medians (sim/costmodels/profiles/vidur/a100-llama-2-70b-tp2.json: token operators from mlp.csv,
prefill and decode FlashAttention from attention.csv); `monotone: false` (the default here)
reproduces the published medians exactly. The script then runs the profiler's own fitting half:

  1. batch shapes: a grid in the style of profiler/grid.py sized to the published region
     (T <= 4096 tokens, contexts <= 4096, at most 128 decode rows: attention.csv stops there,
     so the `long` class cannot occur), with its probes of the token budgets and of the tile
     edges (batches at and just past multiples of 128 tokens; --no-probes leaves them out), plus
     held-out shapes sampled from simulator runs of `sarathi` (token budgets --budgets, default
     512 and 2048) and `prefill_first` on the same cost model;
  2. a measurement CSV in the profiler's format (measurements.COLUMNS, rows in grid.run_order,
     source grid / anchor / heldout) and a metadata.json the fitter reads;
  3. `fit_profile` (what `cbsim fit` runs: it chooses the GEMM tile of the step term by
     cross-validation, printed with every candidate's out-of-fold error) and `costcheck` on the
     held-out and on the grid rows, with scatter PNGs;
  4. a conclusion against the targets (held-out mixed batches: median <= 3 %, p95 <= 8 % absolute
     relative error), the feature bins where the worst class misfits, and the errors of variants
     of the family (smaller ones: without the tile term, with one pair rate as profile format 1;
     a larger one; the exact token-operator curve as a diagnostic) fitted on copies of the design
     matrix (the fit itself is unchanged).

Invariant: every table printed comes from files this run wrote in --out (measurements.csv,
metadata.json, profile.json), so `cbsim fit measurements.csv --network a100_dgx` and
`cbsim costcheck profile.json measurements.csv --rows heldout|grid` reproduce them.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
PROFILE = "a100-llama-2-70b-tp2.json"
MAX_TOKENS = 4096  # mlp.csv num_tokens range
MAX_CONTEXT = 4096  # attention.csv max_model_len
MAX_DECODES = 128  # attention.csv decode batch sizes
MAX_KV = MAX_DECODES * MAX_CONTEXT
TILE = 128  # GEMM tile rows the published A100 token operators step at (mlp.csv: +14..36 % just past k*128)
TARGET_MEDIAN, TARGET_P95 = 0.03, 0.08  # held-out mixed batches (the targets)
DEFAULT_BUDGETS = (512, 2048)  # sarathi token budgets of the held-out simulations


def heldout_policies(budgets=DEFAULT_BUDGETS) -> tuple[tuple[str, dict], ...]:
    """(name, policy) of the held-out simulations: sarathi at each token budget, and prefill_first."""
    sarathi = tuple((f"sarathi-{b}", {"name": "sarathi", "token_budget": int(b), "max_num_seqs": MAX_DECODES})
                    for b in budgets)
    return sarathi + (("prefill_first", {"name": "prefill_first", "max_num_seqs": MAX_DECODES}),)


@dataclass(frozen=True)
class Size:
    """How big a run is: full for the report, tiny for the test (seconds)."""

    grid_batches: int | None  # None: the whole grid; else a seeded subsample of this many
    anchor_repeats: int
    requests: int  # requests per held-out simulation
    shapes: int  # step shapes sampled from each held-out simulation


SIZES = {"full": Size(None, 4, 400, 200), "tiny": Size(48, 1, 60, 12)}


@dataclass
class Report:
    """What a run measured; tables are costcheck.error_table dicts."""

    out: Path
    heldout: dict
    grid: dict
    counts: dict
    misfits: list = field(default_factory=list)
    variants: list = field(default_factory=list)
    tile_selection: dict = field(default_factory=dict)
    meets_targets: bool = False
    conclusion: str = ""


# ----------------------------------------------------------------------------- batch shapes


def in_region(batch) -> bool:
    """Whether a batch lies where the published tables have measurements."""
    return (batch.num_tokens <= MAX_TOKENS and batch.max_ctx <= MAX_CONTEXT
            and len(batch.decode) <= MAX_DECODES and batch.kv_tokens <= MAX_KV)


def published_grid(rng: np.random.Generator, anchor_repeats: int = 4, probes: bool = True):
    """The h200-8b grid's recipe (profiler/grid.py) rescaled to the published A100 region; `probes`:
    with its batches at the token budgets and at and just past multiples of 128 tokens."""
    from cbsim.profiler import grid as g

    chunks = [64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096]
    histories = [0, 128, 512, 1024, 2048, 3072]
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    contexts = [64, 128, 256, 512, 1024, 2048, 3072, 4032]
    batches = (
        g.prefill_batches(chunks, histories, MAX_CONTEXT)
        + g.random_batches(rng, 40, MAX_KV, MAX_CONTEXT, chunks=(2, 6), max_chunk=2048, max_decodes=0)
        + g.decode_batches(sizes, contexts, MAX_KV)
        + g.spread_decode_batches(rng, [4, 16, 32, 64, 128], [256, 1024, 2048], MAX_KV, MAX_CONTEXT)
        + g.mixed_batches(rng, [16, 64, 128, 256, 512, 1024, 2048, 3072], [0, 1024, 2048],
                          [1, 4, 16, 32, 64, 128], [512, 2048], MAX_KV, MAX_CONTEXT, lo=64, hi=MAX_TOKENS)
        + g.random_batches(rng, 100, MAX_KV, MAX_CONTEXT, chunks=(1, 1), max_chunk=4096, max_decodes=MAX_DECODES)
        + g.random_batches(rng, 60, MAX_KV, MAX_CONTEXT, chunks=(2, 2), max_chunk=2048, max_decodes=MAX_DECODES)
    )
    if probes:
        batches += (g.budget_batches(rng, [256, 512, 1024, 2048, 4096], [16, 64, 128], [0, 2048], 1024, MAX_KV,
                                     MAX_CONTEXT)
                    + g.tile_edge_batches(rng, g.TILE_MULTIPLES, (0, 8), 1024, 32, 1024, MAX_KV, MAX_CONTEXT))
    anchors = (g.make_batch(decode=[1024] * 64, source="anchor"), g.make_batch([(512, 0)], source="anchor"),
               g.make_batch([(256, 1024)], [1024] * 32, source="anchor"))
    return g.Grid("a100-70b-tp2-published", tuple(b for b in batches if in_region(b)), anchors,
                  anchor_repeats, MAX_KV, MAX_CONTEXT)


def subsample(grid, count: int | None, rng: np.random.Generator):
    """The grid with a seeded subsample of `count` batches (all when None or larger)."""
    from dataclasses import replace

    if count is None or count >= len(grid.batches):
        return grid
    keep = np.sort(rng.choice(len(grid.batches), size=count, replace=False))
    return replace(grid, batches=tuple(grid.batches[i] for i in keep))


def simulation(policy: dict, size: Size, seed: int, monotone: bool) -> dict:
    """A small experiment on the vidur cost model whose sampled step shapes are held out.

    KV blocks are generous (256k tokens, more than two A100s hold beside 70B weights) so decode
    batches reach the published 128 rows: the point is the kernels' cost surface, not memory."""
    return {
        "name": "fit-on-published", "seed": seed, "model": "llama-2-70b",
        "cost_model": {"type": "vidur", "profile": PROFILE, "monotone": monotone},
        "cluster": {"kv_cache": {"num_blocks": 16384}},
        "policy": policy,
        "workload": {"num_requests": size.requests, "arrival": {"type": "poisson", "rate": 4.0},
                     "prompt_len": {"type": "lognormal", "median": 600, "sigma": 0.9, "max": 3072},
                     "output_len": {"type": "lognormal", "median": 150, "sigma": 0.8, "min": 2, "max": 1000}},
        "output": {"plots": False, "trace": False, "shapes": size.shapes},
    }


def heldout_batches(size: Size, seed: int, monotone: bool, budgets=DEFAULT_BUDGETS) -> tuple[list, int]:
    """Step shapes sampled from the held-out simulations, and how many fell outside the region."""
    from cbsim.api import run_experiment
    from cbsim.profiler.grid import make_batch

    batches = []
    for _, policy in heldout_policies(budgets):
        result = run_experiment(simulation(policy, size, seed, monotone))
        batches += [make_batch(s.prefill, s.decode, "heldout") for s in result.shapes]
    kept = [b for b in batches if in_region(b)]
    return kept, len(batches) - len(kept)


# ----------------------------------------------------------------------------- measurements


@dataclass(frozen=True)
class Timing:
    """The profiler's timing summary (timing.Summary) for a published median."""

    median: float
    p10: float
    p90: float
    repeats: int


def shard_geometry(profile: dict) -> dict:
    """The per-GPU layer geometry (the fields of profiler/layer.py's LayerShape) of a vidur profile."""
    geo, tp = profile["geometry"], int(profile["tp"])
    return {"name": profile["model"], "hidden": geo["n_embd"], "num_heads": geo["n_head"] // tp,
            "num_kv_heads": max(1, geo["n_kv_head"] // tp), "head_dim": geo["head_dim"],
            "intermediate": geo["n_expanded_embd"] // tp, "vocab": math.ceil(geo["vocab_size"] / tp),
            "num_layers": profile["num_layers"]}


def work_counter(geometry: dict):
    """(flops, bytes) of one layer per batch, from profiler/layer.py; NaNs when torch (which that
    module imports) is missing: the fitter never reads these two columns."""
    try:
        from cbsim.profiler.layer import LayerShape, layer_bytes, layer_flops
    except ImportError:
        return lambda prefill, decode: (float("nan"), float("nan"))
    shape = LayerShape(**geometry)
    return lambda prefill, decode: (layer_flops(shape, prefill, decode), layer_bytes(shape, prefill, decode, 2))


def published_times(model, batch) -> tuple[float, float]:
    """(one layer's seconds, LM-head seconds for the batch's sampled rows) from the vidur model."""
    from cbsim.sim.shape import StepShape

    shape = StepShape.from_batch(batch.prefill, batch.decode)
    unsampled = StepShape(shape.prefill, shape.decode, 0, 0)
    return model.layer_time(shape), model.step_time(shape) - model.step_time(unsampled)


def write_measurements(out: Path, order, model, noise: float, rng: np.random.Generator, geometry: dict) -> Path:
    """measurements.csv in run order. With noise > 0 each median is multiplied by a seeded factor
    uniform in [1 - noise, 1 + noise], and p10/p90 are that distribution's quantiles (-+0.8 noise)."""
    from cbsim.profiler.measurements import COLUMNS, CsvAppender, measurement_row

    work = work_counter(geometry)
    path = out / "measurements.csv"
    with CsvAppender(path, COLUMNS) as rows:
        for batch_id, batch in enumerate(order):
            layer, lm_head = published_times(model, batch)
            median = layer * (1.0 + noise * rng.uniform(-1.0, 1.0)) if noise else layer
            timing = Timing(median, median * (1 - 0.8 * noise), median * (1 + 0.8 * noise), 1)
            flops, nbytes = work(batch.prefill, batch.decode)
            rows.append(measurement_row(batch_id, batch.source, batch.prefill, batch.decode, timing, lm_head,
                                        False, flops, nbytes, False))
    return path


def metadata(profile: dict, geometry: dict, grid, size: Size, seed: int, noise: float, monotone: bool,
             planned: int, skipped: int, budgets=DEFAULT_BUDGETS, probes: bool = True) -> dict:
    """metadata.json in the keys fit.py reads (model mapping, tp, gpu, step overhead) plus provenance."""
    from cbsim.profiler.measurements import COLUMNS, git_revision

    return {
        "model": geometry, "tp": int(profile["tp"]), "gpu": profile["gpu"], "step_overhead_s": 0.0,
        "environment": {"gpu": profile["hardware"]["name"], "measured_by": "Vidur (published medians)"},
        "backend": {"name": "published", "version": profile["provenance"]["attention"]},
        "source": {"cost_model": "vidur", "profile": PROFILE, "monotone": monotone,
                   "token_ops": profile["provenance"]["token_ops"], "noise": noise},
        "grid": grid.name, "grid_probes": probes, "grid_max_kv_tokens": grid.max_kv_tokens,
        "batches_planned": planned, "heldout": [name for name, _ in heldout_policies(budgets)],
        "heldout_skipped": skipped,
        "size": size.__dict__, "seed": seed, "git_revision": git_revision(REPO), "columns": list(COLUMNS),
        "timing": "layer_s_median = vidur layer_time (one layer, no all-reduce); lm_head_s = its LM-head term",
    }


# ----------------------------------------------------------------------------- residual analysis

BINS = {  # feature -> bin edges (right-closed)
    "total tokens T": [0, 16, 64, 128, 256, 512, 1024, 2048, 4096],
    "decode rows": [-1, 0, 1, 4, 16, 64, 128],
    "mean decode context": [-1, 0, 256, 1024, 2048, 4096],
    "largest prefill chunk": [-1, 0, 64, 256, 1024, 4096],
}


def feature_columns(frame: pd.DataFrame) -> pd.DataFrame:
    """The features residuals are inspected against (from the CSV's derived columns)."""
    from cbsim.sim.costmodels.features import parse_prefill

    tokens = frame["num_tokens"].astype(int)
    ndec = frame["num_decode"].astype(int)
    chunks = [max((c for c, _ in parse_prefill(p)), default=0) for p in frame["prefill"].fillna("")]
    tile = np.select([tokens % TILE == 0, tokens % TILE <= TILE // 4], [f"multiple of {TILE}", "just past one"],
                     "mid-tile")
    return pd.DataFrame({
        "total tokens T": tokens, "decode rows": ndec,
        "mean decode context": np.where(ndec > 0, frame["decode_kv_read"] / ndec.clip(lower=1), 0),
        "largest prefill chunk": chunks, f"T vs {TILE}-token GEMM tiles": tile,
    }, index=frame.index)


def misfits(frame: pd.DataFrame, rel: np.ndarray, min_rows: int = 5, top: int = 4) -> list[dict]:
    """Where the class with the largest median |error| (of those with `min_rows` rows) misfits: its
    features ranked by the share of the signed-error variance their bins explain (eta squared),
    each with its worst bin (at least `min_rows` rows): n, median |error| and signed bias there."""
    err = pd.Series(rel, index=frame.index)
    by_class = err.abs().groupby(frame["cls"])
    medians = by_class.median()[by_class.size() >= min_rows]
    if medians.empty:
        return []
    worst = medians.idxmax()
    sel = frame["cls"] == worst
    feats, e = feature_columns(frame[sel]), err[sel]
    total = float(((e - e.mean()) ** 2).sum()) or 1.0
    out = []
    for name in feats.columns:
        key = pd.cut(feats[name], BINS[name]) if name in BINS else feats[name]
        groups = [(str(label), g) for label, g in e.groupby(key, observed=True)]
        explained = sum(len(g) * (g.mean() - e.mean()) ** 2 for _, g in groups) / total
        big = [(label, g) for label, g in groups if len(g) >= min_rows]
        if big:
            label, g = max(big, key=lambda item: item[1].abs().median())
            out.append({"cls": worst, "feature": name, "explained": float(explained), "bin": label, "n": int(len(g)),
                        "median_abs": float(g.abs().median()), "bias": float(g.mean())})
    return sorted(out, key=lambda r: -r["explained"])[:top]


# ----------------------------------------------------------------------------- family variants


def variant_matrix(cols: dict, frame: pd.DataFrame, knots, tile, variant: str, token_ops=None) -> np.ndarray:
    """A copy of the fit's design matrix (knots and tile as fitted), changed as `variant` says
    (see VARIANTS)."""
    from cbsim.sim.costmodels.features import LINEAR_FEATURES, design_matrix

    x, names = design_matrix(cols, knots, None if "notile" in variant else tile)
    tokens, extra = cols["tokens"], []
    if "oracle" in variant:  # g and gp replaced by the published token-operator curve (a diagnostic)
        first = names.index(LINEAR_FEATURES[0])
        x, names = x[:, first:], names[first:]
        extra.append(np.array([token_ops(t) for t in tokens]))
    if "onepair" in variant:  # one rate for all causal pairs P = Ph + Pn (profile format 1)
        split = [names.index("pairs_history"), names.index("pairs_new")]
        x = np.delete(x, split, axis=1)
        extra.append(cols["pairs"])
    if "jumps" in variant:  # a non-negative step of g just past every knot
        extra += [(tokens > k).astype(float) for k in knots[1:]]
    return np.column_stack([x] + extra) if extra else x


VARIANTS = (  # (label, variant); smaller and larger families, and a diagnostic of what is reachable
    ("family as fitted", "base"),
    ("format 1: one pair rate, no tile term", "onepair+notile"),
    ("without the tile term", "notile"),
    ("one pair rate", "onepair"),
    ("+ jumps at g knots", "jumps"),
    ("diagnostic: exact token ops", "oracle"),
)


def try_variants(frame: pd.DataFrame, knots, tile, token_ops, folds: int = 5) -> list[dict]:
    """Held-out and out-of-fold grid errors of each variant, fitted like fit.py (relative NNLS)."""
    from cbsim.profiler.costcheck import error_table
    from cbsim.profiler.fit import columns_of, relative_nnls, valid_rows, with_features

    rows, _ = with_features(valid_rows(frame))
    grid, held = rows[rows["source"] == "grid"], rows[rows["source"] == "heldout"]
    y, yh = grid["layer_s_median"].to_numpy(float), held["layer_s_median"].to_numpy(float)
    out = []
    for label, variant in VARIANTS:
        x = variant_matrix(columns_of(grid), grid, knots, tile, variant, token_ops)
        xh = variant_matrix(columns_of(held), held, knots, tile, variant, token_ops)
        fold = np.arange(len(y)) % folds
        oof = np.empty(len(y))
        for f in range(folds):
            oof[fold == f] = x[fold == f] @ relative_nnls(x[fold != f], y[fold != f])
        out.append({"variant": label, "columns": int(x.shape[1]),
                    "heldout": error_table(yh, xh @ relative_nnls(x, y), held["cls"].to_numpy(str)),
                    "grid_oof": error_table(y, oof, grid["cls"].to_numpy(str))})
    return out


def format_variants(variants: list[dict]) -> str:
    """One line per variant: held-out mixed and overall, grid out-of-fold overall (median / p95 %)."""
    def cell(table, cls):
        s = table.get(cls)
        return f"{100 * s['median_abs']:5.2f} /{100 * s['p95_abs']:6.2f}" if s else f"{'-':>13}"

    lines = [f"{'variant':<40}{'cols':>5}  {'held mixed':>13}  {'held all':>13}  {'grid oof mixed':>14}  "
             f"{'grid oof all':>13}"]
    for v in variants:
        lines.append(f"{v['variant']:<40}{v['columns']:>5}  {cell(v['heldout'], 'mixed')}  "
                     f"{cell(v['heldout'], 'overall')}  {cell(v['grid_oof'], 'mixed'):>14}  "
                     f"{cell(v['grid_oof'], 'overall')}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the run


def verdict(heldout: dict, found: list[dict]) -> tuple[bool, str]:
    """Whether held-out mixed batches meet the targets, and the conclusion line."""
    mixed = heldout.get("mixed")
    if mixed is None:
        return False, "no held-out mixed batches: the targets cannot be judged"
    ok = mixed["median_abs"] <= TARGET_MEDIAN and mixed["p95_abs"] <= TARGET_P95
    head = (f"held-out mixed median {100 * mixed['median_abs']:.2f}% (target <= {100 * TARGET_MEDIAN:.0f}%), "
            f"p95 {100 * mixed['p95_abs']:.2f}% (target <= {100 * TARGET_P95:.0f}%): "
            + ("the family MEETS the targets" if ok else "the family MISSES the targets"))
    if found:
        worst = found[0]
        head += (f"; worst held-out class (of those with 5+ rows) {worst['cls']}: its errors follow {worst['feature']} "
                 f"({100 * worst['explained']:.0f}% of their variance; bin {worst['bin']}: n={worst['n']}, "
                 f"median |err| {100 * worst['median_abs']:.1f}%, bias {100 * worst['bias']:+.1f}%)")
    return ok, head


def measure(out: Path, spec: Size, seed: int, noise: float, monotone: bool, budgets=DEFAULT_BUDGETS,
            probes: bool = True):
    """Steps 1-2: the batch shapes and their published times -> (measurements.csv, vidur model, counts)."""
    from cbsim.sim.costmodels.vidur import PROFILE_DIR, VidurCostModel
    from cbsim.profiler.grid import run_order

    rng = np.random.default_rng(seed)
    model = VidurCostModel.from_file(PROFILE_DIR / PROFILE, monotone=monotone)
    geometry = shard_geometry(model.profile)
    grid = subsample(published_grid(rng, spec.anchor_repeats, probes), spec.grid_batches, rng)
    heldout, skipped = heldout_batches(spec, seed, monotone, budgets)
    order = run_order(grid, heldout, rng)
    meta = metadata(model.profile, geometry, grid, spec, seed, noise, monotone, len(order), skipped, budgets, probes)
    (out / "metadata.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    counts = {"grid": len(grid.batches), "anchor_rows": len(grid.anchors) * grid.anchor_repeats,
              "heldout": len(heldout), "heldout_skipped": skipped}
    return write_measurements(out, order, model, noise, rng, geometry), model, counts


def fit_and_check(out: Path, csv: Path, model) -> tuple[dict, dict, str, dict, str, list, list]:
    """Step 3-4: fit (as `cbsim fit`), costcheck held-out and grid rows, residuals, variants.
    Returns (profile, held-out table, its text, grid table, its text, misfits, variants)."""
    from cbsim.profiler.costcheck import costcheck, load_model, predict_layers
    from cbsim.profiler.fit import fit_profile, load_measurements, valid_rows, write_profile

    frame, meta = load_measurements(csv)
    profile = fit_profile(frame, meta, csv_path=csv, network=model.profile["allreduce"]["node"])
    path = out / "profile.json"
    write_profile(profile, path)
    held_table, held_text = costcheck(path, csv, out_png=out / "heldout_scatter.png", rows="heldout")
    grid_table, grid_text = costcheck(path, csv, out_png=out / "grid_scatter.png", rows="grid")
    rows = valid_rows(frame)
    held = rows[rows["source"] == "heldout"]
    rel = predict_layers(load_model(path), held) / held["layer_s_median"].to_numpy(float) - 1
    ops = list(model.profile["token_ops"]["ms"])
    variants = try_variants(frame, profile["knots"], profile["tile"],
                            lambda t: sum(model.operator_time(op, t) for op in ops))
    return profile, held_table, held_text, grid_table, grid_text, misfits(held, rel), variants


def run(out=REPO / "results" / "fit_on_published", size: str = "full", noise: float = 0.0, seed: int = 0,
        monotone: bool = False, log=print, budgets=DEFAULT_BUDGETS, probes: bool = True) -> Report:
    """The whole check (see the module docstring); prints its tables through `log`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    csv, model, counts = measure(out, SIZES[size], seed, noise, monotone, budgets, probes)
    profile, held_table, held_text, grid_table, grid_text, found, variants = fit_and_check(out, csv, model)
    ok, line = verdict(held_table, found)
    selection = profile["provenance"]["tile_selection"]
    report = Report(out, held_table, grid_table, {**counts, "knots": len(profile["knots"])}, found, variants,
                    selection, ok, line)
    (out / "report.json").write_text(json.dumps({k: v for k, v in report.__dict__.items() if k != "out"},
                                                indent=1, default=str) + "\n")
    log(f"published kernels: vidur {PROFILE} (monotone {monotone}), noise {noise:g}, grid probes {probes}, "
        f"held out: {', '.join(name for name, _ in heldout_policies(budgets))}; {report.counts}")
    log(f"GEMM tile of the step term: {selection['chosen']} ({selection['criterion']}): "
        + ", ".join(f"{k} rms {100 * v['rms']:.2f}% p95 {100 * v['p95_abs']:.2f}%" if "rms" in v else f"{k} skipped"
                    for k, v in selection["out_of_fold"].items()))
    log(f"g(T) knots: {profile['knots']}; fitted coefficients: "
        + ", ".join(f"{k}={v:.3g}" for k, v in profile["coefficients"].items()))
    log("\nHELD-OUT " + held_text)
    log("\nIN-SAMPLE " + grid_text)
    log("\nheld-out misfit by feature (worst class; share of its error variance the feature's bins explain; "
        "worst bin: n, median |err|, bias):")
    for m in found:
        log(f"  {m['cls']:<8}{m['feature']:<27}{100 * m['explained']:>5.0f}%   {m['bin']:<18}{m['n']:>5}"
            f"{100 * m['median_abs']:>8.2f}%{100 * m['bias']:>+8.2f}%")
    log("\nfamily variants on copies of the design matrix (median / p95 abs rel error, %):")
    log(format_variants(variants))
    log(f"\nwrote {out}: measurements.csv, metadata.json, profile.json, heldout_scatter.png, grid_scatter.png, "
        "report.json")
    log("CONCLUSION: " + line)
    return report


def main(argv=None) -> Report:
    """Command line entry point; returns the Report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "results" / "fit_on_published")
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--noise", type=float, default=0.0, help="seeded multiplicative timing noise, e.g. 0.01")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--monotone", action="store_true", help="smooth the published tables (isotonic)")
    parser.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)),
                        help="sarathi token budgets of the held-out simulations, comma-separated")
    parser.add_argument("--no-probes", action="store_true",
                        help="leave the grid's token-budget and tile-edge batches out (the grid before them)")
    args = parser.parse_args(argv)
    if not 0.0 <= args.noise < 1.0:
        parser.error("--noise must be in [0, 1)")
    try:
        budgets = tuple(int(b) for b in args.budgets.split(","))
    except ValueError:
        budgets = ()
    if not budgets or min(budgets) < 1:
        parser.error("--budgets must be positive integers, comma-separated")
    return run(args.out, args.size, args.noise, args.seed, args.monotone, budgets=budgets,
               probes=not args.no_probes)


if __name__ == "__main__":
    main()
