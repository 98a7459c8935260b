"""`cbsim sim2real`: record a real vLLM engine, calibrate cbsim on it, predict other workloads, compare.

One engine serves every workload that asks for the same settings (real_engine.Engines; its prefix cache
reset before every replay). First the calibration workload is replayed with the step recorder on: its steps (steps.jsonl,
trace.jsonl) calibrate cbsim's `linear` cost model (linear_fit.py). Then every workload is replayed
`repeats` times on the engine (measured: bench.json in vLLM's schema, preemptions and peak KV usage from
the recorder) and run once in cbsim (predicted), with the same requests (workload.py) and the engine's
own settings as a `server: {engine: vllm, version: "0.32"}` block, KV blocks included (vLLM's own count;
cbsim.server.vllm takes off its null block). DIR/sim2real.json holds, per workload and metric, the measured mean over repeats,
the prediction, the signed error (predicted / measured - 1) and the measured spread over repeats
((max - min) / mean); `same_run`, the error of cbsim calibrated on each repeat's own recorded steps (the
machine's speed in that very run, so what remains is the simulator's own error); `step_speed`, the median
time of a one-decode step in each run (the calibration's too): how fast the shared machine was.
DIR/<workload>/cdf.png puts the measured and predicted TTFT, ITL and E2E side by side.

Measured and predicted KV usage differ in definition with prefix caching on: vLLM's usage counts blocks
held by requests (cached blocks nobody holds count as free), cbsim's kv_blocks_used counts cached blocks
too. Without prefix caching they count the same blocks, and only then is peak KV usage a target. A workload
may set its own engine (a small KV cache that preempts: `server.args`, engine_flags.py); the engine is
restarted for it (real_engine.py) and cbsim gets that engine's block count.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cbsim.tools.compare.measured import load_measured, simulated_metrics

from cbsim.tools.sim2real.driver import bench_json, replay
from cbsim.tools.sim2real.engine_flags import EngineFlags
from cbsim.tools.sim2real.linear_fit import fit_linear
from cbsim.tools.sim2real.real_engine import Engines, RealEngine
from cbsim.tools.sim2real.vllm_scheduler import VLLM_VERSION
from cbsim.tools.sim2real.workload import experiment_requests

KEYS = ("ttft_mean", "ttft_p50", "ttft_p90", "ttft_p99", "tpot_mean", "tpot_p50", "tpot_p90", "tpot_p99",
        "itl_mean", "itl_p50", "itl_p90", "itl_p99", "e2e_mean", "e2e_p50", "e2e_p90", "e2e_p99",
        "throughput_requests_per_s", "throughput_tokens_per_s", "preemptions", "kv_usage_peak", "kv_usage_mean")
TARGETS = ("ttft_mean", "ttft_p90", "tpot_mean", "tpot_p90", "itl_mean", "itl_p90", "e2e_mean", "e2e_p90")
KV_TARGETS = ("preemptions", "kv_usage_peak")  # targets only where the measured value is not 0
VOCAB = 4096  # tiny_llama/config.json vocab_size


def run_sim2real(workloads: list[Path], calibration: Path, flags: EngineFlags, repeats: int, out: Path,
                 say=print) -> dict:
    engines = Engines(say)
    try:
        report, fit = calibrate(engines, calibration, flags, out, say)
        report.update(repeats=repeats, workloads={})
        for path in workloads:
            own = flags.for_experiment(path)
            meta, requests = experiment_requests(path, VOCAB, own.max_model_len)
            real = engines.get(own)
            result, sim = serve_and_predict(real, path.stem, meta, requests, fit, repeats, out / path.stem)
            result["in_sample"] = calibration == path
            report["workloads"][path.stem] = result
            _figure(out / path.stem / "cdf.png", path.stem, out / path.stem, repeats, sim)
            say(f"{path.stem}: " + ", ".join(f"{k} {v['error']:+.1%}" for k, v in result["metrics"].items()
                                             if k in (*TARGETS, *KV_TARGETS) and v["error"] is not None))
    finally:
        engines.close()
    (out / "sim2real.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def calibrate(engines: Engines, calibration: Path, flags: EngineFlags, out: Path, say=print) -> tuple[dict, dict]:
    """Replay the calibration workload with the recorder on and fit cbsim's linear cost model on its steps:
    (the report's engine and calibration sections, the fit)."""
    own = flags.for_experiment(calibration)
    real = engines.get(own)
    meta, requests = experiment_requests(calibration, VOCAB, own.max_model_len)
    real.recorder.clear()
    replay(real.engine, requests, tag="calibration", clients=meta["clients"])
    real.recorder.write(out / "calibration")
    fit = fit_linear(real.recorder.rows)
    say(f"calibrated on {fit['steps']} steps: {fit['cost_model']} (median |error| {fit['median_abs_error']:.1%})")
    report = {"engine": {"vllm": VLLM_VERSION, "flags": own.__dict__, "num_gpu_blocks": real.num_blocks,
                         "server_args": real.server_args},
              "calibration": {"workload": str(calibration),
                              "step_speed": _decode_speed(out / "calibration" / "trace.jsonl"), **fit}}
    return report, fit


def serve_and_predict(real: RealEngine, name: str, meta: dict, requests, fit: dict, repeats: int,
                      folder: Path) -> tuple[dict, object]:
    """Serve `requests` `repeats` times on the real engine and predict them with cbsim on the same engine
    settings: (the workload's comparison, cbsim's results calibrated on `fit`)."""
    measured, same_run = [], []
    for k in range(repeats):
        metrics, rows = _measure(real, requests, meta["clients"], folder / f"repeat{k}", name)
        measured.append(metrics)
        same_run.append(_predict(name, meta, real, fit_linear(rows)["cost_model"])[0])
    predicted, sim = _predict(name, meta, real, fit["cost_model"])
    result = {"server_args": real.server_args,
              **_compare(measured, predicted, kv_comparable=not real.flags.enable_prefix_caching)}
    result["same_run"] = _same_run(measured, same_run)
    result["step_speed"] = [_decode_speed(folder / f"repeat{k}" / "trace.jsonl") for k in range(repeats)]
    return result, sim


def _measure(real: RealEngine, requests, clients, folder: Path, label: str) -> tuple[dict, list[dict]]:
    """One replay: the bench.json metrics in cbsim's names, the preemptions and the peak KV usage."""
    real.core.scheduler.reset_prefix_cache()
    real.recorder.clear()
    served = replay(real.engine, requests, tag=folder.name, clients=clients)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "bench.json").write_text(json.dumps(bench_json(served, label)) + "\n")
    real.recorder.write(folder)
    rows = real.recorder.rows
    metrics = load_measured(folder / "bench.json").metrics
    metrics["preemptions"] = float(sum(len(r["preempted"]) for r in rows))
    metrics["kv_usage_peak"] = max(r["kv_usage"] for r in rows)
    metrics["kv_usage_mean"] = float(np.mean([r["kv_usage"] for r in rows]))
    return metrics, list(rows)


