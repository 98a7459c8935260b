"""Offered load against the simulated capacity: how near a run is to its knee.

Near saturation a few percent of step-time error becomes a 100x TTFT error (queues grow without bound
past the knee), so a run says how close it was: `offered_requests_per_s` (arrivals over their span;
None when every request arrives at once: a batch, not a rate), `capacity_requests_per_s` (what the
replicas complete in steady state) and `load_vs_capacity` (their ratio).

The capacity is the steady state of each replica's own cost model at its batch limit for this run's
mean request (prompt P, output O, read from the requests): B = min(max_num_seqs, token_budget, KV tokens /
(P + O/2)) sequences at the mean context P + O/2; each request takes O decode slots of B in a decode step of B
sequences, plus what its prefill adds to a step it joins:

    1 / capacity = O * t(B decodes) / B + (t(B decodes + a P-token prefill) - t(B decodes))

summed over the replicas. It is an estimate (no prefix-cache hits, no preemption, mean lengths, one
step per pipeline stage): a load_vs_capacity of 0.9 or more is near the knee. P/D clusters are not
estimated (None): their capacity is the slower pool's and the transfer's.
"""
from __future__ import annotations

import math

from cbsim.sim.metrics.summary_units import band_text
from cbsim.sim.shape import StepShape


def load_summary(pool, requests, mode: str = "colocated") -> dict:
    """{offered_requests_per_s, capacity_requests_per_s, load_vs_capacity} of a run."""
    offered = offered_rate(requests["arrival"].to_numpy())
    capacity = None
    if mode != "pd" and len(requests):
        prompt, output = float(requests["prompt_len"].mean()), float(requests["output_len"].mean())
        capacity = sum(replica_capacity(r.cost, r.kv.num_blocks * r.kv.unit_tokens, _batch_cap(r.policy.config),
                                        prompt, output) for r in pool)
    ratio = None if offered is None or not capacity else offered / capacity
    return {"offered_requests_per_s": offered, "capacity_requests_per_s": capacity, "load_vs_capacity": ratio}


def _batch_cap(config) -> int | None:
    """The most decode sequences a step of this policy holds: max_num_seqs, and the token budget (one
    token each), whichever is set and smaller."""
    caps = [c for c in (getattr(config, "max_num_seqs", None), getattr(config, "token_budget", None)) if c]
    return min(caps) if caps else None


def offered_rate(arrivals) -> float | None:
    """Requests per second over the arrival span ((n - 1) / (last - first)); None for one instant."""
    if len(arrivals) < 2:
        return None
    span = float(arrivals.max() - arrivals.min())
    return (len(arrivals) - 1) / span if span > 0 else None


def replica_capacity(cost, kv_tokens: int, max_batch: int | None, prompt: float, output: float) -> float:
    """Requests per second one replica completes in steady state (module docstring)."""
    resident = prompt + output / 2.0
    batch = max(1, int(kv_tokens // max(resident, 1.0)))
    if max_batch:
        batch = min(batch, int(max_batch))
    context = max(1, int(round(resident)))
    decode = cost.step_time(StepShape.from_batch(decode=[context] * batch))
    joined = cost.step_time(StepShape.from_batch(prefill=[(max(1, int(round(prompt))), 0)], decode=[context] * batch))
    per_request = output * decode / batch + max(joined - decode, 0.0)
    return 1.0 / per_request if per_request > 0 and math.isfinite(per_request) else 0.0


KNEE = 0.9  # load_vs_capacity from which a run is "near the knee" (within 10 % of its capacity)


def knee_note(summary: dict) -> str | None:
    """A warning line for a run within 10 % of its capacity or past it (None otherwise)."""
    ratio = summary.get("load_vs_capacity")
    if ratio is None or ratio < KNEE:
        return None
    where = "past its capacity" if ratio >= 1.0 else "within 10 % of its capacity"
    note = (f"near the knee: offered {summary['offered_requests_per_s']:.3g} req/s is {ratio:.0%} of the simulated "
            f"capacity ({summary['capacity_requests_per_s']:.3g} req/s), {where}: a few % of step-time error "
            "moves TTFT and E2E by orders of magnitude here; read this stage's latencies as a band")
    if "ttft_p50_low" not in summary:
        return note + " (cbsim run --band)"
    return (note + f": with step time x{summary['band_step_scale_low']:.3g} .. x{summary['band_step_scale_high']:.3g}"
            f" TTFT p50 is {band_text(summary, 'ttft_p50')}, E2E p50 {band_text(summary, 'e2e_p50')}")
