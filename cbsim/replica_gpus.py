"""GPUs per replica, resolved in one place: the KV cache is sized with it and per-GPU goodput
divides by it, so the two can never disagree (issue 14: 13).

Rule: the tensor-parallel degree is `cluster.tp` when the experiment sets it (for a P/D pool, the
pool's own `cost_model.tp` first: pools.pool_config lays it over cluster.tp); else the degree the built
cost model states (`describe()["tp"]`: the TP a fitted or vidur profile was measured at, roofline's
and vidur's `tp` key); else 1 (unit and linear say nothing about GPUs). A replica holds
tp x pp GPUs, pp the cost model's pipeline stages (`pipeline_stages`, roofline `pp`; 1 elsewhere).
With data-parallel attention (roofline `data_parallel`) a replica is one rank: its tp x pp GPUs.
"""
from __future__ import annotations

from cbsim.config import ExperimentConfig
from cbsim.core.errors import ConfigError
from cbsim.pools import pool_config
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.costmodels.catalog.lookup import gpu_spec, model_spec
from cbsim.sim.costmodels.catalog.specs import GPUSpec, ModelSpec
from cbsim.sim.metrics.step_efficiency import StepHardware
from cbsim.sim.kv.sizing import kv_cache_blocks


def _cost(cfg: ExperimentConfig, cost=None):
    """The cost model built for `cfg` (given, or built here)."""
    if cost is not None:
        return cost
    try:
        return load_cost_model(cfg.cost_model, model_spec(cfg.model, "model"))
    except ConfigError as err:
        raise err.in_file(cfg.source)


def tensor_parallel(cfg: ExperimentConfig, cost=None) -> int:
    """The tensor-parallel degree of one replica (one pipeline stage's GPUs)."""
    if cfg.cluster.tp:
        return int(cfg.cluster.tp)
    return int(_cost(cfg, cost).describe().get("tp") or 1)


def pipeline_stages(cfg: ExperimentConfig, cost=None) -> int:
    """Pipeline stages of one replica: the cost model's `pipeline_stages` (1 without)."""
    return int(getattr(_cost(cfg, cost), "pipeline_stages", 1))


def gpus_per_replica(cfg: ExperimentConfig, cost=None) -> int:
    """GPUs of one replica of `cfg` (a P/D pool: of pools.pool_config(cfg, pool)): tp x pp.
    `cost`: the cost model built for `cfg`, when the caller has it; otherwise it is built here."""
    if cfg.cluster.tp and cost is None and not _may_pipeline(cfg):
        return int(cfg.cluster.tp)
    cost = _cost(cfg, cost)
    return tensor_parallel(cfg, cost) * pipeline_stages(cfg, cost)


def _may_pipeline(cfg: ExperimentConfig) -> bool:
    """Whether the cost model mapping asks for pipeline stages (so the cost model must be built)."""
    return cfg.cost_model.get("pp", 1) != 1  # anything else (a bad value too) is the cost model's to judge


def replica_kv_blocks(cfg: ExperimentConfig, model, cost) -> int:
    """KV blocks of one replica: the configured count, or 'auto' sized per GPU from the replica's
    layout (tp, pp stages, data-parallel ranks sharing the experts): sim/kv/sizing.py kv_cache_blocks."""
    kv_cfg = cfg.cluster.kv_cache
    if kv_cfg.num_blocks != "auto":
        return kv_cfg.num_blocks
    hardware = cost.describe()
    gpu = cfg.cluster.gpu or cfg.cost_model.get("gpu") or hardware.get("gpu")
    if gpu is None:
        raise ConfigError("cluster.kv_cache.num_blocks", "an integer, or 'auto' with a GPU (set cluster.gpu, or use "
                          "a cost model with a gpu)", "auto")
    return kv_cache_blocks(model, gpu_spec(gpu, "cluster.gpu"), tensor_parallel(cfg, cost), kv_cfg.block_size,
                           kv_cfg.gpu_memory_utilization, pp=pipeline_stages(cfg, cost),
                           data_parallel=int(getattr(cost, "data_parallel", 1)))


def kv_bytes_per_gpu(cfg: ExperimentConfig, model, cost) -> float:
    """KV bytes one token takes on one GPU of a replica: its layers' heads over tp (MLA's latent whole
    on each), its stage's share of the layers with pp stages (what a swap or a transfer moves per GPU)."""
    return model.kv_bytes_per_token(tensor_parallel(cfg, cost)) / pipeline_stages(cfg, cost)


def num_gpus(cfg: ExperimentConfig) -> int:
    """GPUs an experiment uses: replicas x gpus_per_replica, summed over both pools in P/D mode."""
    cluster = cfg.cluster
    if cluster.mode != "pd":
        return int(cluster.replicas) * gpus_per_replica(cfg)
    return sum(int(getattr(cluster, pool).replicas) * gpus_per_replica(pool_config(cfg, pool))
               for pool in ("prefill", "decode"))


def hardware_of(cfg, replicas, pools: dict) -> dict:
    """Replica index -> StepHardware (None where no GPU is known) of a run of `cfg`: the model and
    GPU its cost model timed (else the experiment's model and cluster.gpu, or the cost model's gpu),
    its GPUs (gpus_per_replica, above) and its cost model's `collective_time`, if it has one."""
    by_index = {replica.index: replica for replica in replicas}
    out = {}
    for pool, indices in pools.items():
        pool_cfg = cfg if pool == "cluster" else pool_config(cfg, pool)
        for index in indices:
            out[index] = _hardware(pool_cfg, by_index[index].cost)
    return out


def _hardware(cfg, cost) -> StepHardware | None:
    model = getattr(cost, "model", None)
    gpu = getattr(cost, "gpu", None)
    try:
        model = model if isinstance(model, ModelSpec) else model_spec(cfg.model)
        if not isinstance(gpu, GPUSpec):
            name = cfg.cluster.gpu or cfg.cost_model.get("gpu") or cost.describe().get("gpu")
            if name is None:
                return None
            gpu = gpu_spec(name)
    except ConfigError:  # a profile's GPU or model the catalog does not know: no peaks to divide by
        return None
    fp8 = model.compute_dtype != "bf16" and model.weight_dtype == "fp8"
    return StepHardware(model, gpu.peak_flops(fp8), gpu.hbm_bandwidth, gpus_per_replica(cfg, cost),
                        getattr(cost, "collective_time", None), tensor_parallel(cfg, cost))
