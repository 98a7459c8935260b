"""Read a Hugging Face `config.json` into a ModelSpec, and the catalog of such files shipped in models/.

Invariant: every ModelSpec field comes from a named key of the file, or from the default the
architecture's Hugging Face (transformers) class uses when the key is absent; an architecture or a
key value this reader cannot price raises ConfigError naming the file and the key. Nothing is
guessed: a file that says `use_sliding_window: false` prices full attention, one whose
`quantization_config` names a method this reader does not know is refused. An int4 checkpoint
(awq or gptq with bits 4, compressed-tensors with 4-bit int weights) gives its group_size to
ModelSpec.weight_group_size (absent: 0, priced as 128; -1 or strategy channel: per output channel).

What is priced per architecture (the `architectures` key):
  dense GQA      LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (QKV bias),
                 Qwen3ForCausalLM, GemmaForCausalLM, Gemma2ForCausalLM (4 norms per layer, a
                 sliding window on every other layer)
  MoE            MixtralForCausalLM (experts of intermediate_size), Qwen2MoeForCausalLM (one shared
                 expert of shared_expert_intermediate_size; its 1-wide gate is not counted),
                 Qwen3MoeForCausalLM
  MLA + MoE      DeepseekV2ForCausalLM, DeepseekV3ForCausalLM (the multi-token-prediction layers,
                 num_nextn_predict_layers, are not part of the served model and are not counted)
Per-layer RMSNorms on q and k (Qwen3) and the MoE routers' score-correction biases are not counted
(under 0.01 % of any catalog model).
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from types import MappingProxyType

from cbsim.core import bounds
from cbsim.core.errors import ConfigError

from cbsim.sim.costmodels.catalog.specs import PER_CHANNEL, ModelSpec

CATALOG_DIR = Path(__file__).parent / "models"

# architecture -> (family, default of tie_word_embeddings in its transformers config class)
ARCHITECTURES = MappingProxyType({
    "LlamaForCausalLM": ("dense", False),
    "MistralForCausalLM": ("dense", False),
    "Qwen2ForCausalLM": ("qwen2", False),
    "Qwen3ForCausalLM": ("dense", False),
    "GemmaForCausalLM": ("gemma", True),
    "Gemma2ForCausalLM": ("gemma2", True),
    "MixtralForCausalLM": ("mixtral", False),
    "Qwen2MoeForCausalLM": ("qwen2_moe", False),
    "Qwen3MoeForCausalLM": ("qwen3_moe", False),
    "DeepseekV2ForCausalLM": ("deepseek", False),
    "DeepseekV3ForCausalLM": ("deepseek", False),
})
# torch_dtype -> the precision it is served at: vLLM's `dtype: auto` serves a float32 checkpoint in 16
# bits (bf16 for Gemma-2, whose config.json says float32), so float32 prices as bf16 here too
TORCH_DTYPES = MappingProxyType({"bfloat16": "bf16", "float16": "fp16", "float32": "bf16"})
# ModelSpec field -> the config.json key it came from (so a validation error names the file's key)
FIELD_KEYS = MappingProxyType({
    "hidden": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "intermediate": "intermediate_size",
    "vocab": "vocab_size", "max_model_len": "max_position_embeddings", "sliding_window": "sliding_window",
    "num_experts": "num_experts", "experts_per_token": "num_experts_per_tok",
    "moe_intermediate": "moe_intermediate_size", "first_k_dense": "first_k_dense_replace",
    "moe_every": "decoder_sparse_step", "kv_lora_rank": "kv_lora_rank", "q_lora_rank": "q_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
})
_MISSING = object()


class _Reader:
    """Typed access to one parsed config.json; every error names the file and the key."""

    def __init__(self, data: dict, file: str):
        self.data, self.file = data, file

    def error(self, key: str, expected: str, got=_MISSING) -> ConfigError:
        if got is _MISSING:
            return ConfigError(key, expected, file=self.file, has_got=False)
        return ConfigError(key, expected, got, file=self.file)

    def int(self, key: str, default=_MISSING, minimum: int = 1) -> int:
        value = self.data.get(key, default)
        if value is _MISSING:
            raise self.error(key, f"an integer (a key every config.json of this architecture has)")
        if value is None and default is not _MISSING:
            return default
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise self.error(key, f"an integer >= {minimum}", value)
        return value

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise self.error(key, "true or false", value)
        return value


def read_hf_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """The ModelSpec of a config.json file, or of a folder holding one."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        data = bounds.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError("model", "a config.json file or a folder holding one", str(path)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError("<root>", "a JSON object (a Hugging Face config.json)", str(err), file=str(file)) from None
    if not isinstance(data, dict):
        raise ConfigError("<root>", "a JSON object (a Hugging Face config.json)", type(data).__name__, file=str(file))
    if name is None:
        name = file.parent.name if file.name == "config.json" else file.stem
    return spec_from_hf(data, str(file), name)


