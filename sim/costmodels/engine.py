"""The serving engine around the kernels: host work, kernel and collective launches, overlap, and
the front end between the client and the scheduler.

A cost model prices the GPU kernels of a step (`gpu` seconds). A real engine adds work the kernels
do not show, and every cost model (roofline, vidur, fitted) passes its `gpu` through one `StepEngine`:

    forward = max(kernel_scale * gpu, floor)    (the roofline has already scaled its GEMMs, attention,
                                                collectives and MoE experts by gemm_scale, attention_scale,
                                                collective_scale and moe_scale: calibrated per-class factors)
        floor = graph_launch_s                      a decode-only step of <= cuda_graph_max_batch
                                                    sequences replays one CUDA graph (with
                                                    cuda_graph_piecewise any step of <= that many
                                                    tokens: vLLM V1's piecewise graphs)
              = L * (launch_per_layer_s + 2 * collective(tp))   otherwise (eager): the CPU cannot
                                                    launch a layer's kernels and its two all-reduces
                                                    faster than this, so a light step waits on it
        collective(tp) = collective_launch_s + collective_per_rank_s * (tp - 1)   (tp > 1, else 0):
                                                    launching and synchronising one all-reduce across
                                                    more worker processes costs more host time
    host    = host_per_step_s + host_per_seq_s * seqs + host_per_prefill_s * prefills
              + host_per_token_s * tokens           scheduling, input preparation, sampling, output
                                                    processing
    step    = forward + host                        synchronous: schedule, run, process the output
            = max(forward, host)                    `overlap`: all host work hides behind the forward
                                                    (SGLang's zero-overhead scheduler, TensorRT-LLM's
                                                    overlap scheduler, vLLM V1 --async-scheduling)
            = max(forward, s host) + (1 - s) host   `host_hidden_share` s: only that share hides (vLLM
                                                    V0 >= 0.6 async output processing, PR #7049: step
                                                    k's output processing runs behind step k+1's
                                                    forward; scheduling stays on the critical path)

Some terms change what the cost model prices rather than this sum: `cuda_graph_padding` (a graph step
runs at its captured batch size, cuda_graphs.py; `graph_tokens`) and `custom_all_reduce_max_bytes`
(vLLM's custom all-reduce instead of NCCL for small TP messages, custom_allreduce.py),
`decode_attention_per_query_head` (the decode kernel's grid, attention_structure.py) and
`fused_moe_exposed` (how much of its weight streaming the fused-MoE kernel hides, moe_gemms.py). The roofline
reads them; the measured cost models (vidur, fitted) were timed eagerly with NCCL and ignore them.

The front-end terms do not change the step; they move what the client sees (sim/metrics/client_view.py):
a request reaches the scheduler `frontend_s + frontend_per_prompt_token_s * prompt` after the client
sent it (HTTP, tokenising, the hop to the engine core), each output token reaches the client
`stream_s` after the step that sampled it (detokenising, IPC, streaming), and `output_lag_steps`
steps later on a pipelined engine that keeps stepping.

An engine is given as `cost_model.engine:` a preset name (sim/costmodels/engines/*.yaml, each
term with its source), a calibration file (`cbsim calibrate` writes engine.json), or a mapping of
terms (optionally `preset:` or `file:` as the base they override). `none` is no engine at all: the
cost model's numbers bit for bit as before this component existed.

Invariant: `StepEngine.step` (floats) and `StepEngine.step_many` (numpy arrays over a decode run)
apply the same operations in the same order, so a cost model's `step_time` and `decode_run_times`
stay bit-identical.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from cbsim.core import bounds
from cbsim.core.errors import ConfigError
from cbsim.core.schema import option, parse, require
from cbsim.sim.costmodels.cuda_graphs import capture_size

SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's where PyYAML has it: the same data, faster
PRESET_DIR = Path(__file__).resolve().parent / "engines"
DEFAULT = "vllm-v1"  # what a cost model that names no engine gets (docs/concepts/trust.md)
NONE = "none"


@dataclass(frozen=True)
class EngineTerms:
    """Every term of the engine model (seconds unless said); zero means not modelled."""

    host_per_step_s: float = option(0.0, help="host seconds per step: scheduling, input preparation, sampling, "
                                    "output processing")
    host_per_seq_s: float = option(0.0, help="host seconds per sequence in the step")
    host_per_prefill_s: float = option(0.0, help="host seconds per prefill request (chunk) in the step")
    host_per_token_s: float = option(0.0, help="host seconds per new token in the step")
    overlap: bool = option(False, help="async scheduling: step = max(forward, host) instead of forward + host "
                           "(all host work hides behind the GPU)")
    host_hidden_share: float = option(0.0, help="without overlap: the share of the host work that runs behind the "
                                      "next step's forward (vLLM V0 >= 0.6 async output processing: its output "
                                      "processing; 0.30 of the Vidur-profiled V0 host work): step = max(forward, s "
                                      "host) + (1 - s) host; 0: synchronous")
    launch_per_layer_s: float = option(0.0, help="eager execution: CPU seconds to launch one layer's kernels "
                                       "(the forward is never faster than layers x this)")
    cuda_graph_max_batch: int = option(0, help="decode-only steps of at most this many sequences replay a CUDA "
                                       "graph (no per-layer launches); 0: always eager")
    graph_launch_s: float = option(0.0, help="seconds to replay the CUDA graph of a step (its launch floor)")
    cuda_graph_piecewise: bool = option(False, help="piecewise graphs (vLLM V1): mixed prefill+decode steps of at "
                                        "most cuda_graph_max_batch tokens replay too (attention outside the "
                                        "graphs); false: decode-only steps only")
    cuda_graph_padding: bool = option(False, help="a graph step runs at the next captured batch size ([1, 2, 4] + "
                                      "multiples of 8): its GEMMs, streaming kernels and all-reduces see the "
                                      "padded token count (cuda_graphs.py)")
    decode_attention_per_query_head: bool = option(
        False, help="the decode attention kernel runs one CTA per query head and reads its KV head once per query "
        "head (TensorRT-LLM's masked-MHA kernel, vLLM V0's paged_attention): a GQA model's decode KV traffic is "
        "query heads / KV heads times its cache bytes (attention_structure.py); false: once per KV head "
        "(FlashAttention / FlashInfer / XQA pack a KV head's query heads into one CTA)")
    custom_all_reduce_max_bytes: float = option(
        0.0, help="vLLM's custom all-reduce (custom_allreduce.py) for TP all-reduces below this many bytes (8 MiB "
        "in vLLM) where it applies (2 GPUs or NVSwitch, 2/4/6/8 GPUs, one node); NCCL otherwise; 0: NCCL always")
    fused_moe_exposed: float = option(0.0, help="MoE: the fraction of the shorter of compute and weight streaming "
                                      "that the engine's fused-MoE kernel leaves exposed (vLLM's Triton fused_moe: "
                                      "0.4, moe_gemms.py); 0: they overlap fully, as a dense GEMM's (roofline only)")
    collective_launch_s: float = option(0.0, help="eager: CPU seconds to launch one TP all-reduce (2 per layer)")
    collective_per_rank_s: float = option(0.0, help="eager: extra CPU seconds per all-reduce per TP rank beyond the "
                                          "first (more worker processes to synchronise)")
    kernel_scale: float = option(1.0, help="correction factor on the cost model's kernel time (calibrate "
                                 "--fit-kernel-scale); 1: the kernels as priced")
    gemm_scale: float = option(1.0, help="correction factor on the GEMMs' time (linear layers, LM head; calibrate "
                               "--fit-kernel-classes); roofline only; 1: as priced")
    attention_scale: float = option(1.0, help="correction factor on the attention kernels' time (roofline only)")
    collective_scale: float = option(1.0, help="correction factor on the TP all-reduces' (and MoE all-to-alls') time "
                                     "(roofline only)")
    moe_scale: float = option(1.0, help="correction factor on the MoE experts' and router's time (roofline only)")
    frontend_s: float = option(0.0, help="client-side seconds before a request reaches the scheduler (HTTP, API "
                               "server, hop to the engine core)")
    frontend_per_prompt_token_s: float = option(0.0, help="client-side seconds per prompt token before the "
                                                "scheduler (tokenisation)")
    stream_s: float = option(0.0, help="seconds from a step's end until its token reaches the client "
                             "(detokenising, IPC, streaming)")
    output_lag_steps: int = option(0, help="pipelined engines: a token reaches the client this many steps later "
                                   "while the replica keeps stepping")
    swap_preemption: bool = option(True, help="the engine can preempt by swapping a victim's KV to host memory "
                                   "(vLLM V0 --preemption-mode swap); false: it recomputes only (vLLM V1, SGLang), "
                                   "and preemption.mode swap or auto simulates a swap it lacks, with a warning")
    swap_bandwidth_gb_s: float = option(0.0, help="GB/s the engine's KV swap achieves between GPU and host (the "
                                        "default of preemption.swap_bandwidth_gb_s); 0: no data, the PCIe 4 x16 "
                                        "peak (25) is used")

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):  # overlap, cuda_graph_*, decode_attention_per_query_head
                continue
            require(math.isfinite(value) and value >= 0, f.name, "a finite number >= 0", value)
        for name in ("kernel_scale", *CLASS_TERMS):
            require(getattr(self, name) > 0, name, "a number > 0", getattr(self, name))
        require(self.host_hidden_share <= 1, "host_hidden_share", "a share in [0, 1]", self.host_hidden_share)

    @property
    def class_scales(self) -> tuple[float, float, float, float]:
        """The per-class kernel factors, in KERNEL_CLASSES order."""
        return self.gemm_scale, self.attention_scale, self.collective_scale, self.moe_scale


TERM_NAMES = tuple(f.name for f in dataclasses.fields(EngineTerms))
# the kernel classes a cost model that splits its kernels (roofline) scales apart, and their terms
KERNEL_CLASSES = ("gemm", "attention", "collective", "moe")
CLASS_TERMS = tuple(f"{c}_scale" for c in KERNEL_CLASSES)
FRONTEND_TERMS = ("frontend_s", "frontend_per_prompt_token_s", "stream_s", "output_lag_steps")
SWAP_TERMS = ("swap_preemption", "swap_bandwidth_gb_s")  # preemption's, not the step's: never calibrated


@dataclass(frozen=True)
class Engine:
    """A resolved engine: its terms, a name, the file it came from and that file's provenance."""

    terms: EngineTerms
    name: str = NONE
    source: str = ""
    provenance: dict | None = None

    @property
    def is_none(self) -> bool:
        return self.name == NONE

    @property
    def has_frontend(self) -> bool:
        return any(getattr(self.terms, key) for key in FRONTEND_TERMS)

    def bind(self, num_layers: int, tp: int, classes: bool = False) -> "StepEngine":
        """The per-step combination for a model of `num_layers` layers on `tp` GPUs. A cost model that
        does not apply the per-class kernel factors (`classes` false) refuses an engine that sets them."""
        if not classes:
            for name in CLASS_TERMS:
                require(getattr(self.terms, name) == 1.0, f"engine.{name}", "1 (per-class kernel factors need a "
                        "cost model that prices kernels by class: roofline; use kernel_scale)", getattr(self.terms, name))
        return StepEngine(self.terms, num_layers, tp, none=self.is_none)

    def describe(self) -> dict:
        out = {"name": self.name, "source": self.source}
        if not self.is_none:
            out["terms"] = dataclasses.asdict(self.terms)
        return out


