"""Early admission control: reject at arrival a request whose predicted TTFT exceeds a limit.

Prediction (per replica, at the request's arrival, before any of its work is done):

    predicted TTFT = (prefill tokens queued ahead of it + its own prompt) / recent prefill rate

Tokens queued ahead are the prompt tokens not yet computed of every request routed to the replica
and still in prefill (waiting, or running a chunked prompt), recompute-preempted requests
included. The recent prefill rate is prefill tokens per second of steps that carried prefill work,
averaged exponentially over about `window` such steps (mixed steps count whole: decodes that share
a step slow prefill down, and the estimate sees that). Cold start: before any step is observed
the average is seeded with one step of `probe_tokens` prompt tokens alone, priced by the run's
cost model, and that seed fades like any old observation.

Rejecting before the prefill runs is the point (Mooncake's early rejection): a request that would
miss its TTFT anyway should not take prefill time from the ones that can still make it.
"""
from __future__ import annotations

from typing import Iterable

from .cost import CostModel
from .request import Request
from .shape import StepShape

REASON_PREFIX = "admission:"


def prefill_tokens_ahead(queues: Iterable[Iterable[Request]]) -> int:
    """Prompt (or recompute) tokens still to compute of the requests in prefill in `queues`."""
    total = 0
    for queue in queues:
        for req in queue:
            outputs = req.num_output_tokens
            need = req.prompt_len + outputs - req.num_computed_tokens
            if outputs == 0 or need > 1:
                total += need
    return total


class TTFTPredictor:
    """One replica's prefill-rate estimate and the admission verdict built on it."""

    def __init__(self, limit: float, cost: CostModel, window: int = 32, probe_tokens: int = 512):
        if limit <= 0 or window < 1 or probe_tokens < 1:
            raise ValueError("admission needs limit > 0, window >= 1 and probe_tokens >= 1")
        self.limit = limit
        self.alpha = 2.0 / (window + 1)
        self.tokens = float(probe_tokens)  # exponentially averaged prefill tokens per observed step
        self.seconds = cost.step_time(StepShape(prefill=((probe_tokens, 0),), tokens_sampled=1))

    @property
    def rate(self) -> float:
        """Recent prefill tokens per second."""
        return self.tokens / self.seconds

    def observe(self, prefill_tokens: int, seconds: float) -> None:
        """Fold in one step that computed `prefill_tokens` prompt tokens in `seconds` (called per step)."""
        a = self.alpha
        self.tokens += a * (prefill_tokens - self.tokens)
        self.seconds += a * (seconds - self.seconds)

    def predict(self, tokens_ahead: int, prompt_len: int) -> float:
        """Seconds until a new request's prompt would be done, at the recent rate."""
        return (tokens_ahead + prompt_len) / self.rate

    def reject_reason(self, tokens_ahead: int, prompt_len: int) -> str:
        """Why a request arriving now is rejected (empty if it is admitted)."""
        predicted = self.predict(tokens_ahead, prompt_len)
        if predicted <= self.limit:
            return ""
        return (f"{REASON_PREFIX} predicted TTFT {predicted:.3g} s exceeds max_predicted_ttft {self.limit:g} s "
                f"({tokens_ahead} prefill tokens queued ahead + {prompt_len} own at {self.rate:.0f} tokens/s)")
