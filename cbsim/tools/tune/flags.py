"""The chosen deployment as engine flags: `vllm serve` for sarathi (and orca with paged KV),
SGLang's launch_server for sglang, else a note saying why there are none.

Invariant: the flags come from cbsim/server's tables (cbsim.server.render: one table per engine,
read both ways), and they are checked by resolving them back (cbsim.server.vllm/sglang.resolve):
every setting the engine would then run that differs from what cbsim simulated is listed under the
flags, so a reader sees where the engine and the simulated policy part (e.g. vLLM V1 has no
partial-prefill limits). This file only says which simulated settings a deployment wants.
"""
from __future__ import annotations

import json

from cbsim.sim.costmodels.catalog.lookup import gpu_spec, model_spec
from cbsim.server import ENGINES, Context, cost_model_options

from cbsim.config import ExperimentConfig, pool_cost_model, pool_policy
from cbsim.server import speculative
from cbsim.server.render import join, render
from cbsim.tools.tune.stages import policy_settings, speculative_section

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
            cost_model = pool_cost_model(config, pool)
            tp = int(cost_model.get("tp", 1) or 1)
            lines += ["", f"# {pool} pool: {section.replicas} instance(s)"]
            lines += _engine_lines(config, pool_policy(config, pool), tp, section.replicas, cost_model)
    else:
        tp = int(config.cluster.tp or config.cost_model.get("tp", 1) or 1)
        lines += _engine_lines(config, config.policy, tp, config.cluster.replicas, config.cost_model)
    return "\n".join(lines) + "\n"


def _engine_lines(config: ExperimentConfig, policy: dict, tp: int, replicas: int, cost_model: dict) -> list[str]:
    view = _with_policy(config, policy)
    settings = policy_settings(view)
    name = policy["name"]
    pp = int(cost_model.get("pp", 1) or 1)
    context = _context(config, cost_model)
    if name in VLLM_POLICIES and (name == "sarathi" or settings.get("kv_reservation") == "paged"):
        engine = "vllm"
        flags = render(engine, vllm_settings(view, settings, tp, pp), context)
        if view.speculative:
            flags["speculative-config"] = json.loads(speculative.to_vllm(speculative_section(view)))
        command = "vllm serve MODEL " + join(flags)
    elif name == "sglang":
        engine = "sglang"
        flags = render(engine, sglang_settings(view, settings, tp, pp, replicas), context)
        if view.speculative:
            flags.update(speculative.to_sglang(speculative_section(view)))
        command = "python -m sglang.launch_server --model-path MODEL " + join(flags)
    else:
        return [f"# none: policy {name} is not what vLLM V1 (sarathi, orca with paged KV) or SGLang (sglang) "
                "runs, so no engine flags reproduce it"]
    lines = [command]
    if replicas > 1 and engine == "vllm":
        lines.append(f"# {replicas} such instances behind a router ({config.cluster.router})")
    lines += [f"# differs from the simulation: {d}" for d in _differences(view, settings, flags, engine, context)]
    if engine == "vllm" and settings.get("chunk_size") is not None and \
            settings.get("long_prefill_token_threshold") is None:
        lines.append(f"# note: cbsim's chunk_size {settings['chunk_size']} is vLLM's per-request cap "
                     "--long-prefill-token-threshold (the same cap)")
    return lines


def vllm_settings(config: ExperimentConfig, settings: dict, tp: int, pp: int) -> dict:
    """The simulated settings a `vllm serve` deployment should resolve to (dotted keys, as resolve's)."""
    wanted = {"policy.name": config.policy["name"], "policy.token_budget": settings.get("token_budget"),
              "policy.max_num_seqs": settings.get("max_num_seqs"), **_common(config, tp, pp)}
    if config.policy["name"] == "sarathi":
        wanted["policy.long_prefill_token_threshold"] = _cap(settings)
        if settings.get("max_loras") is not None:
            wanted["policy.max_loras"] = settings["max_loras"]
    engine = config.cost_model.get("engine")
    if isinstance(engine, dict) and engine.get("preset") == "vllm-v1":
        wanted["cost_model.engine"] = engine
    return {k: v for k, v in wanted.items() if v is not None or k == "policy.long_prefill_token_threshold"}


def sglang_settings(config: ExperimentConfig, settings: dict, tp: int, pp: int, replicas: int) -> dict:
    """The simulated settings an SGLang deployment should resolve to (dotted keys, as resolve's)."""
    wanted = {"policy.token_budget": settings.get("token_budget"),
              "policy.chunked_prefill_size": settings.get("chunked_prefill_size"),
              "policy.max_num_seqs": settings.get("max_num_seqs"),
              "policy.schedule_policy": settings.get("schedule_policy", "fcfs"),
              "policy.enable_mixed_chunk": bool(settings.get("enable_mixed_chunk")),
              "cluster.replicas": replicas, **_common(config, tp, pp)}
    return {k: v for k, v in wanted.items() if v is not None or k == "policy.chunked_prefill_size"}


def _common(config: ExperimentConfig, tp: int, pp: int) -> dict:
    """KV cache, parallelism and context length: the keys both engines map."""
    kv = config.cluster.kv_cache
    wanted = {"cluster.kv_cache.block_size": kv.block_size,
              "cluster.kv_cache.gpu_memory_utilization": kv.gpu_memory_utilization,
              "cluster.kv_cache.prefix_caching": kv.prefix_caching, "cluster.tp": tp,
              "cluster.max_model_len": config.cluster.max_model_len}
    if isinstance(kv.num_blocks, int) and not isinstance(kv.num_blocks, bool):
        wanted["cluster.kv_cache.num_blocks"] = kv.num_blocks
    if pp > 1:
        wanted["cost_model.pp"] = pp
    return wanted


def _differences(config: ExperimentConfig, settings: dict, flags: dict, engine: str, context) -> list[str]:
    """What the engine would run with these flags (resolved back) that the simulation did not."""
    resolved, _ = ENGINES[engine].resolve(dict(flags), context, "flags")
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


def _context(config: ExperimentConfig, cost_model: dict):
    gpu = cost_model.get("gpu")
    max_len = config.cluster.max_model_len or model_spec(config.model, "model").max_model_len
    return Context(gpu_spec(gpu, "cost_model.gpu") if gpu else None, max_len, None, cost_model.get("type"),
                   cost_model_options(cost_model))


def _with_policy(config: ExperimentConfig, policy: dict) -> ExperimentConfig:
    from dataclasses import replace

    view = replace(config, policy=policy)
    view.source = config.source
    return view
