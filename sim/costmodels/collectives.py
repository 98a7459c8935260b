"""NCCL-like all-reduce time inside one node, by topology.

NCCL picks, per message, the algorithm its cost model predicts fastest; two are modelled here,
each as a launch floor plus per-hop latency plus bytes over the bus bandwidth B of the slowest
link the algorithm crosses:

    ring: base + 2 (n - 1) * hop + 2 (n - 1) / n * S / B     (reduce-scatter + all-gather)
    tree: base + 2 ceil(log2 n) * hop + 2 * S / B            (double binary tree: up, then down)

Tree wins only on small messages among many GPUs; ring carries the bandwidth. Topologies:
  nvswitch          every GPU reaches every other at full NVLink bandwidth (DGX/HGX A100, H100,
                    H200 SXM boards)
  nvlink_pairwise   GPUs paired by NVLink bridges; a 2-GPU group stays on its bridge, a larger
                    ring crosses PCIe (Azure NC A100 v4 / NC H100 v5 style nodes)
  pcie              every hop over PCIe
  xgmi_mesh         AMD Infinity Fabric: one direct link from each GPU to each of the other 7; a group
                    of n GPUs can use n - 1 of each GPU's 7 links, so the bus bandwidth is (n - 1) / 7
                    of the GPU's aggregate link bandwidth (a model, not fitted on any measurement)
GPUs without a fitted table (GPUSpec.family '', e.g. B200, L40S, MI300X) take H100's fitted launch
and hop times and the fraction of datasheet bandwidth H100 reached on the same kind of link (NVSwitch
0.79, NVLink bridge 0.66, PCIe 0.75; xGMI: the NVSwitch fraction); their error is not known.

NVLS (in-switch reduction on H100 NVSwitch) is not modelled apart: the H100 DGX table is fitted
by the ring with one bus bandwidth within 2-10 % at >= 16 MiB for 2, 4 and 8 GPUs.

Across nodes (a TP group larger than `gpus_per_node`; multinode_allreduce_seconds): N nodes of G GPUs
each (n = N G), every GPU with its own NIC of line rate R (GPUSpec.inter_node_bandwidth), as on DGX
A100/H100/H200/B200 and Azure ND/NDv5 nodes. NCCL runs a ring through all n ranks, each channel
entering and leaving a node through a different NIC, so the bytes that cross the network are spread
over the node's G NICs and the ring's bus bandwidth is the slower of the NVLink bus bandwidth B and
the node's network bandwidth G R e; and a tree (a chain inside each node, a double binary tree
between nodes):

    ring: base + 2 (n - N) * hop + 2 N * net_ring_hop + 2 (n - 1) / n * S / min(B, G R e)
    tree: base + 2 ((G - 1) * hop + ceil(log2 N) * net_tree_hop) + 2 S / min(B, G R e)

The tree's bytes are NCCL's own model of them (tuning.cc: a tree's algorithm bandwidth is half its
bus bandwidth, like a long ring), so across nodes it wins only on latency. On 2 nodes a real NCCL
tree can beat the network bound somewhat (NVIDIA/nccl#837: 54-57 GB/s bus bandwidth over 2 x 200
Gb/s NICs per node); that is not modelled. Latencies follow NCCL's own tuning model
(NVIDIA/nccl src/graph/tuning.cc at b6475625: a ring all-reduce takes 2 (nRanks - 1) steps of which
nInterSteps = 2 nNodes cross the network; a tree 2 ((nRanks/nNodes - 1) intra + log2(nNodes) inter)),
with its network step latencies for the LL128 protocol, hwLat[NET]: ring 4.0 us, tree 8.5 us (LL:
2.7 and 5.0, Simple: 14 and 28): NCCL's model constants, not fitted here on any measurement. e = 0.94
is the fraction of a NIC's line rate NCCL moves: NVIDIA's nccl-tests maintainers give 46-48 GB/s per
400 Gb/s NDR NIC (NVIDIA/nccl-tests#290) and ~24 GB/s per 200 Gb/s HDR NIC "on perfect setups"
(NVIDIA/nccl-tests#160: with rings "the busbw is going to reflect exactly what's going through the
NICs"). A GPU whose node has fewer NICs than GPUs takes its share as inter_node_bandwidth (4 x 200
Gb/s for 8 GPUs: 12.5 GB/s). Not modelled: NVLS / NVLS-tree and IB SHARP in-network reduction, PXN,
rail topologies and congestion; the base and hop stay the intra-node fits. Checked against public
nccl-tests numbers in docs/validation/collectives.md: within -15 % .. +3 % at large messages.

MoE expert all-to-all (alltoall_seconds): each GPU sends S bytes spread evenly over the n GPUs'
experts; (G - 1) / n of them stay on its node (NVLink), (n - G) / n leave through its NIC, and the
slower of the two sets the time: base + (net_ring_hop if N > 1 else hop) + max(S (G - 1) / n / B,
S (n - G) / n / (R e)).

Invariant: `allreduce_seconds` is a pure function of Python scalars; it is increasing in the
message size and never below `base`. A group within one node takes exactly `allreduce_seconds`.

Calibration (`python validation/fit_gemm_collectives.py`, log-ratio least squares over every
row): Vidur's measured all-reduce medians, shared/data/vidur/data/profiling/network/
{a100_dgx, h100_dgx, a100_pairwise_nvlink, h100_pairwise_nvlink}/all_reduce.csv (microsoft/vidur
7d47513, MIT; 2 KiB..64 MiB, to 512 MiB on a100_pairwise_nvlink), single-node rows. pcie takes the
pairwise nodes' PCIe bandwidth and latencies. Absolute relative error, median / p90, by GPUs and
message size (the < 1 MiB rows are a noisy floor: at the same size Vidur's medians jump between
~10 and ~60 us, so no smooth curve does better than ~25 % there):

    node                   n   < 1 MiB        1-16 MiB       >= 16 MiB
    a100_dgx               2   28 % / 44 %    2.9 % / 9.7 %  1.8 % / 3.9 %
                           4   30 % / 109 %   6.4 % / 15 %   8.1 % / 11 %
                           8   26 % / 52 %    5.9 % / 13 %   8.8 % / 14 %
    h100_dgx               2   29 % / 164 %   9.8 % / 21 %   10 % / 12 %
                           4   25 % / 29 %    7.9 % / 13 %   1.4 % / 6.7 %
                           8   9.5 % / 39 %   4.4 % / 8.9 %  2.1 % / 4.2 %
    a100_pairwise_nvlink   2   26 % / 42 %    13 % / 18 %    1.6 % / 2.7 %
                           4   3.2 % / 6.4 %  1.7 % / 3.0 %  0.4 % / 1.5 %
    h100_pairwise_nvlink   2   34 % / 120 %   1.9 % / 4.1 %  0.7 % / 1.8 %
                           4   17 % / 33 %    1.4 % / 8.7 %  2.9 % / 3.4 %

Over all rows of a node: a100_dgx 6.4 % / 20 %, h100_dgx 6.6 % / 20 %, a100_pairwise 1.3 % / 7.9 %,
h100_pairwise 2.1 % / 16 %. For scale, the flat model this replaces (10 us + ring at the datasheet
NVLink bandwidth) is 2-6x too fast at every size on these tables.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

Topology = Literal["nvswitch", "nvlink_pairwise", "pcie", "xgmi_mesh"]
TOPOLOGIES = ("nvswitch", "nvlink_pairwise", "pcie", "xgmi_mesh")
MESH_PEERS = 7  # an 8-GPU Infinity Fabric platform: each GPU links to 7 others
Algorithm = Literal["auto", "ring", "tree"]


@dataclass(frozen=True)
class LinkModel:
    """Fitted constants of one GPU family on one topology."""

    base: float  # s, launch floor of one collective
    hop: float  # s, per ring/tree step
    bandwidth: float  # bytes/s, bus bandwidth of the GPUs' direct links (NVSwitch port or NVLink bridge)
    pcie_bandwidth: float  # bytes/s, bus bandwidth when a ring has to cross PCIe


# Fitted on the Vidur tables named in the module docstring. Datasheet peaks for scale: NVLink 300
# (A100) / 450 (H100) GB/s per direction, so the DGX fits reach 0.54 and 0.79 of it; NVLink bridges
# 300 GB/s per direction (0.66); PCIe Gen4 / Gen5 x16 32 / 64 GB/s (0.74, 0.75).
CALIBRATION = MappingProxyType({
    ("a100", "nvswitch"): LinkModel(36.3e-6, 1.28e-6, 163.3e9, 23.6e9),
    ("h100", "nvswitch"): LinkModel(27.4e-6, 0.44e-6, 356.4e9, 47.8e9),
    ("a100", "nvlink_pairwise"): LinkModel(33.9e-6, 4.39e-6, 198.8e9, 23.6e9),
    ("h100", "nvlink_pairwise"): LinkModel(7.3e-6, 4.77e-6, 197.9e9, 47.8e9),
})


# Datasheet bandwidth (one direction) the fitted H100 bandwidths correspond to, for scaling to unfitted GPUs:
# NVLink 4 450 GB/s per GPU, NVLink bridge 300 GB/s, PCIe Gen5 x16 64 GB/s.
H100_DATASHEET = MappingProxyType({"nvswitch": 450e9, "nvlink_pairwise": 300e9, "pcie": 64e9})


def link_model(gpu, topology: str) -> LinkModel:
    """Constants for a GPU (a name, or a GPUSpec) on a topology. A100 and H100 parts (H200: H100's,
    same NVLink 4 and NVSwitch) use the fits; a GPUSpec of no fitted family scales H100's fits to its
    own datasheet link and PCIe bandwidths (see the module docstring)."""
    if topology not in TOPOLOGIES:
        raise ValueError(f"unknown topology {topology!r}; known: {', '.join(TOPOLOGIES)}")
    name = gpu if isinstance(gpu, str) else gpu.name
    fam = getattr(gpu, "family", None) if not isinstance(gpu, str) else None
    if fam == "" or (topology == "xgmi_mesh"):
        return _scaled(gpu, topology)
    fam = fam or ("a100" if name.startswith("a100") else "h100")
    if topology == "pcie":
        pair = CALIBRATION[(fam, "nvlink_pairwise")]
        return LinkModel(pair.base, pair.hop, pair.pcie_bandwidth, pair.pcie_bandwidth)
    return CALIBRATION[(fam, topology)]


def _scaled(gpu, topology: str) -> LinkModel:
    """H100's fitted constants carried to an unfitted GPU by the ratio of datasheet bandwidths."""
    if isinstance(gpu, str):
        raise ValueError(f"no fitted all-reduce constants for {gpu!r} on {topology}; pass its GPUSpec")
    fitted = "nvswitch" if topology == "xgmi_mesh" else topology
    source = CALIBRATION[("h100", "nvlink_pairwise" if fitted == "pcie" else fitted)]
    pcie_fraction = CALIBRATION[("h100", "nvlink_pairwise")].pcie_bandwidth / H100_DATASHEET["pcie"]
    pcie = (gpu.pcie_bandwidth or gpu.link_bandwidth) * pcie_fraction
    if fitted == "pcie":
        return LinkModel(source.base, source.hop, pcie, pcie)
    link = gpu.link_bandwidth * source.bandwidth / H100_DATASHEET[fitted]
    return LinkModel(source.base, source.hop, link, pcie)


