"""CUDA-graph capture sizes: which steps replay a graph, and the batch a replay pads to.

An engine captures one graph per batch size and replays the smallest captured size that holds the
step, padding the rest with dummy rows. vLLM builds its sizes from one `cuda_graph_sizes` value N as
[1, 2, 4] + range(8, N + 1, 8) (vllm/config/__init__.py, VllmConfig._set_cudagraph_sizes, 0.9/0.10;
`batch_size_capture_list`), looked up per step by `pad_for_cudagraph` (bs_to_padded_graph_size),
by token count: in V1 a step of T <= N tokens replays the graph of the next captured size, decode-only
or mixed (PIECEWISE, the 0.10 default: attention runs outside the graphs, the GEMMs, norms and
all-reduces inside). SGLang pads decode batches to its captured sizes the same way
(cuda_graph_runner.py, `bisect` over `capture_bs`); TensorRT-LLM pads only with
`cuda_graph_config.enable_padding` (default False), so its presets leave `cuda_graph_padding` off.

What padding costs: the graph runs every kernel on the padded rows, so the GEMMs, the streaming
kernels, the embedding and the all-reduces see the padded token count; attention sees only the real
rows' context (padded rows carry no KV) and the LM head only the sampled rows.
"""
from __future__ import annotations

import math


def capture_size(tokens: int, largest: int) -> int:
    """The captured batch size a step of `tokens` tokens replays (<= largest): 1, 2, 4, then
    multiples of 8. `tokens` itself when it is above `largest` (no graph) or not positive."""
    if tokens <= 0 or tokens > largest:
        return tokens
    if tokens <= 4:
        return 1 << (tokens - 1).bit_length()
    return min(8 * math.ceil(tokens / 8), largest)
