"""How a step's tokens spread over an MoE layer's experts when the router is uniform at random.

The model: each of T tokens picks k distinct experts of E, uniformly and independently of the other
tokens (what the auxiliary balancing losses train a router towards, in expectation). With expert
parallelism over n GPUs, GPU g holds m = E / n experts. Everything below follows from that one model,
so the experts a step touches, the tiles it computes and the busiest GPU it waits for agree.

- Expert i's rows: X_i ~ Binomial(T, k / E) exactly (a token picks i with probability k / E).
- Touched experts: E[#{X_i > 0}] = E (1 - (1 - k/E)^T), by linearity (exact).
- Padded tiles: a fused-MoE kernel (vLLM's Triton fused_moe, CUTLASS grouped GEMM) pads each expert's
  rows to whole row tiles and spreads all tiles over the SMs, so its compute is sum_i ceil(X_i / t),
  not the busiest expert's; E[sum_i ceil(X_i / t)] = E sum_{j >= 0} P(X > j t), by linearity (exact).
- GPU g's rows: R_g = sum over tokens of C_g, C_g ~ Hypergeometric(E, m, k) (how many of a token's k
  experts live on g), independent over tokens: mean mu = T k / n. Its distribution is the T-fold
  convolution of C_g's, computed exactly (by repeated squaring) while mu < EXACT_MEAN rows; beyond,
  the normal law of variance v = T k (1/n) (1 - 1/n) (E - k) / (E - 1), its excess over the mean
  scaled to meet the exact one at the switch (they differ by under 0.7 % of E[max R] there, for
  E = 8..256 and 2..E GPUs, and the scale keeps E[max R] continuous and monotone in T).
- The busiest GPU: M_ind = sum_x (1 - F(x)^n) is E[max] for n independent GPUs. The R_g are not
  independent: they are exchangeable with a fixed sum T k (covariance -v / (n - 1)), and a Gaussian
  vector with that covariance is mu + s (Z_g - mean(Z)), Z iid N(0, 1), s^2 = v n / (n - 1), whose
  maximum exceeds mu by sqrt(n / (n - 1)) times what n independent ones would. So
  E[max R] = mu + sqrt(n / (n - 1)) (M_ind - mu) (in the normal range M_ind = mu + sqrt(v) e_n, e_n =
  E[max of n iid N(0, 1)]), at least ceil(mu) (some GPU holds the mean, in whole rows) and at most
  T min(k, m). Against Monte Carlo (tests/sim/costmodels/test_moe_routing.py) it is within 4 % from one token up,
  for E = 8..256, k = 2..8 and 2..E GPUs.
- The busiest GPU's touched experts: each of its m experts is touched with probability
  q = 1 - (1 - k/E)^T; E[max over the n GPUs of Binomial(m, q)], exact for independent GPUs and
  experts (`independent_busiest_experts`, the cost model's rule before this module), at least
  max(ceil(k / n), D / n) (a step touches D >= k experts, and the busiest GPU holds at least its share).
- The busiest GPU's tiles: the larger of (a) m E[ceil(Y / t)], its experts' loads taken binomial
  with the rate that gives them E[max R] rows in all (Y ~ Binomial(T, E[max R] / (T m))), and (b) its
  touched experts times the tiles of a touched expert, E[ceil(X / t)] / P(X > 0) (few tokens, where
  the busiest GPU is the one with the most experts to read). An approximation of a maximum of sums
  of ceilings: within 3 % of Monte Carlo on the test grid (tests/sim/costmodels/test_moe_routing.py), up to +17 %
  where the busiest GPU's load sits just under a tile boundary (E = 64, k = 6, one expert per GPU,
  1,024 tokens: every GPU computes one tile, the estimate 1.17); it matters only where the step is
  compute-bound.

Invariant: every method is a deterministic function of a token count (Python floats in and out), so
`step_time` and `decode_run_times` see the same values; results are cached per token count.
"""
from __future__ import annotations

