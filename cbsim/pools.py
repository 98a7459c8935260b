"""What the replicas of one pool of a P/D cluster see of the experiment: the config layer's view of
a pool, shared by the run (api.py), the GPU count (replica_gpus.py) and the step efficiency
(sim/metrics/step_efficiency.py), so none of them has to import the run (api.py) to learn it."""
from __future__ import annotations

from dataclasses import replace

from cbsim.config import ExperimentConfig, pool_cost_model, pool_policy


def pool_config(cfg: ExperimentConfig, pool: str) -> ExperimentConfig:
    """The experiment as the replicas of P/D pool `pool` see it: the pool's policy, its cost model
    (its gpu and tp also size its KV cache), its KV block count and whether it caches prefixes."""
    section = getattr(cfg.cluster, pool)
    own = section.cost_model or {}
    kv = cfg.cluster.kv_cache
    prefix = kv.prefix_caching if section.prefix_caching is None else section.prefix_caching
    cluster = replace(cfg.cluster, gpu=own.get("gpu", cfg.cluster.gpu), tp=own.get("tp", cfg.cluster.tp),
                      kv_cache=replace(kv, num_blocks=section.num_blocks or kv.num_blocks, prefix_caching=prefix))
    return replace(cfg, cost_model=pool_cost_model(cfg, pool), policy=pool_policy(cfg, pool), cluster=cluster)
