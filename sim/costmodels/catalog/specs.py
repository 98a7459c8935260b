"""Model and GPU specifications: the records and the presets.

Invariant: every size here is *per GPU* once a tensor-parallel degree `tp` is given. Attention
heads, the MLP and the vocabulary are split `tp` ways (Megatron-style, as vLLM does); KV heads
are split too but never below one per GPU, so when `tp` exceeds the KV-head count each GPU holds
a replica of one KV head. Experts are split `tp` ways like the MLP; MLA's compressed latent and
its down-projections (q_a, kv_a), the norms and the MoE router are held whole by every GPU. Bytes
follow the precision fields: weights at weight_dtype (fp8/int4 for the decoder's linear layers
only), the cache at kv_dtype. Specs are frozen records; presets are read-only mappings. Names
are looked up in lookup.py (models beyond the presets come from Hugging Face config.json files,
hf_config.py; GPUs beyond them from gpus.py); the KV capacity a spec implies is sim/kv/sizing.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from cbsim.core.bounds import MODEL_LIMITS
from cbsim.core.errors import ConfigError
from cbsim.core.schema import option, require

DEFAULT_MODEL = "llama-3-8b"  # the model of an experiment (or a cost model, a calibration) that names none
TP_DEGREES = (1, 2, 4, 8, 16, 32, 64)  # beyond 8: across nodes (roofline gpus_per_node)
GiB = 1 << 30


WEIGHT_BITS = MappingProxyType({"fp32": 32, "bf16": 16, "fp16": 16, "fp8": 8, "int4": 4})
KV_BYTES = MappingProxyType({"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1})
# int4 group quantisation (GPTQ, AWQ as vLLM lays them out: vllm-project/vllm
# model_executor/layers/quantization/awq.py @92d756e9 and gptq.py @e5dd90be): per group of
# `group_size` input weights of an output column, one 16-bit scale (`scales`, params_dtype) and one
# 4-bit zero point packed 8 to an int32 (`qzeros`), beside the weights packed 8 to an int32 (`qweight`).
INT4_GROUP_SCALE_BYTES = 2.0
INT4_GROUP_ZERO_BYTES = 0.5
INT4_GROUP_SIZE = 128  # AutoAWQ's q_group_size and AutoGPTQ's group_size default
PER_CHANNEL = -1  # GPTQ group_size -1 / compressed-tensors strategy "channel": one scale per output column
WeightDtype = Literal["bf16", "fp16", "fp32", "fp8", "int4"]
KVDtype = Literal["bf16", "fp16", "fp32", "fp8"]


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer: GQA or MLA attention, a gated MLP or a mixture of gated experts.

    The first ten fields describe a dense Llama-family model (as the presets always did); the rest
    default to that family (untied head, no biases, no window, dense, no MLA, dtype_bytes wide).
    """

    name: str = option(help="model name, free text")
    hidden: int = option(help="hidden size")
    num_layers: int = option(help="decoder layers")
    num_heads: int = option(help="query heads")
    num_kv_heads: int = option(help="key/value heads (GQA); equal to num_heads for MHA")
    head_dim: int = option(help="size of one attention head (MLA: qk_nope_head_dim + qk_rope_head_dim)")
    intermediate: int = option(help="MLP intermediate size (gate and up projections each) of the dense layers")
    vocab: int = option(help="vocabulary size")
    max_model_len: int = option(help="longest context the model accepts, in tokens")
    dtype_bytes: int = option(2, help="bytes per weight and KV element (2 for bf16/fp16) unless weight_dtype/kv_dtype say")
    weight_dtype: WeightDtype | None = option(
        None, help="weight precision: bf16, fp16, fp32, fp8, int4 (weight-only, bf16 compute); default: dtype_bytes wide")
    kv_dtype: KVDtype | None = option(None, help="KV-cache precision: bf16, fp16, fp32, fp8; default: dtype_bytes wide")
    weight_group_size: int = option(
        0, help="int4 weights: input weights per 16-bit scale and 4-bit zero point (config.json quantization_config "
        "group_size); 0: not given (128 is assumed), -1: one per output channel")
    compute_dtype: Literal["auto", "bf16", "fp8"] = option(
        "auto", help="GEMM precision: fp8 runs at the GPU's FP8 peak (needs fp8 weights); auto: fp8 when the "
        "weights are fp8 and the GPU has FP8 tensor cores, else bf16")
    tie_word_embeddings: bool = option(False, help="the LM head shares the embedding matrix")
    qkv_bias: bool = option(False, help="the Q, K and V projections carry a bias (Qwen2)")
    norms_per_layer: int = option(2, help="RMSNorms per decoder layer (Gemma-2: 4)")
    sliding_window: int = option(0, help="attention window in tokens of the windowed layers (0: none)")
    sliding_layers: int = option(0, help="how many layers use the window (Mistral-7B-v0.1: all, Gemma-2: every other)")
    num_experts: int = option(0, help="routed experts per MoE layer (0: dense model)")
    experts_per_token: int = option(0, help="routed experts each token is sent to (top-k)")
    moe_intermediate: int = option(0, help="intermediate size of one routed expert (gate and up each)")
    num_shared_experts: int = option(0, help="experts every token goes through in an MoE layer (DeepSeek)")
    shared_intermediate: int = option(0, help="intermediate size of one shared expert (default moe_intermediate)")
    first_k_dense: int = option(0, help="the first k layers keep a dense MLP (DeepSeek first_k_dense_replace)")
    moe_every: int = option(1, help="layer i (from 0) past first_k_dense is MoE when (i + 1) % moe_every == 0")
    kv_lora_rank: int = option(0, help="MLA: rank of the compressed KV latent (0: no MLA)")
    q_lora_rank: int = option(0, help="MLA: rank of the compressed query (0: a plain q projection)")
    qk_nope_head_dim: int = option(0, help="MLA: per-head query/key size without RoPE")
    qk_rope_head_dim: int = option(0, help="MLA: per-head query/key size with RoPE (the key part is shared)")
    v_head_dim: int = option(0, help="MLA: per-head value size")

    def validate(self) -> None:
        """Raise ConfigError (relative key path) unless the geometry is consistent."""
        for key, limit in MODEL_LIMITS.items():  # first: before any per-layer work (cbsim/core/bounds.py)
            require(getattr(self, key) <= limit, key, f"at most {limit:,} (far above any released model)",
                    getattr(self, key))
        for key in ("hidden", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate",
                    "vocab", "max_model_len", "norms_per_layer", "moe_every"):
            require(getattr(self, key) > 0, key, "a positive integer", getattr(self, key))
        for key in ("sliding_window", "sliding_layers", "num_experts", "experts_per_token", "moe_intermediate",
                    "num_shared_experts", "shared_intermediate", "first_k_dense", "kv_lora_rank", "q_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            require(getattr(self, key) >= 0, key, "a non-negative integer", getattr(self, key))
        require(self.num_heads % self.num_kv_heads == 0, "num_kv_heads",
                f"a divisor of num_heads ({self.num_heads})", self.num_kv_heads)
        require(self.dtype_bytes in (1, 2, 4), "dtype_bytes", "1, 2 or 4", self.dtype_bytes)
        require(self.sliding_layers <= self.num_layers, "sliding_layers",
                f"at most num_layers ({self.num_layers})", self.sliding_layers)
        require((self.sliding_window > 0) == (self.sliding_layers > 0), "sliding_layers",
                "positive exactly when sliding_window is", self.sliding_layers)
        if self.num_experts:
            require(0 < self.experts_per_token <= self.num_experts, "experts_per_token",
                    f"between 1 and num_experts ({self.num_experts})", self.experts_per_token)
            require(self.moe_intermediate > 0, "moe_intermediate", "a positive integer for an MoE model",
                    self.moe_intermediate)
            require(self.first_k_dense < self.num_layers, "first_k_dense",
                    f"fewer than num_layers ({self.num_layers})", self.first_k_dense)
        else:
            require(self.experts_per_token == 0 and self.num_shared_experts == 0, "num_experts",
                    "a positive count when experts_per_token or num_shared_experts is set", self.num_experts)
        if self.kv_lora_rank:
            for key in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                require(getattr(self, key) > 0, key, "a positive integer for an MLA model", getattr(self, key))
            require(self.head_dim == self.qk_nope_head_dim + self.qk_rope_head_dim, "head_dim",
                    f"qk_nope_head_dim + qk_rope_head_dim ({self.qk_nope_head_dim + self.qk_rope_head_dim})",
                    self.head_dim)
        require(isinstance(self.weight_group_size, int) and not isinstance(self.weight_group_size, bool)
                and self.weight_group_size >= PER_CHANNEL, "weight_group_size",
                "a positive integer, 0 (not given: 128) or -1 (per output channel)", self.weight_group_size)
        if self.compute_dtype == "fp8":
            require(self.weight_dtype == "fp8", "compute_dtype", "bf16 or auto unless weight_dtype is fp8 "
                    "(fp8 GEMMs read fp8 weights)", self.compute_dtype)

    # ------------------------------------------------------------ architecture and precision

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def weight_bits(self) -> int:
        """Bits per stored weight (int4: 4, scales and zero points not counted)."""
        return 8 * self.dtype_bytes if self.weight_dtype is None else WEIGHT_BITS[self.weight_dtype]

    @property
    def int4_group(self) -> int:
        """Input weights per int4 scale group: weight_group_size, 128 when not given, and `hidden` for
        per-channel scales (exact for the GEMMs reading the hidden state, QKV and gate+up; O and down
        have a K of their own, so their 2.5 / K bytes a weight are approximated, < 0.07 % of 0.5)."""
        if self.weight_group_size == PER_CHANNEL:
            return self.hidden
        return self.weight_group_size or INT4_GROUP_SIZE

    def linear_weight_bytes(self, linear: int) -> int:
        """Bytes of `linear` quantised linear-layer weights: fp8 one each; int4 half a byte plus, per
        group, a 16-bit scale and a 4-bit zero point (0.5 + 2.5 / g bytes a weight, floored)."""
        if self.weight_dtype == "int4":
            g = self.int4_group
            return linear * (8 * g + 40) // (16 * g)
        return linear * self.weight_bits // 8

    @property
    def kv_elem_bytes(self) -> int:
        """Bytes per cached K, V (or MLA latent) element."""
        return self.dtype_bytes if self.kv_dtype is None else KV_BYTES[self.kv_dtype]

    @property
    def precision(self) -> str:
        """weights/KV precision in words, e.g. 'bf16' or 'fp8 weights, fp8 KV'."""
        w = self.weight_dtype or {1: "fp8", 2: "bf16", 4: "fp32"}[self.dtype_bytes]
        kv = self.kv_dtype or {1: "fp8", 2: "bf16", 4: "fp32"}[self.dtype_bytes]
        return w if w == kv or {w, kv} <= {"bf16", "fp16"} else f"{w} weights, {kv} KV"

    def check_measured_precision(self, cost_model: str) -> None:
        """For cost models built from 16-bit measurements (vidur, fitted): raise ConfigError (at the
        cost model's `type`) if this model asks for fp8/int4 weights, an fp8 KV cache or fp8 GEMMs."""
        if self.weight_dtype in ("fp8", "int4") or self.kv_dtype == "fp8" or self.compute_dtype == "fp8":
            raise ConfigError("type", f"a cost model measured at the model's precision ({self.name}: "
                              f"{self.precision}); {cost_model}'s profiles were measured at bf16/fp16 weights, KV "
                              "and GEMMs (use roofline for fp8 or int4)", cost_model)

    def moe_layer(self, i: int) -> bool:
        """Whether decoder layer i (from 0) has routed experts instead of a dense MLP."""
        return self.is_moe and i >= self.first_k_dense and (i + 1) % self.moe_every == 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer(i) for i in range(self.num_layers))

    def check_tp(self, tp: int, path: str = "tp") -> None:
        """Raise ConfigError at `path` unless this model can be sharded `tp` ways."""
        require(tp in TP_DEGREES, path, "one of " + ", ".join(map(str, TP_DEGREES)), tp)
        require(self.num_heads % tp == 0 and self.intermediate % tp == 0, path,
                f"a degree dividing num_heads ({self.num_heads}) and intermediate ({self.intermediate})"
                f" of {self.name}", tp)
        require(self.num_kv_heads % tp == 0 or tp % self.num_kv_heads == 0, path,
                f"a divisor or multiple of num_kv_heads ({self.num_kv_heads}) of {self.name}", tp)
        for key in ("moe_intermediate", "shared_intermediate"):
            require(getattr(self, key) % tp == 0, path, f"a degree dividing {key} ({getattr(self, key)}) of "
                    f"{self.name}", tp)

    def heads_per_gpu(self, tp: int = 1) -> int:
        return self.num_heads // tp

    def kv_heads_per_gpu(self, tp: int = 1) -> int:
        """KV heads each GPU stores; replicated (one per GPU) when tp exceeds num_kv_heads."""
        return max(1, self.num_kv_heads // tp)

    def vocab_per_gpu(self, tp: int = 1) -> int:
        return math.ceil(self.vocab / tp)

    # ------------------------------------------------------------ GEMM shapes, per GPU

    def attention_shapes(self, tp: int = 1) -> tuple[tuple[int, int], ...]:
        """(in, out) features per GPU of one layer's attention GEMMs, in execution order.

        GQA: fused QKV, O. MLA (DeepSeek-V2/V3, as vLLM runs it): q_a (replicated) and q_b, or one q
        projection; kv_a (replicated: latent + shared rope key); kv_b (latent -> per-head nope key and
        value; the absorbed form applies the same weights per query token); O."""
        heads = self.heads_per_gpu(tp)
        if not self.is_mla:
            q = heads * self.head_dim
            kv = self.kv_heads_per_gpu(tp) * self.head_dim
            return ((self.hidden, q + 2 * kv), (q, self.hidden))
        q_out = heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        q = ((self.hidden, self.q_lora_rank), (self.q_lora_rank, q_out)) if self.q_lora_rank else ((self.hidden, q_out),)
        return (*q, (self.hidden, self.kv_lora_rank + self.qk_rope_head_dim),
                (self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim)),
                (heads * self.v_head_dim, self.hidden))

    def mlp_shapes(self, intermediate: int, tp: int = 1) -> tuple[tuple[int, int], tuple[int, int]]:
        """(in, out) per GPU of a gated MLP's gate+up and down GEMMs."""
        mlp = intermediate // tp
        return ((self.hidden, 2 * mlp), (mlp, self.hidden))

    def gemm_shapes(self, tp: int = 1) -> tuple[tuple[int, int], ...]:
        """(in, out) features per GPU of one dense layer's GEMMs: QKV, O, gate+up, down."""
        return (*self.attention_shapes(tp), *self.mlp_shapes(self.intermediate, tp))

    # ------------------------------------------------------------ parameters and bytes

    def layer_params(self, tp: int = 1) -> int:
        """Linear-layer parameters of one dense layer per GPU (attention + gated MLP gate/up/down)."""
        return sum(k * n for k, n in self.gemm_shapes(tp))

    def _attention_params(self, tp: int) -> int:
        params = sum(k * n for k, n in self.attention_shapes(tp))
        if self.qkv_bias:
            params += self.attention_shapes(tp)[0][1]
        if self.is_mla:  # the latent norms (replicated)
            params += self.kv_lora_rank + self.q_lora_rank
        return params

    def expert_params(self, tp: int = 1) -> int:
        """One routed expert's parameters per GPU (experts are split tp ways, as vLLM does without EP)."""
        return sum(k * n for k, n in self.mlp_shapes(self.moe_intermediate, tp))

    def _shared_params(self, tp: int) -> int:
        inter = self.shared_intermediate or self.moe_intermediate
        return self.num_shared_experts * sum(k * n for k, n in self.mlp_shapes(inter, tp))

    def _param_parts(self, tp: int, active: bool = False) -> tuple[int, int]:
        """(decoder linear-layer parameters, the rest: norms, routers, embedding, LM head) per GPU."""
        if not self.is_moe and not self.is_mla and not self.qkv_bias:
            linear, routers = self.num_layers * self.layer_params(tp), 0  # the dense presets' formula
        else:
            moe = self.num_moe_layers
            routed = self.experts_per_token if active else self.num_experts
            dense_mlp = sum(k * n for k, n in self.mlp_shapes(self.intermediate, tp))
            moe_mlp = routed * self.expert_params(tp) + self._shared_params(tp)
            linear = self.num_layers * self._attention_params(tp) + (self.num_layers - moe) * dense_mlp + moe * moe_mlp
            routers = moe * self.hidden * self.num_experts
        norms = (self.norms_per_layer * self.num_layers + 1) * self.hidden  # replicated, tiny
        embed_and_head = (1 if self.tie_word_embeddings else 2) * self.vocab_per_gpu(tp) * self.hidden
        return linear, routers + norms + embed_and_head

    def params(self, tp: int = 1, active: bool = False) -> int:
        """Parameters one GPU holds (all experts), or with `active` those one token uses (top-k experts)."""
        linear, rest = self._param_parts(tp, active)
        return linear + rest

    def active_params(self) -> int:
        """Parameters one token passes through: all but the routed experts it is not sent to (the
        embedding table counts whole, as Mistral counts Mixtral's 12.9 B; DeepSeek's 37 B leaves it out)."""
        return self.params(1, active=True)

    def weight_bytes(self, tp: int = 1) -> int:
        """Weight bytes one GPU holds: all layers, norms, embedding and LM head, sharded tp ways.

        fp8 and int4 quantise the decoder's linear layers only: the embedding, LM head, norms and
        routers stay 16-bit (as vLLM's fp8, AWQ and GPTQ loaders keep them); int4 counts its group
        scales and zero points (int4_group), fp8 scales are not counted (under 0.1 %)."""
        if self.weight_dtype not in ("fp8", "int4"):
            return self.params(tp) * self.weight_bits // 8
        linear, rest = self._param_parts(tp)
        return self.linear_weight_bytes(linear) + rest * 2

    def stage_weight_bytes(self, tp: int, start: int, layers: int, first: bool, last: bool,
                           expert_share: int = 1) -> int:
        """Weight bytes one GPU of a pipeline stage holds: layers [start, start + layers), the embedding
        on the first stage, the final norm and the LM head on the last (a tied head is a second copy
        when the two are different stages, as vLLM's PP loads it); routed experts split over
        `expert_share` x tp GPUs (data-parallel attention with expert parallelism). One stage of
        every layer (first and last) is `weight_bytes(tp)` when expert_share is 1."""
        dense_mlp = sum(k * n for k, n in self.mlp_shapes(self.intermediate, tp))
        moe_mlp = self.num_experts // expert_share * self.expert_params(tp) + self._shared_params(tp) if self.is_moe else 0
        linear, routers = 0, 0
        for i in range(start, start + layers):
            moe = self.moe_layer(i)
            linear += self._attention_params(tp) + (moe_mlp if moe else dense_mlp)
            routers += self.hidden * self.num_experts if moe else 0
        norms = (self.norms_per_layer * layers + (1 if last else 0)) * self.hidden
        tables = ((1 if first else 0) + (1 if last and not (first and self.tie_word_embeddings) else 0))
        rest = routers + norms + tables * self.vocab_per_gpu(tp) * self.hidden
        if self.weight_dtype not in ("fp8", "int4"):
            return (linear + rest) * self.weight_bits // 8
        return self.linear_weight_bytes(linear) + rest * 2

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """KV-cache bytes one token occupies on one GPU, over all layers.

        GQA: K and V of this GPU's KV heads. MLA: the compressed latent plus the shared RoPE key,
        one vector per layer whatever the head count, held whole by every GPU of the TP group (as
        vLLM does). Windowed layers count in full (vLLM allocates them like the others)."""
        if self.is_mla:
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * self.kv_elem_bytes
        return 2 * self.num_layers * self.kv_heads_per_gpu(tp) * self.head_dim * self.kv_elem_bytes


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


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator: memory, dense peaks, memory bandwidth, and how it talks to its neighbours."""

    name: str = option(help="GPU name, free text")
    memory_bytes: int = option(help="device memory in bytes (HBM or GDDR)")
    bf16_flops: float = option(help="dense BF16/FP16 tensor-core peak, FLOP/s (datasheets' sparse figures halved)")
    hbm_bandwidth: float = option(help="device memory bandwidth, bytes/s")
    link_bandwidth: float = option(help="intra-node GPU-GPU link per GPU, one direction, bytes/s "
                                        "(NVLink, xGMI; a PCIe card: its PCIe link)")
    link_latency: float = option(10e-6, help="fixed cost of one small all-reduce, s (not used by the NCCL-like model)")
    topology: Literal["nvswitch", "nvlink_pairwise", "pcie", "xgmi_mesh"] = option(
        "nvswitch", help="how a node's GPUs connect: nvswitch, nvlink_pairwise (bridged pairs), pcie, xgmi_mesh "
        "(AMD: a direct link to every other GPU)")
    fp8_flops: float = option(0.0, help="dense FP8 tensor-core peak, FLOP/s (0: no FP8 tensor cores)")
    pcie_bandwidth: float = option(0.0, help="PCIe x16 link, one direction, bytes/s (0: not given)")
    inter_node_bandwidth: float = option(0.0, help="typical network bandwidth per GPU between nodes, one direction, "
                                                  "bytes/s (0: no standard platform)")
    family: Literal["a100", "h100", ""] = option(
        "", help="the GPU whose fitted GEMM and all-reduce constants it uses: a100, h100, or '' (none fitted: "
        "H100's efficiencies scaled to this GPU's peaks, an assumption)")

    def validate(self) -> None:
        for key in ("memory_bytes", "bf16_flops", "hbm_bandwidth", "link_bandwidth"):
            require(getattr(self, key) > 0, key, "a positive number", getattr(self, key))
        for key in ("link_latency", "fp8_flops", "pcie_bandwidth", "inter_node_bandwidth"):
            require(getattr(self, key) >= 0, key, "a non-negative number", getattr(self, key))

    def peak_flops(self, fp8: bool = False) -> float:
        """Dense tensor-core peak for bf16 GEMMs, or for fp8 ones where the GPU has FP8 units."""
        return self.fp8_flops if fp8 and self.fp8_flops > 0 else self.bf16_flops


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
# fp8: H100/H200 SXM 3,958 TFLOP/s with sparsity, 1,979 dense (same datasheets); A100 has no FP8.
# PCIe: Gen4 x16 (A100) 64 GB/s and Gen5 x16 (H100, H200) 128 GB/s bidirectional, as the datasheets
# list them: 32 and 64 GB/s each way. Between nodes: DGX A100 has one 200 Gb/s HDR InfiniBand port
# per GPU (25 GB/s), DGX H100/H200 one 400 Gb/s NDR port per GPU (50 GB/s) (DGX user guides).
# The other GPUs, with their sources, are in gpus.py (`cbsim gpus`).
GPU_PRESETS = MappingProxyType({
    "a100": GPUSpec("a100", 80 * GiB, 312e12, 2.039e12, 300e9, 10e-6, "nvswitch", 0.0, 32e9, 25e9, "a100"),
    "h100": GPUSpec("h100", 80 * GiB, 989e12, 3.35e12, 450e9, 10e-6, "nvswitch", 1979e12, 64e9, 50e9, "h100"),
    "h200": GPUSpec("h200", 141 * GiB, 989e12, 4.8e12, 450e9, 10e-6, "nvswitch", 1979e12, 64e9, 50e9, "h100"),
})
GPU_ALIASES = MappingProxyType({
    "a100-80gb": "a100", "a100-sxm4-80gb": "a100", "a100-sxm": "a100", "a100-80gb-sxm": "a100",
    "h100-sxm": "h100", "h100-80gb": "h100", "h100-sxm5-80gb": "h100",
    "h200-sxm": "h200", "h200-141gb": "h200",
})
