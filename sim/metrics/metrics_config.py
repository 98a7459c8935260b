"""How a run's results are summarised: the `metrics:` section of an experiment (SLOs, thresholds,
plot and trace limits). Plain typed configuration; the computations live in the metric modules."""
from __future__ import annotations

from dataclasses import dataclass

from cbsim.core.schema import option, require
from cbsim.core.units import SLOSeconds


@dataclass
class SLOConfig:
    """Service-level objectives; a request meets the SLO set when it finished and meets every one set."""

    ttft: SLOSeconds | None = option(None, help="max time to first token: a duration (500ms, 0.5s; a bare number "
                                     "is seconds); null: no TTFT objective")
    tpot: SLOSeconds | None = option(None, help="max time per output token after the first: a duration (50ms; "
                                     "a bare number is seconds); null: none")
    itl_max: SLOSeconds | None = option(
        None, help="max gap between two consecutive tokens of a request: a duration (200ms; a bare number is "
                   "seconds); null: none")

    def is_set(self) -> bool:
        """Whether any objective is set: without one there is no goodput and no attainment (null)."""
        return any(getattr(self, name) is not None for name in ("ttft", "tpot", "itl_max"))

    def validate(self) -> None:
        for name in ("ttft", "tpot", "itl_max"):
            value = getattr(self, name)
            require(value is None or value > 0, name, "a positive number of seconds or null", value)


@dataclass
class BandConfig:
    """A prediction band on the latencies (cbsim/band.py): the run simulated again with every step's kernel
    time at the low and at the high end of the cost model's uncertainty. Off by default (two more runs)."""

    interval: float | None = option(None, help="central probability of the band from a fitted cost model's "
                                    "out-of-fold residual quantiles (0.9: its 5th and 95th percentile step-time "
                                    "factors); null: not from residuals")
    step_scales: list[float] | None = option(None, help="[low, high]: factors on every step's kernel time, for any "
                                             "cost model with an engine (roofline, vidur, fitted), e.g. a "
                                             "scoreboard cell's or a calibration's error: [0.9, 1.15]; null: none")

    def is_set(self) -> bool:
        """Whether a band is asked for (one of interval, step_scales)."""
        return self.interval is not None or self.step_scales is not None

    def validate(self) -> None:
        require(self.interval is None or 0 < self.interval < 1, "interval", "a probability in (0, 1) or null",
                self.interval)
        scales = self.step_scales
        require(scales is None or (len(scales) == 2 and 0 < scales[0] <= 1 <= scales[1]), "step_scales",
                "[low, high] with 0 < low <= 1 <= high, or null", scales)
        require(self.interval is None or scales is None, "interval", "null when step_scales is set (one source "
                "of the band)", self.interval)


@dataclass
class MetricsConfig:
    """How the run's results are summarised."""

    long_prompt_threshold: int = option(2048, help="prompts of at least this many tokens are 'long' (dec@P, short_P)")
    slo: SLOConfig = option(default_factory=SLOConfig, help="objectives for goodput and SLO attainment")
    stall_factor: float = option(5.0, help="an ITL gap above stall_factor x the run's median ITL is a stall")
    cdf_max_points: int = option(2000, help="at most this many points per CDF curve in plots")
    percentiles: list[float] = option([50, 90, 99], help="percentiles of bench.json (p<q>_ttft_ms, ...), as "
                                      "vllm bench serve --metric-percentiles; numpy's linear method, like every "
                                      "percentile in cbsim")
    trace_max_requests: int = option(1000, help="the trace also draws a lane per request (queue, prefill, decode, "
                                     "KV transfers) for at most this many of the requests arriving within the "
                                     "traced steps, the first by arrival; 0 = none")
    trace_max_steps: int = option(50_000, help="the Perfetto trace (output.trace) holds at most this many steps, "
                                  "the first ones (~18 MB; 0 = none)")
    band: BandConfig = option(default_factory=BandConfig, help="prediction band of TTFT and E2E near the knee: "
                              "the run again at the low and high step-time bound (cbsim run --band)")

    def validate(self) -> None:
        require(self.long_prompt_threshold >= 1, "long_prompt_threshold", "an integer >= 1", self.long_prompt_threshold)
        require(self.stall_factor > 0, "stall_factor", "a positive number", self.stall_factor)
        require(self.cdf_max_points >= 2, "cdf_max_points", "an integer >= 2", self.cdf_max_points)
        require(bool(self.percentiles) and all(0 <= q <= 100 for q in self.percentiles), "percentiles",
                "a non-empty list of numbers in [0, 100]", self.percentiles)
        require(self.trace_max_requests >= 0, "trace_max_requests", "an integer >= 0", self.trace_max_requests)
        require(self.trace_max_steps >= 0, "trace_max_steps", "an integer >= 0", self.trace_max_steps)
