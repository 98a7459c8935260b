"""The experiment's `workload:` section: which source of requests, and its options.

Invariant: a parsed WorkloadConfig names exactly one source, and every error names its key path:
- an explicit list (`requests`), used as is;
- a trace (`trace`): arrivals and lengths from a file; `arrival` may replace its timestamps and is
  required for traces without them (sharegpt, arxiv); `shared_prefix` may add system prompts;
- synthetic: `num_requests` with an `arrival` process and `prompt_len` / `output_len`
  distributions, optionally a `shared_prefix` structure (`num_requests` may be left out with load
  stages: the stages then say how many requests arrive).

A synthetic source may instead be `agentic` (workloads/agentic.py): `agentic.sessions` sessions start
at `arrival`'s times, each a program of turns, tool calls and sub-agents (no `num_requests`).

Any source may add clients: `max_concurrency` (closed loop, with `think_time`) and `timeout`
(clients.py). Without `arrival`, a closed-loop synthetic or untimed trace source sends all at once.

Distribution mappings are discriminated by `type` (`{type: poisson, rate: 4.0}`); `parse_tagged`
picks the dataclass by `type` and parses the remaining keys with cbsim.core.schema.parse.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass

from cbsim.core.errors import ConfigError, missing
from cbsim.core.schema import coerce, option, parse, require
from cbsim.sim.durations import CLOCK_LIMIT
from cbsim.core.units import Seconds

from cbsim.workloads.agentic import TAGGED as AGENTIC_TAGGED, AgenticConfig, check_agentic
from cbsim.workloads.arrivals import ARRIVALS, AllAtOnceArrival, ArrivalConfig, StagesArrival
from cbsim.workloads.lengths import LENGTHS, LengthConfig
from cbsim.workloads.multimodal import MultimodalConfig, check_mm_inputs
from cbsim.workloads.prefixes import SharedPrefixConfig
from cbsim.workloads.tool_times import TOOL_TIMES
from cbsim.workloads.trace_source import TraceConfig
from cbsim.workloads.traces import LENGTH_ONLY_FORMATS

HASHED_FORMATS = ("mooncake", "generic_csv", "generic_jsonl")  # traces whose rows may carry prefix hashes


@dataclass
class ExplicitRequest:
    """One request of an explicit list."""

    arrival: Seconds = option(help="arrival time in seconds (>= 0)")
    prompt_len: int = option(help="prompt tokens (>= 1)")
    output_len: int = option(help="output tokens to generate (>= 1)")
    priority: int = option(0, help="scheduling priority; larger is more important")
    tenant: str | None = option(None, help="the tenant that sent it (fair queueing); null: none")
    adapter: str | None = option(None, help="the LoRA adapter it asks for (recorded in the request table); null: none")
    mm_inputs: list[list[int]] | None = option(None, help="images (encoder inputs) in its prompt: [[offset, length], "
                                               "...], sorted, within the prompt (policies/encoder.py); null: none")

    def validate(self):
        require(0 <= self.arrival < CLOCK_LIMIT, "arrival", f"a time >= 0 and below {CLOCK_LIMIT:.3g} s (the "
                "simulated clock's range, sim/durations.py)", self.arrival)
        require(self.prompt_len >= 1, "prompt_len", "a length >= 1", self.prompt_len)
        require(self.output_len >= 1, "output_len", "a length >= 1", self.output_len)
        if self.mm_inputs is not None:
            check_mm_inputs(self.mm_inputs, self.prompt_len, "mm_inputs")


@dataclass
class WorkloadConfig:
    """Where requests come from: an explicit list, a trace, or synthetic distributions."""

    num_requests: int | None = option(None, help="synthetic only: how many requests to generate (>= 1); with a "
                                                 "trace use trace.max_requests or trace.sample instead")
    arrival: ArrivalConfig | None = option(
        None, help="arrival process, {type: ...}: poisson(rate) | gamma(rate, cv) | constant(rate) | all_at_once "
                   "| bursts(on_rate, off_rate, on_seconds, off_seconds) | diurnal(mean_rate, amplitude, period); "
                   "with a trace it replaces the trace's timestamps")
    prompt_len: LengthConfig | None = option(
        None, help="prompt length distribution, {type: ...}: fixed(value) | uniform(min, max) "
                   "| lognormal(median, sigma, min, max) | zipf(a, min, max) | empirical(values or trace); "
                   "min/max truncate (out-of-range draws are redrawn, never clamped)")
    output_len: LengthConfig | None = option(None, help="output length distribution, same forms as prompt_len")
    requests: list[ExplicitRequest] | None = option(
        None, help="explicit list of {arrival, prompt_len, output_len, priority}, used as is (sorted by arrival)")
    trace: TraceConfig | None = option(None, help="a real trace to replay (see its own keys)")
    shared_prefix: SharedPrefixConfig | None = option(
        None, help="synthetic shared prefixes (system prompts or multi-turn) filling prefix_hashes")
    tenants: dict | None = option(
        None, help="synthetic only: {tenant: weight}: each request's tenant is drawn with probability weight / sum "
                   "(from the run's generator, after everything else is drawn); null: no tenants")
    adapters: dict | None = option(
        None, help="synthetic only: {adapter: weight}: each request's LoRA adapter is drawn with probability weight / "
                   "sum (from the run's generator, after tenants and images); a weight under the key 'base' gives "
                   "base-model requests (no adapter); null: none")
    multimodal: MultimodalConfig | None = option(
        None, help="synthetic only: images in prompts {tokens_per_image, fraction, images, offset}: a request carries "
                   "them with probability fraction (drawn after everything else) and its prompt grows by their "
                   "placeholders (workloads/multimodal.py); null: text only")
    agentic: AgenticConfig | None = option(
        None, help="synthetic only: agentic sessions {sessions, turns, tool_calls, tool_time, tool_result_len, "
                   "subagent_*}: programs whose turns extend one context, with tool calls and sub-agents between "
                   "turns (workloads/agentic.py); arrival gives the sessions' starts; null: none")
    max_concurrency: int | None = option(
        None, help="closed loop: at most N requests in flight (like vllm bench serve --max-concurrency); a request "
                   "is sent at its arrival time or when a client is free, whichever is later (without 'arrival': "
                   "all at once, so N clients send back to back); a multi-turn session keeps its client, each turn "
                   "sent after the previous reply; null: open loop")
    think_time: Seconds = option(0.0, help="closed loop: mean seconds (exponential; 0: none) a client waits after a "
                                         "reply before its next request (the session's next turn or a new one)")
    timeout: Seconds | None = option(None, help="client timeout in seconds: a request not finished this long after it "
                                              "arrived is aborted at the next step boundary and counts as failed "
                                              "(status rejected, reason 'timeout'); null: clients wait forever")

    def validate(self):
        require(self.max_concurrency is None or self.max_concurrency >= 1, "max_concurrency",
                "an integer >= 1 or null", self.max_concurrency)
        require(math.isfinite(self.think_time) and self.think_time >= 0, "think_time", "seconds >= 0",
                self.think_time)
        require(self.timeout is None or (math.isfinite(self.timeout) and self.timeout > 0), "timeout",
                "seconds > 0 or null", self.timeout)
        for key in ("tenants", "adapters"):
            mix = getattr(self, key)
            require(mix is None or len(mix) > 0, key, "a non-empty {name: weight} mapping", mix)
            for name, weight in (mix or {}).items():
                ok = isinstance(weight, (int, float)) and not isinstance(weight, bool) and math.isfinite(weight)
                require(ok and weight > 0, f"{key}.{name}", "a weight > 0", weight)

    @property
    def closed_loop(self) -> bool:
        return self.max_concurrency is not None

    @property
    def source(self) -> str:
        """'requests', 'trace' or 'synthetic'."""
        if self.requests is not None:
            return "requests"
        return "trace" if self.trace is not None else "synthetic"

    @property
    def hash_block_size(self) -> int | None:
        """Tokens per block of the requests' prefix_hashes, or None when they carry none."""
        if self.shared_prefix is not None:
            return self.shared_prefix.hash_block_size
        if self.agentic is not None:
            return self.agentic.hash_block_size
        if self.trace is not None and (self.trace.format in HASHED_FORMATS or self.trace.turns == "all"):
            return self.trace.hash_block_size
        return None


