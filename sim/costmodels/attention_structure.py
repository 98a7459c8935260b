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
(benchmarks/validate_trtllm_static.py prints both). It reproduces the table's finding that Mistral-7B
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

from cbsim.sim.costmodels.catalog.specs import ModelSpec

MMHA_FRACTION = 0.008  # of dense bf16 peak: a per-query-head decode kernel's FLOP rate (fitted, module docstring)


def decode_pair_weight(model: ModelSpec, per_query_head: bool, attention_efficiency: float) -> float:
    """A decode query-key pair in prefill pairs at the attention rate: attention_efficiency /
    MMHA_FRACTION for a per-query-head kernel (MLA's absorbed decode is not one), else 1.0."""
    if not per_query_head or model.is_mla:
        return 1.0
    return attention_efficiency / MMHA_FRACTION
