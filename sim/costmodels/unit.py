"""`unit`: every forward step takes the same time, whatever its shape.

For step-count scenarios and exact golden traces: with `seconds: 1`, the clock counts steps. An
empty shape runs no forward pass and costs nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cbsim.core.schema import option, require
from cbsim.sim.cost import CostModel
from cbsim.sim.shape import StepShape

from cbsim.sim.costmodels.registry import register_cost_model


@register_cost_model("unit")
class UnitCost(CostModel):
    """A constant step time."""

    @dataclass
    class Config:
        seconds: float = option(1.0, help="duration of every step, in seconds")

        def validate(self) -> None:
            require(self.seconds > 0, "seconds", "a positive number", self.seconds)

    def __init__(self, seconds: float = 1.0):
        self.seconds = float(seconds)

    @classmethod
    def from_config(cls, config: "UnitCost.Config", model=None) -> "UnitCost":
        return cls(config.seconds)

    def step_time(self, shape: StepShape) -> float:
        return 0.0 if shape.is_empty else self.seconds

    def decode_step_time(self, contexts, offset: int, context_sum: int) -> float:
        return self.seconds if len(contexts) else 0.0

    def mixed_step_time(self, prefill, contexts, offset: int, context_sum: int, sampled: int) -> float:
        return self.seconds if prefill or len(contexts) else 0.0

    def decode_run_times(self, contexts: np.ndarray, steps: int) -> np.ndarray:
        return np.full(steps, self.seconds if len(contexts) else 0.0, dtype=np.float64)

    def describe(self) -> dict:
        return {"type": self.name, "seconds": self.seconds}