_TAGGED = {"arrival": ARRIVALS, "prompt_len": LENGTHS, "output_len": LENGTHS}
MAX_REQUESTS = 10_000_000  # synthetic requests per run (a million run in about a minute)


def parse_workload(mapping, path: str = "workload") -> WorkloadConfig:
    """Validate a `workload:` mapping; raises ConfigError naming the key path of the first problem."""
    if not isinstance(mapping, dict):
        raise ConfigError(path, "a mapping (the workload section)", mapping)
    plain = {k: v for k, v in mapping.items() if k not in _TAGGED and k != "agentic"}
    _precheck(WorkloadConfig, plain, path)
    cfg = parse(WorkloadConfig, plain, path)
    tagged = {k: parse_tagged(kinds, mapping[k], f"{path}.{k}")
              for k, kinds in _TAGGED.items() if mapping.get(k) is not None}
    if mapping.get("agentic") is not None:
        tagged["agentic"] = parse_agentic(mapping["agentic"], f"{path}.agentic")
    cfg = dataclasses.replace(cfg, **tagged)
    if cfg.closed_loop and cfg.arrival is None and _untimed(cfg):
        cfg = dataclasses.replace(cfg, arrival=AllAtOnceArrival())  # N clients sending back to back
    check_workload(cfg, path)
    return cfg


