"""LoRA adapters: the adapters one step may serve (vLLM `--max-loras`) and where they reside.

Per step (vLLM V1, vllm/v1/core/sched/scheduler.py `schedule()`, vllm-project/vllm 00024d31): the
adapters of the requests in the step form a set; a waiting request whose adapter is not in it is
skipped (it stays waiting, later requests may start) once the set holds `max_loras` adapters, and
otherwise joins it. Requests of the base model (no adapter) are never held back. cbsim seeds the set
with the adapters of every running request not preempted in the plan (vLLM: of the running requests
scheduled in the step; the two differ only when a running request sits a step out with budget
left, as in prefill-first steps, whose decodes the next step serves: counting them keeps every
step within the limit).

Residency (`lora_residency`, vLLM's LRUCacheWorkerLoRAManager / LRUCacheLoRAModelManager,
vllm/lora/worker_manager.py and vllm/lora/model_manager.py): `max_loras` GPU slots and
`max_cpu_loras` adapters cached in host memory, each an LRU cache. Before a step's forward the
worker makes the step's adapters active (`_apply_adapters`): one not in host memory is read from
disk (`add_adapter`, evicting the least recently used host entry beyond max_cpu_loras), one not in
a GPU slot is copied into one (`activate_adapter`, evicting the least recently used slot that the
step does not use). Both happen in the step's execute_model call, so their time adds to the step:
adapter bytes / PCIe bandwidth per copy into a slot, plus adapter bytes / disk bandwidth per read
when a disk bandwidth is given (null: host-memory misses are not charged). A request never waits for
a load: the step's set fits the slots by the rule above, so every adapter of the step can be made
resident in it; what a miss costs is time.

Adapter bytes: LoRA adds B (d_out x r) and A (r x d_in) to each target module (Hu et al., "LoRA",
ICLR 2022, §4.1), so an adapter holds r x (d_in + d_out) parameters per module and layer, at the
model's dtype (vLLM stacks A and B per slot at max_lora_rank, vllm/lora/layers). Tensor parallelism
splits them with the base weights; cbsim charges the whole adapter over one link (as TP ranks load
in parallel, each its 1/tp share over its own link: the same time).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Literal

from cbsim.core.errors import ConfigError
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.core.schema import option, require
from cbsim.sim.request import Request

TargetModule = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraResidencyConfig:
    """GPU slots and host cache of LoRA adapters, and the time a miss costs."""

    pcie_bandwidth_gb_s: float = option(help="host-to-GPU copy bandwidth (GB/s) of an adapter into a GPU slot "
                                        "(no default: e.g. ~25 effective on PCIe 4.0 x16, ~50 on PCIe 5.0)")
    rank: int | None = option(None, help="LoRA rank r (with model and target_modules: adapter bytes = r x "
                              "sum(d_in + d_out) over target modules x layers x dtype bytes)")
    model: str | dict | None = option(None, help="the base model whose dimensions the adapter follows (a name "
                                      "or mapping, as the cost model's `model`)")
    target_modules: list[TargetModule] = option(list(ALL_MODULES), help="modules the adapters adapt")
    adapter_bytes: float | None = option(None, help="bytes of one adapter, instead of rank/model/target_modules")
    max_cpu_loras: int | None = option(None, help="adapters cached in host memory (vLLM --max-cpu-loras); null "
                                       "= max_loras, vLLM's default")
    disk_bandwidth_gb_s: float | None = option(None, help="read bandwidth (GB/s) for an adapter not in host "
                                               "memory; null = such reads are not charged")

    def validate(self) -> None:
        require(math.isfinite(self.pcie_bandwidth_gb_s) and self.pcie_bandwidth_gb_s > 0, "pcie_bandwidth_gb_s",
                "GB/s > 0", self.pcie_bandwidth_gb_s)
        require(self.disk_bandwidth_gb_s is None or self.disk_bandwidth_gb_s > 0, "disk_bandwidth_gb_s",
                "GB/s > 0 or null", self.disk_bandwidth_gb_s)
        require(self.max_cpu_loras is None or self.max_cpu_loras >= 1, "max_cpu_loras", "an integer >= 1 or null",
                self.max_cpu_loras)
        given = self.adapter_bytes is not None
        require(given != (self.rank is not None), "adapter_bytes",
                "either adapter_bytes or rank (with model), not both and not neither", self.adapter_bytes)
        require(not given or self.adapter_bytes > 0, "adapter_bytes", "bytes > 0", self.adapter_bytes)
        if self.rank is not None:
            require(self.rank >= 1, "rank", "an integer >= 1", self.rank)
            require(self.model is not None, "model", "the base model (a name or mapping) when rank is given",
                    self.model)
            require(len(self.target_modules) > 0, "target_modules", "a non-empty list", self.target_modules)
            self.bytes()  # a bad model name is an error now, naming the key

    def bytes(self) -> float:
        """Bytes of one adapter."""
        if self.adapter_bytes is not None:
            return float(self.adapter_bytes)
        try:
            spec = model_spec(self.model, "model")
        except ConfigError as err:
            raise err
        return float(adapter_bytes(spec, self.rank, self.target_modules))


def module_shapes(spec) -> dict[str, tuple[int, int]]:
    """(d_in, d_out) of each adaptable module of a dense decoder layer (whole, before TP)."""
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    h, m = spec.hidden, spec.intermediate
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, m), "up_proj": (h, m), "down_proj": (m, h)}


def adapter_bytes(spec, rank: int, modules: Iterable[str]) -> int:
    """r x (d_in + d_out) per module and layer, at the model's dtype bytes (see the module docstring)."""
    shapes = module_shapes(spec)
    per_layer = sum(shapes[m][0] + shapes[m][1] for m in modules)
    return rank * per_layer * spec.num_layers * spec.dtype_bytes


