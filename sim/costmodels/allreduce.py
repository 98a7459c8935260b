"""Tensor-parallel all-reduce time per layer, from a measured table or an analytic ring model.

A TP shard cannot be timed with its collectives on one GPU, so both cost models add this term:
`per_layer` all-reduces (2 in a Llama layer: attention output and MLP output) of
`tokens * bytes_per_token` bytes each (bytes_per_token = hidden size x 2 for bf16/fp16
activations, as Vidur converts sizes). A table is a Curve over message bytes (seconds), taken
from Vidur's network measurements (shared/data/vidur/data/profiling/network/, converted by
`cbsim vidur-convert` into profiles/vidur/network/*.json). The analytic form is the ring
algorithm: latency + 2 (n - 1) / n * bytes / bus_bandwidth, with the user's constants; the `nccl`
form is collectives.py's ring/tree model with constants fitted on those tables for a GPU and a
topology (nvswitch, nvlink_pairwise, pcie).
"""
from __future__ import annotations

from cbsim.sim.costmodels.collectives import allreduce_seconds, link_model
from cbsim.sim.costmodels.curves import Curve, isotonic


class AllReduce:
    """Seconds of TP communication per layer for a step of `tokens` tokens."""

    __slots__ = ("spec", "per_layer", "bytes_per_token", "_curve", "_latency", "_ring", "_nccl")

    def __init__(self, spec: dict, monotone: bool = True):
        self.spec = spec
        self.per_layer = int(spec.get("per_layer", 2))
        self.bytes_per_token = float(spec["bytes_per_token"])
        self._curve = self._nccl = None
        if spec["kind"] == "table":
            seconds = [ms * 1e-3 for ms in spec["ms"]]
            self._curve = Curve(spec["bytes"], isotonic(seconds) if monotone else seconds)
        elif spec["kind"] == "analytic":
            n = int(spec["num_workers"])
            self._latency = float(spec["latency_s"])
            self._ring = 2.0 * (n - 1) / n / float(spec["bus_bandwidth"])
        elif spec["kind"] == "nccl":
            self._nccl = (int(spec["num_workers"]), link_model(spec["gpu"], spec["topology"]), spec["topology"])
        else:
            raise ValueError(f"unknown all-reduce kind {spec['kind']!r}")

    def seconds(self, tokens: float) -> float:
        """Per-layer communication seconds (all of this layer's all-reduces)."""
        size = tokens * self.bytes_per_token
        if self._curve is not None:
            one = self._curve.at(size)
        elif self._nccl is not None:
            one = allreduce_seconds(size, *self._nccl)
        else:
            one = self._latency + self._ring * size
        return self.per_layer * one


def table_spec(network: dict, num_workers: int, hidden: int, per_layer: int = 2) -> dict:
    """An all-reduce spec for `num_workers` GPUs from a converted network file (see vidur_data)."""
    curves = network["all_reduce"]
    key = str(num_workers)
    if key not in curves:
        raise KeyError(f"{network['node']} has all-reduce measurements for {sorted(curves)} GPUs, not {num_workers}")
    return {
        "kind": "table",
        "node": network["node"],
        "source": network["source"],
        "num_workers": num_workers,
        "per_layer": per_layer,
        "bytes_per_token": 2 * hidden,
        "bytes": curves[key]["bytes"],
        "ms": curves[key]["ms"],
    }


def analytic_spec(num_workers: int, hidden: int, bus_bandwidth: float, latency_s: float, per_layer: int = 2) -> dict:
    """A ring all-reduce spec: `bus_bandwidth` bytes/s per GPU link, `latency_s` per collective."""
    return {
        "kind": "analytic",
        "num_workers": num_workers,
        "per_layer": per_layer,
        "bytes_per_token": 2 * hidden,
        "bus_bandwidth": float(bus_bandwidth),
        "latency_s": float(latency_s),
    }


def nccl_spec(num_workers: int, hidden: int, gpu: str, topology: str = "nvswitch", per_layer: int = 2) -> dict:
    """An all-reduce spec from collectives.py's model: `gpu` a100/h100/h200, `topology` as there."""
    link_model(gpu, topology)  # unknown topology: ValueError now, not at the first step
    return {
        "kind": "nccl",
        "num_workers": num_workers,
        "per_layer": per_layer,
        "bytes_per_token": 2 * hidden,
        "gpu": gpu,
        "topology": topology,
    }


def profile_collective_seconds(allreduce, pipeline, num_layers: int, tokens: float) -> float:
    """Seconds a step of `tokens` tokens spends in a measured profile's TP all-reduces (`fitted` and
    `vidur`): num_layers times the per-layer `allreduce` term (0 without one), or with pipeline stages
    the longest stage's (pipeline.collective_seconds)."""
    per_layer = allreduce.seconds(tokens) if allreduce is not None else 0.0
    if pipeline is not None:
        return pipeline.collective_seconds(per_layer, tokens)
    return num_layers * per_layer if allreduce is not None else 0.0
