"""Speculative decoding: a decode step that verifies k proposed tokens and emits 1 + the accepted ones.

What a speculating decode is (vLLM V1, vllm/v1/core/sched/scheduler.py `schedule()` and
`update_from_output()`, and vllm/v1/spec_decode/): the request's last sampled token and its k draft
tokens run through the target model together, k + 1 query tokens over the request's context (its
`num_new_tokens` = num_tokens_with_spec - num_computed_tokens = 1 + k, counted against the token
budget and, as lookahead slots, against the KV cache); the rejection sampler keeps the longest
accepted prefix of the drafts plus one token the target samples itself, and `num_computed_tokens`
steps back over the rejected drafts. cbsim prices the verify row as a prefill row (c = 1 + k new
tokens, h = the context), so every cost model prices it as the chunk it is.

Acceptance (this module's `Speculator.accept`): position i is accepted with probability p_i given
positions 1..i-1 were, drawn from a child of the run's one seeded generator (a run without
speculation draws nothing and spawns nothing, so it is unchanged bit for bit). Mean acceptance length
(vLLM's `spec_decode` metrics: 1 + accepted / drafts) with one rate p for all k positions is
1 + p + p^2 + ... + p^k.

The drafter's cost, added to the step (per method):
- draft_model: k decode steps of the draft model over the speculating rows (vLLM's draft-model
  proposer runs the small model autoregressively, one forward per proposed token), priced by the
  run's cost model with the draft model's spec;
- eagle / eagle3 / mtp: one decoder layer per proposed token (EAGLE, arXiv:2401.15077, sec. 4: the
  draft head is a single transformer decoder layer fed the target's features; EAGLE-3,
  arXiv:2503.01840, keeps one layer; DeepSeek-V3's MTP module, arXiv:2412.19437 sec. 2.2, is one
  transformer block per depth), priced as 1/num_layers of the target's decode step over the rows,
  per proposed token (the shared LM head's share of that step is not separated: an approximation);
- ngram: nothing (prompt lookup on the CPU, vLLM's NgramProposer; its seconds are not modelled).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from cbsim.core.errors import ConfigError
from cbsim.core.schema import option, parse, require
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.shape import StepShape

METHODS = ("draft_model", "eagle", "eagle3", "mtp", "ngram")
LAYER_HEADS = ("eagle", "eagle3", "mtp")  # one decoder layer per proposed token

# Default acceptance, where a published figure exists: a mean acceptance length tau measured with
# k drafts, turned into the one per-position rate p with 1 + p + ... + p^k = tau (rate_for_length).
# eagle3: tau = 2.77 with K = 7 on MT-bench at temperature 1 for yuhuili/EAGLE3-LLaMA3.1-Instruct-8B
# (the comparison table of the nebius/EAGLE3-Llama-3.3-70B-Instruct model card, measured with
# rejection sampling). No such chain-draft figure was found offline for the other methods: they need
# `acceptance` given.
DEFAULT_LENGTHS = {"eagle3": (2.77, 7)}


def rate_for_length(tau: float, k: int) -> float:
    """The per-position rate p with 1 + p + ... + p^k = tau (bisection; 0 <= p <= 1)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if 1 + sum(mid ** i for i in range(1, k + 1)) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass
class SpeculativeConfig:
    """The experiment's `speculative:` section (vLLM's --speculative-config; SGLang's --speculative-*)."""

    method: Literal["draft_model", "eagle", "eagle3", "mtp", "ngram"] = option(
        help="who proposes the draft tokens: draft_model (a small model), eagle / eagle3 (a one-layer head on "
             "the target's features), mtp (the model's multi-token-prediction layers), ngram (prompt lookup)")
    num_speculative_tokens: int = option(help="k: draft tokens proposed and verified per decode step")
    model: Any = option(None, help="method draft_model: the draft model (preset, catalog name or spec); "
                        "other methods: unused (the head's cost is derived from the target)")
    acceptance: Any = option(None, help="per-position acceptance: one rate for every position, or a list of k "
                             "rates (position i accepted with p_i given i-1 accepted); null: the method's "
                             "published default (eagle3 only; see sim/speculative.py)")

    def validate(self) -> None:
        k = self.num_speculative_tokens
        require(isinstance(k, int) and k >= 1, "num_speculative_tokens", "an integer >= 1", k)
        if self.method == "draft_model":
            require(self.model is not None, "model", "the draft model (method draft_model)", self.model)
        rates = self.rates()
        require(all(0.0 <= p <= 1.0 for p in rates), "acceptance", "rates between 0 and 1", self.acceptance)

    def rates(self) -> tuple[float, ...]:
        """The k per-position acceptance rates."""
        k, given = self.num_speculative_tokens, self.acceptance
        if given is None:
            require(self.method in DEFAULT_LENGTHS, "acceptance", f"acceptance rates (method {self.method} has no "
                    "published default cbsim could cite: give one rate or a list of k rates)", given)
            return (rate_for_length(*DEFAULT_LENGTHS[self.method]),) * k
        if isinstance(given, (int, float)) and not isinstance(given, bool):
            return (float(given),) * k
        require(isinstance(given, list) and len(given) == k
                and all(isinstance(p, (int, float)) and not isinstance(p, bool) for p in given),
                "acceptance", f"a rate or a list of num_speculative_tokens ({k}) rates", given)
        return tuple(float(p) for p in given)


