"""Multi-node placements (issue 11): a TP group larger than `gpus_per_node` prices its all-reduces
across nodes (collectives.multinode_allreduce_seconds), equal to the hand formula; every group within
one node keeps its step times bit for bit; the MoE all-to-all grows with the share of traffic that
leaves the node; bad placements are ConfigErrors naming the key; and the vidur and fitted cost
models report the all-reduce seconds their step_time adds (collective_time, for the steps table)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from cbsim.core.errors import ConfigError
from cbsim.sim.costmodels import load_cost_model
from cbsim.sim.costmodels.collectives import (
    NET_EFFICIENCY, NET_RING_HOP, NET_TREE_HOP, allreduce_seconds, alltoall_seconds, link_model,
    multinode_allreduce_seconds)
from cbsim.sim.costmodels.catalog.gpus import gpus_per_node
from cbsim.sim.costmodels.catalog.lookup import gpu_spec, model_spec
from cbsim.sim.shape import StepShape
from factories import pre_issue_28

H100 = gpu_spec("h100")
LINK = link_model(H100, "nvswitch")
SHAPES = [StepShape.from_batch(prefill=[(512, 0)], decode=[1000] * 8), StepShape.from_batch(decode=[37, 4000, 129]),
          StepShape.from_batch(prefill=[(2048, 100), (17, 3)])]


def test_tp16_over_two_nodes_is_the_hand_formula():
    size, n, g, nodes = 8 << 20, 16, 8, 2
    net = g * 50e9 * NET_EFFICIENCY  # DGX H100: one 400 Gb/s NDR NIC per GPU
    assert H100.inter_node_bandwidth == 50e9 and gpus_per_node(H100) == 8
    ring = LINK.base + 2 * (n - nodes) * LINK.hop + 2 * nodes * NET_RING_HOP + 2 * (n - 1) / n * size / min(
        LINK.bandwidth, net)
    tree = LINK.base + 2 * ((g - 1) * LINK.hop + 1 * NET_TREE_HOP) + 2 * size / min(LINK.bandwidth, net)
    got = {a: multinode_allreduce_seconds(size, n, g, LINK, "nvswitch", 50e9, a) for a in ("ring", "tree")}
    assert got["ring"] == pytest.approx(ring, rel=1e-12) and got["tree"] == pytest.approx(tree, rel=1e-12)
    assert multinode_allreduce_seconds(size, n, g, LINK, "nvswitch", 50e9) == min(got.values())
    # on 4 nodes the tree climbs two network levels; at small sizes it beats the ring's 8 network steps
    tree4 = LINK.base + 2 * ((g - 1) * LINK.hop + 2 * NET_TREE_HOP) + 2 * size / min(LINK.bandwidth, net)
    assert multinode_allreduce_seconds(size, 32, g, LINK, "nvswitch", 50e9, "tree") == pytest.approx(tree4, rel=1e-12)
    small = 64 * 1024
    assert multinode_allreduce_seconds(small, 32, g, LINK, "nvswitch", 50e9) == \
        multinode_allreduce_seconds(small, 32, g, LINK, "nvswitch", 50e9, "tree")
    big = 512 << 20  # ... and the ring's 2 (n - 1) / n bytes win at large ones
    assert multinode_allreduce_seconds(big, 32, g, LINK, "nvswitch", 50e9) == \
        multinode_allreduce_seconds(big, 32, g, LINK, "nvswitch", 50e9, "ring")
    # the roofline charges 2 per layer + 1 for the embedding of hidden * 2 bytes per token
    m = model_spec("llama-3.1-405b")
    cost = load_cost_model({"type": "roofline", "gpu": "h100", "tp": 16}, m)
    one = multinode_allreduce_seconds(300 * m.hidden * 2.0, 16, 8, LINK, "nvswitch", 50e9)
    assert cost.collective_time(300.0) == pytest.approx((2 * m.num_layers + 1) * one, rel=1e-12)
    assert cost.describe()["gpus_per_node"] == 8


def test_the_network_bounds_the_ring_when_the_nics_are_slower_than_nvlink():
    slow = 12.5e9  # a 100 Gb/s NIC per GPU: 8 of them carry less than the NVSwitch fit
    size = 256 << 20
    t = multinode_allreduce_seconds(size, 16, 8, LINK, "nvswitch", slow, "ring")
    bw = 8 * slow * NET_EFFICIENCY
    assert bw < LINK.bandwidth
    assert t == pytest.approx(LINK.base + 2 * 14 * LINK.hop + 4 * NET_RING_HOP + 2 * 15 / 16 * size / bw, rel=1e-12)
    # one GPU per node: every ring step crosses the network
    t1 = multinode_allreduce_seconds(size, 4, 1, LINK, "nvswitch", 50e9, "ring")
    assert t1 == pytest.approx(LINK.base + 8 * NET_RING_HOP + 1.5 * size / (50e9 * NET_EFFICIENCY), rel=1e-12)


@pytest.mark.parametrize("topology", ["nvswitch", "nvlink_pairwise", "pcie", "xgmi_mesh"])
def test_a_group_within_one_node_is_unchanged(topology):
    gpu = gpu_spec("mi300x") if topology == "xgmi_mesh" else H100
    link = link_model(gpu, topology)
    for n in (1, 2, 4, 8):
        for size in (4096, 1 << 20, 64 << 20):
            assert multinode_allreduce_seconds(size, n, 8, link, topology, 50e9) == \
                allreduce_seconds(size, n, link, topology)


# Step times (three shapes), the last of a 3-step decode run and collective_time(300) of TP <= 8
# groups, from the roofline before gpus_per_node existed (hex floats: bit for bit; MoE rows pinned to the
# routing of that time, moe_routing mean).
GOLDEN = [
    ('llama-3.1-70b', {'gpu': 'h100', 'tp': 8}, ['0x1.205fbcfa6d444p-5', '0x1.d1f771cdc4b31p-7', '0x1.ab09be1279894p-4'], '0x1.d1a41bfeff117p-7', '0x1.2ffef8b511706p-7'),
    ('llama-3.1-405b', {'gpu': 'h200', 'tp': 8}, ['0x1.17f4b9cf58016p-3', '0x1.25634d7da8f35p-5', '0x1.cd20a4de27866p-2'], '0x1.254c66dc49bd9p-5', '0x1.5331f4752f2dbp-6'),
    ('llama-2-70b', {'gpu': 'a100', 'tp': 4}, ['0x1.028f99feda92cp-3', '0x1.121bdd3530c69p-5', '0x1.b158169462290p-2'], '0x1.11d767e337ab4p-5', '0x1.d6365329e514cp-7'),
    ('qwen2.5-72b', {'gpu': 'mi300x', 'tp': 8}, ['0x1.f39415f0fb917p-6', '0x1.929b8c3069925p-7', '0x1.65e1cf3ca1c3ap-4'], '0x1.9266df9ccfac2p-7', '0x1.30a54663cd7e6p-7'),
    ('mixtral-8x7b', {'gpu': 'h100', 'tp': 8, 'expert_parallel': True, 'moe_routing': 'mean'}, ['0x1.5edf3e13184f4p-7', '0x1.eb11074d8f124p-8', '0x1.8da93b641353fp-6'], '0x1.eace5c41bdc42p-8', '0x1.756d9dbcf5b17p-9'),
    ('deepseek-v3', {'gpu': 'h200', 'tp': 8, 'expert_parallel': True, 'moe_routing': 'mean'}, ['0x1.3159d9d9290bfp-5', '0x1.b0918354deefap-7', '0x1.1144bd17cd688p-4'], '0x1.b02dbb0376f31p-7', '0x1.b4b2bcf8e99bcp-8'),
    ('qwen3-30b-a3b', {'gpu': 'b200', 'tp': 2, 'moe_routing': 'mean'}, ['0x1.5bdf075ee3746p-7', '0x1.9f0d0f77a1b50p-8', '0x1.ebdd14cf297acp-7'], '0x1.9eb94efd95f7ap-8', '0x1.7d781c0117d37p-9'),
    ('llama-3.1-8b', {'gpu': 'l40s', 'tp': 8}, ['0x1.157e052aa9fc3p-5', '0x1.a86dc8b3ffa18p-8', '0x1.ccc551b6fb092p-4'], '0x1.a76b4a646675ap-8', '0x1.01450da4c0cd2p-6'),
    ('llama-3.1-8b', {'gpu': 'h100-nvl', 'tp': 2}, ['0x1.a7a53cc73a6c0p-7', '0x1.3c69521a07368p-8', '0x1.42fe2fc50ba0cp-5'], '0x1.3b84417b4530ap-8', '0x1.f28b56d2112acp-10'),
]


@pytest.mark.parametrize("model,mapping,steps,run,collective", GOLDEN)
def test_single_node_step_times_stay_bit_identical(model, mapping, steps, run, collective):
    for placement in ({}, {"gpus_per_node": 8}):
        cost = load_cost_model(pre_issue_28({"type": "roofline", **mapping, **placement}), model_spec(model))
        assert [cost.step_time(s).hex() for s in SHAPES] == steps
        assert cost.decode_run_times(np.array([10, 500, 3000]), 3)[-1].hex() == run
        assert cost.collective_time(300.0).hex() == collective
        assert "gpus_per_node" not in cost.describe()


def test_tp16_runs_dense_and_expert_parallel_moe():
    dense8 = load_cost_model({"type": "roofline", "gpu": "h100", "tp": 8}, model_spec("llama-3.1-70b"))
    dense16 = load_cost_model({"type": "roofline", "gpu": "h100", "tp": 16}, model_spec("llama-3.1-70b"))
    assert dense16.collective_time(64.0) > dense8.collective_time(64.0)  # network latency steps
    ep = load_cost_model({"type": "roofline", "gpu": "h200", "tp": 16, "expert_parallel": True},
                         model_spec("deepseek-v3"))
    run = ep.decode_run_times(np.array([100, 2000]), 4)
    assert run[-1] == ep.step_time(StepShape.from_batch(decode=[103, 2003]))
    assert all(ep.step_time(s) > ep.collective_time(float(s.num_tokens)) > 0 for s in SHAPES)


def test_alltoall_grows_with_the_share_that_leaves_the_node():
    size, n = 64 << 20, 16
    net = 50e9 * NET_EFFICIENCY
    times = {}
    for g in (16, 8, 4, 2, 1):
        t = alltoall_seconds(size, n, g, LINK, "nvswitch", 50e9)
        off, on = size * (n - g) / n, size * (g - 1) / n
        intra = on / LINK.bandwidth if g > 1 else 0.0
        hop = NET_RING_HOP if g < n else LINK.hop
        assert t == pytest.approx(LINK.base + hop + max(intra, off / net), rel=1e-12)
        times[g] = t
    assert times[16] < times[8] < times[4] < times[2] < times[1]
    # NIC-bound, the transfer term is proportional to the off-node fraction (n - g) / n
    for g in (8, 4, 2):
        transfer = times[g] - LINK.base - NET_RING_HOP
        assert transfer == pytest.approx(size * (n - g) / n / net, rel=1e-12)
    assert alltoall_seconds(size, 1, 8, LINK, "nvswitch", 50e9) == 0.0


@pytest.mark.parametrize("mapping,fragment", [
    ({"gpu": "h100", "tp": 16, "gpus_per_node": 0}, "gpus_per_node"),
    ({"gpu": "h100", "tp": 16, "gpus_per_node": 3}, "gpus_per_node"),
    ({"gpu": "h100", "tp": 8, "gpus_per_node": 3}, "gpus_per_node"),
    ({"gpu": "h100", "tp": 16, "gpus_per_node": "eight"}, "gpus_per_node"),
    ({"gpu": "mi300x", "tp": 16, "gpus_per_node": 16}, "gpus_per_node"),
    ({"gpu": "l40s", "tp": 16}, "gpus_per_node"),  # no network bandwidth in the catalog
    ({"gpu": "h100", "tp": 12}, "tp"),
])
def test_bad_placements_name_the_key(mapping, fragment):
    with pytest.raises(ConfigError) as err:
        load_cost_model({"type": "roofline", **mapping}, model_spec("llama-3.1-70b"))
    assert fragment in err.value.path


def test_vidur_and_fitted_report_the_allreduce_their_step_time_adds():
    vidur = load_cost_model({"type": "vidur", "gpu": "a100", "tp": 2}, model_spec("llama-2-70b"))
    fitted = load_cost_model({"type": "fitted", "profile": "a100-llama-2-70b-tp2-published.json"}, "llama-2-70b")
    for cost in (vidur, fitted):
        assert cost.allreduce is not None
        for tokens in (1, 37, 512, 4096):
            want = cost.num_layers * cost.allreduce.seconds(tokens)
            assert want > 0 and cost.collective_time(float(tokens)) == want
    # ... and it is exactly what step_time adds: the same profiles without the all-reduce
    shape = SHAPES[0]
    bare = load_cost_model({"type": "vidur", "gpu": "a100", "tp": 2}, model_spec("llama-2-70b"))
    bare.allreduce = None
    assert bare.collective_time(520.0) == 0.0
    assert vidur._gpu(520, 0.0, 8) - bare._gpu(520, 0.0, 8) == pytest.approx(vidur.collective_time(520.0), rel=1e-9)
    with_ar = fitted.gpu_time(shape)
    saved, fitted.allreduce = fitted.allreduce, None
    try:
        assert with_ar - fitted.gpu_time(shape) == pytest.approx(
            load_cost_model({"type": "fitted", "profile": "a100-llama-2-70b-tp2-published.json"},
                            "llama-2-70b").collective_time(520.0), rel=1e-9)
    finally:
        fitted.allreduce = saved
    assert math.isclose(fitted.collective_time(0.0), fitted.num_layers * saved.seconds(0.0))
