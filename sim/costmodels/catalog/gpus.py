"""The GPU catalog beyond the a100/h100/h200 presets (specs.py), every number from a vendor document.

Invariant: each entry's numbers are the vendor's (datasheet or platform guide, named in SOURCES),
converted the same way as the presets: sparse tensor-core figures halved to dense, bidirectional
link figures halved to one direction, and the datasheet's memory in GB taken as GiB (HBM and GDDR
come in binary sizes; the 2 GiB activation reserve of kv_cache_blocks absorbs the difference from
what the driver reports). A number the vendor does not publish is left out (0) and said so.

Cost-model constants are fitted only on A100 and H100 tables (gemm_efficiency.py, collectives.py):
`family` names which set a GPU borrows. The A100 parts share the A100's die and its constants; the
H100 PCIe/NVL parts the H100's. B200, L40S, L4, A10, MI300X and MI325X have no published table here
(family ''): the roofline uses H100's fitted fractions of peak on their own peaks and bandwidths, an
extrapolation whose error is unknown.

The A10G (AWS G5) is not in the catalog: NVIDIA publishes no datasheet for it. AWS and third-party
write-ups give its memory (24 GB GDDR6, 600 GB/s, as the A10) but no tensor-core peak from the
vendor; give it as a mapping (`gpu: {name: a10g, ...}`) with numbers you have measured or trust.
"""
from __future__ import annotations

from types import MappingProxyType

from cbsim.sim.costmodels.catalog.specs import GiB, GPUSpec

GB = 1e9
T = 1e12


def _gpu(name, memory_gib, bf16_tflops, fp8_tflops, hbm_gb_s, link_gb_s, topology, pcie_gb_s, inter_node_gb_s,
         family="") -> GPUSpec:
    """One entry in the datasheet's units (GiB, dense TFLOP/s, GB/s one direction)."""
    return GPUSpec(name, memory_gib * GiB, bf16_tflops * T, hbm_gb_s * GB, link_gb_s * GB, 10e-6, topology,
                   fp8_tflops * T, pcie_gb_s * GB, inter_node_gb_s * GB, family)


GPU_CATALOG = MappingProxyType({
    # name: memory GiB, bf16 and fp8 dense TFLOP/s, memory GB/s, link GB/s one way, topology, PCIe GB/s one
    # way, network GB/s per GPU one way, fitted family
    "a100-40gb-sxm": _gpu("a100-40gb-sxm", 40, 312, 0, 1555, 300, "nvswitch", 32, 25, "a100"),
    "a100-40gb-pcie": _gpu("a100-40gb-pcie", 40, 312, 0, 1555, 32, "pcie", 32, 0, "a100"),
    "a100-80gb-pcie": _gpu("a100-80gb-pcie", 80, 312, 0, 1935, 32, "pcie", 32, 0, "a100"),
    "h100-pcie": _gpu("h100-pcie", 80, 756, 1513, 2000, 64, "pcie", 64, 0, "h100"),
    "h100-nvl": _gpu("h100-nvl", 94, 835.5, 1670.5, 3900, 300, "nvlink_pairwise", 64, 0, "h100"),
    "b200": _gpu("b200", 180, 2250, 4500, 8000, 900, "nvswitch", 64, 50),
    "l40s": _gpu("l40s", 48, 362.05, 733, 864, 32, "pcie", 32, 0),
    "l4": _gpu("l4", 24, 121, 242.5, 300, 32, "pcie", 32, 0),
    "a10": _gpu("a10", 24, 125, 0, 600, 32, "pcie", 32, 0),
    "mi300x": _gpu("mi300x", 192, 1307.4, 2614.9, 5300, 448, "xgmi_mesh", 64, 50),
    "mi325x": _gpu("mi325x", 256, 1307.4, 2614.9, 6000, 448, "xgmi_mesh", 64, 50),
})

