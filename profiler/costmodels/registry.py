"""Cost models by name: `@register_cost_model("roofline")` on a CostModel subclass.

A registered class has a `Config` dataclass (fields made with cbsim.schema.option, each with
help text) and a classmethod `from_config(config, model)` where `model` is the experiment's
ModelSpec (cbsim.profiler.specs). `load_cost_model(mapping, model)` validates the YAML mapping
(`{type: NAME, ...}`) and returns the instance; errors are ConfigErrors naming the key path.
"""
from __future__ import annotations

from cbsim.errors import ConfigError

from cbsim.registry import Registry
from cbsim.schema import parse

COST_MODELS = Registry("cost model", "type")
register_cost_model = COST_MODELS.register


def load_cost_model(mapping: dict, model=None, path: str = "cost_model"):
    """Return the cost model a YAML `cost_model:` mapping describes."""
    from . import _builtin  # noqa: F401  (registers the built-in models)

    cls = COST_MODELS.lookup(mapping, path)
    config = parse(cls.Config, {k: v for k, v in mapping.items() if k != "type"}, path)
    if model is None:
        from cbsim.profiler.specs import model_spec

        model = model_spec("llama-3-8b")
    try:
        return cls.from_config(config, model)
    except ConfigError as err:  # keys of the cost model's own section, named from the top
        raise (err if err.path == path or err.path.startswith(path + ".") else err.under(path)) from None