import math

import numpy as np

from cbsim.sim.costmodels.gemm_efficiency import TILE

EXACT_MEAN = 128  # mean rows per GPU below which the GPU-row distribution is convolved exactly


class UniformRouting:
    """Expected loads of E experts under uniform top-k routing, spread whole over `ranks` GPUs."""

    def __init__(self, experts: int, top_k: int, ranks: int = 1, tile: int = TILE):
        if experts % ranks:
            raise ValueError(f"{ranks} GPUs do not divide {experts} experts")
        self.experts, self.top_k, self.ranks, self.tile = experts, top_k, ranks, tile
        self.per_rank = experts // ranks
        self._max_normal = expected_max_normal(ranks)
        self._normal_scale: float | None = None  # exact / normal excess at the switch (set on first use)
        self._cache: dict[tuple[str, float], float] = {}

    def touched(self, tokens: float) -> float:
        """Expected distinct experts a step of `tokens` tokens routes to."""
        e, k = float(self.experts), float(self.top_k)
        return e * (1.0 - (1.0 - k / e) ** tokens)

    def padded_tiles(self, tokens: float) -> float:
        """E[sum over experts of ceil(rows / tile)]: the row tiles a fused-MoE kernel computes."""
        p = self.top_k / self.experts
        return self._cached("tiles", tokens, lambda t: self.experts * _mean_ceil(int(round(t)), p, self.tile))

    def independent_busiest_experts(self, tokens: float) -> float:
        """E[max over the GPUs of Binomial(m, q)] touched experts, GPUs and experts taken independent."""
        return self._cached("independent", tokens, self._independent_experts)

    def busiest_rank_experts(self, tokens: float) -> float:
        """E[max over the GPUs of the experts a step touches on one GPU], floored as the docstring says."""
        if tokens <= 0:
            return 0.0
        floor = max(math.ceil(self.top_k / self.ranks), self.touched(tokens) / self.ranks)
        return max(self.independent_busiest_experts(tokens), floor)

    def busiest_rank_rows(self, tokens: float) -> float:
        """E[max over the GPUs of the token-expert rows routed to one GPU]."""
        return self._cached("rows", tokens, self._busiest_rows)

    def busiest_rank_tiles(self, tokens: float) -> float:
        """Expected row tiles the busiest GPU computes (the larger of the two estimates above)."""
        return self._cached("busiest tiles", tokens, self._busiest_tiles)

    def _busiest_tiles(self, tokens: float) -> float:
        per_expert = self.padded_tiles(tokens) / self.experts  # E[ceil(X / t)]
        if self.ranks == 1:
            return self.padded_tiles(tokens)
        raised = self.busiest_rank_rows(tokens) / (tokens * self.per_rank)  # its experts' share of a token
        by_rows = self.per_rank * _mean_ceil(int(round(tokens)), raised, self.tile)
        touched_share = self.touched(tokens) / self.experts  # P(X > 0)
        by_experts = self.busiest_rank_experts(tokens) * per_expert / touched_share
        return max(by_rows, by_experts)

    def _cached(self, kind: str, tokens: float, compute) -> float:
        key = (kind, tokens)
        if key not in self._cache:
            self._cache[key] = compute(tokens) if tokens > 0 else 0.0
        return self._cache[key]

    def _independent_experts(self, tokens: float) -> float:
        m, n = self.per_rank, self.ranks
        if n == 1:
            return self.touched(tokens)
        q = 1.0 - (1.0 - self.top_k / self.experts) ** tokens
        cdf, expected = 0.0, 0.0
        for j in range(m):  # E[max] = sum over j >= 1 of P(max >= j) = 1 - P(X <= j - 1)^n
            cdf += math.comb(m, j) * q ** j * (1.0 - q) ** (m - j)
            expected += 1.0 - min(cdf, 1.0) ** n
        return expected

    def _busiest_rows(self, tokens: float) -> float:
        k, n, m = self.top_k, self.ranks, self.per_rank
        mean = tokens * k / n
        if n == 1:
            return mean
        switch = math.ceil(EXACT_MEAN * n / k)  # first token count priced by the normal law
        if tokens < switch:
            independent_excess = self._exact_excess(int(round(tokens)))
        else:
            if self._normal_scale is None:
                self._normal_scale = self._exact_excess(switch) / self._normal_excess(float(switch))
            independent_excess = self._normal_scale * self._normal_excess(tokens)
        estimate = mean + math.sqrt(n / (n - 1.0)) * independent_excess
        return min(max(estimate, float(math.ceil(mean - 1e-9))), tokens * min(k, m))

    def _exact_excess(self, tokens: int) -> float:
        """E[max of n independent GPUs' rows] - mean, from the exact distribution of one GPU's rows."""
        cdf = np.cumsum(_rank_rows_pmf(self.experts, self.per_rank, self.top_k, tokens))
        return float(np.sum(1.0 - np.clip(cdf[:-1], 0.0, 1.0) ** self.ranks)) - tokens * self.top_k / self.ranks

    def _normal_excess(self, tokens: float) -> float:
        """The same in the normal limit: sqrt(v) e_n."""
        e, k, n = float(self.experts), float(self.top_k), float(self.ranks)
        return math.sqrt(tokens * k * (1.0 / n) * (1.0 - 1.0 / n) * (e - k) / (e - 1.0)) * self._max_normal