NO_ENGINE = Engine(EngineTerms())


class StepEngine:
    """Step seconds from kernel seconds, for one (layers, tp); see the module docstring."""

    __slots__ = ("terms", "none", "eager_floor", "graph_floor", "graph_max", "piecewise", "padding", "overlap", "hidden",
                 "scale", "per_step", "per_seq", "per_prefill", "per_token")

    def __init__(self, terms: EngineTerms, num_layers: int, tp: int, none: bool = False):
        t = self.terms = terms
        self.none = none
        collective = t.collective_launch_s + t.collective_per_rank_s * (tp - 1) if tp > 1 else 0.0
        self.eager_floor = num_layers * (t.launch_per_layer_s + 2.0 * collective)
        self.graph_floor, self.graph_max = t.graph_launch_s, t.cuda_graph_max_batch
        self.piecewise, self.padding = t.cuda_graph_piecewise, t.cuda_graph_padding
        self.overlap, self.scale = t.overlap, t.kernel_scale
        self.hidden = 0.0 if t.overlap else t.host_hidden_share  # overlap hides it all already
        self.per_step, self.per_seq = t.host_per_step_s, t.host_per_seq_s
        self.per_prefill, self.per_token = t.host_per_prefill_s, t.host_per_token_s

    def host(self, seqs: int, prefills: int, tokens: int) -> float:
        """Host seconds of a step."""
        return self.per_step + self.per_seq * seqs + self.per_prefill * prefills + self.per_token * tokens

    def graph_step(self, tokens: int, prefills: int) -> bool:
        """Whether a step of `tokens` tokens (`prefills` prefill chunks) replays a CUDA graph: at most
        cuda_graph_max_batch tokens, decode-only unless the graphs are piecewise (a decode-only step
        has one token per sequence, so this is the sequence count there)."""
        return tokens <= self.graph_max and (prefills == 0 or self.piecewise)

    def graph_tokens(self, tokens: int, prefills: int) -> int:
        """The token count a step's graph runs at: padded to the next captured size on a graph step
        with cuda_graph_padding, else `tokens` (cuda_graphs.py)."""
        if self.padding and self.graph_step(tokens, prefills):
            return capture_size(tokens, self.graph_max)
        return tokens

    def floor(self, seqs: int, prefills: int, tokens: int | None = None) -> float:
        """The launch floor: a CUDA graph replay for graph steps, else eager launches."""
        return self.graph_floor if self.graph_step(seqs if tokens is None else tokens, prefills) else self.eager_floor

    def step_of(self, gpu: float, shape) -> float:
        """Step seconds of a step of this StepShape whose kernels take `gpu` seconds."""
        prefills = len(shape.prefill)
        return self.step_for(gpu, prefills + len(shape.decode), prefills, shape.num_tokens)

    def decode_step(self, gpu: float, seqs: int) -> float:
        """`step_of` for a decode-only step of `seqs` sequences (one token each), without a shape."""
        return self.step_for(gpu, seqs, 0, seqs)

    def step_for(self, gpu: float, seqs: int, prefills: int, tokens: int) -> float:
        """Step seconds of a step of `seqs` sequences (`prefills` of them prefill rows) and `tokens` tokens
        whose kernels take `gpu` seconds (called once per simulated step: `host` and `floor` are written out
        inline)."""
        if self.none:
            return gpu
        forward = gpu * self.scale
        floor = self.graph_floor if tokens <= self.graph_max and (prefills == 0 or self.piecewise) else self.eager_floor
        if forward < floor:
            forward = floor
        host = self.per_step + self.per_seq * seqs + self.per_prefill * prefills + self.per_token * tokens
        if self.overlap:
            return forward if forward >= host else host
        if self.hidden:  # async output processing: that share of the host runs behind the next forward
            behind = self.hidden * host
            return (forward if forward >= behind else behind) + (host - behind)
        return forward + host

    def step_many(self, gpu: np.ndarray, seqs: int) -> np.ndarray:
        """`step` over an array of decode-only steps of `seqs` sequences (one token each)."""
        if self.none:
            return gpu
        forward = np.maximum(gpu * self.scale, self.floor(seqs, 0))
        host = self.host(seqs, 0, seqs)
        if self.overlap:
            return np.where(forward >= host, forward, host)
        if self.hidden:
            behind = self.hidden * host
            return np.where(forward >= behind, forward, behind) + (host - behind)
        return forward + host


