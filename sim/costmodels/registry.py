"""Cost models by name: `@register_cost_model("roofline")` on a CostModel subclass.

A registered class has a `Config` dataclass (fields made with cbsim.core.schema.option, each with
help text) and a classmethod `from_config(config, model)` where `model` is the experiment's
ModelSpec (cbsim.sim.costmodels.catalog.specs). `load_cost_model(mapping, model)` validates the YAML mapping
(`{type: NAME, ...}`) and returns the instance; errors are ConfigErrors naming the key path.
"""
from __future__ import annotations

from cbsim.core.errors import ConfigError
from cbsim.sim.costmodels.catalog.lookup import model_spec
from cbsim.sim.costmodels.catalog.specs import DEFAULT_MODEL
from cbsim.core.registry import Registry
from cbsim.core.schema import parse

from cbsim.sim.costmodels.engine import NO_ENGINE, load_engine

COST_MODELS = Registry("cost model", "type")
# the cost model of an experiment that names none (its `cost_model:` default, and the server resolution's)
DEFAULT_COST_MODEL = {"type": "roofline", "gpu": "h100", "tp": 1}
register_cost_model = COST_MODELS.register


def load_cost_model(mapping: dict, model=None, path: str = "cost_model"):
    """Return the cost model a YAML `cost_model:` mapping describes."""
    from cbsim.sim.costmodels import _builtin  # noqa: F401  (registers the built-in models)

    cls = COST_MODELS.lookup(mapping, path)
    given = _roofline_only(cls, mapping, path)
    config = parse(cls.Config, {k: v for k, v in given.items() if k != "type"}, path)
    if model is None:
        model = model_spec(DEFAULT_MODEL)
    try:
        cost = cls.from_config(config, model)
    except ConfigError as err:  # keys of the cost model's own section, named from the top
        raise (err if err.path == path or err.path.startswith(path + ".") else err.under(path)) from None
    _warn_outside_calibration(cost)
    return cost


def _warn_outside_calibration(cost) -> None:
    """An engine file from `cbsim calibrate` records where it was fitted (domain.py): warn when this
    cost model's GPU, model or TP lies outside."""
    engine = getattr(cost, "engine", None)
    if engine is not None and (engine.provenance or {}).get("domain"):
        from cbsim.sim.costmodels.domain import warn_outside

        hardware = cost.describe()
        warn_outside(engine, gpu=hardware.get("gpu"), model=hardware.get("model"), tp=hardware.get("tp"))


ROOFLINE_ONLY = {  # parallelism keys some cost models cannot price, and which do
    "pp": ("pipeline stages", "roofline, vidur and fitted price them"),
    "data_parallel": ("data-parallel attention with expert parallelism",
                      "only roofline prices it; vidur and fitted time one TP group's dense steps as measured"),
}


def _roofline_only(cls, mapping: dict, path: str) -> dict:
    """`mapping` less the parallelism keys a cost model without them was given as 1; any other value is
    a one-line ConfigError (vidur and fitted time one TP group's dense steps as measured, with no
    all-to-all: they cannot price data-parallel attention honestly; unit and linear have no GPUs)."""
    from dataclasses import fields

    own = {f.name for f in fields(cls.Config)}
    for key, (what, which) in ROOFLINE_ONLY.items():
        if key in mapping and key not in own and mapping[key] != 1:
            raise ConfigError(f"{path}.{key}", f"1 or absent: cost model {mapping.get('type')} has no {what} "
                              f"({which})", mapping[key])
    return {k: v for k, v in mapping.items() if k in own or k not in ROOFLINE_ONLY}


def takes_engine(mapping: dict, path: str = "cost_model") -> bool:
    """Whether the cost model a `cost_model:` mapping names wraps its kernels in an engine (roofline,
    vidur, fitted do; unit and linear do not)."""
    from dataclasses import fields

    from cbsim.sim.costmodels import _builtin  # noqa: F401

    return "engine" in {f.name for f in fields(COST_MODELS.lookup(mapping, path).Config)}


def engine_of(mapping: dict, path: str = "cost_model"):
    """The serving engine a `cost_model:` mapping names (NO_ENGINE for models without one, such as
    unit and linear), without building the cost model: its front end acts outside the steps."""
    if not takes_engine(mapping, path) or mapping.get("cpu_overhead") is not None:
        return NO_ENGINE
    return load_engine(mapping.get("engine"), f"{path}.engine")
