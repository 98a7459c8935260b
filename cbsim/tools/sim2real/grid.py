"""`cbsim sim2real grid`: does cbsim rank engine settings and loads as the real engine does?

The issue's rank-agreement target: over a grid of `max_num_batched_tokens` x request rate, Kendall's tau
(scipy.stats.kendalltau, tau-b) between cbsim's predictions and the real engine's measurements of E2E,
TTFT and TPOT means is at least 0.9. Each `max_num_batched_tokens` needs its own engine start
(real_engine.Engines), each rate a serving run of the experiment's workload with its arrival rate set
(workload.with_rate); cbsim is calibrated once, on the calibration workload's recorded steps
(sim2real.calibrate), and predicts every point with the point's own engine settings.

Beside the tau of the predictions, `rank_agreement` gives two more, so the result can be read on a noisy
machine: `same_run` (cbsim calibrated on each repeat's own recorded steps, the machine's speed in that very
run) and `between_repeats` (repeat 0 against repeat 1 of the measurement itself: the rank agreement the
machine's run-to-run noise leaves possible). DIR/grid.json holds the points and the taus, DIR/grid.md the
table.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from cbsim.tools.sim2real.engine_flags import EngineFlags
from cbsim.tools.sim2real.real_engine import Engines
from cbsim.tools.sim2real.sim2real import VOCAB, calibrate, serve_and_predict
from cbsim.tools.sim2real.workload import cfg_mapping, experiment_requests, with_rate

GRID_KEYS = ("e2e_mean", "ttft_mean", "tpot_mean")
TAU_TARGET = 0.9


def run_grid(workload: Path, calibration: Path, flags: EngineFlags, budgets: list[int], rates: list[float],
             repeats: int, out: Path, say=print) -> dict:
    """Serve and predict `workload` at every (max_num_batched_tokens, rate); write grid.json and grid.md."""
    base = flags.for_experiment(workload)
    mapping = cfg_mapping(workload)
    engines = Engines(say)
    points = []
    try:
        report, fit = calibrate(engines, calibration, dataclasses.replace(flags, max_num_batched_tokens=budgets[0]),
                                out, say)
        for budget in budgets:
            real = engines.get(dataclasses.replace(base, max_num_batched_tokens=budget))
            for rate in rates:
                meta, requests = experiment_requests(workload, VOCAB, base.max_model_len,
                                                     with_rate(mapping, rate, workload))
                name = f"mnbt{budget}_rate{rate:g}"
                result, _ = serve_and_predict(real, name, meta, requests, fit, repeats, out / name)
                points.append(_point(budget, rate, result))
                say(f"{name}: " + ", ".join(f"{k} {p['measured'] * 1e3:.0f} ms measured, {p['predicted'] * 1e3:.0f} "
                                            f"predicted" for k, p in points[-1]["metrics"].items()))
    finally:
        engines.close()
    report.update(workload=str(workload), repeats=repeats, max_num_batched_tokens=budgets, rates=rates,
                  points=points, kendall_tau=rank_agreement(points), target=TAU_TARGET)
    (out / "grid.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "grid.md").write_text("\n".join(table(report)) + "\n")
    return report


def _point(budget: int, rate: float, result: dict) -> dict:
    metrics = {}
    for key in GRID_KEYS:
        m = result["metrics"][key]
        same = result["same_run"].get(key, {}).get("errors", [])
        metrics[key] = {"measured": m["measured"], "measured_repeats": m["measured_repeats"],
                        "predicted": m["predicted"], "error": m["error"], "spread": m["spread"],
                        "same_run": float(np.mean([v * (1 + e) for v, e in zip(m["measured_repeats"], same)]))
                        if same else None}
    return {"max_num_batched_tokens": budget, "rate": rate, "metrics": metrics}


def rank_agreement(points: list[dict]) -> dict:
    """Per metric, Kendall's tau-b of predicted vs measured means over the points (and its p-value), of the
    same-run predictions, and between the measurement's first two repeats (None with one repeat)."""
    from scipy.stats import kendalltau

    def tau(a, b):
        if len(a) < 2 or any(v is None for v in (*a, *b)):
            return None
        result = kendalltau(a, b)
        return {"tau": float(result.statistic), "p_value": float(result.pvalue)}

    out = {}
    for key in GRID_KEYS:
        metric = [p["metrics"][key] for p in points]
        measured = [m["measured"] for m in metric]
        repeats = [m["measured_repeats"] for m in metric]
        out[key] = {"predicted": tau([m["predicted"] for m in metric], measured),
                    "same_run": tau([m["same_run"] for m in metric], measured),
                    "between_repeats": tau([r[0] for r in repeats], [r[1] for r in repeats])
                    if all(len(r) > 1 for r in repeats) else None}
        out[key]["meets_target"] = out[key]["predicted"] is not None and out[key]["predicted"]["tau"] >= TAU_TARGET
    return out


def table(report: dict) -> list[str]:
    """The grid as a markdown table (ms; measured / predicted) and the taus."""
    lines = ["| max_num_batched_tokens | rate (req/s) | " + " | ".join(f"{k} measured / predicted (ms)"
                                                                     for k in GRID_KEYS) + " |",
             "|---|---|" + "---|" * len(GRID_KEYS)]
    for p in report["points"]:
        cells = [f"{p['metrics'][k]['measured'] * 1e3:.1f} / {p['metrics'][k]['predicted'] * 1e3:.1f}"
                 for k in GRID_KEYS]
        lines.append(f"| {p['max_num_batched_tokens']} | {p['rate']:g} | " + " | ".join(cells) + " |")
    lines += ["", "| Kendall tau | predicted | same-run calibration | between repeats |", "|---|---|---|---|"]
    for key, t in report["kendall_tau"].items():
        cells = [f"{t[k]['tau']:.2f}" if t[k] else "n/a" for k in ("predicted", "same_run", "between_repeats")]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return lines
