"""GPUs per replica, resolved in one place: the KV cache is sized with it and per-GPU goodput
divides by it, so the two can never disagree (issue 14: 13).

Rule: `cluster.tp` when the experiment sets it (for a P/D pool, the pool's own `cost_model.tp`
first: api.pool_config lays it over cluster.tp); else the tensor-parallel degree the built cost
model states (`describe()["tp"]`: the TP a fitted or vidur profile was measured at, roofline's and
vidur's `tp` key); else 1 (unit and linear say nothing about GPUs).
"""
from __future__ import annotations

from .config import ExperimentConfig
from .errors import ConfigError


def gpus_per_replica(cfg: ExperimentConfig, cost=None) -> int:
    """The tensor-parallel degree of one replica of `cfg` (a P/D pool: of api.pool_config(cfg, pool)).
    `cost`: the cost model built for `cfg`, when the caller has it; otherwise it is built here."""
    if cfg.cluster.tp:
        return int(cfg.cluster.tp)
    if cost is None:
        from cbsim.profiler.costmodels import load_cost_model
        from cbsim.profiler.specs import model_spec

        try:
            cost = load_cost_model(cfg.cost_model, model_spec(cfg.model, "model"))
        except ConfigError as err:
            raise err.in_file(cfg.source)
    return int(cost.describe().get("tp") or 1)


def num_gpus(cfg: ExperimentConfig) -> int:
    """GPUs an experiment uses: replicas x gpus_per_replica, summed over both pools in P/D mode."""
    cluster = cfg.cluster
    if cluster.mode != "pd":
        return int(cluster.replicas) * gpus_per_replica(cfg)
    from .api import pool_config

    return sum(int(getattr(cluster, pool).replicas) * gpus_per_replica(pool_config(cfg, pool))
               for pool in ("prefill", "decode"))
