"""Pipeline parallelism: how a replica's layers split into stages, and what a stage pays to hand its
activations to the next one. The roofline, vidur and fitted cost models all price `pp` with it: each
adds its own per-layer time on a stage's layers, and step_time is the slowest stage.

Invariant: a replica of `pp` stages, each a TP group of `tp` GPUs, holds every layer exactly once
(`stage_layers` sums to num_layers, every stage >= 1 layer). The first stage also holds the
embedding, the last the final norm and the LM head (vLLM's PPMissingLayer placeholders elsewhere).

Layer split: vLLM's default partition (vllm/distributed/utils.py `get_pp_indices`; the cases of
tests/distributed/test_pipeline_partition.py, e.g. 5 layers on 3 stages -> 2, 2, 1 and 4 on 3 ->
1, 2, 1): L // pp layers per stage, the remainder one each to the stages before the last, counted
back from the second-to-last, so the first and last stages (embedding, LM head) get the fewer.

Hand-off: the stage sends the residual stream to the next, `hidden_states` and `residual` (two
tensors of tokens x hidden at the activation width: vLLM's IntermediateTensors for Llama-family and
DeepSeek models). With TP, vLLM's send-allgather (vllm/distributed/parallel_state.py,
GroupCoordinator.send_tensor_dict / recv_tensor_dict: "send only a slice, then do allgather") has
each of the tp GPUs send 1/tp of the bytes to its peer in the next stage, which all-gathers them:

    send    = p2p_base + bytes / tp / B_p2p                          (sender; B_p2p by placement)
    gather  = base + (tp - 1) hop + (tp - 1) / tp * bytes / B_ring   (receiver, tp > 1; a ring all-gather)

A stage boundary inside a node runs over NVLink (NVSwitch, or an NVLink bridge when the stage is one
GPU of a bridged pair), PCIe, or one xGMI link; a boundary between nodes over the sending GPU's own
NIC: p2p_base + NET_RING_HOP + bytes / tp / (R e). Stage s holds GPUs [s tp, (s + 1) tp); a boundary
crosses nodes when (s + 1) tp is a multiple of gpus_per_node (every boundary once tp >= gpus_per_node).

Calibration of the intra-node p2p (`python validation/fit_send_recv.py`): Vidur's send_recv medians
between 2 GPUs of one node (shared/data/vidur/data/profiling/network/{a100_dgx,h100_dgx}/send_recv.csv,
devices_per_node 2; microsoft/vidur 7d47513, MIT; 2 KiB..64 MiB, 994 rows each), t = base + S / B by
relative least squares: A100 DGX 13.2 us, 285.8 GB/s (|error| median 9.5 %, p90 16.2 %); H100 DGX
7.6 us, 357.5 GB/s (1.7 %, 8.0 %). Other GPUs take H100's base and the same fraction of their own
link (357.5 / 450 = 0.79 of NVLink 4's one-way 450 GB/s); PCIe and xGMI boundaries the fitted PCIe
bus bandwidth of collectives.py, and one xGMI link at that fraction. Across nodes the same tables
have rows with one GPU per node (devices_per_node 1): H100 1.9 ms for 64 MiB (35.9 GB/s), A100 7.8
GB/s; Vidur does not name its network, so the model keeps the catalog NIC (DGX H100: 400 Gb/s, 47
GB/s at e = 0.94) and is 24 % faster than that one table at 64 MiB (docs/validation/pp.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from cbsim.core.errors import ConfigError

from cbsim.sim.costmodels.catalog.gpus import gpus_per_node
from cbsim.sim.costmodels.catalog.lookup import gpu_spec
from cbsim.sim.costmodels.collectives import NET_EFFICIENCY, NET_RING_HOP, LinkModel, _intra_bandwidth, link_model

# Intra-node p2p fits (see the module docstring): family -> (base s, bandwidth bytes/s).
P2P_FIT = MappingProxyType({"a100": (13.2e-6, 285.8e9), "h100": (7.6e-6, 357.5e9)})
H100_NVLINK_ONE_WAY = 450e9  # the datasheet figure the H100 fit reaches 0.79 of
ACTIVATION_TENSORS = 2  # hidden_states and residual (vLLM IntermediateTensors)


def stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers of each stage under vLLM's default partition (see the module docstring)."""
    per, extra = divmod(num_layers, pp)
    layers = [per] * pp
    for i in range(2, extra + 2):
        layers[-i] += 1
    return tuple(layers)


def check_pipeline(num_layers: int, pp, path: str = "cost_model.pp") -> None:
    """ConfigError unless `pp` is an integer between 1 and the model's layer count."""
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ConfigError(path, "an integer >= 1 (pipeline stages)", pp)
    if pp > num_layers:
        raise ConfigError(path, f"at most the model's {num_layers} layers (every stage holds at least one)", pp)


