"""The unit of every summary.json key: the documented schema of the run summary.

summary.json (and the Python API's `Results.summary`, the sweep and capacity tables, the regression
baseline, tune's records) keeps SI values under unit-less keys: times in seconds, rates per second,
fractions in [0, 1]. The keys are what sweeps, capacity `--slo`, tune `slo:` and the regression suite
name, so they stay; this table is where each key's unit is written down (`cbsim schema --summary`), and
what every command prints from: latencies in milliseconds, as `vllm bench serve` prints them and as
bench.json stores them (`p99_ttft_ms`, the schema of vLLM's --save-result), other times in seconds.
"""
from __future__ import annotations

import re

# stems of time-valued keys: <stem>_p<q>, <stem>_max, <stem>_mean, or the stem itself
LATENCY_STEMS = ("ttft", "tpot", "itl", "e2e", "queue_delay", "transfer_time", "link_queue", "backpressure_wait",
                 "prefill_kv_held", "stall", "first_turn_ttft", "followup_ttft")
OTHER_TIMES = ("makespan", "short_p_mean", "short_p_max", "stall_seconds_total", "sim_wall_seconds",
               "session_makespan_p50", "session_makespan_p90", "session_makespan_p99")
UNITS = {  # exact keys that are not times
    "throughput_tokens_per_s": "tokens/s", "throughput_requests_per_s": "requests/s",
    "goodput_requests_per_s": "requests/s", "goodput_per_gpu": "requests/s per GPU",
    "slo_attainment": "fraction", "kv_usage_mean": "fraction", "kv_usage_p99": "fraction", "mfu_mean": "fraction",
    "hbm_util_mean": "fraction", "collective_share": "fraction", "prefix_hit_rate": "fraction",
    "tenant_jain_index": "fraction", "dec_at_p_mean": "tokens", "dec_at_p_min": "tokens",
    "swapped_bytes": "bytes", "kv_transfer_bytes": "bytes", "session_kv_resident_fraction": "fraction",
    "session_reusable_tokens": "tokens", "session_recomputed_tokens": "tokens",
    "session_recomputed_moved_tokens": "tokens",
    "offered_requests_per_s": "requests/s", "capacity_requests_per_s": "requests/s", "load_vs_capacity": "ratio",
    "band_source": "text", "band_step_scale_low": "factor", "band_step_scale_high": "factor",
}
BAND_ENDS = ("_low", "_high")  # <key>_low / <key>_high: the key in the runs at the band's bounds (cbsim/band.py)
_LATENCY = re.compile(r"^(%s)(_p\d+(\.\d+)?|_max|_mean)?(%s)?$" % ("|".join(LATENCY_STEMS), "|".join(BAND_ENDS)))
# the lower KV tiers' keys (sim/metrics/tier_metrics.py; only with cluster.kv_cache.tiers), by suffix
TIER_UNITS = {"_hit_rate": "fraction", "_restored_tokens": "tokens", "_restore_stall_seconds": "s",
              "_restore_ttft_share": "fraction", "_capacity_blocks": "blocks", "_peak_blocks": "blocks",
              "_written_bytes": "bytes", "_dropped_units": "count"}
TIER_MEANINGS = {
    "_hit_rate": "kv_tier_gpu_hit_rate, kv_tier_<tier>_hit_rate: prompt tokens found on the GPU / restored from "
    "<tier>, over the admitted requests' prompt tokens (together: prefix_hit_rate)",
    "_restored_tokens": "kv_tier_<tier>_restored_tokens: prompt tokens restored from <tier>",
    "_restore_stall_seconds": "kv_tier_restore_stall_seconds: seconds steps lasted beyond their forward waiting "
    "on restores and write_back stores",
    "_restore_ttft_share": "kv_tier_restore_ttft_share: of the restoring requests' TTFT, the share their "
    "admission step's wait took",
    "_capacity_blocks": "kv_tier_<tier>_capacity_blocks: the tier's size (summed over replicas)",
    "_peak_blocks": "kv_tier_<tier>_peak_blocks: the most it held (cpu: with swapped requests)",
    "_written_bytes": "kv_tier_<tier>_written_bytes: bytes stored into it (copies and demotions)",
    "_dropped_units": "kv_tier_dropped_units: prefix units the last tier let go",
}
_MEANINGS = {
    "ttft": "time to first token", "tpot": "time per output token after the first", "itl": "inter-token latency",
    "e2e": "end-to-end latency", "queue_delay": "arrival to first scheduled step",
    "transfer_time": "P/D: KV transfer time of a hand-off", "link_queue": "P/D: wait for a KV link lane",
    "backpressure_wait": "P/D: prefilled, waiting for room on a decode replica",
    "prefill_kv_held": "P/D: time the prefill side holds a request's KV",
    "stall": "an ITL gap above metrics.stall_factor x the run's median ITL",
    **{f"session_makespan_p{q}": f"agentic: p{q} of a top-level session's first send to its last turn's end"
       for q in (50, 90, 99)},
    "first_turn_ttft": "agentic: TTFT of agents' first turns", "followup_ttft": "agentic: TTFT of later turns",
    "session_kv_resident_fraction": "agentic: history tokens found cached / reusable (resident through the gaps)",
    "session_reusable_tokens": "agentic: history tokens the previous turn left in the prefix cache",
    "session_recomputed_tokens": "agentic: reusable history tokens recomputed (evicted in a gap, or on another "
    "replica)", "session_recomputed_moved_tokens": "agentic: of those, on another replica than the turn before",
    "short_p_mean": "per long prompt: last completion of the short requests in the system at its arrival, minus "
    "that arrival (short_P)", "short_p_max": "short_P, the largest",
    "dec_at_p_mean": "per long prompt: short requests' decode tokens during its prefill (dec@P)",
    "dec_at_p_min": "dec@P, the smallest", "stall_seconds_total": "summed length of the stalls",
    "offered_requests_per_s": "arrivals over their span (null for an all-at-once batch)",
    "capacity_requests_per_s": "what the replicas complete in steady state (sim/metrics/knee.py)",
    "load_vs_capacity": "offered / capacity: 0.9 or more is near the knee",
    "band_source": "metrics.band: where the step-time factors come from (cbsim run --band; null key without a band)",
    "band_step_scale_low": "the band's low factor on every step's kernel time",
    "band_step_scale_high": "the band's high factor on every step's kernel time",
    "sim_wall_seconds": "wall-clock time of the simulation", "makespan": "first arrival to last completion", "slo_attainment": "requests meeting metrics.slo "
    "(null without an SLO)", "goodput_requests_per_s": "requests meeting metrics.slo per second (null without an SLO)",
}


