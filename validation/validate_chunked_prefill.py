"""What a long prompt costs in 512-token chunks over one step, cbsim's roofline against the published range.

Published: a prompt prefilled in 512-token chunks costs +11..+20 % over one prefill step on 34B/70B models
on A100 (Sarathi-Serve, Agrawal et al., OSDI'24, figure 9, and Splitwise's tables, as issue 28 reads them).
Not re-read from the figure here: the range is the issue's.
cbsim: roofline, engine vllm-v1, the sum of the chunk steps (512 new tokens after h cached ones) over one
step of the whole prompt, with FlashAttention-2's wave efficiency on the SMs (prefill_occupancy, the default)
and without it (cbsim before issue 28).
Run: python validation/validate_chunked_prefill.py
"""
from __future__ import annotations

from cbsim.api import load_cost_model
from cbsim.sim.shape import StepShape

PUBLISHED = (0.11, 0.20)
CASES = [("codellama-34b", "a100", 2), ("llama-2-70b", "a100", 4), ("codellama-34b", "h100", 2),
         ("llama-2-70b", "h100", 4), ("llama-3.1-8b", "a100", 1), ("llama-3.1-8b", "h100", 1)]
PROMPTS = (2048, 4096, 8192, 16384)


def chunked_overhead(cost, prompt: int, chunk: int = 512) -> float:
    """(sum of the chunk steps) / (one step of the whole prompt) - 1."""
    one = cost.step_time(StepShape.from_batch(prefill=[(prompt, 0)]))
    steps = sum(cost.step_time(StepShape.from_batch(prefill=[(min(chunk, prompt - h), h)]))
                for h in range(0, prompt, chunk))
    return steps / one - 1


def overheads(model: str, gpu: str, tp: int, occupancy: bool = True) -> list[float]:
    cost = load_cost_model({"type": "roofline", "gpu": gpu, "tp": tp, "prefill_occupancy": occupancy}, model)
    return [chunked_overhead(cost, p) for p in PROMPTS]


if __name__ == "__main__":
    print(f"published (34B/70B, A100): +{PUBLISHED[0]:.0%}..+{PUBLISHED[1]:.0%}")
    print(f"{'model':<14} {'gpu':<5} {'tp':>2}  " + "  ".join(f"{f'P={p}':>17}" for p in PROMPTS)
          + "   (before -> now)")
    for model, gpu, tp in CASES:
        cells = "  ".join(f"{b:+6.1%} -> {a:+6.1%}" for b, a in zip(overheads(model, gpu, tp, False),
                                                                    overheads(model, gpu, tp)))
        print(f"{model:<14} {gpu:<5} {tp:>2}  {cells}")
