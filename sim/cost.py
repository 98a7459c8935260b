"""The cost-model interface the event loop calls; implementations live in cbsim.sim.costmodels.

The simulator only ever asks "how long does a step of this shape take". `decode_run_times` is
the fast path for a run of pure-decode steps in which every context grows by one token per step;
an implementation that overrides it must return exactly (bit for bit) what `step_time` returns
for each of those steps, which is what lets the replica skip ahead without changing results.
`decode_step_time` is the same for one step of such a run, in plain Python (short runs),
`decode_pricer` the same as one function of a fixed set of rows (called at every step of a prompt
run's decode phase), and `mixed_step_time` for a step of prefill chunks beside such decode rows.
"""
from __future__ import annotations

import numpy as np

from cbsim.sim.shape import StepShape


class CostModel:
    """Base class: subclasses implement `step_time`; may override `decode_run_times`."""

    name = "base"

    def step_time(self, shape: StepShape) -> float:
        """Seconds one forward step of this shape takes. Called once per simulated step."""
        raise NotImplementedError

    def decode_run_times(self, contexts: np.ndarray, steps: int) -> np.ndarray:
        """Durations of `steps` consecutive pure-decode steps; step j has contexts + j.

        Called by a replica that may skip ahead; the default asks `step_time` step by step.
        """
        out = np.empty(steps, dtype=np.float64)
        base = [int(x) for x in contexts]
        n = len(base)
        for j in range(steps):
            out[j] = self.step_time(StepShape(decode=tuple(x + j for x in base), tokens_sampled=n))
        return out

    def decode_step_time(self, contexts: list[int], offset: int, context_sum: int) -> float:
        """Seconds of one pure-decode step whose rows have contexts `contexts` + `offset`
        (`context_sum`: their sum, offset included): the scalar twin of `decode_run_times`, called
        step by step over a short decode run. An override must return exactly what `step_time` returns."""
        return self.step_time(StepShape(decode=tuple(x + offset for x in contexts), tokens_sampled=len(contexts)))

    def decode_pricer(self, contexts: list[int]):
        """context_sum -> decode_step_time of these rows at the offset that sum implies (the rows are fixed
        until one leaves; step j's sum is sum(contexts) + len(contexts) j): asked once per set of rows,
        then called once a step. An override prices from the sum alone, in as few calls as it can, and
        returns exactly what `step_time` returns."""
        step_time, base, n = self.decode_step_time, sum(contexts), len(contexts)
        return lambda context_sum: step_time(contexts, (context_sum - base) // n if n else 0, context_sum)

    def mixed_step_time(self, prefill: tuple, contexts: list[int], offset: int, context_sum: int,
                        sampled: int) -> float:
        """Seconds of a step of prefill rows `prefill` beside decode rows of contexts `contexts` + `offset`
        (`context_sum`: their sum, offset included) that samples `sampled` tokens: step_time of that shape,
        called step by step over a prompt run (sim/prompt_run.py). An override prices it from the decode
        rows' count and sum and must return exactly what `step_time` returns."""
        return self.step_time(StepShape(prefill, tuple(x + offset for x in contexts), 0, sampled))

    def describe(self) -> dict:
        """A small JSON-able description recorded with the results."""
        return {"type": self.name}


def decode_run_reads(contexts: np.ndarray, steps: int) -> tuple[int, np.ndarray]:
    """(batch size, context tokens read at each of `steps` decode steps, as float64): step j reads
    sum(contexts) + j * batch, for vectorised `decode_run_times` implementations."""
    n = len(contexts)
    total = int(np.asarray(contexts, dtype=np.int64).sum())
    return n, (total + n * np.arange(steps, dtype=np.int64)).astype(np.float64)