class LoraResidency:
    """One replica's GPU slots and host cache of adapters, least recently used first (persists across steps)."""

    def __init__(self, config: LoraResidencyConfig, max_loras: int):
        self.config = config
        self.slots = max_loras
        self.cpu_capacity = config.max_cpu_loras or max_loras
        self.bytes = config.bytes()
        self.gpu: OrderedDict[str, None] = OrderedDict()
        self.cpu: OrderedDict[str, None] = OrderedDict()
        self.loads = 0  # copies into a GPU slot
        self.reads = 0  # reads from disk into host memory

    def activate(self, adapters: list[str]) -> tuple[int, int]:
        """Make the step's `adapters` (at most `slots`, in order of first use) resident; returns
        (copies into GPU slots, disk reads)."""
        copies = reads = 0
        for name in adapters:
            if name in self.cpu:
                self.cpu.move_to_end(name)
            else:
                reads += 1
                self.cpu[name] = None
                if len(self.cpu) > self.cpu_capacity:
                    self._evict(self.cpu, adapters)
            if name in self.gpu:
                self.gpu.move_to_end(name)
            else:
                copies += 1
                self.gpu[name] = None
                if len(self.gpu) > self.slots:
                    self._evict(self.gpu, adapters)
        self.loads += copies
        self.reads += reads
        return copies, reads

    @staticmethod
    def _evict(cache: OrderedDict, keep: list[str]) -> None:
        """Drop the least recently used entry the step does not use (there is one: the step uses at most
        `slots` <= capacity adapters)."""
        for name in cache:
            if name not in keep:
                del cache[name]
                return
        cache.popitem(last=False)  # more adapters than capacity in one step: the oldest goes anyway

    def seconds(self, copies: int, reads: int) -> float:
        cfg = self.config
        time = copies * self.bytes / (cfg.pcie_bandwidth_gb_s * 1e9)
        if cfg.disk_bandwidth_gb_s is not None:
            time += reads * self.bytes / (cfg.disk_bandwidth_gb_s * 1e9)
        return time


@dataclass
class LoraSlots:
    """The adapters a step serves, at most `max_loras` of them, in order of first use."""

    max_loras: int | None
    adapters: dict[str, None] = field(default_factory=dict)

    @classmethod
    def seeded(cls, max_loras: int | None, running: Iterable[Request]) -> "LoraSlots":
        slots = cls(max_loras)
        for req in running:
            slots.take(req)
        return slots

    def allows(self, req: Request) -> bool:
        """Whether `req` may join the step (its adapter is served already, or a slot is free)."""
        adapter = req.adapter
        return (adapter is None or self.max_loras is None or adapter in self.adapters
                or len(self.adapters) < self.max_loras)

    def take(self, req: Request) -> None:
        if req.adapter is not None:
            self.adapters.setdefault(req.adapter, None)
