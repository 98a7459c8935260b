"""How many KV blocks a replica's cache holds: GPU memory at the utilization asked for, less the weights
each GPU holds and a reserve, over the bytes of one block (vLLM's sizing)."""
from __future__ import annotations

from cbsim.core.errors import ConfigError
from cbsim.core.schema import require
from cbsim.sim.costmodels.catalog.specs import GiB, GPUSpec, ModelSpec
from cbsim.sim.costmodels.pipeline import check_pipeline, stage_layers


def kv_cache_blocks(model: ModelSpec, gpu: GPUSpec, tp: int, block_size: int, gpu_memory_utilization: float,
                    activation_reserve_bytes: int = 2 * GiB, pp: int = 1, data_parallel: int = 1) -> int:
    """KV blocks that fit on each GPU, vLLM-style.

    memory * utilization, minus this GPU's weights, minus a reserve for activations, the CUDA
    context and graphs (2 GiB by default: an assumption, of the size vLLM's profiling run finds for
    7-8B models), divided by the bytes of one block. Raises ConfigError if not one block fits.

    With `pp` stages each GPU holds its stage's layers (weights and KV; stage_layers of
    costmodels/pipeline.py) and the replica gets the fewest blocks any stage fits: vLLM sizes each
    worker's cache and keeps the smallest count (vllm/v1/core/kv_cache_utils.py
    unify_kv_cache_configs: "changes the num_blocks of each worker to the smallest among all
    workers"). With `data_parallel` ranks sharing the experts, each GPU holds 1/data_parallel of
    its TP share of the routed experts. pp = data_parallel = 1 is the one-stage formula, bit for bit.
    """
    model.check_tp(tp, "cluster.tp")
    require(block_size > 0, "cluster.kv_cache.block_size", "a positive integer", block_size)
    require(0.0 < gpu_memory_utilization <= 1.0, "cluster.kv_cache.gpu_memory_utilization",
            "a fraction in (0, 1]", gpu_memory_utilization)
    if pp == 1 and data_parallel == 1:
        stages = [(model.weight_bytes(tp), model.kv_bytes_per_token(tp))]
    else:
        stages = _stage_footprints(model, tp, pp, data_parallel)
    budget = gpu.memory_bytes * gpu_memory_utilization
    blocks = None
    for weights, kv in stages:
        free = budget - weights - activation_reserve_bytes
        fits = int(free // (block_size * kv)) if free > 0 else 0
        blocks = fits if blocks is None else min(blocks, fits)
    if blocks < 1:
        heaviest = max(weights for weights, _ in stages)
        layout = f"TP{tp}" + (f" PP{pp}" if pp > 1 else "") + (f" DP{data_parallel}" if data_parallel > 1 else "")
        raise ConfigError("cluster.kv_cache.num_blocks",
                          f"room for at least one KV block: {model.name} at {layout} needs "
                          f"{heaviest / GiB:.1f} GiB of weights per GPU, {gpu.name} offers "
                          f"{budget / GiB:.1f} GiB at this utilization",
                          blocks)
    return blocks


def _stage_footprints(model: ModelSpec, tp: int, pp: int, data_parallel: int) -> list[tuple[int, int]]:
    """(weight bytes, KV bytes per token) of one GPU of each pipeline stage."""
    check_pipeline(model.num_layers, pp)
    per_layer = model.kv_bytes_per_token(tp) // model.num_layers
    out, start = [], 0
    layers = stage_layers(model.num_layers, pp)
    for s, n in enumerate(layers):
        weights = model.stage_weight_bytes(tp, start, n, s == 0, s == len(layers) - 1, data_parallel)
        out.append((weights, per_layer * n))
        start += n
    return out