# Where each number comes from (the presets' sources are in specs.py, above GPU_PRESETS).
SOURCES = MappingProxyType({
    "a100": "NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB); DGX A100 user guide (8x 200 Gb/s HDR per node)",
    "h100": "NVIDIA H100 Tensor Core GPU datasheet (SXM5); DGX H100 user guide (8x 400 Gb/s NDR per node)",
    "h200": "NVIDIA H200 Tensor Core GPU product brief (SXM); DGX H200 user guide (8x 400 Gb/s NDR per node)",
    "a100-40gb-sxm": "NVIDIA A100 datasheet: BF16 312 TFLOPS (624 sparse), 1,555 GB/s, NVLink 600 GB/s, PCIe Gen4 "
                     "64 GB/s; no FP8; DGX A100 (40GB) user guide: 200 Gb/s HDR per GPU",
    "a100-40gb-pcie": "NVIDIA A100 datasheet, PCIe 40GB: BF16 312 TFLOPS, 1,555 GB/s, PCIe Gen4 64 GB/s (an optional "
                      "2-GPU NVLink bridge, 600 GB/s: set topology nvlink_pairwise); no standard network",
    "a100-80gb-pcie": "NVIDIA A100 datasheet, PCIe 80GB: BF16 312 TFLOPS, 1,935 GB/s, PCIe Gen4 64 GB/s (optional "
                      "NVLink bridge as above); no standard network",
    "h100-pcie": "NVIDIA H100 PCIe datasheet (2022): BF16 1,513 / FP8 3,026 TFLOPS with sparsity, 80GB HBM2e at "
                 "2 TB/s, PCIe Gen5 128 GB/s (optional NVLink bridge 600 GB/s: set topology nvlink_pairwise)",
    "h100-nvl": "NVIDIA H100 NVL datasheet (per GPU): BF16 1,671 / FP8 3,341 TFLOPS with sparsity, 94GB HBM3 at "
                "3.9 TB/s, NVLink bridge 600 GB/s between the two GPUs of a pair, PCIe Gen5 128 GB/s",
    "b200": "NVIDIA HGX B200 datasheet (8 GPUs: FP16/BF16 36 and FP8 72 PFLOPS with sparsity, 1.44 TB HBM3e at "
            "64 TB/s) per GPU; NVLink 5 1.8 TB/s per GPU; DGX B200 datasheet: 8x 400 Gb/s ConnectX-7 per node",
    "l40s": "NVIDIA L40S datasheet: BF16 362.05 / FP8 733 TFLOPS dense (733 / 1,466 with sparsity), 48GB GDDR6 "
            "at 864 GB/s, PCIe Gen4 x16 64 GB/s, no NVLink",
    "l4": "NVIDIA L4 datasheet: BF16 242 / FP8 485 TFLOPS with sparsity, 24GB GDDR6 at 300 GB/s, PCIe Gen4 x16 "
          "64 GB/s, no NVLink",
    "a10": "NVIDIA A10 datasheet: BF16 125 TFLOPS (250 sparse), 24GB GDDR6 at 600 GB/s, PCIe Gen4 64 GB/s; no FP8",
    "mi300x": "AMD Instinct MI300X data sheet: FP16/BF16 1,307.4 and FP8 2,614.9 TFLOPS dense, 192GB HBM3 at "
              "5.3 TB/s, 7 Infinity Fabric links of 128 GB/s (64 each way) to the other 7 GPUs of an 8-GPU "
              "platform, PCIe Gen5 x16 128 GB/s; network: Azure ND MI300X v5, one 400 Gb/s InfiniBand link per GPU",
    "mi325x": "AMD Instinct MI325X data sheet: FP16/BF16 1,307.4 and FP8 2,614.9 TFLOPS dense, 256GB HBM3E at "
              "6 TB/s, Infinity Fabric as MI300X, PCIe Gen5 x16 128 GB/s; network as MI300X",
})

# GPUs of one node sharing its intra-node link (NVSwitch, xGMI), i.e. the largest TP group the node
# models of collectives.py cover; a larger group spans nodes over inter_node_bandwidth. Each from the
# platform document named: DGX A100 (A100 SXM4 40/80GB), DGX H100 and DGX H200 user guides: 8 GPUs
# on NVSwitch; NVIDIA HGX B200 datasheet: 8 GPUs; AMD Instinct MI300X / MI325X platform (data
# sheets; Azure ND MI300X v5): 8 OAM GPUs on Infinity Fabric. PCIe cards and bridged H100 NVL pairs
# have no standard node: they take DEFAULT_GPUS_PER_NODE, which is no hardware fact but the group
# size the single-node models already accepted (tp <= 8), so their existing configs stay as they are.
GPUS_PER_NODE = MappingProxyType({
    "a100": 8, "h100": 8, "h200": 8, "a100-40gb-sxm": 8, "b200": 8, "mi300x": 8, "mi325x": 8,
})
DEFAULT_GPUS_PER_NODE = 8


def gpus_per_node(gpu) -> int:
    """The catalog's GPUs per node for a GPU (a GPUSpec or a name), else DEFAULT_GPUS_PER_NODE."""
    name = gpu if isinstance(gpu, str) else gpu.name
    return GPUS_PER_NODE.get(name.strip().lower(), DEFAULT_GPUS_PER_NODE)
