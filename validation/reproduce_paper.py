"""Reproduce three published scheduling results, qualitatively, on cbsim's calibrated cost models.

    python validation/reproduce_paper.py [--size full|small] [--out results/paper]
                                          [--only orca,capacity,ablation] [--data DIR]

Each study builds its runs from a YAML file in this folder plus `--set`-style overrides (policy,
arrival rate, number of requests), measures the numbers behind its claim, draws a figure, and
checks the claim; everything measured goes to `<out>/numbers.json`. README.md describes each
study, its figure and what was measured. tests/validation/test_paper.py imports this file and checks every
claim at size "small", so the claims are tested, not only described.

Trace studies read the length traces under $CBSIM_DATA (default: shared/data beside the
repository); when a trace is missing they say so and use its synthetic stand-in
(`<name>_synthetic.yaml`, lognormal lengths with the trace's medians and P90s).

Capacity (study b) comes from the shared capacity search, cbsim.tools.sweep.capacity.find_capacity.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HERE = REPO / "experiments" / "paper"  # the experiment files this script runs


@dataclass(frozen=True)
class Size:
    """How big each study runs: full for the figures, small for the tests (seconds)."""

    orca_requests: int
    orca_rates: tuple[float, ...]
    capacity_requests: int
    capacity_rel_tol: float
    capacity_slos: tuple[str, ...]
    ablation_requests: int
    ablation_rates: tuple[float, ...]
    ablation_workloads: tuple[str, ...]


SIZES = {
    "full": Size(400, tuple(round(0.05 * 1.55 ** i, 4) for i in range(14)), 500, 0.03, ("strict", "relaxed"),
                 600, (1.0, 1.5, 2.0, 2.5, 3.0), ("sharegpt", "arxiv")),
    "small": Size(150, (0.05, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0, 10.0), 150, 0.15, ("strict",),
                  200, (1.0, 2.0), ("sharegpt",)),
}

# -------------------------------------------------------------------------------- running


def run(base: Path, overrides: list[str]):
    """Run the experiment `base` with `overrides` (key=value strings) and return its Results."""
    from cbsim.api import run_experiment
    from cbsim.config import load_config

    return run_experiment(load_config(base, overrides))


def workload_base(name: str, prefer_trace: bool = True) -> tuple[Path, str]:
    """The YAML of workload `name` and its kind: the trace version when its file resolves, else the
    synthetic stand-in (a name with no trace version is synthetic)."""
    from cbsim.config import read_yaml
    from cbsim.core.errors import ConfigError
    from cbsim.workloads.trace_source import resolve_path

    traced = HERE / f"{name}.yaml"
    trace = read_yaml(traced).get("workload", {}).get("trace")
    if trace is None:
        return traced, "synthetic"
    if prefer_trace:
        try:
            resolve_path(trace["path"], HERE, "workload.trace.path")
            return traced, "trace"
        except ConfigError as err:
            print(f"{name}: trace skipped ({err}); using {name}_synthetic.yaml", file=sys.stderr)
    return HERE / f"{name}_synthetic.yaml", "synthetic"


def size_override(kind: str, n: int) -> str:
    return f"workload.trace.sample={n}" if kind == "trace" else f"workload.num_requests={n}"


# -------------------------------------------------------------------------------- (a) Orca vs static

ORCA_POLICIES = {"static": "{name: static, max_num_seqs: 32}", "orca": "{name: orca, max_num_seqs: 32}"}
LATENCY_TARGETS = (1.25, 1.5, 2.0, 3.0)  # multiples of the unloaded normalized latency
ORCA_CLAIM_TARGET, ORCA_CLAIM_RATIO = 1.5, 10.0


def throughput_at(curve: list[dict], target: float) -> float:
    """Highest throughput (req/s) of a rate sweep whose median normalized latency stays <= target,
    interpolated linearly at the crossing; 0 when even the lowest rate misses the target."""
    best, prev = 0.0, None
    for point in curve:
        if point["norm_latency_p50"] <= target:
            best = max(best, point["throughput"])
        elif prev is not None:
            frac = (target - prev["norm_latency_p50"]) / (point["norm_latency_p50"] - prev["norm_latency_p50"])
            return max(best, prev["throughput"] + frac * (point["throughput"] - prev["throughput"]))
        else:
            return best
        prev = point
    return best


def orca_vs_static(size: Size) -> dict:
    """Sweep the arrival rate for static and Orca batching; throughput at equal normalized latency."""
    curves = {}
    for name, policy in ORCA_POLICIES.items():
        curves[name] = []
        for rate in size.orca_rates:
            res = run(HERE / "orca_vs_static.yaml", [f"policy={policy}", f"workload.arrival.rate={rate}",
                                                     f"workload.num_requests={size.orca_requests}"])
            curves[name].append({"rate": rate, "throughput": res.summary["throughput_requests_per_s"],
                                 "norm_latency_p50": float(res.requests["normalized_latency"].median())})
    unloaded = min(p["norm_latency_p50"] for c in curves.values() for p in c)
    gaps = []
    for mult in LATENCY_TARGETS:
        static, orca = (throughput_at(curves[k], mult * unloaded) for k in ("static", "orca"))
        gaps.append({"multiple": mult, "target": mult * unloaded, "static": static, "orca": orca,
                     "ratio": orca / static if static > 0 else math.inf})
    claim = next(g for g in gaps if g["multiple"] == ORCA_CLAIM_TARGET)
    return {"curves": curves, "unloaded_norm_latency": unloaded, "gaps": gaps,
            "claims": {f"orca >= {ORCA_CLAIM_RATIO:g}x static throughput at {ORCA_CLAIM_TARGET}x unloaded "
                       "normalized latency": claim["ratio"] >= ORCA_CLAIM_RATIO}}


# -------------------------------------------------------------------------------- (b) capacity

SLOS = {"strict": 0.1, "relaxed": 0.5}  # P99 TBT (ITL) objective, seconds
MAX_MEDIAN_SCHEDULING_DELAY = 2.0  # seconds; keeps "capacity" below the queueing collapse
VLLM_BATCH_SIZES = (32, 64, 128)
SARATHI_BUDGET = {"strict": 512, "relaxed": 2048}


def capacity(base: Path, overrides: list[str], tbt_slo: float, rel_tol: float) -> tuple[float, list[dict]]:
    """Capacity (req/s; 0 if even the lowest rate fails) under the TBT SLO and the scheduling-delay
    bound, with the probes tried, from the shared capacity search (cbsim.tools.sweep.capacity)."""
    from cbsim.tools.sweep.capacity import find_capacity

    slo = {"itl_p99": tbt_slo, "queue_delay_p50": MAX_MEDIAN_SCHEDULING_DELAY}
    result = find_capacity(base, slo, lo=0.05, hi=16.0, rel_tol=rel_tol, overrides=overrides)
    points = result.points[["rate", "meets", "itl_p99", "queue_delay_p50"]].to_dict("records")
    return result.rate or 0.0, points


def capacity_study(size: Size, prefer_trace: bool = True) -> dict:
    """Capacity of vLLM (prefill-first) at batch sizes 32/64/128 and of Sarathi-Serve per TBT SLO."""
    base, kind = workload_base("sharegpt", prefer_trace)
    common = [size_override(kind, size.capacity_requests)]
    out = {"workload": base.name, "slos": {}}
    for slo_name in size.capacity_slos:
        variants = {f"vllm_bs{b}": f"{{name: prefill_first, max_num_seqs: {b}}}" for b in VLLM_BATCH_SIZES}
        variants[f"sarathi_{SARATHI_BUDGET[slo_name]}"] = (f"{{name: sarathi, token_budget: "
                                                            f"{SARATHI_BUDGET[slo_name]}, max_num_seqs: 128}}")
        found = {name: capacity(base, common + [f"policy={policy}"], SLOS[slo_name], size.capacity_rel_tol)
                 for name, policy in variants.items()}
        out["slos"][slo_name] = {"tbt_slo": SLOS[slo_name], "capacity": {k: v[0] for k, v in found.items()},
                                 "points": {k: v[1] for k, v in found.items()}}
    strict = out["slos"]["strict"]["capacity"]
    vllm = [strict[f"vllm_bs{b}"] for b in VLLM_BATCH_SIZES]
    out["claims"] = {
        "strict SLO: Sarathi-Serve capacity >= 1.5x the best vLLM batch size":
            strict["sarathi_512"] >= 1.5 * max(vllm),
        "strict SLO: vLLM capacity changes by <= 15% across batch sizes 32/64/128":
            min(vllm) > 0 and max(vllm) / min(vllm) - 1 <= 0.15,
    }
    return out


# -------------------------------------------------------------------------------- (c) ablation

ABLATION_POLICIES = {
    "hybrid-only": "{name: orca, kv_reservation: paged, max_num_seqs: 128}",
    "chunked-only": "{name: chunked_only, chunk_size: 512, max_num_seqs: 128}",
    "sarathi": "{name: sarathi, token_budget: 512, max_num_seqs: 128}",
}


def ablation(size: Size, workload: str, prefer_trace: bool = True) -> dict:
    """P50 TTFT and P99 TBT of hybrid-only, chunked-only and combined (Sarathi) batching per rate."""
    base, kind = workload_base(workload, prefer_trace)
    rows = []
    for rate in size.ablation_rates:
        for name, policy in ABLATION_POLICIES.items():
            s = run(base, [f"policy={policy}", f"workload.arrival.rate={rate}",
                           size_override(kind, size.ablation_requests)]).summary
            rows.append({"rate": rate, "variant": name, "ttft_p50": s["ttft_p50"], "tbt_p99": s["itl_p99"]})
    return {"workload": base.name, "rows": rows, "claims": ablation_claims(rows)}


def ablation_claims(rows: list[dict]) -> dict:
    """Each part of the paper's ordering, checked at every rate (see README for which hold)."""
    by_rate: dict[float, dict] = {}
    for row in rows:
        by_rate.setdefault(row["rate"], {})[row["variant"]] = row
    h, c, s = "hybrid-only", "chunked-only", "sarathi"

    def every(test):
        return all(test(v) for v in by_rate.values())

    return {
        "sarathi has the lowest P99 TBT": every(lambda v: v[s]["tbt_p99"] < min(v[h]["tbt_p99"], v[c]["tbt_p99"])),
        "hybrid-only has a lower P50 TTFT than sarathi": every(lambda v: v[h]["ttft_p50"] < v[s]["ttft_p50"]),
        "hybrid-only has the highest P99 TBT": every(lambda v: v[h]["tbt_p99"] > max(v[c]["tbt_p99"], v[s]["tbt_p99"])),
        "chunked-only has the highest P50 TTFT": every(lambda v: v[c]["ttft_p50"] > max(v[h]["ttft_p50"], v[s]["ttft_p50"])),
    }


