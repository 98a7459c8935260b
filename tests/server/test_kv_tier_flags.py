"""The engines' KV-offloading flags resolve to cluster.kv_cache.tiers (cbsim/server/kv_tiers.py)."""
from __future__ import annotations

import pytest

from cbsim.config import load_config
from cbsim.core.errors import ConfigError

WORKLOAD = {"num_requests": 5, "arrival": {"type": "poisson", "rate": 1.0},
            "prompt_len": {"type": "fixed", "value": 100}, "output_len": {"type": "fixed", "value": 10}}


def tiers(engine, args):
    data = {"name": "t", "model": "llama-3-8b", "cost_model": {"type": "roofline", "gpu": "h100", "tp": 1},
            "server": {"engine": engine, "args": args}, "workload": WORKLOAD}
    return load_config(data).cluster.kv_cache.tiers


def shape(t):
    level = t.levels[0]
    return level.name, level.capacity_gib, level.capacity_ratio, t.write_policy, t.load


@pytest.mark.parametrize("args,expected", [
    ("--kv-offloading-size 64", ("cpu", 64.0, None, "write_through", "layerwise")),
    ("--kv-offloading-size 64 --tensor-parallel-size 2", ("cpu", 32.0, None, "write_through", "layerwise")),
    ("--kv-offloading-size 64 --kv-offloading-backend lmcache", ("cpu", 64.0, None, "write_through", "blocking")),
    ("""--kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": 68719476736}}'""",
     ("cpu", 64.0, None, "write_through", "layerwise")),
    ("""--kv-transfer-config '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.max_local_cpu_size": 5}}'""",
     ("cpu", 5.0, None, "write_through", "blocking")),
])
def test_vllm_offloading_flags(args, expected):
    assert shape(tiers("vllm", args)) == expected


@pytest.mark.parametrize("args,expected", [
    ("--enable-hierarchical-cache", ("cpu", None, 2.0, "write_through", "layerwise")),
    ("--enable-hierarchical-cache --hicache-ratio 4 --hicache-write-policy write_back",
     ("cpu", None, 4.0, "write_back", "layerwise")),
    ("--enable-hierarchical-cache --hicache-size 100", ("cpu", 100e9 / 2**30, None, "write_through", "layerwise")),
    ("--enable-hierarchical-cache --hicache-write-policy write_through_selective",
     ("cpu", None, 2.0, "write_through_selective", "layerwise")),
])
def test_sglang_hicache_flags(args, expected):
    assert shape(tiers("sglang", args)) == expected


def test_no_flag_no_tiers():
    assert tiers("vllm", "") is None and tiers("sglang", "--hicache-ratio 3") is None


@pytest.mark.parametrize("engine,args,needle", [
    ("vllm", "--kv-offloading-backend native", "--kv-offloading-size"),
    ("vllm", "--kv-offloading-size 8 --no-enable-prefix-caching", "--no-enable-prefix-caching"),
    ("vllm", """--kv-transfer-config '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'""", "kv_connector"),
    ("vllm", """--kv-transfer-config '{"kv_connector": "OffloadingConnector",
      "kv_connector_extra_config": {"num_cpu_blocks": 1000}}'""", "cpu_bytes_to_use"),
    ("sglang", "--enable-hierarchical-cache --hicache-storage-backend mooncake", "--hicache-storage-backend"),
])
def test_unmodelled_offloading_flags_are_named(engine, args, needle):
    with pytest.raises(ConfigError) as err:
        tiers(engine, args)
    assert needle in str(err.value)
