"""The chosen deployment as engine flags: `vllm serve` for sarathi (and orca with paged KV),
SGLang's launch_server for sglang, else a note saying why there are none.

Invariant: the flags are the inverse of cbsim/server's tables, and they are checked by resolving
them back (cbsim.server.vllm/sglang.resolve): every setting the engine would then run that
differs from what cbsim simulated is listed under the flags, so a reader sees where the engine
and the simulated policy part (e.g. vLLM V1 has no partial-prefill limits).
"""
from __future__ import annotations

import shlex

from .config import ExperimentConfig, pool_policy
from .tune_stages import policy_settings

VLLM_POLICIES = ("sarathi", "orca")


def flags_text(config: ExperimentConfig) -> str:
    """best_flags.txt: one command per pool (colocated: one), with the differences noted."""
    lines = [f"# {config.name}: engine flags of the chosen deployment (model {config.model})"]
    if config.cluster.mode == "pd":
        lines.append("# P/D: run each pool as its own instances and join them with the engine's KV-transfer "
                     "connector (vLLM --kv-transfer-config, SGLang --disaggregation-mode); cbsim modelled the "
                     f"link as {config.cluster.link.mode}, {config.cluster.link.bandwidth_gb_s} GB/s")
        for pool in ("prefill", "decode"):
            section = getattr(config.cluster, pool)
            tp = int((section.cost_model or {}).get("tp", config.cost_model.get("tp", 1)) or 1)
            lines += ["", f"# {pool} pool: {section.replicas} instance(s)"]
            lines += _engine_lines(config, pool_policy(config, pool), tp, section.replicas)
    else:
        tp = int(config.cluster.tp or config.cost_model.get("tp", 1) or 1)
        lines += _engine_lines(config, config.policy, tp, config.cluster.replicas)
    return "\n".join(lines) + "\n"


def _engine_lines(config: ExperimentConfig, policy: dict, tp: int, replicas: int) -> list[str]:
    view = _with_policy(config, policy)
    settings = policy_settings(view)
    name = policy["name"]
    if name in VLLM_POLICIES and (name == "sarathi" or settings.get("kv_reservation") == "paged"):
        flags, engine = _vllm(view, settings, tp), "vllm"
        command = "vllm serve MODEL " + _join(flags)
    elif name == "sglang":
        flags, engine = _sglang(view, settings, tp, replicas), "sglang"
        command = "python -m sglang.launch_server --model-path MODEL " + _join(flags)
    else:
        return [f"# none: policy {name} is not what vLLM V1 (sarathi, orca with paged KV) or SGLang (sglang) "
                "runs, so no engine flags reproduce it"]
    lines = [command]
    if replicas > 1 and engine == "vllm":
        lines.append(f"# {replicas} such instances behind a router ({config.cluster.router})")
    lines += [f"# differs from the simulation: {d}" for d in _differences(view, settings, flags, engine)]
    if engine == "vllm" and settings.get("chunk_size") is not None and \
            settings.get("long_prefill_token_threshold") is None:
        lines.append(f"# note: cbsim's chunk_size {settings['chunk_size']} is vLLM's per-request cap "
                     "--long-prefill-token-threshold (the same cap)")
    return lines


def _vllm(config: ExperimentConfig, settings: dict, tp: int) -> dict:
    flags: dict = {}
    if config.policy["name"] == "orca":
        flags["enable-chunked-prefill"] = False
    flags["max-num-batched-tokens"] = settings.get("token_budget")
    flags["max-num-seqs"] = settings.get("max_num_seqs")
    cap = _cap(settings)
    if cap is not None:
        flags["long-prefill-token-threshold"] = cap
    flags.update(_kv_flags(config, {"block_size": ("block-size", 16), "gpu_memory_utilization":
                                    ("gpu-memory-utilization", 0.9), "num_blocks": ("num-gpu-blocks-override", None)}))
    if not config.cluster.kv_cache.prefix_caching:
        flags["enable-prefix-caching"] = False
    if tp > 1:
        flags["tensor-parallel-size"] = tp
    if config.cluster.max_model_len:
        flags["max-model-len"] = config.cluster.max_model_len
    return {k: v for k, v in flags.items() if v is not None}


