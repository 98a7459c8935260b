"""Cost model `vidur`: step times composed from Vidur's published per-operator GPU measurements.

A step of T tokens (prefill chunks plus decode rows) on one TP shard takes
    L * (token_ops(T) + attention + allreduce(T)) + emb(T) + lm_head(rows)
and then the serving engine around the kernels (engine.py). token_ops is the sum of the layer's
token-level operators from mlp.csv (norms, QKV, RoPE, O-proj, gate/up, activation, down,
residual add), interpolated in num_tokens between measured points; attention comes from
attention.csv where published, else from a calibrated roofline (vidur_attention.py); the
all-reduce from the network tables (allreduce.py). This is Vidur's composition, plus the
embedding and an LM-head term Vidur leaves out.

The model reads only a converted JSON profile (sim/costmodels/profiles/vidur/, or a path): never the
shared CSVs. Invariant: `decode_run_times` evaluates the same private function of aggregates as
`step_time`, with only the decode-context sum varying, so the two agree bit for bit. Every profile
is checked when loaded (profile_check.py): a bad one is a ProfileError naming its file and key.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cbsim.core import bounds
from cbsim.core.errors import ConfigError
from cbsim.core.schema import option, require
from cbsim.sim.cost import CostModel
from cbsim.sim.shape import StepShape

from cbsim.sim.costmodels.allreduce import AllReduce, profile_collective_seconds
from cbsim.sim.costmodels.engine import NO_ENGINE, CpuOverheadConfig, Engine, engine_option, resolve_engine
from cbsim.sim.costmodels.curves import Curve, isotonic
from cbsim.sim.costmodels.pipeline import profile_pipeline, slowest
from cbsim.sim.costmodels.profile_check import MAX_LAYERS, check_vidur
from cbsim.sim.costmodels.registry import register_cost_model
from cbsim.sim.costmodels.vidur_attention import make_attention

PROFILE_DIR = Path(__file__).resolve().parent / "profiles" / "vidur"
TOKEN_TERMS_CACHE = 1 << 16  # (tokens, rows) pairs remembered; cleared when full


@register_cost_model("vidur")
class VidurCostModel(CostModel):
    @dataclass
    class Config:
        gpu: str = option("a100", help="GPU Vidur profiled: a100 or h100 (shipped profiles)")
        model: str | None = option(None, help="llama-2-70b, llama-2-7b, llama-3-8b, ...; default: the experiment's model")
        tp: int = option(1, help="tensor-parallel degree (GPUs per replica)")
        profile: str | None = option(None, help="a converted profile JSON (cbsim vidur-convert; a bare name is looked "
                                     "up in the shipped profiles/vidur/); overrides gpu/model/tp")
        num_layers: int | None = option(None, help="decoder layers; default: the profile's")
        monotone: bool = option(True, help="smooth the measured tables into non-decreasing ones (isotonic "
                                "regression); false reproduces every published median exactly")
        pp: int = option(1, help="pipeline stages: the profile's layers split as vLLM splits them, step_time one "
                         "stage's time, the activation hand-off priced as roofline's (pipeline.py: p2p fitted on "
                         "Vidur's own send_recv tables)")
        engine: Any = engine_option()
        cpu_overhead: CpuOverheadConfig | None = option(None, help="the older form of the engine's host terms "
                                                        "(kept for old configs; use engine:)")

        def validate(self) -> None:
            require(self.tp >= 1, "tp", "an integer >= 1", self.tp)
            require(isinstance(self.pp, int) and not isinstance(self.pp, bool) and self.pp >= 1, "pp",
                    "an integer >= 1", self.pp)
            require(self.num_layers is None or 1 <= self.num_layers <= MAX_LAYERS, "num_layers",
                    f"an integer >= 1 and <= {MAX_LAYERS}", self.num_layers)

    def __init__(self, profile: dict, *, num_layers: int | None = None, monotone: bool = True,
                 engine: Engine = NO_ENGINE, source: str = "", pp: int = 1):
        if profile.get("type") != "vidur":
            raise ValueError(f"{source or 'profile'} is not a vidur profile (type {profile.get('type')!r})")
        check_vidur(profile, source)  # ProfileError naming the file and key
        self.profile = profile
        self.source = source
        self.monotone = monotone
        self.num_layers = int(num_layers or profile["num_layers"])
        self.engine = engine
        self.pipeline_stages = pp
        self._pipeline = None
        if pp > 1:
            hidden = (profile.get("geometry") or {}).get("n_embd")
            self._pipeline = profile_pipeline(self.num_layers, pp, int(profile["tp"]), hidden, profile["gpu"],
                                              "cost_model.pp")
        stage = max(self._pipeline.layers) if self._pipeline else self.num_layers
        self._engine = engine.bind(stage, int(profile["tp"]))
        ops = profile["token_ops"]
        tokens = ops["num_tokens"]
        self._ops = {op: Curve(tokens, np.asarray(ms) * 1e-3) for op, ms in ops["ms"].items()}
        total = np.sum([np.asarray(ms) for ms in ops["ms"].values()], axis=0) * 1e-3
        emb = np.asarray(ops["emb_ms"]) * 1e-3
        self._token_ops = Curve(tokens, isotonic(total) if monotone else total)
        self._emb = Curve(tokens, isotonic(emb) if monotone else emb)
        up = np.asarray(ops["ms"][profile["lm_head"]["op"]]) * 1e-3
        self._lm_head = Curve(tokens, isotonic(up) if monotone else up)
        self._lm_ratio = float(profile["lm_head"]["ratio"])
        self.attention = make_attention(profile["attention"], monotone)
        self.allreduce = AllReduce(profile["allreduce"], monotone) if profile.get("allreduce") else None
        self._token_terms: dict[tuple[int, int], tuple[float, float]] = {}  # steps repeat their sizes
        self._stage_memo: dict[tuple[int, int], tuple] = {}  # (tokens, rows) -> _stage_terms
        self._decode_prices: dict[int, object] = {}  # batch size -> its decode step's price (_decode_price)
        self._decode_attention: dict[int, object] = {}  # batch size -> context sum -> its decode attention
        self._prefill_terms: dict[tuple[int, int], float] = {}  # (c, h) -> one chunk's attention; chunks repeat

    @classmethod
    def from_config(cls, config: "VidurCostModel.Config", model=None) -> "VidurCostModel":
        if hasattr(model, "check_measured_precision"):  # 16-bit profiles: refuse fp8/int4 (specs.py)
            model.check_measured_precision("vidur")
        if config.profile is not None:
            path = Path(config.profile)
            if not path.exists() and (PROFILE_DIR / path).exists():
                path = PROFILE_DIR / path  # a shipped file by name
            key = "profile"
        else:
            name = config.model or getattr(model, "name", None)
            if not name:
                raise ConfigError("model", "a model name (the experiment names none)", None)
            path = PROFILE_DIR / f"{config.gpu}-{normalise_model_name(name)}-tp{config.tp}.json"
            key = "model"
            if not path.exists():
                raise ConfigError(key, "a model/GPU/TP with a shipped vidur profile: " + ", ".join(shipped_profiles())
                                  + " (or convert one with `cbsim vidur-convert` and pass profile:)",
                                  f"{config.gpu}-{normalise_model_name(name)}-tp{config.tp}")
        return cls.from_file(path, num_layers=config.num_layers, monotone=config.monotone,
                             engine=resolve_engine(config.engine, config.cpu_overhead), key=key, pp=config.pp)

    @classmethod
    def from_file(cls, path, key: str = "profile", **kwargs) -> "VidurCostModel":
        """Load a converted profile; errors name the file."""
        path = Path(path)
        try:
            profile = bounds.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(key, "an existing vidur profile JSON", str(path)) from None
        except ValueError as err:  # not JSON, or not UTF-8 text
            raise ConfigError(key, f"valid JSON ({err})", str(path), file=str(path)) from None
        if not isinstance(profile, dict) or profile.get("type") != "vidur":
            got = profile.get("type") if isinstance(profile, dict) else type(profile).__name__
            raise ConfigError(key, f"a vidur profile (cbsim vidur-convert); {path} has type {got!r}", has_got=False)
        return cls(profile, source=str(path), **kwargs)

    # --- the pieces -------------------------------------------------------------------------

    def operator_time(self, op: str, tokens: float) -> float:
        """Seconds of one published token-level operator at `tokens` (raw medians, interpolated)."""
        return self._ops[op].at(tokens)

    def _gpu(self, tokens: int, attn, rows: int):
        """GPU seconds of a step from its aggregates; `attn` (per layer) may be a numpy array."""
        per_layer, fixed = self._terms(tokens, rows)
        if self._pipeline is not None:
            return self._slowest_stage(tokens, rows, per_layer + attn)
        return self.num_layers * (per_layer + attn) + fixed

    def _terms(self, tokens: int, rows: int) -> tuple[float, float]:
        """_token_terms_of, remembered (steps repeat their sizes)."""
        terms = self._token_terms.get((tokens, rows))
        if terms is None:
            terms = self._token_terms[tokens, rows] = self._token_terms_of(tokens, rows)
        return terms

    def _slowest_stage(self, tokens: int, rows: int, layer):
        """One pipeline stage's seconds (the slowest; elementwise over arrays): its layers, the embedding
        on the first stage, the LM head on the last, and its activation hand-off."""
        return slowest(n * layer + embedding + lm + handoff for n, embedding, lm, handoff
                       in self._stage_terms(tokens, rows))

    def _stage_terms(self, tokens: int, rows: int) -> tuple:
        """Per stage (its layers, the embedding's seconds on the first stage, the LM head's on the last, its
        hand-off's; 0.0 where a stage has none): pure in (tokens, rows), remembered (steps repeat their sizes)."""
        terms = self._stage_memo.get((tokens, rows))
        if terms is None:
            if len(self._stage_memo) >= TOKEN_TERMS_CACHE:
                self._stage_memo.clear()
            pipe = self._pipeline
            last = pipe.stages - 1
            lm = self._lm_head.at(rows) * self._lm_ratio if rows else 0.0
            terms = self._stage_memo[tokens, rows] = tuple(
                (n, self._emb.at(tokens) if s == 0 else 0.0, lm if s == last else 0.0, pipe.handoff_seconds(tokens, s))
                for s, n in enumerate(pipe.layers))
        return terms

    def _token_terms_of(self, tokens: int, rows: int) -> tuple[float, float]:
        """(per-layer seconds without attention, per-step fixed seconds): pure in (tokens, rows)."""
        if len(self._token_terms) >= TOKEN_TERMS_CACHE:
            self._token_terms.clear()
        per_layer = self._token_ops.at(tokens)
        if self.allreduce is not None:
            per_layer = per_layer + self.allreduce.seconds(tokens)
        fixed = self._emb.at(tokens)
        if rows:
            fixed = fixed + self._lm_head.at(rows) * self._lm_ratio
        return per_layer, fixed

    def collective_time(self, tokens: float) -> float:
        """Seconds a step of `tokens` tokens spends in the profile's all-reduces (num_layers times the
        per-layer `allreduce` term step_time adds; 0 without one). Asked after the run for the steps
        table (sim/metrics/step_efficiency.py)."""
        return profile_collective_seconds(self.allreduce, self._pipeline, self.num_layers, tokens)

    def _prefill_attention(self, prefill: tuple) -> float:
        total = 0.0
        memo = self._prefill_terms
        for c, h in prefill:
            seconds = memo.get((c, h))
            if seconds is None:
                if len(memo) >= TOKEN_TERMS_CACHE:
                    memo.clear()
                seconds = memo[c, h] = self.attention.prefill(c, h)
            total += seconds
        return total

    def layer_time(self, shape: StepShape) -> float:
        """Seconds of one decoder layer's compute (no all-reduce, embedding, LM head or CPU)."""
        n = len(shape.decode)
        attn = self._prefill_attention(shape.prefill) + self.attention.decode(n, sum(shape.decode))
        return self._token_ops.at(shape.num_tokens) + attn

    def step_time(self, shape: StepShape) -> float:
        return self.mixed_step_time(shape.prefill, shape.decode, 0, sum(shape.decode), shape.tokens_sampled)

    def mixed_step_time(self, prefill, contexts, offset: int, context_sum: int, sampled: int) -> float:
        n = len(contexts)
        decode = self._decode_attention.get(n)
        if decode is None:
            decode = self._decode_row(n)
        attn, tokens, memo = 0.0, n, self._prefill_terms  # _prefill_attention, written out
        for chunk in prefill:
            seconds = memo.get(chunk)
            attn += seconds if seconds is not None else self._prefill_attention((chunk,))
            tokens += chunk[0]
        attn = attn + decode(context_sum)
        if self._pipeline is None:  # _gpu, written out (once a step of a prompt run)
            terms = self._token_terms.get((tokens, sampled)) or self._terms(tokens, sampled)
            gpu = self.num_layers * (terms[0] + attn) + terms[1]
        else:
            gpu = self._gpu(tokens, attn, sampled)
        engine = self._engine
        return gpu if engine.none else engine.step_for(gpu, len(prefill) + n, len(prefill), tokens)

    def decode_step_time(self, contexts, offset: int, context_sum: int) -> float:
        return self.decode_pricer(contexts)(context_sum)

    def decode_pricer(self, contexts):
        price = self._decode_prices.get(len(contexts))
        return price if price is not None else self._decode_price(len(contexts))

    def _decode_row(self, n: int):
        """context sum -> the decode attention of n rows (the attention grid's row looked up once), remembered."""
        row = self._decode_attention.get(n)
        if row is None:
            if len(self._decode_attention) >= TOKEN_TERMS_CACHE:
                self._decode_attention.clear()
            row = self._decode_attention[n] = self.attention.decode_row(n)
        return row

    def _decode_price(self, n: int):
        """context sum -> decode_step_time of n rows, remembered per n: step_time's arithmetic (its empty
        prefill sum, then the decode attention; _gpu; the engine) with the batch's attention row, per-size
        terms and engine looked up once (without a pipeline or an engine: one call, the attention row
        composed with the layers and the fixed terms)."""
        if len(self._decode_prices) >= TOKEN_TERMS_CACHE:
            self._decode_prices.clear()
        engine = self._engine
        if self._pipeline is not None:
            attention = self._decode_row(n)
            price = lambda s: engine.step_for(self._gpu(n, 0.0 + attention(s), n), n, 0, n)
        else:
            (per_layer, fixed), layers = self._terms(n, n), self.num_layers
            if engine.none:
                price = self.attention.decode_row(n, outer=(layers, per_layer, fixed))
            else:
                attention = self._decode_row(n)
                price = lambda s: engine.step_for(layers * (per_layer + (0.0 + attention(s))) + fixed, n, 0, n)
        self._decode_prices[n] = price
        return price

    def decode_run_times(self, contexts: np.ndarray, steps: int) -> np.ndarray:
        contexts = np.asarray(contexts, dtype=np.int64)
        n = len(contexts)
        kv = int(contexts.sum()) + n * np.arange(steps, dtype=np.int64)
        attn = 0.0 + self.attention.decode_many(n, kv)
        return self._engine.step_many(self._gpu(n, attn, n), n)

    def describe(self) -> dict:
        p = self.profile
        return {
            "type": self.name, "profile": self.source, "gpu": p.get("gpu"), "model": p.get("model"), "tp": p["tp"],
            "num_layers": self.num_layers, "monotone": self.monotone, "engine": self.engine.describe(),
            "measured": (p.get("provenance") or {}).get("measured"),
            **({"pp": self.pipeline_stages} if self.pipeline_stages > 1 else {}),
        }


def normalise_model_name(name: str) -> str:
    """'meta-llama/Meta-Llama-3-8B' or 'Llama-2-7b-hf' -> 'llama-3-8b' / 'llama-2-7b'."""
    name = name.split("/")[-1].lower()
    if name.startswith("meta-"):
        name = name[len("meta-"):]
    for suffix in ("-hf", "-instruct"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def shipped_profiles() -> list[str]:
    """Names (gpu-model-tpN) of the vidur profiles shipped with the package."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))
