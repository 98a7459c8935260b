"""`linear`: step time = base + per_token * tokens + per_seq * sequences + per_kv_token * cached tokens read.

Tokens count every row pushed through the GEMMs (prefill chunk tokens and decode rows, padding
included); cached tokens read are the history h of each prefill chunk plus each decode row's
context. For teaching and tests. Invariant: `step_time` and `decode_run_times` evaluate the same
`_seconds` on the same exact integer features, so they agree bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cbsim.core.schema import option, require
from cbsim.sim.cost import CostModel, decode_run_reads
from cbsim.sim.shape import StepShape

from cbsim.sim.costmodels.registry import register_cost_model


@register_cost_model("linear")
class LinearCost(CostModel):
    """An affine function of tokens, sequences and cached tokens read."""

    @dataclass
    class Config:
        base: float = option(0.01, help="fixed seconds per step")
        per_token: float = option(1.0e-4, help="seconds per new token (prefill tokens and decode rows, padding included)")
        per_seq: float = option(0.0, help="seconds per sequence in the batch")
        per_kv_token: float = option(0.0, help="seconds per cached token read (prefill history + decode contexts)")

        def validate(self) -> None:
            for key in ("base", "per_token", "per_seq", "per_kv_token"):
                require(getattr(self, key) >= 0, key, "a non-negative number", getattr(self, key))
            require(self.base > 0 or self.per_token > 0 or self.per_seq > 0, "base",
                    "a positive base, per_token or per_seq (a non-empty step must take time)", self.base)

    def __init__(self, base: float = 0.01, per_token: float = 1.0e-4, per_seq: float = 0.0,
                 per_kv_token: float = 0.0):
        self.base = float(base)
        self.per_token = float(per_token)
        self.per_seq = float(per_seq)
        self.per_kv_token = float(per_kv_token)

    @classmethod
    def from_config(cls, config: "LinearCost.Config", model=None) -> "LinearCost":
        return cls(config.base, config.per_token, config.per_seq, config.per_kv_token)

    def _seconds(self, tokens, seqs, kv_read):
        """The model on aggregate features; works on floats and on numpy arrays alike."""
        return self.base + self.per_token * tokens + self.per_seq * seqs + self.per_kv_token * kv_read

    def step_time(self, shape: StepShape) -> float:
        return self.mixed_step_time(shape.prefill, shape.decode, 0, sum(shape.decode), shape.tokens_sampled)

    def mixed_step_time(self, prefill, contexts, offset: int, context_sum: int, sampled: int) -> float:
        if not (prefill or contexts):
            return 0.0  # step_time's, from the decode rows' count and context sum (O(1) in them)
        kv_read = sum(h for _, h in prefill) + context_sum
        tokens, seqs = sum(c for c, _ in prefill) + len(contexts), len(prefill) + len(contexts)
        return self._seconds(float(tokens), float(seqs), float(kv_read))

    def decode_step_time(self, contexts, offset: int, context_sum: int) -> float:
        return self.mixed_step_time((), contexts, offset, context_sum, len(contexts))

    def decode_run_times(self, contexts: np.ndarray, steps: int) -> np.ndarray:
        n, kv_read = decode_run_reads(contexts, steps)
        if n == 0:
            return np.zeros(steps, dtype=np.float64)
        return np.asarray(self._seconds(float(n), float(n), kv_read), dtype=np.float64)

    def describe(self) -> dict:
        return {"type": self.name, "base": self.base, "per_token": self.per_token, "per_seq": self.per_seq,
                "per_kv_token": self.per_kv_token}