def p2p_model(gpu, topology: str, tp: int) -> tuple[float, float]:
    """(base seconds, bytes/s) of one intra-node send between GPUs of adjacent stages."""
    base, fitted = P2P_FIT.get(getattr(gpu, "family", "") or "", P2P_FIT["h100"])
    fraction = P2P_FIT["h100"][1] / H100_NVLINK_ONE_WAY
    if topology == "nvswitch" or (topology == "nvlink_pairwise" and tp == 1):
        family = getattr(gpu, "family", "")
        bandwidth = fitted if family and topology == "nvswitch" else gpu.link_bandwidth * fraction
        return base, bandwidth
    if topology == "xgmi_mesh":
        return base, gpu.link_bandwidth / 7 * fraction
    return base, None  # PCIe: the caller uses the fitted PCIe bus bandwidth


def slowest(times):
    """The longest of the stages' seconds: floats, or numpy arrays elementwise (the same results on
    both, so a decode run priced as arrays equals its steps priced one by one)."""
    out = None
    for t in times:
        if out is None:
            out = t
        elif isinstance(t, np.ndarray) or isinstance(out, np.ndarray):
            out = np.maximum(out, t)
        else:
            out = t if t > out else out
    return out


@dataclass(frozen=True)
class Pipeline:
    """The stages of one replica and the seconds each pays to pass a step's activations on."""

    layers: tuple[int, ...]  # per stage
    crosses: tuple[bool, ...]  # per boundary (stage s -> s + 1): over the network
    tp: int
    bytes_per_token: float  # hidden x activation bytes x ACTIVATION_TENSORS
    p2p_base: float
    p2p_bandwidth: float
    net_bandwidth: float  # the NIC's line rate, bytes/s one way
    link: LinkModel
    topology: str
    per_node: int

    @classmethod
    def build(cls, num_layers: int, pp: int, tp: int, hidden: int, act_bytes: float, gpu, topology: str,
              link: LinkModel, per_node: int) -> "Pipeline":
        layers = stage_layers(num_layers, pp)
        crosses = tuple(((s + 1) * tp) % per_node == 0 or tp > per_node for s in range(pp - 1))
        if any(crosses) and gpu.inter_node_bandwidth <= 0:
            raise ConfigError("cost_model.pp", f"stages within one node ({pp} x tp {tp} GPUs exceed the node's "
                              f"{per_node}) unless the GPU has an inter_node_bandwidth ({gpu.name} has none)", pp)
        base, bandwidth = p2p_model(gpu, topology, tp)
        return cls(layers, crosses, tp, float(ACTIVATION_TENSORS * hidden * act_bytes), base,
                   bandwidth if bandwidth is not None else link.pcie_bandwidth, gpu.inter_node_bandwidth, link,
                   topology, per_node)

    @property
    def stages(self) -> int:
        return len(self.layers)

    def send_seconds(self, tokens: float, stage: int) -> float:
        """What stage `stage` pays to send a step of `tokens` tokens to the next (0 for the last)."""
        if stage >= self.stages - 1 or tokens <= 0:
            return 0.0
        size = self.bytes_per_token * tokens / self.tp
        if self.crosses[stage]:
            return self.p2p_base + NET_RING_HOP + size / (self.net_bandwidth * NET_EFFICIENCY)
        return self.p2p_base + size / self.p2p_bandwidth

    def gather_seconds(self, tokens: float, stage: int) -> float:
        """What stage `stage` pays to all-gather the slices it received (0 for the first, or tp 1)."""
        if stage == 0 or self.tp == 1 or tokens <= 0:
            return 0.0
        n, link = self.tp, self.link
        local = min(n, self.per_node)
        bandwidth = _intra_bandwidth(local, link, self.topology) if local > 1 else math.inf
        if n > self.per_node:
            bandwidth = min(bandwidth, self.per_node * self.net_bandwidth * NET_EFFICIENCY)
        size = self.bytes_per_token * tokens
        return link.base + (n - 1) * link.hop + (n - 1) / n * size / bandwidth

    def handoff_seconds(self, tokens: float, stage: int) -> float:
        return self.send_seconds(tokens, stage) + self.gather_seconds(tokens, stage)

    def collective_seconds(self, per_layer: float, tokens: float) -> float:
        """The communication of the stage that communicates longest: `per_layer` (an all-reduce) on
        each of its layers plus its activation hand-off."""
        return max(n * per_layer + self.handoff_seconds(tokens, s) for s, n in enumerate(self.layers))


def profile_pipeline(num_layers: int, pp: int, tp: int, hidden, gpu_name: str, path: str) -> Pipeline:
    """The stages of a measured profile's model (vidur, fitted) on its GPU (the catalog's topology and
    node), with 16-bit activations (the profiles are 16-bit); `hidden` must be known (ConfigError at `path`)."""
    check_pipeline(num_layers, pp)
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ConfigError(path, "1 for a profile whose model's hidden size is unknown (the hand-off sends "
                          "hidden x tokens)", pp)
    gpu = gpu_spec(gpu_name, path)
    return Pipeline.build(num_layers, pp, tp, hidden, 2.0, gpu, gpu.topology, link_model(gpu, gpu.topology),
                          gpus_per_node(gpu))
