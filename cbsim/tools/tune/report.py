"""The outputs of `cbsim tune`: the ranked table, best.yaml, best_flags.txt, report.md (pareto.png
is tune_plots.py's).

Invariant: every output is a function of the tune result alone (records loaded from the point
files included), never of the wall clock of this call, so a resumed tune that runs nothing new
writes the same bytes.
"""
from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import yaml

from cbsim.core.atomic import mark_complete, mark_incomplete, write_file_atomic

from cbsim.tools.sweep.capacity import num_gpus
from cbsim.sim.metrics.summary_units import display
from cbsim.config import ExperimentConfig, pool_policy
from cbsim.tools.tune.tune import Candidate, TuneResult, rank_key
from cbsim.tools.tune.flags import flags_text
from cbsim.tools.tune.stages import policy_settings, slo_family


def ranked_table(result: TuneResult) -> pd.DataFrame:
    """One row per distinct candidate experiment (its first stage and label), ranked by goodput per
    GPU then SLO headroom; `chosen` marks the tune's answer."""
    spec = result.spec
    rows, seen = [], {}
    for outcome in result.stages:
        for c in outcome.candidates:
            if c.record is None:
                continue
            if c.point.id in seen:
                seen[c.point.id]["stages"] += f", {outcome.stage.name}"
                continue
            row = _row(c, outcome.stage.name, result)
            seen[c.point.id] = row
            rows.append(row)
    if result.best.point.id not in seen:
        rows.append(_row(result.best, "final", result))
    table = pd.DataFrame(rows)
    keys = [rank_key(result.records.get(pid), spec.slo) for pid in table["point_id"]]
    order = sorted(range(len(rows)), key=lambda i: (-keys[i][0], -keys[i][1], not rows[i]["chosen"], i))
    table = table.iloc[order].reset_index(drop=True)
    for column in ("tp", "replicas", "prefill_gpus", "decode_gpus", "token_budget", "max_num_seqs", "chunk_size",
                   "chunked_prefill_size", "max_num_partial_prefills", "max_long_partial_prefills",
                   "long_prefill_token_threshold", "num_gpus", "probes"):
        table[column] = pd.array([None if v is None or v != v else int(v) for v in table[column]], dtype="Int64")
    if "pp" in table:  # pipeline stages: 1 where a candidate has none
        table["pp"] = pd.array([1 if v is None or v != v else int(v) for v in table["pp"]], dtype="Int64")
    table.insert(0, "rank", range(1, len(table) + 1))
    return table


def _row(c: Candidate, stage: str, result: TuneResult) -> dict:
    config, record, spec = c.point.config, c.record, result.spec
    rate = record.get("rate")
    gpus = record["num_gpus"]
    per_gpu = None if rate is None else rate / gpus
    row = {"stage": stage, "stages": stage, "candidate": c.label, "chosen": c.point.id == result.best.point.id,
           **knobs(config), "num_gpus": gpus, "capacity": rate, "fail_rate": record.get("fail_rate"),
           "goodput_per_gpu": per_gpu}
    price = spec.gpus.price_per_gpu_hour
    row["requests_per_dollar"] = None if per_gpu is None or price is None else per_gpu * 3600 / price
    for metric in dict.fromkeys([*spec.slo, "throughput_tokens_per_s", "num_preemptions"]):
        row[f"{metric}_at_capacity"] = worst(record, metric)
    row.update(binding=record.get("binding"), probes=record.get("probes"), wall_seconds=record.get("wall_seconds"),
               status=record.get("status"), error=record.get("error"), point_id=c.point.id)
    return row


def knobs(config: ExperimentConfig) -> dict:
    """The searched knobs of an experiment, as table columns (P/D: the decode pool's policy)."""
    pd_mode = config.cluster.mode == "pd"
    settings = policy_settings(config)
    if pd_mode:
        from dataclasses import replace

        settings = policy_settings(replace(config, policy=pool_policy(config, "decode")))
    out = {"mode": config.cluster.mode, "tp": int(config.cost_model.get("tp", 1) or 1),
           "replicas": None if pd_mode else config.cluster.replicas,
           "prefill_gpus": _pool_gpus(config, "prefill") if pd_mode else None,
           "decode_gpus": _pool_gpus(config, "decode") if pd_mode else None,
           "policy": (pool_policy(config, "decode") if pd_mode else config.policy)["name"]}
    pp = int(config.cost_model.get("pp", 1) or 1)
    if pp > 1:  # a column only in tunes that list pipeline candidates
        out["pp"] = pp
    for key in ("token_budget", "max_num_seqs", "chunk_size", "chunked_prefill_size", "max_num_partial_prefills",
                "max_long_partial_prefills", "long_prefill_token_threshold", "strict_fcfs", "schedule_policy"):
        out[key] = settings.get(key)
    kv = config.cluster.kv_cache
    out.update(reserve_full_prompt=kv.reserve_full_prompt, watermark=kv.watermark, router=config.cluster.router)
    return out


