"""Bounded work before validation: limits that keep a hostile or broken input from hanging or
exhausting memory before cbsim can say what is wrong with it.

- YAML: a document of at most MAX_YAML_BYTES, whose aliases expand to at most
  max(MAX_YAML_NODES, ALIAS_RATIO x its own nodes) nodes (a 300-byte "billion laughs" document names
  one node 9^9 times; shared in memory, every later walk of it, a deep copy, a validation or an error
  message, would visit all of them). The same rule as go-yaml's alias budget (yaml.v3 decode.go,
  allowedAliasRatio), with a floor of its own.
- JSON: nested at most MAX_JSON_DEPTH levels (the standard parser recurses once per level and would
  raise RecursionError near 1,000); `loads` raises JsonDepthError, a json.JSONDecodeError, so every
  reader's "valid JSON" error names the file and says why.
- Model sizes: each ModelSpec dimension at most MODEL_LIMITS (checked before any per-layer work: a
  config.json of 10^9 layers would otherwise build 10^9 layer records).
- Error messages show at most one line of the offending value (`short_repr`, at most MAX_SHOWN
  characters): formatting a whole value can be as costly as the value is large.

Imports nothing of cbsim.
"""
from __future__ import annotations

import json
import reprlib

import yaml

MAX_YAML_BYTES = 64 * 2**20  # an experiment or engine file is kilobytes; an inline request list a few MB
MAX_YAML_NODES = 1_000_000  # expanded nodes always allowed, aliases or not
ALIAS_RATIO = 10  # beyond the floor: expanded nodes per node written in the document
MAX_JSON_DEPTH = 64  # the deepest JSON cbsim reads (traces, profiles, HF configs) nests fewer than 10 levels
MAX_SHOWN = 120  # characters of an offending value an error message shows

# Upper bounds of a model's dimensions, each far above the largest released model's, so no real config
# is refused: layers (Llama-3.1-405B: 126; DeepSeek-V3: 61), widths (405B hidden 16,384, intermediate
# 53,248), heads (405B: 128), vocabularies (Gemma 3: 262,144), experts (DeepSeek-V3: 256 routed) and
# context (Llama 4 Scout: 10,485,760 positions), as their Hugging Face config.json files give them.
MODEL_LIMITS = {"num_layers": 2**10, "hidden": 2**20, "intermediate": 2**22, "moe_intermediate": 2**22,
                "shared_intermediate": 2**22, "num_heads": 2**14, "num_kv_heads": 2**14, "head_dim": 2**14,
                "vocab": 2**24, "num_experts": 2**16, "experts_per_token": 2**16, "num_shared_experts": 2**16,
                "max_model_len": 2**26, "sliding_window": 2**26, "kv_lora_rank": 2**20, "q_lora_rank": 2**20,
                "qk_nope_head_dim": 2**14, "qk_rope_head_dim": 2**14, "v_head_dim": 2**14}

_shown = reprlib.Repr()
_shown.maxstring = _shown.maxother = _shown.maxlong = MAX_SHOWN
_shown.maxlist = _shown.maxtuple = _shown.maxdict = _shown.maxset = 8
_shown.maxlevel = 3


def short_repr(value) -> str:
    """repr(value) cut to one line of at most MAX_SHOWN characters, in work bounded by that length."""
    try:
        text = _shown.repr(value)
        if "..." not in text:  # nothing was cut, so the value is small: its own repr (dicts in their order)
            text = repr(value)
    except ValueError:  # an int beyond Python's str conversion limit
        text = f"<an integer of {value.bit_length()} bits>" if isinstance(value, int) else f"<{type(value).__name__}>"
    text = text.replace("\n", "\\n")
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


class JsonDepthError(json.JSONDecodeError):
    """JSON nested deeper than MAX_JSON_DEPTH: a decode error (every reader reports those)."""

    def __init__(self, doc):
        super().__init__(f"nested deeper than {MAX_JSON_DEPTH} levels", doc if isinstance(doc, str) else "", 0)
        self.args = (f"JSON nested at most {MAX_JSON_DEPTH} levels deep",)

    def __str__(self) -> str:
        return self.args[0]


def loads(text: str | bytes):
    """json.loads, refusing data nested deeper than MAX_JSON_DEPTH (JsonDepthError)."""
    try:
        data = json.loads(text)
    except RecursionError:
        raise JsonDepthError(text) from None
    if isinstance(data, (dict, list)) and deeper_than(data, MAX_JSON_DEPTH):
        raise JsonDepthError(text)
    return data


def deeper_than(data, limit: int) -> bool:
    """Whether lists and dicts nest more than `limit` levels in `data` (iterative: no recursion)."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


class YamlBoundsError(yaml.YAMLError):
    """A YAML document beyond the limits above: a YAML error (every reader reports those)."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem  # where readers look for a parser error's reason


def load_yaml(text: str, loader: type = yaml.SafeLoader):
    """The one YAML document in `text`, read with `loader` (a PyYAML or libyaml safe loader class),
    refusing a document over MAX_YAML_BYTES or whose aliases expand too far (YamlBoundsError)."""
    if len(text) > MAX_YAML_BYTES:
        raise YamlBoundsError(f"a YAML document of at most {MAX_YAML_BYTES // 2**20} MiB ({len(text):,} characters)")
    reader = loader(text)
    try:
        node = reader.get_single_node()
        problem = yaml_expansion_error(node)
        if problem:
            raise YamlBoundsError(problem)
        return reader.construct_document(node) if node is not None else None
    finally:
        reader.dispose()


def yaml_expansion_error(root) -> str | None:
    """Why the composed YAML node graph `root` is too large once its aliases are expanded (or refers to
    itself), or None. A node an alias names is one object reached again, so each node's expanded size
    is computed once (iterative post-order: no recursion)."""
    if root is None:
        return None
    sizes: dict[int, int] = {}
    open_: set[int] = set()  # expanded, children not yet done: reaching one again is a cycle
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            open_.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in _children(node))
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_:
            return "no recursive alias (an alias inside the node it names)"
        open_.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)
    budget = max(MAX_YAML_NODES, ALIAS_RATIO * len(sizes))
    if sizes[id(root)] > budget:
        return (f"aliases that expand to at most {budget:,} nodes (this document's {len(sizes):,} nodes "
                f"expand to {sizes[id(root)]:,})")
    return None


def _children(node) -> list:
    value = getattr(node, "value", None)
    if not isinstance(value, list):
        return []
    return [item for pair in value for item in pair] if value and isinstance(value[0], tuple) else value
