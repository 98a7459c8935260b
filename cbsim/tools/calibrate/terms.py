"""The terms `cbsim calibrate` fits, shared by the step fit (steps.py) and the serving fit (serving.py):
their units in the optimisers, their physical ranges, and which kernel-class factors a data set can
say anything about.

Host terms are seconds >= 0 (a host cannot give time back). The kernel factors (kernel_scale and the
per-class gemm_scale, attention_scale, collective_scale, moe_scale of engine.py) are signed corrections
in the multiplicative sense: below 1 where the cost model over-prices a kernel class, above 1 where it
under-prices it, within SCALE_BOUNDS: a kernel 4x faster or slower than its roofline price is not a
correction but a different kernel (the cost model needs fixing, not a factor).
"""
from __future__ import annotations

from cbsim.sim.costmodels.engine import CLASS_TERMS, KERNEL_CLASSES

SCALE_TERMS = ("kernel_scale", *CLASS_TERMS)
SCALE_BOUNDS = (0.25, 4.0)
# each term's unit in the optimisers (conditioning); terms not named: 1e-3 (milliseconds)
UNITS = {"host_per_seq_s": 1e-6, "host_per_prefill_s": 1e-6, "host_per_token_s": 1e-6,
         "frontend_per_prompt_token_s": 1e-6, **{name: 1.0 for name in SCALE_TERMS}}


def unit(name: str) -> float:
    return UNITS.get(name, 1e-3)


def bounds(name: str) -> tuple[float, float]:
    """The physical range of a term in optimiser units."""
    return SCALE_BOUNDS if name in SCALE_TERMS else (0.0, float("inf"))


def class_refusals(names, cost_type: str | None, is_moe: bool, max_tp: int) -> dict:
    """{term: why} for the per-class factors among `names` that no data of this setup can identify: every
    factor unless the cost model prices kernels by class (roofline), moe_scale on a dense model,
    collective_scale when no step runs on more than one GPU."""
    out = {}
    for name, kind in zip(CLASS_TERMS, KERNEL_CLASSES):
        if name not in names:
            continue
        if cost_type != "roofline":
            out[name] = f"the {cost_type} cost model does not price its kernels by class (roofline does)"
        elif kind == "moe" and not is_moe:
            out[name] = "the model has no experts"
        elif kind == "collective" and max_tp <= 1:
            out[name] = "no measured step runs on more than one GPU (no all-reduces)"
    return out
