"""The stages of `cbsim tune`, in a fixed tuning order, coarse knobs before fine ones.

The order: (1) fix workload and SLO; (2) sweep the token budget to the knee; (3) sweep the
chunk size; (4) set partial/long-prefill limits (short prompts overtake long ones, long ones do not
starve); (5) admission headroom, only when preemptions are non-zero: reserve the full input vs a
watermark; (6) the queue policy: FCFS guardrails first, then LPM/affinity for cache locality;
(7) P/D, only if TTFT and TPOT cannot both be met with reasonable chunking; (8) speculative
decoding's draft length, when the base speculates: speculation pays at small decode batches and
costs at large ones (docs/concepts/speculative-decoding.md), so the capacity under the SLO decides
where this workload's load falls, k = 0 (off) included. Step 1 is the tune
file itself (workload, SLO, GPU budget); cbsim adds the deployment shape (TP x replicas over the
budget) and the policy before step 2, and max running requests beside the token budget.

Invariant: a stage never runs anything. It turns each candidate into dotted overrides of the base
experiment (`--set` semantics), lists its default candidates from the incumbent (the incumbent's
own value first, so a tie keeps it), and says why it is skipped: `applies` when the incumbent's
policy has no such knob (always), `when` when the stage's condition does not hold (default
candidates only: candidates a tune file lists always run).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import yaml

from cbsim.policies.registry import make_policy

from cbsim.config import ExperimentConfig
from cbsim.core.errors import ConfigError

TTFT_FAMILY = ("ttft", "queue_delay", "e2e")  # SLO metrics a prefill-heavy step hurts
DECODE_FAMILY = ("itl", "tpot")  # SLO metrics a large chunk beside decodes hurts
PARTIAL_KEYS = ("max_num_partial_prefills", "max_long_partial_prefills", "long_prefill_token_threshold",
                "strict_fcfs")
ADMISSION_KEYS = {"reserve_full_prompt": "cluster.kv_cache.reserve_full_prompt",
                  "watermark": "cluster.kv_cache.watermark",
                  "max_predicted_ttft": "admission.max_predicted_ttft"}
QUEUE_KEYS = {"schedule_policy": "policy.schedule_policy", "router": "cluster.router"}
CHUNK_KEYS = ("chunk_size", "chunked_prefill_size")  # sarathi/prefill_first, sglang


@dataclass(frozen=True)
class StageContext:
    """What a stage sees: the incumbent experiment, the GPU budget, the SLO, the incumbent's capacity
    record (run on demand) and the candidate rows of the stages already run."""

    config: ExperimentConfig
    gpus: int
    slo: dict
    incumbent: Callable[[], dict]
    history: dict  # stage name -> list of {"label", "record"}


@dataclass(frozen=True)
class Stage:
    name: str
    step: str  # the step of the order (module docstring) this stage implements
    help: str
    check: Callable[[Any, str], None]  # one candidate's form; ConfigError naming `path`
    overrides: Callable[[Any, StageContext], dict]  # candidate -> {dotted key: value}
    defaults: Callable[[StageContext], list]
    label: Callable[[Any], str] = lambda value: _flow(value)
    shows: tuple[str, ...] = ()  # summary metrics the report adds for this stage (what the seed watches)
    applies: Callable[[StageContext], str | None] = lambda ctx: None  # None, or why the knob is absent
    when: Callable[[StageContext], str | None] = lambda ctx: None  # None, or why the seed skips it


def policy_settings(config: ExperimentConfig) -> dict:
    """Every option of the incumbent's policy, defaults included (the policy's Config dataclass)."""
    policy = make_policy(config.policy)
    return dataclasses.asdict(policy.config)


def _has(field: str) -> Callable[[StageContext], str | None]:
    def applies(ctx: StageContext) -> str | None:
        if field in policy_settings(ctx.config):
            return None
        return f"policy {ctx.config.policy['name']} has no {field}"
    return applies


def _first(value, values) -> list:
    """`value` first, then the others (deduplicated): a tie keeps the incumbent."""
    out = [value]
    for v in values:
        if v not in out:
            out.append(v)
    return out


# --- checks of one candidate's form -------------------------------------------------------------

def _int_or_null(minimum: int = 1, null: bool = True):
    def check(value, path: str) -> None:
        ok = (value is None and null) or (isinstance(value, int) and not isinstance(value, bool) and value >= minimum)
        if not ok:
            raise ConfigError(path, f"an integer >= {minimum}" + (" or null" if null else ""), value)
    return check


def _mapping_of(keys) -> Callable[[Any, str], None]:
    def check(value, path: str) -> None:
        if not isinstance(value, dict):
            raise ConfigError(path, "a mapping with keys from " + ", ".join(keys), value)
        for key in value:
            if key not in keys:
                raise ConfigError(f"{path}.{key}", "one of the keys " + ", ".join(keys), has_got=False)
    return check


def _check_policy(value, path: str) -> None:
    if not (isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("name"), str))):
        raise ConfigError(path, "a policy name or a policy mapping {name: ..., options}", value)


def _check_queue(value, path: str) -> None:
    if isinstance(value, str):
        return
    _mapping_of(tuple(QUEUE_KEYS))(value, path)


def _check_pd(value, path: str) -> None:
    if value == "colocated":
        return
    _mapping_of(("prefill", "decode", "prefill_tp", "decode_tp"))(value, path)
    for key in ("prefill", "decode"):
        if key not in value:
            raise ConfigError(f"{path}.{key}", "the GPUs of this pool (an integer >= 1)", has_got=False)
    for key, v in value.items():
        _int_or_null(1, null=False)(v, f"{path}.{key}")
        if key in ("prefill", "decode") and v % value.get(f"{key}_tp", 1):
            raise ConfigError(f"{path}.{key}", f"a multiple of {key}_tp", v)


# --- parallelism (TP [x PP] x replicas over the budget) ------------------------------------------

def parallel_shape(value) -> tuple[int, int]:
    """(tp, pp) of a parallelism candidate: an integer TP degree (one pipeline stage), or {tp, pp}."""
    if isinstance(value, dict):
        return int(value.get("tp", 1)), int(value.get("pp", 1))
    return int(value), 1


def _check_shape(value, path: str) -> None:
    if not isinstance(value, dict):
        _int_or_null(1, null=False)(value, path)
        return
    _mapping_of(("tp", "pp"))(value, path)
    for key, v in value.items():
        _int_or_null(1, null=False)(v, f"{path}.{key}")


def _tp_overrides(value, ctx: StageContext) -> dict:
    tp, pp = parallel_shape(value)
    out = {"cost_model.tp": tp, "cluster.replicas": ctx.gpus // (tp * pp)}
    if pp > 1 or "pp" in ctx.config.cost_model:  # a pipeline candidate, or back to one stage from the base's
        out["cost_model.pp"] = pp
    if ctx.config.cluster.tp is not None:
        out["cluster.tp"] = tp
    return out


def _shape_label(value) -> str:
    tp, pp = parallel_shape(value)
    return f"tp{tp}" + (f" pp{pp}" if pp > 1 else "")


def _tp_defaults(ctx: StageContext) -> list:
    return [tp for tp in (1, 2, 4, 8) if tp <= ctx.gpus and ctx.gpus % tp == 0]


# --- policy ---------------------------------------------------------------------------------------

def _policy_overrides(value, ctx: StageContext) -> dict:
    if isinstance(value, dict):
        return {"policy": value}
    if value == ctx.config.policy["name"]:
        return {"policy": ctx.config.policy}
    return {"policy": {"name": value}}


def _policy_defaults(ctx: StageContext) -> list:
    return _first(ctx.config.policy["name"], ["sarathi", "sglang"])


# --- chunk size -----------------------------------------------------------------------------------

def _chunk_key(ctx: StageContext) -> str | None:
    settings = policy_settings(ctx.config)
    return next((key for key in CHUNK_KEYS if key in settings), None)


def _chunk_defaults(ctx: StageContext) -> list:
    settings = policy_settings(ctx.config)
    budget = settings.get("token_budget")
    sizes = [c for c in (256, 512, 1024, 2048) if budget is None or c < budget]
    return _first(settings[_chunk_key(ctx)], [None] + sizes)


# --- partial prefills -------------------------------------------------------------------------------

def _partial_defaults(ctx: StageContext) -> list:
    settings = policy_settings(ctx.config)
    seqs = settings["max_num_seqs"]
    current = {key: settings[key] for key in PARTIAL_KEYS[:2]}
    return _first(current, [{"max_num_partial_prefills": 1, "max_long_partial_prefills": 1},
                            {"max_num_partial_prefills": 4, "max_long_partial_prefills": 1},
                            {"max_num_partial_prefills": seqs, "max_long_partial_prefills": seqs}])


# --- admission headroom ---------------------------------------------------------------------------

def _admission_defaults(ctx: StageContext) -> list:
    kv = ctx.config.cluster.kv_cache
    current = {"reserve_full_prompt": kv.reserve_full_prompt, "watermark": kv.watermark}
    return _first(current, [{"reserve_full_prompt": True, "watermark": kv.watermark},
                            {"reserve_full_prompt": False, "watermark": max(0.05, kv.watermark)}])


def _admission_when(ctx: StageContext) -> str | None:
    preemptions = _at_capacity(ctx.incumbent(), "num_preemptions")
    if preemptions:
        return None
    return "no preemptions at the incumbent's capacity: no KV headroom to buy (seed step 5 applies " \
           "only when preemption/recompute is non-zero)"


# --- queue policy ---------------------------------------------------------------------------------

def _queue_overrides(value, ctx: StageContext) -> dict:
    value = {"schedule_policy": value} if isinstance(value, str) else value
    return {QUEUE_KEYS[key]: v for key, v in value.items()}


def _queue_applies(ctx: StageContext) -> str | None:
    if "schedule_policy" in policy_settings(ctx.config) or ctx.config.cluster.replicas > 1:
        return None
    return f"one replica and policy {ctx.config.policy['name']} has one queue order (FCFS)"


def _queue_defaults(ctx: StageContext) -> list:
    settings = policy_settings(ctx.config)
    caching = ctx.config.cluster.kv_cache.prefix_caching
    orders = []
    if "schedule_policy" in settings:
        orders = _first(settings["schedule_policy"], ["fcfs"] + (["lpm"] if caching else []))
    routers = []
    if ctx.config.cluster.replicas > 1:
        routers = _first(ctx.config.cluster.router, ["round_robin", "least_loaded"]
                         + (["prefix_affinity"] if caching else []))
    out = []
    for order in orders or [None]:
        for router in routers or [None]:
            out.append({k: v for k, v in (("schedule_policy", order), ("router", router)) if v is not None})
    return out


# --- speculative decoding ----------------------------------------------------------------------

SPECULATIVE_KS = (1, 2, 3, 4, 5)  # draft lengths tried by default: cbsim's choice, not an engine default (list others)


def _check_speculative(value, path: str) -> None:
    if value is None or value == 0 or isinstance(value, dict):
        return
    _int_or_null(1, null=False)(value, path)


def _speculative_overrides(value, ctx: StageContext) -> dict:
    if value is None or value == 0:
        return {"speculative": None}
    if isinstance(value, dict):
        return {"speculative": value}
    return {"speculative": {**speculative_section(ctx.config), "num_speculative_tokens": value}}


def speculative_section(config: ExperimentConfig) -> dict:
    """The incumbent's speculative section as a mapping ({} without one)."""
    section = config.speculative
    if section is None or isinstance(section, dict):
        return dict(section or {})
    return {k: v for k, v in dataclasses.asdict(section).items() if v is not None}