def allreduce_seconds(size: float, n: int, link: LinkModel, topology: str,
                      algorithm: Algorithm = "auto") -> float:
    """Time of one all-reduce of `size` bytes among `n` GPUs; 0 for one GPU."""
    if n <= 1:
        return 0.0
    direct = topology == "nvswitch" or (topology == "nvlink_pairwise" and n == 2)
    bw = link.bandwidth if direct else link.pcie_bandwidth
    if topology == "xgmi_mesh":
        bw = link.bandwidth * (n - 1) / MESH_PEERS
    ring = link.base + 2 * (n - 1) * link.hop + 2.0 * (n - 1) / n * size / bw
    tree = link.base + 2 * math.ceil(math.log2(n)) * link.hop + 2.0 * size / bw
    if algorithm == "ring":
        return ring
    if algorithm == "tree":
        return tree
    return ring if ring <= tree else tree



NET_RING_HOP = 4.0e-6  # s, NCCL tuning.cc hwLat[NET][RING][LL128] (see the module docstring)
NET_TREE_HOP = 8.5e-6  # s, NCCL tuning.cc hwLat[NET][TREE][LL128]
NET_EFFICIENCY = 0.94  # of a NIC's line rate: 46-48 GB/s per 400 Gb/s NDR NIC (NVIDIA/nccl-tests#290)