def _sglang(config: ExperimentConfig, settings: dict, tp: int, replicas: int) -> dict:
    kv = config.cluster.kv_cache
    chunk = settings.get("chunked_prefill_size")
    flags = {"max-prefill-tokens": settings.get("token_budget"), "chunked-prefill-size": -1 if chunk is None else chunk,
             "max-running-requests": settings.get("max_num_seqs"), "page-size": kv.block_size,
             "mem-fraction-static": kv.gpu_memory_utilization}
    if settings.get("schedule_policy", "fcfs") != "fcfs":
        flags["schedule-policy"] = settings["schedule_policy"].replace("_", "-")
    if settings.get("enable_mixed_chunk"):
        flags["enable-mixed-chunk"] = True
    if not kv.prefix_caching:
        flags["disable-radix-cache"] = True
    if isinstance(kv.num_blocks, int):
        flags["max-total-tokens"] = kv.num_blocks * kv.block_size
    if tp > 1:
        flags["tp-size"] = tp
    if replicas > 1:
        flags["dp-size"] = replicas
    if config.cluster.max_model_len:
        flags["context-length"] = config.cluster.max_model_len
    return {k: v for k, v in flags.items() if v is not None}


def _differences(config: ExperimentConfig, settings: dict, flags: dict, engine: str) -> list[str]:
    """What the engine would run with these flags (resolved back) that the simulation did not."""
    from cbsim.server import sglang, vllm

    module = vllm if engine == "vllm" else sglang
    resolved, _ = module.resolve(dict(flags), _context(config), "flags")
    out = []
    for key, value in resolved.items():
        section, _, leaf = key.partition(".")
        if section == "policy":
            ours = settings.get(leaf, config.policy.get(leaf)) if leaf != "name" else config.policy["name"]
            if leaf == "long_prefill_token_threshold":
                ours = _cap(settings)
        elif key.startswith("cluster.kv_cache."):
            ours = getattr(config.cluster.kv_cache, key.rsplit(".", 1)[1])
        elif key == "cost_model.engine":
            ours = config.cost_model.get("engine")
            if ours is None:
                continue  # the cost model's default engine
        elif key == "preemption.mode":
            ours = config.preemption.mode
        else:
            continue
        if ours != value:
            out.append(f"{key}: the engine runs {value!r}, cbsim simulated {ours!r}" + _why(key, engine))
    return out


def _why(key: str, engine: str) -> str:
    if engine == "vllm" and "partial_prefills" in key:
        return " (vLLM V1 has no partial-prefill limit and refuses the flags at startup; V0 had them)"
    return ""


def _cap(settings: dict):
    caps = [c for c in (settings.get("long_prefill_token_threshold"), settings.get("chunk_size")) if c]
    return min(caps) if caps else None


def _kv_flags(config: ExperimentConfig, table: dict) -> dict:
    kv = config.cluster.kv_cache
    out = {}
    for key, (flag, default) in table.items():
        value = getattr(kv, key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != default:
            out[flag] = value
    return out


def _context(config: ExperimentConfig):
    from cbsim.profiler.specs import gpu_spec, model_spec
    from cbsim.server import Context

    gpu = config.cost_model.get("gpu")
    max_len = config.cluster.max_model_len or model_spec(config.model, "model").max_model_len
    return Context(gpu_spec(gpu, "cost_model.gpu") if gpu else None, max_len)


def _with_policy(config: ExperimentConfig, policy: dict) -> ExperimentConfig:
    from dataclasses import replace

    view = replace(config, policy=policy)
    view.source = config.source
    return view


def _join(flags: dict) -> str:
    parts = []
    for name, value in flags.items():
        if value is True:
            parts.append(f"--{name}")
        elif value is False:
            parts.append(f"--no-{name}")
        else:
            parts.append(f"--{name} {shlex.quote(str(value))}")
    return " ".join(parts)