def _pool_gpus(config: ExperimentConfig, pool: str) -> int:
    section = getattr(config.cluster, pool)
    tp = int((section.cost_model or {}).get("tp", config.cost_model.get("tp", 1)) or 1)
    return section.replicas * tp


def worst(record: dict, metric: str):
    """A metric at the capacity rate, the worst over seeds (max; min for throughput)."""
    values = [row.get(metric) for row in record.get("at_capacity") or [] if row.get(metric) is not None]
    if not values:
        return None
    return min(values) if metric.startswith("throughput") else max(values)


def save_table(table: pd.DataFrame, out: Path) -> None:
    write_file_atomic(out / "tune.csv", lambda tmp: table.to_csv(tmp, index=False))
    write_file_atomic(out / "tune.parquet", lambda tmp: table.to_parquet(tmp, index=False))


def best_yaml(result: TuneResult) -> str:
    """The chosen experiment, runnable with `cbsim run best.yaml`, at its capacity rate."""
    best, spec = result.best, result.spec
    data = best.point.config.to_dict()
    data["name"] = f"{spec.name}_best"
    data["output"]["dir"] = None
    rate = best.record.get("rate")
    if rate is not None:
        _set(data, spec.search.rate_key, float(rate))
    header = [f"# cbsim tune {spec.name}: the chosen deployment ({num_gpus(best.point.config)} GPUs)",
              f"# SLO: " + ", ".join(f"{k} <= {v:g}" for k, v in spec.slo.items()),
              f"# capacity {_num(rate)} req/s ({spec.search.rate_key} set to it), "
              f"goodput {_num(None if rate is None else rate / best.record['num_gpus'])} req/s per GPU",
              "# run: cbsim run best.yaml"]
    if isinstance((data.get("workload") or {}).get("trace"), dict) and best.point.config.source:
        header.append(f"# the trace path is relative to {Path(best.point.config.source).parent}")
    return "\n".join(header) + "\n" + yaml.safe_dump(data, sort_keys=False, width=100)


def _set(data: dict, key: str, value) -> None:
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value


def report_markdown(result: TuneResult, table: pd.DataFrame) -> str:
    """report.md: the setting, the answer, then per stage its candidates, capacities and the winner."""
    lines = _report_header(result, table)
    lines += ["| stage | set to | why |", "|---|---|---|"]
    for o in result.stages:
        value = o.winner.label if o.winner else "(unchanged)"
        lines.append(f"| {o.stage.name} | {value} | {o.why if o.winner else o.reason} |")
    lines += ["", "Coordinate descent: each stage fixes its best before the next, so knobs are tuned one at a "
              "time in a fixed order, not jointly.", "", "## Stages", ""]
    for o in result.stages:
        lines += _stage_section(o, result.spec.slo)
    lines += ["## Outputs", "", "- `best.yaml`: the chosen experiment at its capacity rate (`cbsim run best.yaml`)",
              "- `best_flags.txt`: the same as `vllm serve` / SGLang flags, with what they cannot express",
              "- `tune.csv`, `tune.parquet`: every distinct candidate, ranked", "- `pareto.png`: goodput per GPU "
              "against each SLO metric at capacity", ""]
    return "\n".join(lines)


def _report_header(result: TuneResult, table: pd.DataFrame) -> list[str]:
    spec, best = result.spec, result.best
    compute = sum(r.get("wall_seconds") or 0 for r in result.records.values())
    price = f", {spec.gpus.price_per_gpu_hour:g} per GPU-hour" if spec.gpus.price_per_gpu_hour else ""
    per_dollar = ""
    if spec.gpus.price_per_gpu_hour:
        per_dollar = f" ({_num(table.loc[table['chosen'], 'requests_per_dollar'].iloc[0])} requests per dollar)"
    return [f"# cbsim tune: {spec.name}", "",
            f"- base: `{spec.base if isinstance(spec.base, str) else 'inline'}`"
            + (f" with {', '.join(f'{k}={v}' for k, v in spec.set.items())}" if spec.set else ""),
            "- SLO (capacity: the highest rate meeting all): " + ", ".join(f"{k} <= {display(k, v)}"
                                                                          for k, v in spec.slo.items()),
            f"- GPU budget: {spec.gpus.count} x {result.base.cost_model.get('gpu', 'the cost model GPU')}{price}",
            f"- search: rate from {spec.search.lo or 'the base rate'}, tolerance {spec.search.rel_tol:g}, seeds "
            f"{spec.search.seeds}; {len(result.records)} capacity searches, {compute:.0f} s of compute",
            "", "## Chosen", "",
            f"**{_num(best.record.get('rate'))} req/s on {best.record['num_gpus']} GPUs = "
            f"{_num(_per_gpu(best.record))} req/s per GPU**{per_dollar}; {_limit_text(best.record)}", ""]