def _intra_bandwidth(n: int, link: LinkModel, topology: str) -> float:
    """Bus bandwidth of a ring among `n` GPUs of one node (allreduce_seconds' rule)."""
    if topology == "xgmi_mesh":
        return link.bandwidth * (n - 1) / MESH_PEERS
    direct = topology == "nvswitch" or (topology == "nvlink_pairwise" and n == 2)
    return link.bandwidth if direct else link.pcie_bandwidth


def multinode_allreduce_seconds(size: float, n: int, per_node: int, link: LinkModel, topology: str,
                                net_bandwidth: float, algorithm: Algorithm = "auto") -> float:
    """All-reduce of `size` bytes among `n` GPUs placed `per_node` to a node, each GPU with a NIC of
    `net_bandwidth` bytes/s one way; a group within one node is `allreduce_seconds` exactly."""
    if n <= per_node:
        return allreduce_seconds(size, n, link, topology, algorithm)
    nodes = n // per_node
    net = per_node * net_bandwidth * NET_EFFICIENCY
    bw = min(_intra_bandwidth(per_node, link, topology), net) if per_node > 1 else net
    ring = (link.base + 2 * (n - nodes) * link.hop + 2 * nodes * NET_RING_HOP
            + 2.0 * (n - 1) / n * size / bw)
    tree = (link.base + 2 * ((per_node - 1) * link.hop + math.ceil(math.log2(nodes)) * NET_TREE_HOP)
            + 2.0 * size / bw)
    if algorithm == "ring":
        return ring
    if algorithm == "tree":
        return tree
    return ring if ring <= tree else tree


def alltoall_seconds(size: float, n: int, per_node: int, link: LinkModel, topology: str,
                     net_bandwidth: float) -> float:
    """One all-to-all (MoE dispatch or combine) in which each of `n` GPUs sends `size` bytes spread
    evenly over all n GPUs; the share that leaves the node goes through the GPU's own NIC."""
    if n <= 1 or size <= 0:
        return 0.0
    local = min(per_node, n)
    on_node = size * (local - 1) / n
    off_node = size * (n - local) / n
    intra = on_node / _intra_bandwidth(local, link, topology) if local > 1 else 0.0
    inter = off_node / (net_bandwidth * NET_EFFICIENCY) if off_node > 0 else 0.0
    return link.base + (NET_RING_HOP if n > local else link.hop) + max(intra, inter)
