"""Decode attention by the kernel's parallel structure: per KV head on tensor cores, or per query head
on CUDA cores.

A decode attention kernel splits its work into CTAs over (sequence, head, KV split); which head
indexes the grid decides how the work runs for a GQA model (g query heads per KV head):
  - one CTA per KV head holding its g query heads (FlashAttention-2/3, which swaps the g query heads
    into the query-length dimension when a query is one token, `seqlenq_ngroups_swapped`; FlashInfer's
    batch decode; TensorRT-LLM's XQA): the g heads share each KV tile in one matrix product, the cache
    is read once, and the step is bound by its KV bytes. This is how cbsim priced every decode before,
    and stays the default: the presets' engines run these kernels.
  - one CTA per query head: TensorRT-LLM's masked multi-head attention kernel
    (NVIDIA/TensorRT-LLM cpp/tensorrt_llm/kernels/decoderMaskedMultiheadAttention/
    decoderMaskedMultiheadAttentionLaunch.h @14e801da, mmha_launch_kernel_ex: `dim3 grid{num_heads,
    batch_size, seq_len_tile}`, each block loading KV head `hi / qhead_per_kv`) and vLLM V0's
    paged_attention v1/v2 (grid num_heads x num_seqs x partitions). Each query head's dot products run
    on CUDA cores, element by element with the cache's conversion to float, so the work scales with
    query heads x context whatever the KV head count; the g blocks of one KV head read it at about the
    same time, so the repeats largely hit L2 and HBM still sees the cache about once.
So a per-query-head decode is priced as the longer of its KV bytes (unchanged) and its query-key FLOPs
(4 heads head_dim per pair, as prefill) at MMHA_FRACTION of the GPU's dense bf16 peak instead of the
tensor-core attention rate: in the roofline a decode pair weighs attention_efficiency / MMHA_FRACTION
prefill pairs.

Which kernel TensorRT-LLM v0.9 ran for a GQA model: its generation phase tries XQA first and falls back
to masked MHA, and XQA then "only supports a limited number of model configurations, such as the LLAMA2
70B model" (docs/source/advanced/gpt-attention.md, "XQA Optimization", 0.9-era text): a Mistral-7B or
LLaMA-7B engine ran masked MHA.

MMHA_FRACTION = 0.008 (7.9 TFLOP/s on H100's 989 TFLOP/s bf16 peak; about an eighth of its 67 TFLOP/s
FP32 CUDA-core peak) is fitted (grid search, median |log error|) on the H100 rows of TensorRT-LLM
v0.9's published static-batch FP8 throughput (perf-overview.md, "All data was generated using version
0.9.0"; Mistral-7B and LLaMA-7B), and checked on the H200 rows, held out
(validation/validate_trtllm_static.py prints both). It reproduces the table's finding that Mistral-7B
(8 KV heads) runs at 0.9-1.2x LLaMA-7B's (32 KV heads) throughput at the same batch, and its H200 rows
barely faster than H100's (3,867 vs 3,731 tokens/s at 2048/2048, NVIDIA/TensorRT-LLM issue #1570),
where a bytes-only price makes Mistral 1.3-2.3x too fast. Errors, bytes-only -> per query head:
Mistral-7B H100 (fitted) +55/+82/+30/+68 % -> +24/+4/+2/-7 % at 128/128, 128/2048, 2048/128, 2048/2048;
H200 (held out) +69/+131/+39/+111 % -> +28/+6/+3/-6 %; LLaMA-7B rows unchanged (-2..+31 %: its MHA cache
is bytes-bound either way). The 128/128 rows (a batch of 896, mostly prefill) carry LLaMA's prefill error
too (+15 / +31 %), not the decode kernel's. Scaling by the bf16 peak carries it to other
NVIDIA GPUs at their CUDA-core to tensor-core ratio (A100 1/16, H100 1/15): an assumption, unmeasured.
Not modelled: occupancy (CTAs vs SMs; the split-KV kernels size their splits to fill the SMs, and a
per-query-head kernel has batch x heads CTAs, more than the SMs in every published row here).
"""
from __future__ import annotations

import math

from cbsim.sim.costmodels.catalog.specs import ModelSpec

MMHA_FRACTION = 0.008  # of dense bf16 peak: a per-query-head decode kernel's FLOP rate (fitted, module docstring)


def decode_pair_weight(model: ModelSpec, per_query_head: bool, attention_efficiency: float) -> float:
    """A decode query-key pair in prefill pairs at the attention rate: attention_efficiency /
    MMHA_FRACTION for a per-query-head kernel (MLA's absorbed decode is not one), else 1.0."""
    if not per_query_head or model.is_mla:
        return 1.0
    return attention_efficiency / MMHA_FRACTION


