"""Measured vs simulated: run an experiment and set its metrics beside a measured benchmark's.

Invariant: a row exists for every metric present on both sides (cbsim's names, seconds), with the
signed relative error (simulated - measured) / measured. The experiment runs exactly as `cbsim run`
would run it, except when it has no workload: then the measured file's per-request prompt and
output lengths become an explicit request list (see `measured_workload`), and a note says so. A run
within 10 % of its simulated capacity (sim/metrics/knee.py) gets a note and `meta.near_knee`: there a
small step-time error is a large latency error. With `metrics.band` (compare --band) each latency row also
carries the simulated value at the band's low and high step-time factor (cbsim/band.py), and whether the
measured value lies inside.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from cbsim.workloads.arrivals import GammaArrival, PoissonArrival, sample_arrivals

from cbsim.api import run_experiment
from cbsim.config import ExperimentConfig, apply_overrides, load_config, read_yaml
from cbsim.core.errors import ConfigError
from cbsim.tools.compare.measured import METRICS, MeasuredRun, load_measured, simulated_metrics
from cbsim.tools.compare.pairing import (PairErrors, Warmup, kept_measured, kept_simulated, measured_frame,
                                         measured_metrics, pairing, request_errors, simulated_frame,
                                         simulated_metrics_kept)
from cbsim.sim.metrics.knee import knee_note


@dataclass(frozen=True)
class Row:
    measured: float
    simulated: float
    error: float  # (simulated - measured) / measured


@dataclass
class CompareResult:
    rows: dict[str, Row]  # metric name -> measured, simulated, error (METRICS order)
    measured: MeasuredRun
    results: object  # cbsim.api.Results of the simulated run
    notes: list[str] = field(default_factory=list)  # what the comparison assumed, for the user to read
    out_dir: Path | None = None
    per_request: dict[str, PairErrors] = field(default_factory=dict)  # latency -> errors of the paired requests
    warmup: Warmup = field(default_factory=Warmup)  # requests left out of the latencies on both sides

    def band(self) -> dict[str, tuple[float, float]]:
        """metric -> (simulated at the band's low, at its high step-time factor) for the rows the run's
        `metrics.band` covers (cbsim/band.py; whole-run values, before any warm-up cut)."""
        summary = self.results.summary
        return {name: (summary[f"{name}_low"], summary[f"{name}_high"]) for name in self.rows
                if summary.get(f"{name}_low") is not None and summary.get(f"{name}_high") is not None}

    def to_dict(self) -> dict:
        """compare.json: {metric: {measured, simulated, error}} (with a band: simulated_low, simulated_high,
        measured_in_band) plus a `meta` entry."""
        band = self.band()
        out = {name: {"measured": row.measured, "simulated": row.simulated, "error": row.error,
                      **({"simulated_low": band[name][0], "simulated_high": band[name][1],
                          "measured_in_band": band[name][0] <= row.measured <= band[name][1]} if name in band else {})}
               for name, row in self.rows.items()}
        cfg = self.results.config
        out["meta"] = {"experiment": cfg.source or cfg.name, "measured": self.measured.source,
                       "measured_format": self.measured.format, "units": "seconds (latencies), per second (rates)",
                       "error": "(simulated - measured) / measured",
                       "measured_requests": None if self.measured.input_lens is None else len(self.measured.input_lens),
                       "measured_failed": self.measured.num_failed,
                       "simulated_finished": self.results.summary.get("num_finished"),
                       "load_vs_capacity": self.results.summary.get("load_vs_capacity"),
                       "near_knee": knee_note(self.results.summary) is not None,
                       "band": self.results.summary.get("band_source"),
                       "skipped": list(self.measured.skipped), "notes": self.notes,
                       "warmup": {"requests": self.warmup.requests, "seconds": self.warmup.seconds}}
        if self.per_request:  # pairing.py: measured request i beside simulated request i
            out["per_request"] = {name: {"pairs": e.pairs, "median_error": e.median, "p90_abs_error": e.p90_abs,
                                         "median_diff": e.median_diff} for name, e in self.per_request.items()}
        return out


def compare(experiment, measured, out_dir: str | Path | None = None,
            overrides: list[str] | None = None, warmup: Warmup | None = None) -> CompareResult:
    """Run `experiment` (YAML path, mapping or ExperimentConfig) and compare it with `measured` (a file
    or a MeasuredRun). With per-request measured data, the requests are paired and `warmup` may leave the
    first ones out of the latencies (pairing.py). With `out_dir`, writes the run's results there plus
    compare.json and, when the measured file has per-request data, compare_cdf.png."""
    run = measured if isinstance(measured, MeasuredRun) else load_measured(measured)
    warmup = warmup or Warmup()
    if warmup and not run.has_lengths:  # refused before simulating
        raise ConfigError("--warmup" if warmup.requests else "--warmup-s", "a measured file with per-request "
                          "details (vLLM --save-result --save-detailed, SGLang --output-details)",
                          has_got=False, file=run.source or None)
    cfg, notes = experiment_config(experiment, run, overrides)
    results = run_experiment(cfg)
    measured_side, simulated, per_request, more = _sides(run, results, warmup)
    notes += more
    rows = {name: Row(measured_side[name], simulated[name],
                      (simulated[name] - measured_side[name]) / measured_side[name])
            for name in METRICS if name in measured_side and name in simulated}
    notes += _caveats(run, rows)
    knee = knee_note(results.summary)  # a stage within 10 % of the simulated capacity is flagged
    if knee:
        notes.append(knee)
    result = CompareResult(rows, run, results, notes, per_request=per_request, warmup=warmup)
    if out_dir is not None:
        write(result, out_dir)
    return result


def _sides(run: MeasuredRun, results, warmup: Warmup) -> tuple[dict, dict, dict, list[str]]:
    """The measured and simulated metrics (after the warm-up, when there is one), the per-request errors
    of the paired requests, and the notes (pairing.py)."""
    if not run.has_lengths:
        return run.metrics, simulated_metrics(results), {}, []
    measured, simulated = measured_frame(run), simulated_frame(results)
    paired, why = pairing(run, simulated)
    notes = [] if paired else [why]
    keep = kept_measured(run, measured, warmup) if warmup else np.ones(len(measured), dtype=bool)
    errors = request_errors(measured, simulated, keep) if paired else {}
    if not warmup:
        return run.metrics, simulated_metrics(results), errors, notes
    kept = keep if paired else kept_simulated(simulated, warmup)
    notes.append(f"warm-up: {warmup.describe()} left out of the latencies ({int((~keep).sum())} measured, "
                 f"{int((~kept).sum())} simulated); throughputs are whole-run numbers and not compared")
    return measured_metrics(run, measured, keep), simulated_metrics_kept(results, simulated, kept), errors, notes


def write(result: CompareResult, out_dir: str | Path, overwrite: bool = False) -> Path:
    """The run's results folder plus compare.json and (with per-request data) compare_cdf.png."""
    from cbsim.tools.compare.plots import plot_compare_cdf

    def also(folder: Path) -> list[Path]:  # written before the folder is marked complete
        (folder / "compare.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        if result.measured.ttfts is None and result.measured.itls is None:
            return [folder / "compare.json"]
        plot_compare_cdf(result, folder / "compare_cdf.png")
        return [folder / "compare.json", folder / "compare_cdf.png"]

    out = result.results.write(out_dir, overwrite=overwrite, also=also)
    result.out_dir = out
    return out


def experiment_config(experiment, run: MeasuredRun, overrides: list[str] | None) -> tuple[ExperimentConfig, list[str]]:
    """The validated experiment (overrides applied; output.dir cleared, the caller decides where to
    write), with a workload from `run` when it has none, and the notes saying so."""
    if isinstance(experiment, ExperimentConfig):
        data, file = experiment.to_dict(), experiment.source
    elif isinstance(experiment, (str, Path)):
        data, file = read_yaml(experiment), str(experiment)
    else:
        data, file = dict(experiment), None
    notes = []
    try:
        data = apply_overrides(data, overrides)
        if not data.get("workload"):
            data["workload"], note = measured_workload(run, data.get("seed", 0))
            notes.append(note)
        cfg = load_config(data)
    except ConfigError as err:
        raise err.in_file(file)
    cfg = replace(cfg, output=replace(cfg.output, dir=None))
    cfg.source = file
    return cfg, notes


def measured_workload(run: MeasuredRun, seed: int) -> tuple[dict, str]:
    """An explicit `workload: {requests: [...]}` with the measured prompt and output lengths, in send order.

    Arrivals: the measured send times when the file has them and the client had no concurrency cap;
    else all at t=0 when the client sent at an infinite rate; else Poisson (gamma when vLLM's
    burstiness != 1) at the measured request_rate, drawn from a generator seeded with `seed`.
    """
    if not run.has_lengths:
        raise ConfigError("workload", "a workload section, or a measured file with per-request input_lens and "
                          "output_lens (vLLM --save-result --save-detailed, SGLang --output-details)", has_got=False)
    n, rate = len(run.input_lens), run.request_rate
    if run.start_times is not None and run.max_concurrency is None:
        arrival, how = run.start_times, "at the measured send times"
    elif rate is None or not np.isfinite(rate):
        arrival = np.zeros(n)
        how = "all at t=0 (" + ("request_rate inf" if rate is not None else "the file gives no request_rate") + ")"
    else:
        burst = run.burstiness or 1.0
        process = PoissonArrival(rate) if burst == 1.0 else GammaArrival(rate, cv=burst ** -0.5)
        arrival = sample_arrivals(process, n, np.random.default_rng(seed))
        how = f"{'Poisson' if burst == 1.0 else f'gamma (burstiness {burst:g})'} at {rate:g} req/s (seed {seed})"
    requests = [{"arrival": float(a), "prompt_len": int(p), "output_len": int(o)}
                for a, p, o in zip(arrival, run.input_lens, run.output_lens)]
    return {"requests": requests}, f"workload: the {n} measured requests' prompt and output lengths, arriving {how}"


def _caveats(run: MeasuredRun, rows: dict[str, Row]) -> list[str]:
    notes = []
    if run.max_concurrency is not None:
        notes.append(f"the measured client capped concurrency at {run.max_concurrency}; cbsim has no client cap, so "
                     "requests the client held back wait in the server queue here (and count in TTFT)")
    if run.num_failed:
        notes.append(f"{run.num_failed} measured request(s) failed and are left out")
    if run.skipped:
        notes.append("not measured (0 or null in the file): " + ", ".join(run.skipped))
    if not rows:
        notes.append("no metric is present on both sides")
    return notes