def parse_agentic(mapping, path: str) -> AgenticConfig:
    """Validate a `workload.agentic` mapping: its plain keys, then each distribution by its `type`."""
    if not isinstance(mapping, dict):
        raise ConfigError(path, "a mapping (the agentic section)", mapping)
    cfg = parse(AgenticConfig, {k: v for k, v in mapping.items() if k not in AGENTIC_TAGGED}, path)
    tagged = {k: parse_tagged(TOOL_TIMES if k == "tool_time" else LENGTHS, mapping[k], f"{path}.{k}")
              for k in AGENTIC_TAGGED if mapping.get(k) is not None}
    cfg = dataclasses.replace(cfg, **tagged)
    check_agentic(cfg, path)
    return cfg


def parse_tagged(kinds: dict[str, type], mapping, path: str):
    """Parse a mapping discriminated by its `type` key into the dataclass registered for that type.

    A bare string is shorthand for a type without options (`arrival: all_at_once`).
    """
    names = "one of " + ", ".join(kinds)
    if isinstance(mapping, str):
        mapping = {"type": mapping}
    if not isinstance(mapping, dict):
        raise ConfigError(path, f"a mapping with a 'type' key ({names})", mapping)
    if "type" not in mapping:
        raise missing(f"{path}.type", names)
    kind = mapping["type"]
    if not isinstance(kind, str) or kind not in kinds:
        raise ConfigError(f"{path}.type", names, kind)
    rest = {k: v for k, v in mapping.items() if k != "type"}
    _precheck(kinds[kind], rest, path)
    return parse(kinds[kind], rest, path)


def _precheck(cls, mapping: dict, path: str) -> None:
    """Parse each optional section (`X | None`, X a dataclass or a list) on its own first.

    cbsim.core.schema.coerce reports a bad optional section only as "X or null"; parsing the section
    alone raises the inner error, naming the exact key (`workload.trace.time_scale`).
    """
    hints = typing.get_type_hints(cls)
    for name, value in mapping.items():
        args = typing.get_args(hints.get(name))
        inner = [a for a in args if a is not type(None)]
        if value is None or type(None) not in args or len(inner) != 1:
            continue
        if dataclasses.is_dataclass(inner[0]) or typing.get_origin(inner[0]) is list:
            coerce(inner[0], value, f"{path}.{name}")


def _untimed(cfg: WorkloadConfig) -> bool:
    """A synthetic source, or a trace without timestamps: the arrival process gives the times."""
    return cfg.source == "synthetic" or (cfg.source == "trace" and cfg.trace.format in LENGTH_ONLY_FORMATS)


def check_workload(cfg: WorkloadConfig, path: str = "workload") -> None:
    """Check that the fields name one coherent source (see the module docstring)."""
    if cfg.think_time and not cfg.closed_loop:
        raise ConfigError(f"{path}.think_time", "0 without max_concurrency (think time is a closed-loop client's; "
                          "open-loop multi-turn gaps are shared_prefix.think_time)", cfg.think_time)
    if cfg.agentic is not None:
        _check_agentic(cfg, path)
    if cfg.source == "requests":
        _check_requests(cfg, path)
    elif cfg.source == "trace":
        _check_trace(cfg, path)
    else:
        _check_synthetic(cfg, path)


def _check_requests(cfg: WorkloadConfig, path: str) -> None:
    for name in ("num_requests", "arrival", "prompt_len", "output_len", "trace", "shared_prefix", "tenants",
                 "adapters", "multimodal"):
        if getattr(cfg, name) is not None:
            raise ConfigError(f"{path}.{name}", "nothing beside an explicit 'requests' list (it is used as is; "
                              "give each request its tenant and mm_inputs)", has_got=False)
    require(len(cfg.requests) > 0, f"{path}.requests", "a non-empty list", cfg.requests)


