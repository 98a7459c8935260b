"""Model and GPU specifications, and the KV-cache capacity they imply.

Invariant: every size here is *per GPU* once a tensor-parallel degree `tp` is given. Attention
heads, the MLP and the vocabulary are split `tp` ways (Megatron-style, as vLLM does); KV heads
are split too but never below one per GPU, so when `tp` exceeds the KV-head count each GPU holds
a replica of one KV head. Specs are frozen records; presets are read-only mappings.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

from cbsim.errors import ConfigError
from cbsim.schema import option, parse, require

TP_DEGREES = (1, 2, 4, 8)
GiB = 1 << 30


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder-only transformer (Llama family: GQA attention, gated MLP, untied LM head)."""

    name: str = option(help="model name, free text")
    hidden: int = option(help="hidden size")
    num_layers: int = option(help="decoder layers")
    num_heads: int = option(help="query heads")
    num_kv_heads: int = option(help="key/value heads (GQA); equal to num_heads for MHA")
    head_dim: int = option(help="size of one attention head")
    intermediate: int = option(help="MLP intermediate size (gate and up projections each)")
    vocab: int = option(help="vocabulary size")
    max_model_len: int = option(help="longest context the model accepts, in tokens")
    dtype_bytes: int = option(2, help="bytes per weight and KV element (2 for bf16/fp16)")

    def validate(self) -> None:
        """Raise ConfigError (relative key path) unless the geometry is consistent."""
        for key in ("hidden", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate",
                    "vocab", "max_model_len"):
            require(getattr(self, key) > 0, key, "a positive integer", getattr(self, key))
        require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
                f"a divisor of num_heads ({self.num_heads})", self.num_kv_heads)
        require(self.dtype_bytes in (1, 2, 4), "dtype_bytes", "1, 2 or 4", self.dtype_bytes)

    def check_tp(self, tp: int, path: str = "tp") -> None:
        """Raise ConfigError at `path` unless this model can be sharded `tp` ways."""
        require(tp in TP_DEGREES, path, "one of " + ", ".join(map(str, TP_DEGREES)), tp)
        require(self.num_heads % tp == 0 and self.intermediate % tp == 0, path,
                f"a degree dividing num_heads ({self.num_heads}) and intermediate ({self.intermediate})"
                f" of {self.name}", tp)
        require(self.num_kv_heads % tp == 0 or tp % self.num_kv_heads == 0, path,
                f"a divisor or multiple of num_kv_heads ({self.num_kv_heads}) of {self.name}", tp)

    def heads_per_gpu(self, tp: int = 1) -> int:
        return self.num_heads // tp

    def kv_heads_per_gpu(self, tp: int = 1) -> int:
        """KV heads each GPU stores; replicated (one per GPU) when tp exceeds num_kv_heads."""
        return max(1, self.num_kv_heads // tp)

    def vocab_per_gpu(self, tp: int = 1) -> int:
        return math.ceil(self.vocab / tp)

    def gemm_shapes(self, tp: int = 1) -> tuple[tuple[int, int], ...]:
        """(in, out) features per GPU of one layer's GEMMs: QKV, O, gate+up, down."""
        q = self.heads_per_gpu(tp) * self.head_dim
        kv = self.kv_heads_per_gpu(tp) * self.head_dim
        mlp = self.intermediate // tp
        return ((self.hidden, q + 2 * kv), (q, self.hidden), (self.hidden, 2 * mlp), (mlp, self.hidden))

    def layer_params(self, tp: int = 1) -> int:
        """Linear-layer parameters of one layer per GPU (QKV + O + gated MLP gate/up/down)."""
        return sum(k * n for k, n in self.gemm_shapes(tp))

    def weight_bytes(self, tp: int = 1) -> int:
        """Weight bytes one GPU holds: all layers, RMSNorms, embedding and LM head, sharded tp ways."""
        norms = (2 * self.num_layers + 1) * self.hidden  # replicated, tiny
        embed_and_head = 2 * self.vocab_per_gpu(tp) * self.hidden
        return (self.num_layers * self.layer_params(tp) + norms + embed_and_head) * self.dtype_bytes

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """KV-cache bytes one token occupies on one GPU, over all layers (K and V)."""
        return 2 * self.num_layers * self.kv_heads_per_gpu(tp) * self.head_dim * self.dtype_bytes


def _llama(name, hidden, layers, heads, kv_heads, intermediate, vocab, ctx) -> ModelSpec:
    return ModelSpec(name, hidden, layers, heads, kv_heads, hidden // heads, intermediate, vocab, ctx)


# Geometry from each model's config.json on the Hugging Face hub (meta-llama/*).
MODEL_PRESETS = MappingProxyType({
    "llama-2-7b": _llama("llama-2-7b", 4096, 32, 32, 32, 11008, 32000, 4096),
    "llama-3-8b": _llama("llama-3-8b", 4096, 32, 32, 8, 14336, 128256, 8192),
    "llama-2-70b": _llama("llama-2-70b", 8192, 80, 64, 8, 28672, 32000, 4096),
    "llama-3-70b": _llama("llama-3-70b", 8192, 80, 64, 8, 28672, 128256, 8192),
    "tiny": ModelSpec("tiny", 256, 2, 4, 2, 64, 512, 1000, 4096),
})


def _model_key(name: str) -> str:
    """Normalise a Hugging Face id or spelling: 'meta-llama/Meta-Llama-3-8B-Instruct' -> 'llama-3-8b'."""
    key = name.strip().lower().rsplit("/", 1)[-1].replace("_", "-")
    key = key.replace("meta-llama-", "llama-")
    for suffix in ("-hf", "-instruct", "-chat"):
        key = key.removesuffix(suffix)
    return key


def model_spec(name_or_mapping, path: str = "model") -> ModelSpec:
    """A preset by name (Hugging Face ids accepted), or a mapping of every ModelSpec field.

    In a mapping, head_dim may be left out: it defaults to hidden // num_heads.
    """
    if isinstance(name_or_mapping, ModelSpec):
        return name_or_mapping
    if isinstance(name_or_mapping, str):
        spec = MODEL_PRESETS.get(_model_key(name_or_mapping))
        if spec is None:
            raise ConfigError(path, "a model preset (" + ", ".join(MODEL_PRESETS) + ") or a mapping of its fields",
                              name_or_mapping)
        return spec
    if not isinstance(name_or_mapping, dict):
        raise ConfigError(path, "a model preset name or a mapping of its fields", name_or_mapping)
    mapping = dict(name_or_mapping)
    hidden, heads = mapping.get("hidden"), mapping.get("num_heads")
    if "head_dim" not in mapping and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        mapping["head_dim"] = hidden // heads
    return parse(ModelSpec, mapping, path)


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: memory, dense bf16 peak, HBM bandwidth, and its NVLink port."""

    name: str
    memory_bytes: int
    bf16_flops: float  # dense tensor-core peak, FLOP/s (no sparsity)
    hbm_bandwidth: float  # bytes/s
    link_bandwidth: float  # NVLink per GPU, one direction, bytes/s
    link_latency: float  # fixed cost of one small all-reduce, s
    topology: str = "nvswitch"  # how the TP group's GPUs connect: nvswitch, nvlink_pairwise, pcie


# Vendor datasheets (NVIDIA A100 Tensor Core GPU datasheet, SXM4 80GB; H100 Tensor Core GPU
# datasheet, SXM5; H200 Tensor Core GPU product brief, SXM). Memory: 80 GB and 141 GB of HBM are
# binary sizes (HBM stacks come in powers of two; CUDA reports ~79.2 GiB usable on an H100, ~139.8
# GiB on an H200; the activation reserve of kv_cache_blocks absorbs the difference). bf16: 312 and
# 989 TFLOP/s dense (the datasheets' 624 / 1,979 figures are with 2:4 sparsity). HBM: 2,039 GB/s,
# 3.35 TB/s, 4.8 TB/s. NVLink: 600 and 900 GB/s total bidirectional, i.e. 300 and 450 GB/s each way.
# link_latency is not a vendor number: the smallest median all-reduce times Vidur measured on DGX
# A100/H100 NVLink (shared/data/vidur/.../network/*/all_reduce.csv) run from 7 µs (2 GPUs) to
# 25 µs (8 GPUs); 10 µs is a middle value.
# topology: the SXM4/SXM5 parts ship on HGX/DGX baseboards where all 8 GPUs meet at NVSwitches
# (NVIDIA DGX A100 and DGX H100/H200 user guides: 6 second-gen / 4 third-gen NVSwitches), so the
# presets are `nvswitch`; the roofline's `topology:` chooses a pairwise-NVLink or PCIe node instead.
GPU_PRESETS = MappingProxyType({
    "a100": GPUSpec("a100", 80 * GiB, 312e12, 2.039e12, 300e9, 10e-6, "nvswitch"),
    "h100": GPUSpec("h100", 80 * GiB, 989e12, 3.35e12, 450e9, 10e-6, "nvswitch"),
    "h200": GPUSpec("h200", 141 * GiB, 989e12, 4.8e12, 450e9, 10e-6, "nvswitch"),
})
GPU_ALIASES = MappingProxyType({
    "a100-80gb": "a100", "a100-sxm4-80gb": "a100", "a100-sxm": "a100",
    "h100-sxm": "h100", "h100-80gb": "h100", "h100-sxm5-80gb": "h100",
    "h200-sxm": "h200", "h200-141gb": "h200",
})


def gpu_spec(name, path: str = "gpu") -> GPUSpec:
    """A GPU preset by name (case-insensitive; aliases such as 'a100-80gb' and 'h100-sxm')."""
    if isinstance(name, GPUSpec):
        return name
    key = name.strip().lower() if isinstance(name, str) else None
    key = GPU_ALIASES.get(key, key)
    if key not in GPU_PRESETS:
        raise ConfigError(path, "a GPU preset (" + ", ".join([*GPU_PRESETS, *GPU_ALIASES]) + ")", name)
    return GPU_PRESETS[key]


def kv_cache_blocks(model: ModelSpec, gpu: GPUSpec, tp: int, block_size: int, gpu_memory_utilization: float,
                    activation_reserve_bytes: int = 2 * GiB) -> int:
    """KV blocks that fit on each GPU, vLLM-style.

    memory * utilization, minus this GPU's weights, minus a reserve for activations, the CUDA
    context and graphs (2 GiB by default: an assumption, of the size vLLM's profiling run finds for
    7-8B models), divided by the bytes of one block. Raises ConfigError if not one block fits.
    """
    model.check_tp(tp, "cluster.tp")
    require(block_size > 0, "cluster.kv_cache.block_size", "a positive integer", block_size)
    require(0.0 < gpu_memory_utilization <= 1.0, "cluster.kv_cache.gpu_memory_utilization",
            "a fraction in (0, 1]", gpu_memory_utilization)
    free = gpu.memory_bytes * gpu_memory_utilization - model.weight_bytes(tp) - activation_reserve_bytes
    blocks = int(free // (block_size * model.kv_bytes_per_token(tp))) if free > 0 else 0
    if blocks < 1:
        raise ConfigError("cluster.kv_cache.num_blocks",
                          f"room for at least one KV block: {model.name} at TP{tp} needs "
                          f"{model.weight_bytes(tp) / GiB:.1f} GiB of weights per GPU, {gpu.name} offers "
                          f"{gpu.memory_bytes * gpu_memory_utilization / GiB:.1f} GiB at this utilization",
                          blocks)
    return blocks