def _speculative_applies(ctx: StageContext) -> str | None:
    if not ctx.config.speculative:
        return "the base has no speculative section (no drafter to tune: list mappings to try one)"
    if ctx.config.cluster.mode == "pd":
        return "the incumbent is a P/D split: speculative decoding runs on colocated clusters"
    return None


def _speculative_defaults(ctx: StageContext) -> list:
    return _first(speculative_section(ctx.config)["num_speculative_tokens"], [0, *SPECULATIVE_KS])


def _speculative_label(value) -> str:
    if value is None or value == 0:
        return "off"
    return f"k={value}" if isinstance(value, int) else _flow(value)


# --- P/D --------------------------------------------------------------------------------------------

def _pd_overrides(value, ctx: StageContext) -> dict:
    if value == "colocated":
        return {}
    tp = int(ctx.config.cost_model.get("tp", 1) or 1)
    out = {"cluster.mode": "pd"}
    for pool in ("prefill", "decode"):
        pool_tp = value.get(f"{pool}_tp", tp)
        section = {"replicas": value[pool] // pool_tp}
        if pool_tp != tp:
            section["cost_model"] = {"tp": pool_tp}
        out[f"cluster.{pool}"] = section
    return out


def _pd_applies(ctx: StageContext) -> str | None:
    if int(ctx.config.cost_model.get("pp", 1) or 1) > 1:
        return "the incumbent's replicas are pipeline-parallel: P/D splits of them are not searched"
    return None if ctx.gpus >= 2 else "one GPU cannot be split into a prefill and a decode pool"


def _pd_defaults(ctx: StageContext) -> list:
    tp = int(ctx.config.cost_model.get("tp", 1) or 1)
    n = ctx.gpus
    splits = range(1, n) if n <= 4 else sorted({n // 4, n // 2, 3 * n // 4})
    pools = [{"prefill": k, "decode": n - k} for k in splits if k % tp == 0 and (n - k) % tp == 0 and k > 0]
    wider = []  # P and D may want different parallelism (seed step 7): each pool at twice the TP once
    if 2 * tp <= 8:
        for split in pools:
            for pool in ("prefill", "decode"):
                if split[pool] % (2 * tp) == 0:
                    wider.append({**split, f"{pool}_tp": 2 * tp})
    return ["colocated"] + pools + wider


def _pd_when(ctx: StageContext) -> str | None:
    families = {slo_family(metric) for metric in ctx.slo}
    if not {"ttft", "decode"} <= families:
        return "the SLO does not bound both TTFT and TPOT/ITL, so there is no trade-off for P/D to remove"
    budget = ctx.history.get("token_budget") or []
    binding = {slo_family(row["record"].get("binding") or "") for row in budget if row["record"]} - {None}
    if binding and not {"ttft", "decode"} <= binding:
        return ("chunking meets TTFT and TPOT/ITL together: every token budget tried is limited by the same "
                f"side ({', '.join(sorted(b for b in binding if b))}), so step 7 (P/D) keeps colocation")
    return None


def slo_family(metric: str) -> str | None:
    if metric.startswith(TTFT_FAMILY):
        return "ttft"
    if metric.startswith(DECODE_FAMILY):
        return "decode"
    return None


def _at_capacity(record: dict, metric: str):
    rows = record.get("at_capacity") or []
    values = [row.get(metric) for row in rows if row.get(metric) is not None]
    return max(values) if values else None


def _partial_label(value: dict) -> str:
    names = {"max_num_partial_prefills": "partial", "max_long_partial_prefills": "long",
             "long_prefill_token_threshold": "threshold", "strict_fcfs": "strict_fcfs"}
    return ", ".join(f"{value[key]} {name}" if key != "strict_fcfs" else f"strict_fcfs {value[key]}"
                     for key, name in names.items() if key in value) or "{}"


def _pd_label(value) -> str:
    if value == "colocated":
        return "colocated"
    pools = [f"{value[pool]}{pool[0].upper()}" + (f" tp{value[f'{pool}_tp']}" if f"{pool}_tp" in value else "")
             for pool in ("prefill", "decode")]
    return " + ".join(pools) + " GPUs"


def _flow(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, (dict, list)):
        return yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip()
    return str(value)


STAGES: list[Stage] = [
    Stage("parallelism", "before 2: the deployment shape over the GPU budget",
          "tensor-parallel degree per replica, or {tp, pp} for pipeline stages too (listed candidates only: the "
          "defaults are TP degrees); replicas = gpus.count / (tp x pp)",
          _check_shape, _tp_overrides, _tp_defaults, label=_shape_label),
    Stage("policy", "before 2: the scheduler whose knobs the next stages tune",
          "policy names (the base's own section for its name, else that policy's defaults) or policy mappings",
          _check_policy, _policy_overrides, _policy_defaults),
    Stage("token_budget", "2: sweep the token budget to the knee", "policy.token_budget values",
          _int_or_null(), lambda v, ctx: {"policy.token_budget": v},
          lambda ctx: _first(policy_settings(ctx.config)["token_budget"], [512, 1024, 2048, 4096, 8192]),
          applies=_has("token_budget"), shows=("throughput_tokens_per_s", "ttft_p99", "itl_p99")),
    Stage("max_num_seqs", "2: the batch limit beside the token budget", "policy.max_num_seqs values (max running "
          "requests)", _int_or_null(null=False), lambda v, ctx: {"policy.max_num_seqs": v},
          lambda ctx: _first(policy_settings(ctx.config)["max_num_seqs"], [64, 256, 1024]),
          applies=_has("max_num_seqs")),
    Stage("chunk_size", "3: sweep the chunk size", "per-request chunk caps: policy.chunk_size (sarathi, "
          "prefill_first) or policy.chunked_prefill_size (sglang); null = no cap",
          _int_or_null(), lambda v, ctx: {f"policy.{_chunk_key(ctx)}": v}, _chunk_defaults,
          applies=lambda ctx: None if _chunk_key(ctx) else f"policy {ctx.config.policy['name']} has no chunk size",
          shows=("throughput_tokens_per_s", "itl_p99")),
    Stage("partial_prefills", "4: partial/long-prefill limits", "mappings of " + ", ".join(PARTIAL_KEYS)
          + "; short_p_mean shows short prompts overtaking long ones, ttft_p99 (long prompts are its tail) "
          "shows whether long ones starve",
          _mapping_of(PARTIAL_KEYS), lambda v, ctx: {f"policy.{k}": x for k, x in v.items()}, _partial_defaults,
          label=_partial_label, applies=_has("max_num_partial_prefills"), shows=("short_p_mean", "ttft_p99")),
    Stage("admission", "5: admission headroom (reserve the full input vs a watermark)",
          "mappings of " + ", ".join(ADMISSION_KEYS), _mapping_of(tuple(ADMISSION_KEYS)),
          lambda v, ctx: {ADMISSION_KEYS[k]: x for k, x in v.items()}, _admission_defaults, when=_admission_when),
    Stage("queue_policy", "6: queue policy (FCFS guardrails, then LPM/affinity)",
          "a schedule_policy name, or mappings {schedule_policy, router}", _check_queue, _queue_overrides,
          _queue_defaults, applies=_queue_applies),
    Stage("pd", "7: colocated or a P/D split of the budget", "'colocated' or {prefill: GPUs, decode: GPUs, "
          "prefill_tp, decode_tp}", _check_pd, _pd_overrides, _pd_defaults, label=_pd_label,
          applies=_pd_applies, when=_pd_when),
    Stage("speculative", "8: speculative decoding's draft length at the load the SLO allows",
          "num_speculative_tokens values of the base's speculative section (0 or null: off), or whole "
          "speculative mappings", _check_speculative, _speculative_overrides, _speculative_defaults,
          label=_speculative_label, applies=_speculative_applies,
          shows=("tpot_p50", "mean_acceptance_length", "tokens_per_gap")),
]
STAGE_NAMES = [stage.name for stage in STAGES]