def expected_max_normal(n: int) -> float:
    """E[max of n iid standard normals] (0 for n = 1): the integral of x n phi(x) Phi(x)^(n-1) dx
    (trapezoids of 1/1,000 over [-12, 12])."""
    if n <= 1:
        return 0.0
    x = np.linspace(-12.0, 12.0, 24001)
    phi = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    cdf = 0.5 * np.array([math.erfc(-v / math.sqrt(2.0)) for v in x])
    y = x * n * phi * cdf ** (n - 1)
    return float(np.sum(y[1:] + y[:-1]) * 0.5 * (x[1] - x[0]))


def _rank_rows_pmf(experts: int, per_rank: int, top_k: int, tokens: int) -> np.ndarray:
    """Distribution of one GPU's rows: the `tokens`-fold convolution of Hypergeometric(E, m, k)."""
    total = math.comb(experts, top_k)
    one = np.array([math.comb(per_rank, j) * math.comb(experts - per_rank, top_k - j) / total
                    for j in range(min(top_k, per_rank) + 1)])
    out, power = np.array([1.0]), one
    while tokens:
        if tokens & 1:
            out = _convolve(out, power)
        tokens >>= 1
        if tokens:
            power = _convolve(power, power)
    return out / out.sum()


def _convolve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Full convolution of two distributions by FFT, rounding noise clipped at 0."""
    size = len(a) + len(b) - 1
    n = 1 << (size - 1).bit_length()
    out = np.fft.irfft(np.fft.rfft(a, n) * np.fft.rfft(b, n), n)[:size]
    return np.clip(out, 0.0, None)


def _mean_ceil(tokens: int, p: float, tile: int) -> float:
    """E[ceil(X / tile)] for X ~ Binomial(tokens, p): sum over j >= 0 of P(X > j tile)."""
    if tokens <= 0 or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return float(math.ceil(tokens / tile))
    j = np.arange(tokens, dtype=np.float64)  # log pmf(j + 1) - log pmf(j) = log((T - j) / (j + 1)) + logit p
    steps = np.log((tokens - j) / (j + 1.0)) + math.log(p / (1.0 - p))
    log_pmf = tokens * math.log1p(-p) + np.concatenate(([0.0], np.cumsum(steps)))
    cdf = np.cumsum(np.exp(log_pmf - log_pmf.max()))
    cdf /= cdf[-1]
    edges = np.arange(0, tokens // tile + 1) * tile
    return float(np.sum(1.0 - np.minimum(cdf[edges], 1.0)))
