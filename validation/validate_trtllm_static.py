"""cbsim's roofline against TensorRT-LLM's published static-batch FP8 throughput (v0.9.0), the table
where Mistral-7B (8 KV heads) runs about as fast as LLaMA-7B (32 KV heads) at the same batch.

Source: NVIDIA/TensorRT-LLM docs/source/performance/perf-overview.md as of v0.9.0 ("All data was
generated using version 0.9.0"; nvidia.github.io/TensorRT-LLM/performance/perf-overview.html before the
v0.10 switch to in-flight batching), sections "H100 GPUs (FP8)" and "H200 GPUs (FP8)": a static batch of
the given size, fixed input and output lengths, TP1, output tokens/s per GPU. TensorRT-LLM v0.9 builds
FP8 engines with an FP8 KV cache (--qformat fp8 --kv_cache_dtype fp8). LLaMA 7B is priced as
Llama-2-7B (the catalog's MHA 7B). LLaMA 7B at 2048/2048 on H100 is not in the excerpt we could read.

MMHA_FRACTION (attention_structure.py) is fitted on the H100 rows; the H200 rows are held out.
A static batch, as gptSessionBenchmark runs it: the context phase of all B prompts in one step (it samples
the first token), then OSL - 1 decode steps of the B sequences; throughput = B OSL / time.
Run: python validation/validate_trtllm_static.py
"""
from __future__ import annotations

import numpy as np

from cbsim.api import load_cost_model
from cbsim.sim.shape import StepShape

SOURCE = "NVIDIA/TensorRT-LLM perf-overview.md v0.9.0 (static batching, FP8)"
PUBLISHED = {  # (model, gpu) -> [(batch, isl, osl, output tokens/s/GPU)]
    ("mistral-7b", "h100"): [(896, 128, 128, 20404), (120, 128, 2048, 8623), (84, 2048, 128, 2405),
                             (56, 2048, 2048, 3731)],
    ("llama-2-7b", "h100"): [(896, 128, 128, 19854), (120, 128, 2048, 6944), (84, 2048, 128, 2163)],
    ("mistral-7b", "h200"): [(896, 128, 128, 20460), (120, 128, 2048, 8950), (64, 2048, 128, 2423),
                             (56, 2048, 2048, 3867)],
    ("llama-2-7b", "h200"): [(896, 128, 128, 20618), (120, 128, 2048, 8348), (64, 2048, 128, 2391),
                             (56, 2048, 2048, 3522)],
}


def static_throughput(cost, batch: int, isl: int, osl: int) -> float:
    """Output tokens/s of one static batch: one context step of every prompt, then osl - 1 decode steps."""
    prefill = cost.step_time(StepShape.from_batch(prefill=[(isl, 0)] * batch))
    decode = cost.decode_run_times(np.full(batch, isl, dtype=np.int64), osl - 1) if osl > 1 else np.zeros(0)
    return batch * osl / (prefill + float(decode.sum()))


def rows(extra: dict | None = None):
    """(model, gpu, batch, isl, osl, published, predicted) for every published row."""
    out = []
    for (model, gpu), published in PUBLISHED.items():
        spec = {"config": model, "weight_dtype": "fp8", "kv_dtype": "fp8"}
        cost = load_cost_model({"type": "roofline", "gpu": gpu, "tp": 1, "engine": "trtllm", **(extra or {})}, spec)
        for batch, isl, osl, tput in published:
            out.append((model, gpu, batch, isl, osl, tput, static_throughput(cost, batch, isl, osl)))
    return out


V09_ENGINE = {"engine": {"preset": "trtllm", "decode_attention_per_query_head": True}}  # masked MHA (v0.9)


if __name__ == "__main__":
    print(SOURCE)
    print("cbsim: roofline, engine trtllm. 'per KV head': decode attention priced by its KV bytes (a kernel packing a"
          " KV head's query heads per CTA: XQA, FlashAttention); 'per query head': v0.9's masked-MHA kernel, one CTA"
          " per query head on CUDA cores (decode_attention_per_query_head, sim/costmodels/attention_structure.py)")
    print(f"{'model':<11} {'gpu':<5} {'batch':>5} {'isl/osl':>10} {'published':>10} {'per KV head':>18} "
          f"{'per query head':>18}")
    for once, per_head in zip(rows(), rows(V09_ENGINE)):
        model, gpu, batch, isl, osl, tput, a = once
        b = per_head[-1]
        print(f"{model:<11} {gpu:<5} {batch:>5} {f'{isl}/{osl}':>10} {tput:>10,} {a:>9,.0f} {a / tput - 1:>+7.1%} "
              f"{b:>9,.0f} {b / tput - 1:>+7.1%}")