# --- resolving `cost_model.engine:` -------------------------------------------------------------

def preset_names() -> list[str]:
    """Names of the shipped engine presets: sim/costmodels/engines/*.yaml (terms with their
    sources) and *.json (engine files fitted by `cbsim calibrate`, with their data and errors)."""
    return sorted(p.stem for p in [*PRESET_DIR.glob("*.yaml"), *PRESET_DIR.glob("*.json")])


def load_engine(value, path: str = "engine") -> Engine:
    """The engine a config value names: None (the default preset), 'none', a preset name, a file,
    or a mapping of terms with an optional `preset:` or `file:` base."""
    if value is None:
        value = DEFAULT
    if isinstance(value, Engine):
        return value
    if isinstance(value, str):
        return _load_named(value, path)
    if not isinstance(value, dict):
        raise ConfigError(path, f"an engine preset name ({', '.join([NONE, *preset_names()])}), a calibration "
                          "file or a mapping of engine terms", value)
    mapping = dict(value)
    base_key = "preset" if "preset" in mapping else "file" if "file" in mapping else None
    base = _load_named(mapping.pop(base_key), f"{path}.{base_key}") if base_key else None
    if base is not None and base.is_none:
        base = None
    start = dataclasses.asdict(base.terms) if base else {}
    terms = parse(EngineTerms, {**start, **mapping}, path)
    if base is None:
        return Engine(terms, "custom")
    return Engine(terms, f"{base.name}+custom" if mapping else base.name, base.source, base.provenance)