def spec_from_hf(data: dict, file: str, name: str) -> ModelSpec:
    """Map a parsed config.json onto ModelSpec fields (see the module docstring for what is priced)."""
    r = _Reader(data, file)
    family, tie_default = _architecture(r)
    hidden, layers, heads = r.int("hidden_size"), r.int("num_hidden_layers"), r.int("num_attention_heads")
    fields = dict(
        name=name, hidden=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=r.int("num_key_value_heads", heads), intermediate=r.int("intermediate_size"),
        vocab=r.int("vocab_size"), max_model_len=r.int("max_position_embeddings"),
        tie_word_embeddings=r.bool("tie_word_embeddings", tie_default),
        qkv_bias=family in ("qwen2", "qwen2_moe") or r.bool("attention_bias", False),
        norms_per_layer=4 if family == "gemma2" else 2,
        **_precision(r), **_window(r, family, layers), **_moe(r, family), **_mla(r, family))
    if fields.get("kv_lora_rank"):
        fields["head_dim"] = fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"]
        fields["num_kv_heads"] = heads  # MLA: every head has its own (decompressed) key and value
    elif "head_dim" in data and data["head_dim"] is not None:
        fields["head_dim"] = r.int("head_dim")
    else:
        if hidden % heads:
            raise r.error("head_dim", f"a value: hidden_size ({hidden}) is not a multiple of "
                                      f"num_attention_heads ({heads})")
        fields["head_dim"] = hidden // heads
    spec = ModelSpec(**fields)
    try:
        spec.validate()
    except ConfigError as err:
        raise ConfigError(FIELD_KEYS.get(err.path, err.path), err.expected, err.got, file, err.has_got) from None
    return spec


def _architecture(r: _Reader) -> tuple[str, bool]:
    archs = r.data.get("architectures")
    known = ", ".join(ARCHITECTURES)
    if archs is None:
        raise r.error("architectures", f"a list naming the architecture ({known})")
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise r.error("architectures", "a list of one architecture name", archs)
    if archs[0] not in ARCHITECTURES:
        raise r.error("architectures", f"an architecture cbsim can price ({known})", archs[0])
    return ARCHITECTURES[archs[0]]


def _precision(r: _Reader) -> dict:
    """weight_dtype and kv_dtype from torch_dtype (or dtype), overridden by a quantization_config it
    knows: fp8 and fbgemm_fp8; awq and gptq at 4 bits; modelopt with quant_algo FP8 (and
    kv_cache_quant_algo FP8); compressed-tensors whose every weight group is 8-bit float or 4-bit
    int (and a kv_cache_scheme of 8-bit float). vLLM keeps the KV cache at the model's dtype unless
    the checkpoint quantises it."""
    key = "torch_dtype" if "torch_dtype" in r.data else "dtype"
    torch_dtype = r.data.get(key, "bfloat16")
    if not isinstance(torch_dtype, str) or torch_dtype not in TORCH_DTYPES:  # a list or mapping is not hashable
        raise r.error(key, "bfloat16, float16 or float32", torch_dtype)
    weight = kv = TORCH_DTYPES[torch_dtype]
    quant = r.data.get("quantization_config")
    if quant is None:
        return {"weight_dtype": weight, "kv_dtype": kv}
    group = 0
    if not isinstance(quant, dict):
        raise r.error("quantization_config", "a mapping", quant)
    method = quant.get("quant_method")
    if method in ("fp8", "fbgemm_fp8"):
        weight = "fp8"
    elif method in ("awq", "gptq") and quant.get("bits") == 4:
        weight = "int4"
        group = _group_size(r, quant.get("group_size"), "quantization_config.group_size")
    elif method == "modelopt" and quant.get("quant_algo") == "FP8":
        weight = "fp8"
        kv = "fp8" if quant.get("kv_cache_quant_algo") == "FP8" else kv
    elif method == "compressed-tensors":
        weight, group = _compressed_tensors(r, quant)
        scheme = quant.get("kv_cache_scheme")
        kv = "fp8" if isinstance(scheme, dict) and (scheme.get("num_bits"), scheme.get("type")) == (8, "float") else kv
    else:
        raise r.error("quantization_config.quant_method", "fp8, fbgemm_fp8, awq/gptq with bits 4, modelopt FP8 or "
                      "compressed-tensors (fp8 or int4 weights)",
                      f"{method} (bits {quant.get('bits')})" if "bits" in quant else method)
    out = {"weight_dtype": weight, "kv_dtype": kv}
    return {**out, "weight_group_size": group} if weight == "int4" else out


