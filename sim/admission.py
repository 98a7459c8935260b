"""Admission signals: when a replica takes a request in.

Early rejection at arrival (`TTFTPredictor`): reject a request whose predicted TTFT exceeds a limit.
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

Overload (`queue_full_reason`, admission.max_queued_requests): a request arriving while that many
requests wait at the replica (its waiting queue, preempted ones included, and those routed there at
the same instant) is rejected, as SGLang's --max-queued-requests aborts it with "The request queue is
full." (python/sglang/srt/managers/scheduler.py Scheduler._abort_on_queued_limit: rejected unless
len(waiting_queue) + 1 <= max_queued_requests; its priority variant, which may abort a waiting
request instead, is not modelled).

Per-step admission limits, applied by BatchBuilder.admit (policies/batch.py) to every policy:
- `DecodeReserve` (admission.decode_reserve): SGLang's new_token_ratio. KV an admission may use is
  free + evictable - watermark - the running requests' expected future decode tokens, each
  min(outputs left, clip) x ratio; a new request needs room for its own input and its own
  min(outputs left, clip) (not scaled). The ratio starts at init, decays by a fixed step each
  decode step without preemption down to min, and after a preemption jumps to
  (outputs so far + 20 x requests) / (output lengths + 1) of the requests still running, capped at 1.
- TPOT slack (admission.tpot_slack): while a running request is decoding, a new request is not
  admitted into a step whose predicted time exceeds tpot_slack x metrics.slo.tpot (SchedulerState.step_cap).
"""
from __future__ import annotations

from typing import Iterable

from cbsim.sim.cost import CostModel
from cbsim.sim.request import Request
from cbsim.sim.shape import StepShape

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


def queue_full_reason(queued: int, limit: int) -> str:
    """Why a request arriving with `queued` requests waiting is rejected (empty if there is room)."""
    if queued + 1 <= limit:
        return ""
    return f"{REASON_PREFIX} the request queue is full ({queued} waiting, max_queued_requests {limit})"


# SGLang's defaults (python/sglang/srt/environ.py, formerly global_config.py): SGLANG_INIT_NEW_TOKEN_RATIO,
# SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR, SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS, SGLANG_RETRACT_DECODE_STEPS
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20


class DecodeReserve:
    """SGLang's estimate of the KV that the running requests will still write (new_token_ratio).

    Source: sgl-project/sglang ad0119fd, python/sglang/srt/managers/schedule_policy.py PrefillAdder
    (rem_total_tokens = available + evictable - rem_total_token_offset; the offset starts at
    sum over the running batch of min(max_new_tokens - len(output_ids), CLIP_MAX_NEW_TOKENS) x
    new_token_ratio; add_one_req needs extend_input_len + min(max_new_tokens - outputs, CLIP) <
    rem_total_tokens and, for a whole prompt, adds extend_input_len + min(max_new_tokens, CLIP) to
    the offset, only the chunk for a truncated one), scheduler.py (init_new_token_ratio =
    min(0.7 x schedule_conservativeness, 1), min = init x 0.14, decay = (init - min) / 600 per
    decode step that needed no retraction) and schedule_batch.py retract_decode (after a retraction
    the ratio becomes min(1, (decoded tokens + 20 x len(reqs)) / (sum of max_new_tokens + 1)) over
    the requests kept). cbsim knows each request's true output_len and uses it for max_new_tokens
    (SGLang only knows the client's cap, usually larger, so it reserves more).

    The replica calls `after_step` once per step (and `decay_steps` for a fast-forwarded run);
    policies read `ratio` and `future` through BatchBuilder.
    """

    def __init__(self, conservativeness: float = 1.0, clip: int = 4096):
        self.init = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.min = min(self.init * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.decay = (self.init - self.min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.ratio = self.init
        self.clip = clip

    def future(self, req: Request) -> int:
        """Future decode tokens `req` is expected to write, clipped (unscaled)."""
        return max(min(req.output_len - req.num_output_tokens, self.clip), 0)

    def after_step(self, preempted: bool, decoded: bool, running: Iterable[Request]) -> None:
        """Update the ratio after planning a step: jump after a preemption, else decay if it decodes."""
        if preempted:
            running = list(running)
            if not running:
                self.ratio = self.init
                return
            decoded_tokens = sum(r.num_output_tokens for r in running)
            total = sum(r.output_len for r in running)
            self.ratio = min(1.0, (decoded_tokens + RETRACT_DECODE_STEPS * len(running)) / (total + 1))
        elif decoded:
            self.ratio = max(self.min, self.ratio - self.decay)

    def decay_steps(self, count: int) -> None:
        """`count` more decode steps without preemption (the rest of a fast-forwarded run)."""
        for _ in range(count):
            self.ratio = max(self.min, self.ratio - self.decay)
