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

from cbsim.tools.scoreboard.published import INT4_L4 as SOURCE, INT4_L4_MS as PUBLISHED_MS, INT4_MODEL as MODEL
from cbsim.tools.scoreboard.runs import int4_run_ms as run_ms


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
