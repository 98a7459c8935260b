"""Cost-model speed: microseconds per step_time call and per decode_run_times step, and load times.

    python benchmarks/cost_models.py
"""
from __future__ import annotations

import time

import numpy as np

from cbsim.api import load_cost_model
from cbsim.sim.shape import StepShape

MODELS = {
    "unit": ({"type": "unit"}, "llama-3-8b"),
    "linear": ({"type": "linear", "base": 0.01, "per_token": 1e-4}, "llama-3-8b"),
    "roofline h100 llama-3-8b": ({"type": "roofline", "gpu": "h100", "tp": 1}, "llama-3-8b"),
    "vidur a100 llama-2-70b tp2": ({"type": "vidur", "gpu": "a100", "model": "llama-2-70b", "tp": 2}, "llama-2-70b"),
    "vidur h100 llama-3-8b": ({"type": "vidur", "gpu": "h100", "model": "llama-3-8b", "tp": 1}, "llama-3-8b"),
}
SHAPE = StepShape.from_batch(prefill=[(256, 1000)], decode=[1000] * 32)


def main() -> None:
    print(f"{'model':<30} {'load ms':>8} {'step_time us':>13} {'decode run us/step':>19}")
    for name, (mapping, model) in MODELS.items():
        started = time.perf_counter()
        cost = load_cost_model(mapping, model)
        load = time.perf_counter() - started
        calls = 20_000
        started = time.perf_counter()
        for _ in range(calls):
            cost.step_time(SHAPE)
        per_call = (time.perf_counter() - started) / calls
        contexts = np.full(32, 1000, dtype=np.int64)
        started = time.perf_counter()
        for _ in range(200):
            cost.decode_run_times(contexts, 100)
        per_step = (time.perf_counter() - started) / (200 * 100)
        print(f"{name:<30} {load * 1e3:8.1f} {per_call * 1e6:13.2f} {per_step * 1e6:19.3f}")


if __name__ == "__main__":
    main()