def _predict(name: str, meta: dict, real: RealEngine, cost_model: dict):
    from cbsim.api import run_experiment
    from cbsim.server import apply_server

    experiment = {"name": f"sim2real_{name}", "seed": meta["seed"], "workload": meta["workload"],
                  "server": {"engine": "vllm", "version": VLLM_VERSION, "args": real.server_args},
                  "cost_model": cost_model, "output": {"plots": False, "trace": False}}
    experiment, _ = apply_server(experiment)
    experiment["cost_model"].pop("engine")  # the linear fit is the whole step: no engine terms on top
    results = run_experiment(experiment)
    metrics = simulated_metrics(results)
    metrics["preemptions"] = float(results.summary.get("num_preemptions", 0))
    steps = results.steps
    usage = steps["kv_blocks_used"].to_numpy(dtype=np.float64) / (real.num_blocks - 1)
    metrics["kv_usage_peak"] = float(usage.max()) if len(usage) else 0.0
    metrics["kv_usage_mean"] = float(usage.mean()) if len(usage) else 0.0
    return metrics, results


def _compare(measured: list[dict], predicted: dict, kv_comparable: bool) -> dict:
    """Per metric: measured mean and repeats, prediction, signed error, spread over repeats, and the part of
    the error the spread does not explain (|error| - spread, at least 0). `within_10pct` holds the targets:
    latencies; preemptions (0 measured: met only when 0 predicted); peak KV usage where the two count alike
    (`kv_comparable`: without prefix caching, see the module docstring)."""
    out = {}
    for key in KEYS:
        values = np.array([m[key] for m in measured if key in m], dtype=np.float64)
        if not len(values):
            continue
        mean = float(values.mean())
        pred = predicted.get(key)
        out[key] = {"measured": mean, "measured_repeats": values.tolist(), "predicted": pred,
                    "error": None if pred is None or mean == 0 else pred / mean - 1.0,
                    "spread": float((values.max() - values.min()) / mean) if mean else 0.0}
        error = out[key]["error"]
        out[key]["error_beyond_spread"] = None if error is None else max(0.0, abs(error) - out[key]["spread"])
    within = {k: abs(v["error"]) <= 0.10 for k, v in out.items() if k in TARGETS and v["error"] is not None}
    if "preemptions" in out:
        p = out["preemptions"]
        within["preemptions"] = p["predicted"] == 0 if p["measured"] == 0 else abs(p["error"]) <= 0.10
    if kv_comparable and out.get("kv_usage_peak", {}).get("error") is not None:
        within["kv_usage_peak"] = abs(out["kv_usage_peak"]["error"]) <= 0.10
    return {"metrics": out, "within_10pct": within}