# --- prefill and chunked-prefill attention: FlashAttention-2's split-KV grid against the SMs ----------------
#
# vLLM's FlashAttention-2 varlen call on a paged KV cache runs the split-KV kernel (paged KV forces it:
# Dao-AILab/flash-attention csrc/flash_attn/flash_api.cpp @765fbd92, mha_varlen_fwd -> run_mha_fwd(params,
# stream, /*force_split_kernel=*/paged_KV)) with 64-row query blocks and 128-thread CTAs, and picks its KV
# splits with num_splits_heuristic(batch * heads * m_blocks, 2 * SMs, n_blocks, 128) ("we multiply number
# of SMs by 2 to hard-code the fact that we're using 128 threads per block"): one split when the blocks fill
# 80 % of the 2 x SMs slots, else the fewest splits reaching 85 % of the best wave efficiency. Its wave
# efficiency, waves / ceil(waves), is the fraction of the slots the kernel keeps busy; the attention FLOPs
# of the step's prefill chunks are charged at that fraction of the attention rate. A long prompt in one
# step fills many waves (efficiency ~1); a 512-token chunk has 8 blocks per head, so e.g. CodeLlama-34B at
# TP2 (32 heads per GPU: 256 blocks >= 0.8 x 216 on A100) runs one split in 1.19 waves (efficiency 0.59),
# while Llama-2-70B at TP4 (16 heads: 128 blocks) splits its KV and fills the SMs. Decode rows keep their
# bytes-bound price (above). SM counts are the datasheets'; GPUs not listed (AMD: other kernels) are not
# occupancy-limited here. H100/H200 run FlashAttention-3 in vLLM V1, whose split heuristic
# (hopper/heuristics.h) is of the same form; FA2's is used for them too (an approximation). Not charged: the
# growing KV re-read of a chunk (each 64-row query block of each query head streams the whole cached prefix,
# ceil(c / 64) x heads times per layer): the blocks sharing a KV head run together and mostly hit L2, and at
# 64 query rows per block the kernel stays compute-bound even at L2 bandwidth; no measurement separates it.
# What it reproduces: validation/validate_chunked_prefill.py (512-token chunks over one step, published
# +11..+20 % on 34B/70B A100): CodeLlama-34B TP2 A100 +5..+6 % -> +8..+22 % (2K..16K prompts), Llama-2-70B
# TP4 A100 +8..+9.5 % -> +8..+11 %; H100 unchanged (+12..+21 %: 132 SMs hold these grids in one wave).

SMS = {"a100": 108, "h100-pcie": 114, "h100": 132, "h200": 132, "b200": 148, "l40s": 142, "l4": 58, "a10": 72}
Q_BLOCK = 64  # query rows per CTA of the split-KV kernel (kBlockM)


def streaming_multiprocessors(gpu_name: str) -> int:
    """SMs of a catalog GPU (longest matching name prefix), 0 when unknown."""
    match = max((name for name in SMS if gpu_name.startswith(name)), key=len, default=None)
    return SMS[match] if match else 0


def num_splits(blocks: int, slots: int, n_blocks: int, max_splits: int = 128) -> int:
    """FlashAttention-2's num_splits_heuristic (flash_api.cpp @765fbd92), restated."""
    if blocks >= 0.8 * slots:
        return 1
    max_splits = min(max_splits, slots, n_blocks)
    eligible = [s for s in range(1, max_splits + 1) if s == 1 or -(-n_blocks // s) != -(-n_blocks // (s - 1))]
    efficiency = {s: _wave_efficiency(blocks * s, slots) for s in eligible}
    best = max(efficiency.values(), default=0.0)
    return next((s for s in eligible if efficiency[s] >= 0.85 * best), 1)


def _wave_efficiency(ctas: int, slots: int) -> float:
    waves = ctas / slots
    return waves / math.ceil(waves)


def prefill_efficiency(chunks, heads: int, sms: int, head_dim: int) -> float:
    """Fraction of the GPU's CTA slots FlashAttention-2 keeps busy on a step's prefill chunks
    ((new tokens, cached tokens) pairs), 1.0 without chunks or SM count."""
    if not chunks or sms <= 0:
        return 1.0
    blocks = heads * sum(-(-c // Q_BLOCK) for c, _ in chunks)
    block_n = 256 if head_dim <= 64 else 128 if head_dim <= 128 else 64
    n_blocks = -(-max(c + h for c, h in chunks) // block_n)
    slots = 2 * sms
    return _wave_efficiency(blocks * num_splits(blocks, slots, n_blocks), slots)