def _stage_section(o, slo: dict) -> list[str]:
    """One stage: its knob, why it ran (or not), a row per candidate, the winner and why."""
    lines = [f"### {o.stage.name} ({o.stage.step})", "", f"Knob: {o.stage.help}.", "", f"{o.status}: {o.reason}."]
    lines += [f"- dropped (the experiment refuses it): {text}" for text in o.dropped]
    if o.candidates and o.status == "searched":
        metrics = list(dict.fromkeys([*slo, *o.stage.shows]))
        lines += ["", "| candidate | req/s per GPU | capacity | first failing rate | broke first | "
                  + " | ".join(f"{m} at capacity" for m in metrics) + " | preemptions |",
                  "|---" * (6 + len(metrics)) + "|"]
        for c in o.candidates:
            r = c.record
            mark = "**" if c is o.winner else ""
            cells = [f"{mark}{c.label}{mark}", _num(_per_gpu(r)), _num(r.get("rate")), _num(r.get("fail_rate")),
                     r.get("binding") or ("-" if r.get("status") == "ok" else r.get("error") or "failed")]
            cells += [_metric(m, worst(r, m)) for m in metrics] + [_num(worst(r, "num_preemptions"))]
            lines.append("| " + " | ".join(cells) + " |")
        knee = knee_text(o.candidates)
        lines += ["", f"Chosen: **{o.winner.label}**: {o.why}." + (f" {knee}" if knee else "")]
    elif o.winner is not None:
        lines.append(f"Set to {o.winner.label}.")
    return lines + [""]


def knee_text(candidates: list[Candidate]) -> str:
    """Where the first SLO to break flips from the TTFT side to the TPOT/ITL side as a numeric knob
    grows (seed step 2's knee), or '' when it does not flip."""
    numeric = sorted((c.value, c) for c in candidates
                     if isinstance(c.value, int) and not isinstance(c.value, bool) and c.record)
    sides = [(value, slo_family(c.record.get("binding") or "")) for value, c in numeric]
    sides = [(v, side) for v, side in sides if side]
    for (low, a), (high, b) in zip(sides, sides[1:]):
        if a == "ttft" and b == "decode":
            return (f"The knee: up to {low} the TTFT side breaks first (too little prefill per step), from {high} "
                    "the TPOT/ITL side (prefill chunks slow the decodes).")
    return ""


def _limit_text(record: dict) -> str:
    if record.get("rate") is None:
        return "no probed rate met the SLO"
    if record.get("fail_rate") is None:
        return "no failing rate was found (the capacity is at least this: raise search.hi or the workload size)"
    return f"at {_num(record['fail_rate'])} req/s {record.get('binding')} broke first"


def _per_gpu(record: dict):
    rate = record.get("rate")
    return None if rate is None else rate / record["num_gpus"]


def _metric(metric: str, value) -> str:
    """A summary metric's cell: in the unit every command prints it (latencies in ms)."""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else display(metric, value)


def _num(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
    return str(value)


def write_outputs(result: TuneResult, out_dir: str | Path, plots: bool = True) -> dict[str, Path]:
    """Write tune.csv/.parquet, best.yaml, best_flags.txt, report.md and (plots) pareto.png, each atomically,
    then the folder's completion marker (cbsim/core/atomic.py); the tune's points are kept beside them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mark_incomplete(out)
    table = ranked_table(result)
    save_table(table, out)
    files = {"table": out / "tune.parquet", "best": out / "best.yaml", "flags": out / "best_flags.txt",
             "report": out / "report.md"}
    texts = {"best": best_yaml(result), "flags": flags_text(result.best.point.config),
             "report": report_markdown(result, table)}
    for key, text in texts.items():
        write_file_atomic(files[key], lambda tmp, text=text: tmp.write_text(text))
    if plots:
        from cbsim.tools.tune.plots import pareto_plot

        files["pareto"] = write_file_atomic(out / "pareto.png", lambda tmp: pareto_plot(
            table, result.spec.slo, tmp, title=result.spec.name, stages=[o.stage.name for o in result.stages]))
    mark_complete(out, sorted(["tune.csv", *(path.name for path in files.values())]))
    return files