def _same_run(measured: list[dict], predicted: list[dict]) -> dict:
    """Per target metric, the mean signed error of cbsim calibrated on each repeat's own recorded steps
    (the machine's speed in that very run): what is left is the simulator's, not the machine's drift."""
    out = {}
    for key in TARGETS:
        errors = [p[key] / m[key] - 1.0 for m, p in zip(measured, predicted) if m.get(key) and p.get(key)]
        if errors:
            out[key] = {"error": float(np.mean(errors)), "errors": errors}
    return out


def _decode_speed(trace: Path) -> float | None:
    """Median seconds of the run's steps that decode one request alone: the machine's speed that run."""
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    alone = [r["time_s"] for r in rows if not r["prefill"] and len(r["decode"]) == 1]
    return float(np.median(alone)) if alone else None


def _figure(path: Path, name: str, folder: Path, repeats: int, sim) -> None:
    """Measured (every repeat) and predicted CDFs of TTFT, ITL and E2E, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = sim.requests[sim.requests["status"] == "finished"]
    predicted = {"TTFT": done["ttft"].to_numpy(), "E2E": done["e2e"].to_numpy(),
                 "ITL": np.repeat(sim.itl.values, sim.itl.weights) if len(sim.itl.values) else np.zeros(0)}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key in zip(axes, ("TTFT", "ITL", "E2E")):
        for k in range(repeats):
            bench = json.loads((folder / f"repeat{k}" / "bench.json").read_text())
            values = {"TTFT": bench["ttfts"], "E2E": bench["latencies"],
                      "ITL": [g for gaps in bench["itls"] for g in gaps]}[key]
            _cdf(ax, values, f"vLLM {VLLM_VERSION} (repeat {k})", "tab:blue", 0.5)
        _cdf(ax, predicted[key], "cbsim", "tab:red", 1.0)
        ax.set_xlabel(f"{key} (s)")
        ax.set_ylabel("fraction of requests" if key != "ITL" else "fraction of gaps")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{name}: measured (tiny Llama, vLLM CPU engine) vs cbsim (linear cost model calibrated on steps)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cdf(ax, values, label: str, color: str, alpha: float) -> None:
    values = np.sort(np.asarray(values, dtype=np.float64))
    if len(values):
        ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label, color=color,
                alpha=alpha)
