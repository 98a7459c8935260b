"""cbsim's roofline on int4 weight-only (AWQ, Marlin kernels) decode against published vLLM runs.

Source: github.com/bereketlemma/llm-inference-bench, results/Data/awq_marlin_results.csv (commit
e3c511995d0d6a0b7b4633f87a7396368cf0a1bc; the table in docs/validation/int4.md): vLLM 0.16.0 on one
NVIDIA L4 24GB, TheBloke/Mistral-7B-v0.1-AWQ (AWQ, 4 bits, group 128, run by vLLM's awq_marlin),
offline `LLM.generate` of `batch` copies of one short prompt, greedy, exactly `output_tokens` tokens
each (benchmark/runner.py @95ec40cc), 3 warm-up and 10 measured runs; mean_latency_ms is one run.
The prompt is one sentence; its token count is not published: PROMPT_TOKENS is an estimate (a
prefill of at most 8 x 26 tokens, under 1 % of any run).
The same repository's FP16 table (results/Data/fp16_results.csv) is not used: its latency and
tokens/s columns disagree with each other (batch 1, 128 tokens: 3,587 ms but 17.9 tok/s, i.e. 7.2 s).

Each row runs cbsim on the same shape (roofline on an L4, the default engine, every request at
t = 0) and prints the predicted run time, the published one and the error.
Run: python validation/validate_int4.py
"""
from __future__ import annotations

from cbsim.api import run_experiment

SOURCE = "bereketlemma/llm-inference-bench@e3c51199 results/Data/awq_marlin_results.csv"
PROMPT_TOKENS = 26  # estimate: one English sentence of 18 words and punctuation, plus BOS
MODEL = {"config": "mistral-7b", "weight_dtype": "int4", "weight_group_size": 128, "max_model_len": 2048}
# (batch, output tokens) -> mean_latency_ms of one run, as published (10 runs each)
PUBLISHED_MS = {
    (1, 128): 2084.076759099844, (1, 256): 4200.395622800352, (1, 512): 8459.656260000338,
    (4, 128): 2179.9132934003865, (4, 256): 4393.515665900122, (4, 512): 8990.099085800466,
    (8, 128): 2264.0909331006696, (8, 256): 4589.831577201039, (8, 512): 9545.16661609996,
}


def run_ms(batch: int, output_tokens: int, model=MODEL, gpu: str = "l4") -> float:
    """cbsim's time for one offline run: `batch` requests at once, fixed prompt and output lengths."""
    result = run_experiment({
        "name": "validate_int4", "seed": 0, "model": model,
        "cost_model": {"type": "roofline", "gpu": gpu, "tp": 1},
        "cluster": {"replicas": 1, "kv_cache": {"num_blocks": "auto", "gpu_memory_utilization": 0.9}},
        "policy": {"name": "sarathi", "token_budget": 2048, "max_num_seqs": 256},
        "workload": {"num_requests": batch, "arrival": {"type": "all_at_once"},
                     "prompt_len": {"type": "fixed", "value": PROMPT_TOKENS},
                     "output_len": {"type": "fixed", "value": output_tokens}},
        "output": {"plots": False, "trace": False}})
    return float(result.requests["completion_time"].max()) * 1e3


def rows() -> list[tuple[int, int, float, float, float]]:
    """(batch, output tokens, published ms, predicted ms, relative error) for every published row."""
    out = []
    for (batch, tokens), published in PUBLISHED_MS.items():
        predicted = run_ms(batch, tokens)
        out.append((batch, tokens, published, predicted, predicted / published - 1.0))
    return out


if __name__ == "__main__":
    print(f"int4 AWQ (Marlin) decode, Mistral-7B on one L4, vLLM 0.16.0 ({SOURCE})")
    print(f"{'batch':>5} {'tokens':>6} {'published ms':>12} {'cbsim ms':>9} {'error':>7}")
    errors = []
    for batch, tokens, published, predicted, error in rows():
        errors.append(abs(error))
        print(f"{batch:>5} {tokens:>6} {published:>12.0f} {predicted:>9.0f} {error:>+7.1%}")
    errors.sort()
    print(f"median |error| {errors[len(errors) // 2]:.1%}, max {errors[-1]:.1%}")