def _load_named(name, path: str) -> Engine:
    if not isinstance(name, str):
        raise ConfigError(path, "an engine preset name or a file path", name)
    if name == NONE:
        return NO_ENGINE
    for preset in (PRESET_DIR / f"{name}.yaml", PRESET_DIR / f"{name}.json"):
        if preset.exists():
            return read_engine_file(preset, path, name=name)
    file = Path(name)
    if file.suffix in (".json", ".yaml", ".yml"):
        if not file.exists():
            raise ConfigError(path, "an existing engine file (cbsim calibrate writes one)", name)
        return read_engine_file(file, path)
    raise ConfigError(path, "an engine preset (" + ", ".join([NONE, *preset_names()]) + ") or an engine file "
                      "(.json/.yaml)", name)


def read_engine_file(file: Path, path: str = "engine", name: str | None = None) -> Engine:
    """An engine from a preset YAML or a calibration JSON: `terms:` maps each term to a value or to
    `{value, source, note}`; a null value is a term without data (0: not modelled)."""
    try:
        text = file.read_text(encoding="utf-8")
        data = bounds.loads(text) if file.suffix == ".json" else bounds.load_yaml(text, SAFE_LOADER)
    except (UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as err:
        raise ConfigError(path, f"a readable engine file ({type(err).__name__})", str(file), file=str(file)) from None
    if not isinstance(data, dict) or not isinstance(data.get("terms"), dict):
        raise ConfigError("terms", "a mapping of engine terms", None if not isinstance(data, dict) else
                          data.get("terms"), file=str(file))
    values = {}
    for key, entry in data["terms"].items():
        value = entry.get("value") if isinstance(entry, dict) else entry
        if isinstance(value, str):  # YAML 1.1 reads 4e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"terms.{key}", "a number", value, file=str(file)) from None
        if value is not None:
            values[key] = value
    try:
        terms = parse(EngineTerms, values, "terms")
    except ConfigError as err:
        raise err.in_file(str(file)) from None
    provenance = {k: v for k, v in data.items() if k != "terms"}
    sources = {k: {f: v for f, v in e.items() if f != "value"} for k, e in data["terms"].items() if isinstance(e, dict)}
    if sources:
        provenance["term_sources"] = sources
    return Engine(terms, name or data.get("name") or file.stem, str(file), provenance)


def engine_option():
    """The `engine:` field every kernel cost model (roofline, vidur, fitted) takes."""
    return option(None, help=f"the serving engine around the kernels: a preset ({DEFAULT} by default; "
                  "`cbsim engines` lists them), an engine file from `cbsim calibrate`, a mapping of terms "
                  "(optionally with preset: or file: as the base), or none (kernels only)")


@dataclass(frozen=True)
class CpuOverheadConfig:
    """The former `cpu_overhead:` key, kept so old configs run unchanged: now engine host terms."""

    preset: str = option("none", help="vidur-a100-tp1 or vidur-a100-tp2 (now engine presets)")
    per_step: float | None = option(None, help="host seconds per step (now engine host_per_step_s)")
    per_seq: float | None = option(None, help="host seconds per sequence (now engine host_per_seq_s)")
    overlap: bool = option(False, help="async scheduling (now engine overlap)")

    def validate(self) -> None:
        require(self.preset in ("none", "vidur-a100-tp1", "vidur-a100-tp2"), "preset",
                "one of none, vidur-a100-tp1, vidur-a100-tp2", self.preset)
        require(self.per_step is None or self.per_step >= 0, "per_step", "a number >= 0", self.per_step)
        require(self.per_seq is None or self.per_seq >= 0, "per_seq", "a number >= 0", self.per_seq)


def resolve_engine(engine, cpu_overhead: CpuOverheadConfig | None, path: str = "engine") -> Engine:
    """A cost model's engine from its `engine:` and legacy `cpu_overhead:` keys (not both)."""
    if cpu_overhead is None:
        return load_engine(engine, path)
    if engine is not None:
        raise ConfigError("cpu_overhead", "either engine: or the older cpu_overhead: (now part of engine:), "
                          "not both", has_got=False)
    terms = {"overlap": cpu_overhead.overlap}
    if cpu_overhead.per_step is not None:
        terms["host_per_step_s"] = cpu_overhead.per_step
    if cpu_overhead.per_seq is not None:
        terms["host_per_seq_s"] = cpu_overhead.per_seq
    base = NO_ENGINE if cpu_overhead.preset == "none" else load_engine(cpu_overhead.preset, "cpu_overhead.preset")
    merged = {**dataclasses.asdict(base.terms), **terms}
    return Engine(parse(EngineTerms, merged, "cpu_overhead"), base.name if base.name != NONE else "cpu_overhead",
                  base.source, base.provenance)