# -------------------------------------------------------------------------------- figures


def plot_orca(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for name, style in (("static", "s-"), ("orca", "o-")):
        curve = result["curves"][name]
        ax.plot([p["throughput"] for p in curve], [1e3 * p["norm_latency_p50"] for p in curve], style, label=name)
    gap = next(g for g in result["gaps"] if g["multiple"] == ORCA_CLAIM_TARGET)
    ax.axhline(1e3 * gap["target"], color="grey", ls="--", lw=1)
    ax.text(0.72, 0.72, f"at {ORCA_CLAIM_TARGET}x the unloaded latency (dashed):\norca {gap['orca']:.2f} req/s, "
            f"static {gap['static']:.2f} req/s ({gap['ratio']:.0f}x)", transform=ax.transAxes, ha="center", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("median normalized latency (ms/token)")
    ax.set_title("Orca vs static batching (Llama-2-7B, A100, batch 32)")
    ax.legend()
    return _save(fig, path)


def plot_capacity(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slos = result["slos"]
    fig, axes = plt.subplots(1, len(slos), figsize=(4.6 * len(slos), 4.0), squeeze=False)
    for ax, (slo_name, data) in zip(axes[0], slos.items()):
        names = list(data["capacity"])
        values = [data["capacity"][n] for n in names]
        bars = ax.bar(names, values, color=["tab:blue"] * (len(names) - 1) + ["tab:orange"])
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
        ax.set_title(f"{slo_name}: P99 TBT <= {1e3 * data['tbt_slo']:.0f} ms")
        ax.set_ylabel("capacity (requests/s)")
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle(f"vLLM (prefill-first) vs Sarathi-Serve capacity, Llama-3-8B on A100 ({result['workload']})",
                 fontsize=10)
    return _save(fig, path)


def plot_ablation(result: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.6, 4.0))
    for variant, style in zip(ABLATION_POLICIES, ("o-", "s-", "^-")):
        rows = [r for r in result["rows"] if r["variant"] == variant]
        rates = [r["rate"] for r in rows]
        axes[0].plot(rates, [r["ttft_p50"] for r in rows], style, label=variant)
        axes[1].plot(rates, [1e3 * r["tbt_p99"] for r in rows], style, label=variant)
    axes[0].set_ylabel("P50 TTFT (s)")
    axes[1].set_ylabel("P99 TBT (ms)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("arrival rate (requests/s)")
        ax.legend(fontsize=8)
    fig.suptitle(f"Sarathi-Serve ablation, Llama-3-8B on A100 ({result['workload']})", fontsize=10)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -------------------------------------------------------------------------------- main

STUDIES = ("orca", "capacity", "ablation")


def reproduce(size: Size, out: Path, only=STUDIES, prefer_trace: bool = True) -> dict:
    """Run the chosen studies, write their figures and numbers.json into `out`, return the numbers."""
    numbers = {}
    if "orca" in only:
        numbers["orca"] = orca_vs_static(size)
        plot_orca(numbers["orca"], out / "orca_vs_static.png")
    if "capacity" in only:
        numbers["capacity"] = capacity_study(size, prefer_trace)
        plot_capacity(numbers["capacity"], out / "capacity.png")
    if "ablation" in only:
        for workload in size.ablation_workloads:
            numbers[f"ablation_{workload}"] = result = ablation(size, workload, prefer_trace)
            plot_ablation(result, out / f"ablation_{workload}.png")
    out.mkdir(parents=True, exist_ok=True)
    (out / "numbers.json").write_text(json.dumps(numbers, indent=2) + "\n")
    return numbers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="full")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "paper")
    parser.add_argument("--only", default=",".join(STUDIES), help="comma-separated: " + ", ".join(STUDIES))
    parser.add_argument("--data", type=Path, help="data folder holding traces/ (default: $CBSIM_DATA, "
                        "else shared/data beside the repository)")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = sorted(set(only) - set(STUDIES))
    if unknown:
        parser.error(f"--only: unknown studies {unknown}; choose from {', '.join(STUDIES)}")
    if args.data is not None:  # else cbsim.core.data's rule: $CBSIM_DATA, then shared/data beside the repository
        os.environ["CBSIM_DATA"] = str(args.data)
    numbers = reproduce(SIZES[args.size], args.out, only)
    for study, result in numbers.items():
        for claim, holds in result["claims"].items():
            print(f"{study:18s} {'holds' if holds else 'DOES NOT HOLD':14s} {claim}")
    print(f"figures and numbers.json in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
