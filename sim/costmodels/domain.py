"""Where a calibration holds: the GPUs, models, TPs, batch sizes and contexts of the measured steps it
was fitted on (`cbsim calibrate` writes it as the engine file's `domain:`), and the warnings a later
prediction outside it gets.

A calibrated term is a statement about the data it was fitted on; a host term fitted at TP2 and TP8
says little at TP16, a GEMM factor fitted on A100 nothing about H100, a per-sequence term fitted up to
batch 64 is an extrapolation at 256. cbsim warns (it does not refuse: extrapolating may be what the
user wants) when a cost model is built on another GPU, model or TP than the domain's, and after a run
whose steps went beyond the domain's largest batch or context (cbsim.api).
"""
from __future__ import annotations

import warnings


class ExtrapolationWarning(UserWarning):
    """A prediction outside the domain its engine file was calibrated on."""


def domain_of(steps, model=None) -> dict:
    """The domain of measured steps (profiler/converters/step_table.MeasuredStep)."""
    batches = [len(s.shape.prefill) + len(s.shape.decode) for s in steps]
    contexts = [max([c + h for c, h in s.shape.prefill] + list(s.shape.decode)) for s in steps]
    names = {s.model or (model if isinstance(model, str) else None) for s in steps}
    return {"gpu": sorted({s.gpu for s in steps if s.gpu}), "model": sorted(n for n in names if n),
            "tp": sorted({int(s.tp) for s in steps if s.tp}), "batch": [min(batches), max(batches)],
            "context": [min(contexts), max(contexts)]}


def outside(domain: dict | None, gpu: str | None = None, model: str | None = None, tp: int | None = None,
            batch: int | None = None, context: int | None = None) -> list[str]:
    """What of a prediction lies outside `domain` (empty when inside, or when there is no domain)."""
    if not domain:
        return []
    out = []
    for key, value in (("gpu", gpu), ("model", model)):
        if value is not None and domain.get(key) and value not in domain[key]:
            out.append(f"{key} {value} (calibrated on {', '.join(domain[key])})")
    if tp is not None and domain.get("tp") and not min(domain["tp"]) <= tp <= max(domain["tp"]):
        out.append(f"tp {tp} (calibrated on {', '.join(map(str, domain['tp']))})")
    for key, value in (("batch", batch), ("context", context)):
        if value is not None and domain.get(key) and value > domain[key][1]:
            out.append(f"{key} up to {value} (calibrated up to {domain[key][1]})")
    return out


def warn_outside(engine, **point) -> list[str]:
    """Warn (ExtrapolationWarning) when `point` lies outside the domain of `engine`'s calibration file."""
    found = outside((engine.provenance or {}).get("domain"), **point)
    if found:
        warnings.warn(f"engine {engine.name} ({engine.source}) extrapolates beyond its calibration: "
                      + "; ".join(found), ExtrapolationWarning, stacklevel=2)
    return found


def warn_run_outside(costs, steps, requests) -> None:
    """After a run: warn once per calibrated engine when its steps went beyond the domain's largest batch
    (sequences in a step) or context (a request's prompt plus output)."""
    seen = set()
    for cost in costs:
        engine = getattr(cost, "engine", None)
        if engine is None or id(engine) in seen or not (engine.provenance or {}).get("domain"):
            continue
        seen.add(id(engine))
        batch = int(steps["num_seqs"].max()) if len(steps) else None
        context = int((requests["prompt_len"] + requests["output_len"]).max()) if len(requests) else None
        warn_outside(engine, batch=batch, context=context)