class Speculator:
    """One replica's speculation: its rates, its own child generator and its drafter's cost."""

    def __init__(self, config: SpeculativeConfig, rng: np.random.Generator, target_cost, num_layers: int,
                 draft_cost=None):
        self.k = config.num_speculative_tokens
        self.method = config.method
        self.rates = np.asarray(config.rates())
        self.rng = rng
        self.target_cost = target_cost
        self.num_layers = num_layers
        self.draft_cost = draft_cost
        self.rows: list[tuple[int, int]] = []  # the step's verify rows (drafts, context before it), set by begin

    def accept(self, drafts: int) -> int:
        """Drafts accepted of `drafts` proposed: the first position whose draw fails ends the run."""
        if drafts <= 0:
            return 0
        draws = self.rng.random(drafts)
        failed = np.flatnonzero(draws >= self.rates[:drafts])
        return int(failed[0]) if len(failed) else drafts

    def draft_seconds(self) -> float:
        """The drafter's seconds for the step's verify rows (self.rows: (drafts, context) pairs)."""
        rows = self.rows
        if not rows or self.method == "ngram":
            return 0.0
        steps = max(d for d, _ in rows)
        if self.method == "draft_model":
            return sum(self.draft_cost.step_time(StepShape(decode=tuple(h + 1 + j for d, h in rows if d > j),
                                                           tokens_sampled=sum(d > j for d, _ in rows)))
                       for j in range(steps))
        one = self.target_cost.step_time(StepShape(decode=tuple(h + 1 for _, h in rows), tokens_sampled=len(rows)))
        return steps * one / self.num_layers


@dataclass(frozen=True)
class Speculation:
    """What build.py hands each replica: the section, the target's and draft's cost models and the
    generator each replica's Speculator spawns its own child from (in replica order)."""

    config: SpeculativeConfig
    rng: np.random.Generator
    num_layers: int
    draft_cost: Any = None

    def make(self, target_cost) -> Speculator:
        return Speculator(self.config, self.rng.spawn(1)[0], target_cost, self.num_layers, self.draft_cost)


def parse_speculative(config) -> SpeculativeConfig | None:
    """The experiment's `speculative` section parsed (None: off); colocated clusters only, and a draft
    model that names a known model."""
    section = config.speculative
    if section is None or isinstance(section, SpeculativeConfig):
        return section
    spec = parse(SpeculativeConfig, section, "speculative")
    if config.cluster.mode == "pd":
        raise ConfigError("speculative", "null with cluster.mode pd (speculative decoding runs on colocated "
                          "clusters)", spec.method)
    if config.policy.get("name") == "static":
        raise ConfigError("speculative", "null with policy static (its batches decode one token a step; the "
                          "iteration-level policies speculate)", spec.method)
    if spec.method == "draft_model":
        model_spec(spec.model, "speculative.model")
    return spec


def speculation(config, target_model, rng: np.random.Generator, load_cost_model) -> Speculation | None:
    """The run's Speculation (None without a `speculative` section): a child of the run's generator,
    spawned only here, and the draft model's cost model (the run's cost model with the draft's spec)."""
    spec = parse_speculative(config)
    if spec is None:
        return None
    draft = None
    if spec.method == "draft_model":
        draft = load_cost_model(config.cost_model, model_spec(spec.model, "speculative.model"))
    return Speculation(spec, rng.spawn(1)[0], target_model.num_layers, draft)