def _group_size(r: _Reader, value, key: str) -> int:
    """An int4 checkpoint's group size: a positive integer, -1 (one scale per output channel), or
    absent (0: AutoAWQ's and AutoGPTQ's default of 128 is assumed)."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not (value >= 1 or value == PER_CHANNEL):
        raise r.error(key, "a positive integer (input weights per int4 scale) or -1 (per output channel)", value)
    return value


def _compressed_tensors(r: _Reader, quant: dict) -> tuple[str, int]:
    """(fp8 or int4, group size): the one weight format every config group of a compressed-tensors
    checkpoint uses; int4 groups by `strategy` group (its group_size) or channel (-1)."""
    groups = quant.get("config_groups")
    formats, sizes = set(), set()
    for name, group in groups.items() if isinstance(groups, dict) else ():
        weights = group.get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict):
            formats.add((weights.get("num_bits"), weights.get("type")))
            if (weights.get("num_bits"), weights.get("type")) != (4, "int"):
                continue
            if weights.get("strategy") == "channel":
                sizes.add(PER_CHANNEL)
            else:
                key = f"quantization_config.config_groups.{name}.weights.group_size"
                sizes.add(_group_size(r, weights.get("group_size"), key))
    known = {(8, "float"): "fp8", (4, "int"): "int4"}
    if len(formats) != 1 or next(iter(formats)) not in known:
        raise r.error("quantization_config.config_groups", "weight groups all of 8-bit float (fp8) or all of 4-bit "
                      "int (int4)", sorted(map(str, formats)) or groups)
    weight = known[formats.pop()]
    if weight == "int4" and len(sizes) != 1:
        raise r.error("quantization_config.config_groups", "int4 weight groups of one group_size", sorted(sizes))
    return weight, (sizes.pop() if weight == "int4" else 0)


def _window(r: _Reader, family: str, layers: int) -> dict:
    """Sliding-window attention: the window and how many layers use it."""
    layer_types = r.data.get("layer_types")
    window = r.data.get("sliding_window")
    uses = r.bool("use_sliding_window", family not in ("qwen2", "qwen2_moe", "qwen3_moe"))
    if window is None or not uses:
        return {}
    window = r.int("sliding_window")
    if window >= r.int("max_position_embeddings"):
        return {}  # a window as long as the context is no window
    if isinstance(layer_types, list):
        count = sum(t == "sliding_attention" for t in layer_types)
    elif family == "gemma2":
        count = (layers + 1) // 2  # transformers Gemma2: layers 0, 2, 4, ... slide
    elif family in ("qwen2", "qwen2_moe", "qwen3_moe"):
        count = layers - min(layers, r.int("max_window_layers", layers, minimum=0))
    else:
        count = layers
    return {"sliding_window": window, "sliding_layers": count} if count else {}


def _moe(r: _Reader, family: str) -> dict:
    if family not in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek"):
        return {}
    key = {"mixtral": "num_local_experts", "deepseek": "n_routed_experts"}.get(family, "num_experts")
    out = {"num_experts": r.int(key), "experts_per_token": r.int("num_experts_per_tok")}
    if family == "mixtral":
        out["moe_intermediate"] = r.int("intermediate_size")
        return out
    out["moe_intermediate"] = r.int("moe_intermediate_size")
    if family == "deepseek":
        out["num_shared_experts"] = r.int("n_shared_experts", 0, minimum=0)
        out["first_k_dense"] = r.int("first_k_dense_replace", 0, minimum=0)
        if r.int("moe_layer_freq", 1) != 1:
            raise r.error("moe_layer_freq", "1 (every layer past first_k_dense_replace is MoE)",
                          r.data["moe_layer_freq"])
        return out
    out["moe_every"] = r.int("decoder_sparse_step", 1)
    only = r.data.get("mlp_only_layers", [])
    if only:
        raise r.error("mlp_only_layers", "an empty list (dense layers among MoE ones are not priced)", only)
    if family == "qwen2_moe":
        shared = r.int("shared_expert_intermediate_size", 0, minimum=0)
        out.update(num_shared_experts=1 if shared else 0, shared_intermediate=shared)
    return out


def _mla(r: _Reader, family: str) -> dict:
    if family != "deepseek":
        return {}
    kv_lora = r.data.get("kv_lora_rank")
    if kv_lora is None:
        raise r.error("kv_lora_rank", "an integer (DeepSeek-V2/V3 attention is MLA)")
    return {"kv_lora_rank": r.int("kv_lora_rank"), "q_lora_rank": r.int("q_lora_rank", 0, minimum=0),
            "qk_nope_head_dim": r.int("qk_nope_head_dim"), "qk_rope_head_dim": r.int("qk_rope_head_dim"),
            "v_head_dim": r.int("v_head_dim")}


# ---------------------------------------------------------------- the shipped catalog


def catalog_names() -> tuple[str, ...]:
    """Names of the config.json files shipped in models/ (file stems), sorted."""
    return tuple(sorted(p.stem for p in CATALOG_DIR.glob("*.json")))


@lru_cache(maxsize=None)
def catalog_spec(name: str) -> ModelSpec:
    """The ModelSpec of one catalog file (read once per process)."""
    return read_hf_config(CATALOG_DIR / f"{name}.json", name)


def catalog_key(key: str) -> str | None:
    """The catalog name a normalised model key refers to, trying without a version suffix (-v0.1)."""
    names = catalog_names()
    if key in names:
        return key
    head, _, tail = key.rpartition("-v")
    if head in names and tail.replace(".", "").isdigit():
        return head
    return None
