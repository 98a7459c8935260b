"""Engines' KV-offloading flags as cbsim's `cluster.kv_cache.tiers` section (sim/kv/tiers.py).

vLLM (vllm/config/vllm.py VllmConfig._post_init_kv_transfer_config; vllm/config/cache.py, 0.11-0.12):
`--kv-offloading-size` (GiB of CPU memory, for all the TP x PP ranks together) turns offloading on;
`--kv-offloading-backend` native (the default) sets `--kv-transfer-config` to the OffloadingConnector with
`kv_connector_extra_config.cpu_bytes_to_use` = size x 2^30, lmcache to the LMCacheConnectorV1 with
`lmcache.max_local_cpu_size` = size / ranks (per rank; LMCache's LocalCPUBackend allocates it x 1024**3 bytes). The same connectors given directly through
`--kv-transfer-config` (a JSON object) resolve the same way. cbsim's capacity is per GPU, so the size is
divided by the ranks. The OffloadingConnector stores every computed block (write_through) and loads a
hit asynchronously, the request waiting for it (cbsim: load layerwise, the step that admits it waiting);
LMCache stores after prefill and, without `use_layerwise`, loads before the forward (load blocking).
Other connectors (NixlConnector, P2pNcclConnector, ...) move KV between P/D instances: cluster.mode pd.

SGLang (python/sglang/srt/server_args.py, hicache_*; docs/advanced_features/hicache_best_practices.md):
`--enable-hierarchical-cache` turns HiCache on; the host pool is `--hicache-ratio` (default 2.0) times
the device pool, or `--hicache-size` GB per rank when given (it overrides the ratio);
`--hicache-write-policy` write_through (default), write_through_selective (a node is copied once a second
request takes it: HiRadixCache's write_through_threshold 2) or write_back; load-back overlaps the forward
layer by layer. An L3
`--hicache-storage-backend` has no bandwidth cbsim could cite: give an ssd or remote tier in the file.
"""
from __future__ import annotations

import json

from cbsim.core.errors import ConfigError

KEY = "cluster.kv_cache.tiers"
VLLM_SOURCE = "vllm/config/vllm.py (_post_init_kv_transfer_config), vllm/config/cache.py (kv_offloading_*)"
SGLANG_SOURCE = "python/sglang/srt/server_args.py (enable_hierarchical_cache, hicache_*)"
SGLANG_POLICIES = ("write_through", "write_through_selective", "write_back")


def transfer_config(text: str) -> dict:
    """--kv-transfer-config's value: a JSON object (ValueError otherwise, which the flag reader reports)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _tiers(gib_per_gpu: float, write_policy: str, load: str) -> dict:
    return {KEY: {"levels": [{"name": "cpu", "capacity_gib": gib_per_gpu}], "write_policy": write_policy,
                  "load": load}}


def from_vllm(flags: dict, path: str) -> dict:
    """Dotted settings of vLLM's --kv-offloading-size / --kv-offloading-backend / --kv-transfer-config."""
    ranks = flags.get("tensor-parallel-size", 1) * flags.get("pipeline-parallel-size", 1)
    size = flags.get("kv-offloading-size")
    if size is not None:
        if "kv-transfer-config" in flags:
            raise ConfigError(f"{path} --kv-transfer-config", "no --kv-transfer-config with --kv-offloading-size "
                              "(vLLM builds the connector from the size)", flags["kv-transfer-config"])
        if size <= 0:
            raise ConfigError(f"{path} --kv-offloading-size", "GiB > 0", size)
        backend = flags.get("kv-offloading-backend", "native")
        return _tiers(size / ranks, "write_through", "layerwise" if backend == "native" else "blocking")
    if "kv-offloading-backend" in flags:
        raise ConfigError(f"{path} --kv-offloading-size", "a size in GiB with --kv-offloading-backend (vLLM: 'You "
                          "must set kv_offloading_size when kv_offloading_backend is set')", None)
    config = flags.get("kv-transfer-config")
    return _from_connector(config, ranks, f"{path} --kv-transfer-config") if config else {}


def _from_connector(config: dict, ranks: int, where: str) -> dict:
    connector = config.get("kv_connector")
    extra = config.get("kv_connector_extra_config") or {}
    if connector == "OffloadingConnector":
        size = extra.get("cpu_bytes_to_use")
        if not isinstance(size, (int, float)) or isinstance(size, bool) or size <= 0:
            raise ConfigError(f"{where} kv_connector_extra_config.cpu_bytes_to_use", "bytes > 0 (cbsim reads the "
                              "CPU size from it; 0.11's num_cpu_blocks: give cluster.kv_cache.tiers instead)", size)
        return _tiers(size / 2**30 / ranks, "write_through", "layerwise")
    if connector == "LMCacheConnectorV1":
        size = extra.get("lmcache.max_local_cpu_size")
        if not isinstance(size, (int, float)) or isinstance(size, bool) or size <= 0:
            raise ConfigError(f"{where} kv_connector_extra_config.lmcache.max_local_cpu_size", "GiB per rank > 0 "
                              "(LMCache otherwise reads it from its own config file or LMCACHE_MAX_LOCAL_CPU_SIZE: "
                              "give cluster.kv_cache.tiers instead)", size)
        load = "layerwise" if extra.get("lmcache.use_layerwise") else "blocking"
        return _tiers(float(size), "write_through", load)  # LMCache allocates max_local_cpu_size * 1024**3 bytes
    raise ConfigError(f"{where} kv_connector", "OffloadingConnector or LMCacheConnectorV1 (the connectors that "
                      "offload to a lower tier; P/D connectors are cluster.mode pd)", connector)


def from_sglang(flags: dict, path: str) -> dict:
    """Dotted settings of SGLang's --enable-hierarchical-cache and --hicache-* flags (none without it)."""
    if not flags.get("enable-hierarchical-cache"):
        return {}
    if flags.get("disable-radix-cache"):
        raise ConfigError(f"{path} --disable-radix-cache", "not with --enable-hierarchical-cache (HiCache extends "
                          "the radix cache)", True)
    if flags.get("hicache-storage-backend"):
        raise ConfigError(f"{path} --hicache-storage-backend", "none (cbsim has no cited bandwidth for an L3 "
                          "backend: give an ssd or remote tier in cluster.kv_cache.tiers)",
                          flags["hicache-storage-backend"])
    policy = flags.get("hicache-write-policy", "write_through")
    if policy not in SGLANG_POLICIES:
        raise ConfigError(f"{path} --hicache-write-policy", "write_through, write_through_selective or write_back",
                          policy)
    size = flags.get("hicache-size", 0)
    level = {"name": "cpu"}
    if size and size > 0:
        level["capacity_gib"] = size * 1e9 / 2**30  # GB per rank (HostKVCache: host_size * 1e9 bytes)
    else:
        ratio = flags.get("hicache-ratio", 2.0)
        if ratio <= 0:
            raise ConfigError(f"{path} --hicache-ratio", "a number > 0", ratio)
        level["capacity_ratio"] = ratio
    return {KEY: {"levels": [level], "write_policy": policy, "load": "layerwise"}}