def is_latency(key: str) -> bool:
    """A per-request or per-token latency key (ttft_p99, itl_max, queue_delay_p50, ...): printed in ms."""
    return _LATENCY.match(key) is not None


def unit_of(key: str) -> str:
    """The unit of a summary key's value: 's', 'tokens/s', 'fraction', 'bytes', ... or 'count'."""
    if is_latency(key) or key in OTHER_TIMES:
        return "s"
    if key in UNITS:
        return UNITS[key]
    if key.endswith(BAND_ENDS) and key.rsplit("_", 1)[0] in UNITS:  # capacity_requests_per_s_low, ...
        return UNITS[key.rsplit("_", 1)[0]]
    if key.startswith("kv_tier_"):
        for suffix, unit in TIER_UNITS.items():
            if key.endswith(suffix):
                return unit
    if key.endswith("_utilization") or key.endswith("_share"):
        return "fraction"
    return "count"


def display(key: str, value) -> str:
    """A summary value as every command prints it: latencies in ms (in s from 10 s on, not '4.446e+04
    ms'), other times in s, fractions in %, counts bare; 'n/a' for None (undefined, or no SLO set)."""
    if value is None:
        return "n/a"
    unit = unit_of(key)
    if unit == "s" and is_latency(key) and value < 10.0:
        return f"{value * 1e3:.4g} ms"
    if unit == "fraction" and key == "slo_attainment":
        return f"{value * 100:.4g} %"
    if unit in ("count", "ratio", "factor", "text"):
        return f"{value:.4g}" if isinstance(value, float) else str(value)
    return f"{value:.4g} {unit}"


def band_text(summary: dict, key: str) -> str | None:
    """'[39.82 ms .. 52.75 ms]': a key's values in the band's low and high runs (None without a band)."""
    if f"{key}_low" not in summary:
        return None
    return f"[{display(key, summary[f'{key}_low'])} .. {display(key, summary[f'{key}_high'])}]"


def ms(seconds) -> str:
    """A latency in seconds as printed: '69.34 ms'; 'n/a' for None."""
    return "n/a" if seconds is None else f"{seconds * 1e3:.4g} ms"


def schema_markdown() -> str:
    """The summary.json reference as Markdown: the unit of each key (family), as `cbsim schema --summary`."""
    lines = ["| key | unit in summary.json | printed as | meaning |", "|---|---|---|---|"]
    for stem in LATENCY_STEMS:
        lines.append(f"| `{stem}_p<q>`, `{stem}_max`, `{stem}_mean` | s | ms | {_MEANINGS.get(stem, '')} |")
    for key in OTHER_TIMES:
        lines.append(f"| `{key}` | s | s | {_MEANINGS.get(key, '')} |")
    for key, unit in UNITS.items():
        shown = "%" if key == "slo_attainment" else unit
        lines.append(f"| `{key}` | {unit} | {shown} | {_MEANINGS.get(key, '')} |")
    lines.append("| `<key>_low`, `<key>_high` | the key's | the key's | metrics.band (cbsim run --band): the key "
                 "in the run at the band's low / high step-time factor; ttft, tpot, e2e percentiles, "
                 "capacity_requests_per_s, load_vs_capacity |")
    for suffix, unit in TIER_UNITS.items():
        lines.append(f"| `kv_tier_*{suffix}` | {unit} | {unit} | {TIER_MEANINGS[suffix]} |")
    lines.append("| `<pool>_utilization`, `*_share` | fraction | fraction | (agentic: `session_serving_share`, "
                 "`session_tool_share`, `session_subagent_share` of the sessions' summed makespan) |")
    lines.append("| every other key (`num_*`, ...) | count | count | |")
    return "\n".join(lines) + "\n"
