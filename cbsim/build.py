"""The composition root: an experiment's config turned into the parts of a run (cost models, KV caches,
replica settings, policies, P/D links) and the simulation of its requests over them. Everything here
reads the sections the config parsed once when it was loaded (config.parsed_sections); run_experiment
(api.py) is build -> simulate -> measure -> write on top of it.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from cbsim.config import ExperimentConfig, parsed_sections
from cbsim.core.errors import ConfigError
from cbsim.pools import pool_config
from cbsim.replica_gpus import kv_bytes_per_gpu, replica_kv_blocks
from cbsim.sim.costmodels.registry import engine_of, load_cost_model
from cbsim.sim.kv.cache import KVCache
from cbsim.sim.kv.tiers import Tier, TierStore
from cbsim.sim.kv.window import cache_window
from cbsim.sim.metrics.client_view import frontend_delays, shift_arrivals
from cbsim.sim.pd import PDSettings, PoolParts, simulate_pd
from cbsim.sim.preemption import swap_bandwidth
from cbsim.sim.replica import ReplicaSettings
from cbsim.sim.request_table import RequestTable
from cbsim.sim.simulation import simulate
from cbsim.sim.speculative import speculation


def build_replica_parts(cfg: ExperimentConfig, pool: str = "cluster"):
    """Model spec, cost model, KV-cache factory and replica settings for a config (for P/D pool `pool`,
    the pool's view of it: pools.pool_config); the model and cost model as the config parsed them."""
    sections = parsed_sections(cfg)
    model, cost = sections.model, sections.cost_models[pool]
    cfg = pool_config(cfg, pool) if pool != "cluster" else cfg
    cluster = cfg.cluster
    kv_cfg = cluster.kv_cache
    num_blocks = replica_kv_blocks(cfg, model, cost)  # the replica's layout: tp, pp stages, DP ranks
    bytes_per_token = kv_bytes_per_gpu(cfg, model, cost)  # what a swap moves per GPU
    tiers = kv_cfg.tiers
    cpu_bandwidth = tiers.levels[0].bandwidth_gb_s if tiers is not None else None
    settings = ReplicaSettings(
        preemption_mode=cfg.preemption.mode, victim=cfg.preemption.victim,
        swap_bandwidth=swap_bandwidth(cpu_bandwidth or cfg.preemption.swap_bandwidth_gb_s,
                                      getattr(cost, "engine", None), cfg.preemption.mode),
        max_model_len=cluster.max_model_len or model.max_model_len, fast_forward=cfg.sim.fast_forward,
        record_shapes=cfg.output.shapes > 0, max_predicted_ttft=cfg.admission.max_predicted_ttft,
        admission_window=cfg.admission.window_steps, admission_probe_tokens=cfg.admission.probe_tokens,
        pp_chunk_pipelining=cluster.pp_chunk_pipelining,
        dp_lockstep=cluster.dp_lockstep,
        prefill_schedule_interval=cluster.prefill_schedule_interval, **preemption_admission_settings(cfg))

    hash_block = None
    if kv_cfg.prefix_caching:
        hash_block = kv_cfg.hash_block_size or parsed_sections(cfg).workload.hash_block_size

    window = cache_window(model, kv_cfg.block_size, kv_cfg.hybrid_kv_cache_manager, kv_cfg.prefix_caching,
                          cluster.mode == "pd")
    units = num_blocks * (window.units_per_block if window is not None else 1)  # a window counts g layer-pages

    def make_kv():
        kv = KVCache(units, kv_cfg.block_size, int(math.floor(kv_cfg.watermark * units)),
                     kv_cfg.reserve_full_prompt, bytes_per_token,
                     prefix_caching=kv_cfg.prefix_caching, hash_block_size=hash_block, window=window,
                     check_full_input=kv_cfg.check_full_input)
        if tiers is not None:
            kv.prefix.tiers = tier_store(tiers, kv, settings.swap_bandwidth)
        return kv

    if tiers is not None:  # a step that restores is never one of a fast-forwarded run's identical steps
        if cfg.preemption.swap_space_gib is not None:
            raise ConfigError("preemption.swap_space_gib", "null with cluster.kv_cache.tiers (swap shares the cpu "
                              "tier: its capacity is the host space)", cfg.preemption.swap_space_gib)
        settings = replace(settings, fast_forward=False)
    return model, cost, make_kv, settings


def tier_store(tiers, kv: KVCache, host_bandwidth: float) -> TierStore:
    """The replica's lower tiers (cluster.kv_cache.tiers) in blocks of its cache: capacity_gib per GPU over
    the bytes of one block per GPU, or capacity_ratio x the GPU's blocks; cpu's bandwidth is the host link's."""
    levels = []
    for level in tiers.levels:
        blocks = (int(level.capacity_gib * 2**30 // kv.block_bytes) if level.capacity_gib is not None
                  else int(level.capacity_ratio * kv.num_blocks))
        bandwidth = host_bandwidth if level.name == "cpu" else level.bandwidth_gb_s * 1e9
        levels.append(Tier(level.name, blocks, bandwidth, level.latency_s))
    return TierStore(levels, kv.prefix.unit_blocks, tiers.write_policy, tiers.load == "layerwise")


def preemption_admission_settings(cfg: ExperimentConfig) -> dict:
    """ReplicaSettings fields of preemption.swap_space_gib/swapped_queue and the per-step admission signals."""
    pre, adm = cfg.preemption, cfg.admission
    if pre.swapped_queue == "vllm_v0" and cfg.policy.get("name") == "sglang":
        # its adder stops at the first request it cannot add: a reordered queue would block on a new prompt
        raise ConfigError("preemption.swapped_queue", "head with policy sglang (SGLang has no swapped queue: it "
                          "retracts by recompute; vllm_v0 is vLLM V0's)", "vllm_v0")
    step_cap = None
    if adm.tpot_slack is not None:
        tpot = cfg.metrics.slo.tpot if hasattr(cfg.metrics, "slo") else None
        if tpot is None:
            raise ConfigError("admission.tpot_slack", "metrics.slo.tpot set (the cap is tpot_slack x slo.tpot)",
                              adm.tpot_slack)
        step_cap = adm.tpot_slack * tpot
    return dict(swap_space=None if pre.swap_space_gib is None else pre.swap_space_gib * 2**30,
                swapped_queue=pre.swapped_queue, decode_reserve=adm.decode_reserve,
                schedule_conservativeness=adm.schedule_conservativeness,
                clip_max_new_tokens=adm.clip_max_new_tokens, step_cap=step_cap, pd_backpressure=adm.pd_backpressure,
                max_queued_requests=adm.max_queued_requests)


def step_noise(cfg: ExperimentConfig, cost, rng: np.random.Generator):
    """The per-step time factor for `sim.cost_noise`, drawn from its own child generator."""
    if not cfg.sim.cost_noise:
        return None
    if not hasattr(cost, "sample_factor"):
        raise ConfigError("sim.cost_noise", "a cost model with fitted residuals (type: fitted)",
                          cfg.cost_model.get("type"))
    noise_rng = rng.spawn(1)[0]
    return lambda: cost.sample_factor(noise_rng)


def pool_parts(cfg: ExperimentConfig, pool: str, rng: np.random.Generator):
    """(model, PoolParts) of P/D pool `pool`; only the prefill pool, where requests arrive, applies
    admission control."""
    model, cost, make_kv, settings = build_replica_parts(cfg, pool)
    if pool == "decode":
        settings = replace(settings, max_predicted_ttft=None)
    policy = parsed_sections(cfg).policies[pool]
    return model, PoolParts(getattr(cfg.cluster, pool).replicas, policy.build, cost, make_kv,
                            settings, step_noise(pool_config(cfg, pool), cost, rng))


def pd_settings(cfg: ExperimentConfig, model):
    """The links and hand-off rules of a P/D cluster (bandwidths in bytes/s)."""
    link, cluster = cfg.cluster.link, cfg.cluster
    return PDSettings(link_mode=link.mode, latency=link.latency_s, bandwidth=link.bandwidth_gb_s * 1e9,
                      lanes=link.lanes, pool_bandwidth=(link.pool_bandwidth_gb_s or link.bandwidth_gb_s) * 1e9,
                      first_token_on=cluster.first_token_on, decode_router=cluster.decode_router,
                      bytes_per_token=float(model.kv_bytes_per_token(1)))


def simulate_run(cfg: ExperimentConfig, requests, rng: np.random.Generator, progress=None, clients=None):
    """(recorder, replicas, pools, P/D cluster or None) of one run of `requests` under `cfg`;
    `clients`: the workload's timeouts and closed-loop clients (workloads/clients.py), colocated only."""
    try:
        if cfg.cluster.mode == "pd":
            model, prefill = pool_parts(cfg, "prefill", rng)
            _, decode = pool_parts(cfg, "decode", rng)
            links = pd_settings(cfg, model)
        else:
            model, cost, make_kv, settings = build_replica_parts(cfg)
            noise = step_noise(cfg, cost, rng)
            spec = speculation(cfg, model, rng, load_cost_model)
            if spec is not None:  # a speculating step is never one of a fast-forwarded run's identical steps
                settings = replace(settings, speculative=spec, fast_forward=False)
    except ConfigError as err:
        raise err.in_file(cfg.source)
    try:  # a step or transfer time the guard refuses (sim/durations.py) names the experiment file too
        if cfg.cluster.mode == "pd":
            if clients is not None:
                key, value = _client_key(clients)
                raise ConfigError(key, "null with cluster.mode pd (clients, agentic sessions and timeouts run on "
                                  "colocated clusters)", value, file=cfg.source)
            recorder, replicas, cluster = simulate_pd(requests, prefill, decode, links, router=cfg.cluster.router,
                                                      max_time=cfg.sim.max_time, progress=progress)
            pools = {"prefill": list(range(prefill.replicas)),
                     "decode": list(range(prefill.replicas, prefill.replicas + decode.replicas))}
            return recorder, replicas, pools, cluster
        recorder, replicas = simulate(requests, parsed_sections(cfg).policies["cluster"].build, cost, make_kv, settings,
                                      replicas=cfg.cluster.replicas, router=cfg.cluster.router,
                                      max_time=cfg.sim.max_time, noise=noise, progress=progress, clients=clients)
        return recorder, replicas, {"cluster": list(range(cfg.cluster.replicas))}, None
    except ConfigError as err:
        raise err.in_file(cfg.source)


def _client_key(clients) -> tuple[str, object]:
    """The workload key (and its value) that made a run's clients."""
    if clients.waits is not None:
        return "workload.agentic", "a mapping"
    if clients.closed_loop:
        return "workload.max_concurrency", clients.max_concurrency
    return "workload.timeout", clients.timeout


def client_frontend(cfg: ExperimentConfig, requests):
    """(engine, client arrivals or None, requests in scheduler-arrival order): with an engine front
    end, each request reaches the scheduler later than the client sent it (sim/metrics/client_view.py)."""
    try:
        engine = engine_of(cfg.cost_model)
    except ConfigError as err:
        raise err.in_file(cfg.source)
    if not engine.has_frontend:
        return engine, None, requests
    if isinstance(requests, RequestTable):  # its rows stay in id order; it delivers them by the new times
        return engine, requests.shift_arrivals(frontend_delays(requests.column("prompt_len"), engine.terms)), requests
    client = shift_arrivals(requests, engine.terms)
    return engine, client, sorted(requests, key=lambda r: r.arrival)