def _check_trace(cfg: WorkloadConfig, path: str) -> None:
    if cfg.num_requests is not None:
        raise ConfigError(f"{path}.num_requests", "null with a trace (use trace.max_requests or trace.sample)",
                          cfg.num_requests)
    if cfg.tenants is not None:
        raise ConfigError(f"{path}.tenants", "no tenant mix beside 'trace' (a generic CSV/JSONL trace gives each "
                          "row's tenant in its 'tenant' column)", has_got=False)
    if cfg.adapters is not None:
        raise ConfigError(f"{path}.adapters", "no adapter mix beside 'trace' (a generic CSV/JSONL trace gives each "
                          "row's adapter in its 'adapter' column)", has_got=False)
    if cfg.multimodal is not None:
        raise ConfigError(f"{path}.multimodal", "no synthetic images beside 'trace' (a generic CSV/JSONL trace gives "
                          "each row's images in its 'mm_inputs' column)", has_got=False)
    for name in ("prompt_len", "output_len"):
        if getattr(cfg, name) is not None:
            raise ConfigError(f"{path}.{name}", "no length distribution beside 'trace' (the trace gives lengths; "
                              "for lengths drawn from a trace use {type: empirical, trace: ...})", has_got=False)
    fmt = cfg.trace.format
    if cfg.arrival is None and fmt in LENGTH_ONLY_FORMATS:
        raise missing(f"{path}.arrival", f"an arrival process; {fmt} traces have no timestamps")
    if cfg.arrival is not None:
        require(cfg.trace.time_scale == 1.0, f"{path}.trace.time_scale",
                "1.0 (workload.arrival replaces the trace's timestamps; set its rate instead)", cfg.trace.time_scale)
    if cfg.shared_prefix is not None:
        require(fmt != "mooncake", f"{path}.shared_prefix", "no shared_prefix with a mooncake trace "
                "(its hash_ids already describe the shared prefixes)", "a mapping")
        require(cfg.shared_prefix.mode == "system_prompts", f"{path}.shared_prefix.mode",
                "system_prompts with a trace (multi_turn builds conversations from prompt_len/output_len)",
                cfg.shared_prefix.mode)


def _check_agentic(cfg: WorkloadConfig, path: str) -> None:
    """Agentic sessions are a synthetic source of their own: the section says how many sessions."""
    if cfg.source != "synthetic":
        raise ConfigError(f"{path}.agentic", f"no agentic sessions beside '{cfg.source}' (they are a synthetic "
                          "source: arrival, prompt_len and output_len with agentic.sessions)", has_got=False)
    for name, why in (("num_requests", "agentic.sessions says how many sessions start"),
                      ("shared_prefix", "agentic.system_prompt_len gives the shared prefix; turns extend the "
                                        "history themselves"),
                      ("multimodal", "agentic prompts are text")):
        if getattr(cfg, name) is not None:
            raise ConfigError(f"{path}.{name}", f"null with agentic ({why})", getattr(cfg, name))
    if cfg.think_time:
        raise ConfigError(f"{path}.think_time", "0 with agentic (the gaps between turns are tool calls: "
                          "agentic.tool_time)", cfg.think_time)
    for name in ("arrival", "prompt_len", "output_len"):
        if getattr(cfg, name) is None:
            raise missing(f"{path}.{name}", "a mapping with a 'type' key")


def _check_synthetic(cfg: WorkloadConfig, path: str) -> None:
    if cfg.agentic is not None:
        return  # _check_agentic
    if all(getattr(cfg, k) is None for k in ("num_requests", "arrival", "prompt_len", "output_len")):
        raise ConfigError(path, "one source: 'requests', 'trace', or 'num_requests' with 'arrival', "
                                "'prompt_len' and 'output_len'", has_got=False)
    if cfg.num_requests is None and not isinstance(cfg.arrival, StagesArrival):
        raise missing(f"{path}.num_requests", "int >= 1 (optional only with arrival type stages)")
    if isinstance(cfg.arrival, StagesArrival):  # with num_requests too: the process draws the stages' arrivals
        require(cfg.arrival.expected <= MAX_REQUESTS, f"{path}.arrival.stages",
                f"stages holding at most {MAX_REQUESTS:,} arrivals (sum of rate * duration)", cfg.arrival.expected)
    if cfg.num_requests is not None:
        require(1 <= cfg.num_requests <= MAX_REQUESTS, f"{path}.num_requests",
                f"an integer >= 1 and <= {MAX_REQUESTS:,}", cfg.num_requests)
    for name in ("arrival", "prompt_len", "output_len"):
        if getattr(cfg, name) is None:
            raise missing(f"{path}.{name}", "a mapping with a 'type' key")


def check_lengths(cfg: WorkloadConfig, limit: int, path: str = "workload") -> None:
    """Every length a synthetic workload names is at most `limit` (the model's max_model_len): a
    longer one could only make requests the replicas reject, or hash chains that take minutes."""
    for name in ("prompt_len", "output_len"):
        spec = getattr(cfg, name)
        for field in ("value", "min", "max", "median"):
            value = getattr(spec, field, None)
            require(value is None or value <= limit, f"{path}.{name}.{field}",
                    f"a length <= max_model_len ({limit})", value)
        values = getattr(spec, "values", None)
        require(not values or max(values) <= limit, f"{path}.{name}.values",
                f"lengths <= max_model_len ({limit})", max(values or [0]))
    prefix = cfg.shared_prefix
    require(prefix is None or prefix.prefix_len <= limit, f"{path}.shared_prefix.prefix_len",
            f"a length <= max_model_len ({limit})", prefix and prefix.prefix_len)
